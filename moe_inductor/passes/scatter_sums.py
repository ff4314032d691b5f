"""``scatter_reduce(..., reduce="sum")`` read as the ``scatter_add`` it equals.

DeepSeek-MoE's ``moe_infer`` combines each expert's rows by ``cache.scatter_reduce_(0, idx, out, reduce="sum")``
where MiniMind and most others write ``cache.scatter_add_(0, idx, out)``. With ``include_self`` True (the default)
the two are the same sums, forward and backward, so the graph is respelled before the passes match and every
combine the passes prove through ``scatter_add`` covers the other spelling too. ``include_self=False`` and the other
reductions are left as they are, and so is every reduction a backward runs through (``_needs_grad``): DeepSeek-MoE
runs its ``moe_infer`` under ``torch.no_grad()``.
"""
from __future__ import annotations

from torch.fx import Graph, Node

_RESPELLED = {"scatter_reduce_": "scatter_add_", "scatter_reduce": "scatter_add"}
_PARAMS = ("dim", "index", "src", "reduce")


def _needs_grad(node: Node) -> bool:
    """Whether the reduction's result takes part in a backward (or is not known not to). There the two spellings
    differ: ``scatter_reduce`` saves its result for its backward, so a second in-place write to the same buffer
    makes eager's backward raise where ``scatter_add_``'s would run, and the error must stay the user's."""
    from .fx_utils import val

    out = val(node)
    return out is None or out.requires_grad


def scatter_sums_as_adds(graph: Graph) -> int:
    """Replace every ``t.scatter_reduce[_](dim, index, src, "sum")`` (``include_self`` True) by
    ``t.scatter_add[_](dim, index, src)``; returns how many were replaced."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _RESPELLED or not node.args:
            continue
        params = dict(zip(_PARAMS, node.args[1:]))
        if len(node.args) - 1 > len(_PARAMS) or set(node.kwargs) & set(params):
            continue
        params.update(node.kwargs)
        if set(params) - {*_PARAMS, "include_self"} or set(_PARAMS) - set(params):
            continue
        if params["reduce"] != "sum" or params.get("include_self", True) is not True:
            continue
        if not isinstance(node.args[0], Node) or _needs_grad(node):
            continue
        with graph.inserting_before(node):
            new = graph.call_method(_RESPELLED[node.target],
                                    (node.args[0], params["dim"], params["index"], params["src"]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
    return done
