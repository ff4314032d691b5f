"""Form "moe_region" (a note, never a rewrite): a router whose top-k (or argmax) ids feed per-expert work that no
form rewrote and no form explained. explain() then names it, at the router's line, instead of saying nothing.

The user code this notes (anything after the router that no pass proves):

    weights, ids = torch.topk(router(x).softmax(-1), k)        # or torch.max / argmax over the experts
    ...                                                         # selection, sort, one_hot, masked_select, split ...
    y = ... x[sel] @ w ...                                       # a matmul, linear, einsum, bmm or grouped GEMM

It runs after every other pass (the driver's ``Explainer``). It stays quiet where one of them rewrote the region (the
ids reach a moe_inductor op), and on a graph where one of them already said why it left code alone.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from .aliases import tensors_written, view_family
from .driver import Explainer, region_of
from .fx_utils import is_call, val

FORM = "moe_region"

#: the ops that make per-expert work out of routed rows
_EXPERT_WORK = {operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm", torch.mm: "mm",
                torch.einsum: "einsum", torch.functional.einsum: "einsum", F.linear: "linear",
                torch._C._nn.linear: "linear"}
if hasattr(torch, "_grouped_mm"):
    _EXPERT_WORK[torch._grouped_mm] = "_grouped_mm"
_METHOD_WORK = {"matmul": "matmul", "mm": "mm", "bmm": "bmm"}
#: how routed code turns ids into rows (named in the note, so the user sees which spelling was not proven)
_DISPATCH = {torch.nonzero: "nonzero", torch.where: "where", torch.argsort: "argsort", torch.sort: "sort",
             F.one_hot: "one_hot", torch.masked_select: "masked_select", torch.bincount: "bincount",
             torch.histc: "histc", torch.split: "split", torch.cat: "cat", torch.gather: "gather",
             torch.index_select: "index_select", torch.cumsum: "cumsum"}
_DISPATCH_METHODS = {"nonzero", "sort", "argsort", "masked_select", "tolist", "split", "index_select", "scatter",
                     "scatter_", "scatter_add_", "index_add_", "index_add", "cumsum", "masked_fill", "masked_fill_"}
_MAX_REACH = 5000


def _router_ids(node: Node) -> Optional[Node]:
    """The anchor: ``topk(scores, k, dim=-1)[1]`` / ``.indices``, ``torch.max(scores, dim=-1)[1]`` or
    ``argmax(scores, dim=-1)`` over a 2D-or-more float score tensor (one row of experts per token)."""
    if is_call(node, "call_function", operator.getitem) and node.args[1] == 1:
        top = node.args[0]
        if is_call(top, "call_function", torch.topk) or is_call(top, "call_method", "topk"):
            dim = top.kwargs.get("dim", top.args[2] if len(top.args) > 2 else -1)
        elif is_call(top, "call_function", torch.max) or is_call(top, "call_method", "max"):
            dim = top.kwargs.get("dim", top.args[1] if len(top.args) > 1 else None)
        else:
            return None
    elif is_call(node, "call_function", torch.argmax) or is_call(node, "call_method", "argmax"):
        top, dim = node, node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    else:
        return None
    scores = val(top.args[0]) if top.args else None
    if scores is None or not scores.is_floating_point() or scores.dim() < 2 or dim not in (-1, scores.dim() - 1):
        return None
    return node


def _name(node: Node) -> Optional[str]:
    if node.op == "call_function":
        return _DISPATCH.get(node.target) or _EXPERT_WORK.get(node.target) or (
            "index" if node.target is operator.getitem and any(isinstance(a, Node) for a in _flat_args(node.args[1:]))
            else None)
    if node.op == "call_method":
        return node.target if node.target in _DISPATCH_METHODS else _METHOD_WORK.get(node.target)
    return None


def _flat_args(args) -> list:
    out = []
    for a in args:
        out += _flat_args(a) if isinstance(a, (tuple, list)) else [a]
    return out


#: transformers' own code: its experts modules are substituted at trace time, or left alone there with a reason
#: (hf.py), so work that is still in the graph from it has been explained already
_TRANSFORMERS_SOURCE = "/transformers/"


def _is_work(node: Node) -> bool:
    work = (node.op == "call_function" and node.target in _EXPERT_WORK) or (
        node.op == "call_method" and node.target in _METHOD_WORK)
    return work and _TRANSFORMERS_SOURCE not in (node.meta.get("stack_trace") or "")


#: ops that only rearrange a tensor (stack, slice, view, cast): per-expert work behind them is still per-expert work
_REARRANGE = {torch.stack, torch.cat, torch.concat, operator.getitem, torch.flatten, torch.transpose, torch.permute,
              torch.squeeze, torch.unsqueeze, torch.reshape, torch.zeros_like}
_REARRANGE_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "contiguous", "flatten", "to",
                      "float", "half", "bfloat16", "type_as", "expand", "chunk", "split"}
#: how far back through rearranging ops the ids' readers are traced to per-expert work
_BEHIND = 4


def _rearranges(node: Node) -> bool:
    """``node`` stacks, slices, views or casts its tensor input(s), or scales or shifts one (by a number or
    another tensor: a per-expert scale, a bias)."""
    if node.op == "call_method":
        return node.target in _REARRANGE_METHODS
    if node.op != "call_function":
        return False
    return node.target in _REARRANGE or node.target in (operator.mul, operator.truediv, operator.add, operator.sub)


def _work_behind(node: Node, router: set) -> Optional[Node]:
    """The per-expert work ``node`` is, or whose output it rearranges (``_rearranges``, up to ``_BEHIND`` ops
    deep): every expert's output stacked, or sliced and joined again, before a dense form's routing matrix mixes
    it. The router's own computation (``router``, what the ids are made from) is not per-expert work."""
    stack, seen = [(node, 0)], set()
    while stack:
        n, depth = stack.pop()
        if n in seen or n in router:
            continue
        seen.add(n)
        if _is_work(n):
            return n
        if depth < _BEHIND and _rearranges(n):
            stack.extend((a, depth + 1) for a in n.all_input_nodes)
    return None


def _ancestors(node: Node) -> set:
    """What ``node`` is computed from (itself included), up to ``_MAX_REACH`` nodes."""
    found, stack = set(), [node]
    while stack and len(found) < _MAX_REACH:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def _changed(node: Node) -> list[Node]:
    """Every name of the tensors ``node`` changes in place (``t.scatter_(...)``, ``t[i] = v``, ``out=t``,
    ``torch.topk(s, k, out=(v, i))``): the readers of any of them (``aliases.view_family``: views, in-place results)
    read what the write carries."""
    changed = list(tensors_written(node))
    if is_call(node, "call_function", operator.setitem) and isinstance(node.args[0], Node):
        changed.append(node.args[0])
    return [a for t in changed for a in view_family(t)]


def unexplained(gm: GraphModule) -> list[tuple[Node, str]]:
    """(router ids, reason) for each router whose ids reach per-expert work with no moe_inductor op in between."""
    found = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    covered, regions = set(), set()  # one note per MoE region: a second choice's argmax is downstream of the first
    for node in gm.graph.nodes:
        ids = _router_ids(node)
        if ids is None or ids in covered or region_of(ids) in regions:
            continue
        reach, stack, rewritten = set(), [ids], False
        while stack and len(reach) < _MAX_REACH:
            n = stack.pop()
            if n in reach:
                continue
            reach.add(n)
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "moe_inductor":
                rewritten = True
                break
            stack.extend(n.users)
            stack.extend(_changed(n))  # an in-place write carries the ids into the tensor it changes
        if rewritten:
            continue
        # the ids reach per-expert work, or meet its output (a dense form scales every expert's output by them),
        # maybe stacked or sliced first; the router's own work is what it meets when the graph hands the ids on
        # (to a loop Dynamo could not trace, say)
        router = _ancestors(ids)
        met = [w for n in reach for a in n.all_input_nodes if a not in reach
               for w in ((a if _is_work(a) else _work_behind(a, router)),) if w is not None]
        if not any(_is_work(n) for n in reach) and not met:
            continue
        covered |= reach
        regions.add(region_of(ids))
        names = list(dict.fromkeys(filter(None, (_name(n) for n in sorted(reach | set(met), key=order.__getitem__)))))
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        if not any(_is_work(n) for n in reach) and all(w in router for w in met) and any(
                n.op == "output" for n in reach):
            # nothing after the router here: the ids leave the graph beside the router's own projection
            found.append((ids, f"a router's top-k/argmax ids leave this graph (returned, or handed on past a graph "
                          f"break) beside the router's own projection ({shown}), and no MoE form proves the experts "
                          "they feed from this graph alone: those are traced in another graph, or not at all"))
            continue
        found.append((ids, f"a router's top-k/argmax ids feed per-expert work ({shown}) that no MoE form proves: "
                      "none of the loop, gathered-weights, dense, sort + grouped_mm or capacity forms matched it"))
    return found


rewrite = Explainer(FORM, unexplained)
"""Note (never rewrite) each router whose ids reach per-expert work that no form rewrote or explained."""
