"""Form "sorted_grouped_mm": sort the assignments by expert, run ``torch._grouped_mm`` per projection, scatter back
(torchtitan's MoE; hand-written versions of HF's grouped_mm path).

The user code this matches (the routing score may scale the expert input, as torchtitan does by default, or its
output; the combine may be ``scatter_add_`` or ``index_add_``):

    order = torch.argsort(ids.view(-1), stable=True)              # or torch.sort(ids.view(-1))[1]
    tok = order // k
    scores = weights.view(-1)[order]
    xs = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, H))     # or x[tok]
    xs = (xs.float() * scores.reshape(-1, 1)).to(x.dtype)          # score on the input (optional)
    counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    ys = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)    # (* scores[:, None] for a score on the output)
    out = torch.zeros_like(x); out.scatter_add_(0, tok.reshape(-1, 1).expand(-1, H), ys)

Every piece is checked to come from the same flattened ids: the sort, the counts behind the offsets, the token index
and the score gather. Anything else is left alone.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from ..report import Rewrite
from ..spec import MoESpec
from .emit import emit_experts, inputs_unchanged, note_unmatched
from .fx_utils import alias_mutations, is_call, read_gated, source_line, val

FORM = "sorted_grouped_mm"


def _flat(node) -> Optional[Node]:
    """``t`` for ``t.view(-1)``, ``t.reshape(-1)`` or ``t.flatten()``."""
    if is_call(node, "call_method", "view", "reshape") and tuple(node.args[1:]) in ((-1,), ((-1,),)):
        return node.args[0]
    if is_call(node, "call_method", "flatten") and len(node.args) == 1:
        return node.args[0]
    return None


def _strip(node, *methods) -> Node:
    """Skip dtype casts like ``.float()`` / ``.int()`` / ``.to(...)``."""
    while is_call(node, "call_method", *methods):
        node = node.args[0]
    return node


def _sort_order(order: Node) -> Optional[Node]:
    """The (T, k) ids whose flattening ``order`` sorts: ``argsort(flat)`` or ``sort(flat)[1]``."""
    if is_call(order, "call_function", torch.argsort) and len(order.args) == 1 and set(order.kwargs) <= {"stable"}:
        return _flat(order.args[0])
    if is_call(order, "call_function", operator.getitem) and order.args[1] == 1:
        sort = order.args[0]
        if is_call(sort, "call_function", torch.sort) and len(sort.args) == 1 and set(sort.kwargs) <= {"stable"}:
            return _flat(sort.args[0])
    return None


def _token_rows(index: Node) -> Optional[Node]:
    """``tok`` for ``tok.reshape(-1, 1).expand(-1, H)`` (the gather/scatter index) or ``tok`` itself."""
    if is_call(index, "call_method", "expand") and is_call(index.args[0], "call_method", "reshape", "view"):
        if tuple(index.args[0].args[1:]) == (-1, 1) and index.args[1] == -1:
            return index.args[0].args[0]
        return None
    return index


def _token_of(tok: Node) -> Optional[tuple[Node, Node]]:
    """(order, ids) for ``tok = order // k`` with k the ids' width."""
    if not (is_call(tok, "call_function", operator.floordiv) and isinstance(tok.args[1], int)):
        return None
    order = tok.args[0]
    ids = _sort_order(order)
    iv = val(ids) if ids is not None else None
    if iv is None or iv.dim() != 2 or iv.shape[1] != tok.args[1] or iv.dtype.is_floating_point:
        return None
    return order, ids


def _offsets_of(offs, ids: Node, num_experts: int) -> bool:
    """``cumsum(counts, 0, dtype=int32)`` of per-expert counts of the same flattened ids."""
    if not (is_call(offs, "call_function", torch.cumsum) and offs.kwargs.get("dtype") == torch.int32):
        return False
    if (offs.args[1:] or (offs.kwargs.get("dim"),))[0] != 0:
        return False
    counts = offs.args[0]
    if is_call(counts, "call_function", torch.histc):
        bins = counts.kwargs.get("bins", counts.args[1] if len(counts.args) > 1 else None)
        lo = counts.kwargs.get("min", counts.args[2] if len(counts.args) > 2 else None)
        hi = counts.kwargs.get("max", counts.args[3] if len(counts.args) > 3 else None)
        # with bins = E and min 0, max E or E - 1 puts id v in bin v exactly
        return (bins == num_experts and lo == 0 and hi in (num_experts, num_experts - 1)
                and _flat(_strip(counts.args[0], "float", "int", "to")) is ids)
    return False


def _grouped_mm_ops() -> tuple:
    """The grouped-GEMM calls with ``_grouped_mm``'s meaning (rows [offs[e-1], offs[e]) times w[e]): the aten op,
    ``F.grouped_mm`` where torch has it, and transformers' ``grouped_mm_fallback`` op once transformers registered it."""
    ops = [torch._grouped_mm]
    if hasattr(torch.nn.functional, "grouped_mm"):
        ops.append(torch.nn.functional.grouped_mm)
    try:
        fallback = torch.ops.transformers.grouped_mm_fallback
        ops += [fallback, fallback.default]
    except (AttributeError, RuntimeError):
        pass
    return tuple(ops)


def _grouped(node: Node, offs_ids: Node, num_experts: Optional[int]) -> Optional[tuple[Node, Node, str, Node]]:
    """(input, stacked weight, layout, offs) of ``torch._grouped_mm(a, w or w.transpose(-2, -1), offs=offs)``."""
    if not is_call(node, "call_function", *_grouped_mm_ops()) or len(node.args) != 2 or "offs" not in node.kwargs:
        return None
    # F.grouped_mm traces to _grouped_mm with its defaults spelled out; a bias or another out_dtype is not ours
    if set(node.kwargs) - {"offs", "bias", "out_dtype"} or any(node.kwargs.get(k) is not None for k in ("bias", "out_dtype")):
        return None
    a, w = node.args
    layout = "kn"
    if is_call(w, "call_method", "transpose") and set(w.args[1:]) in ({-2, -1}, {1, 2}):
        w, layout = w.args[0], "nk"
    wv = val(w)
    if wv is None or wv.dim() != 3:
        return None
    offs = node.kwargs["offs"]
    if not _offsets_of(offs, offs_ids, wv.shape[0] if num_experts is None else num_experts):
        return None
    return a, w, layout, offs


def _scaled_by(node: Node, scores: Node) -> Optional[Node]:
    """``t`` when ``node`` is ``t * scores.reshape(-1, 1)`` (or ``scores[:, None]``), possibly inside casts."""
    node = _strip(node, "to")
    if not is_call(node, "call_function", operator.mul):
        return None
    for t, s in (node.args, node.args[::-1]):
        s = _strip(s, "to", "float")
        if (is_call(s, "call_method", "reshape", "view") and tuple(s.args[1:]) == (-1, 1) and s.args[0] is scores) or (
                is_call(s, "call_function", operator.getitem) and s.args[0] is scores
                and s.args[1] == (slice(None, None, None), None)):
            return _strip(t, "float", "to")
    return None


def _scores_of(order: Node) -> list[Node]:
    """The ``weights.view(-1)[order]`` gathers that read the routing weights in sorted order."""
    return [u for u in order.users if is_call(u, "call_function", operator.getitem) and u.args[1] is order
            and _flat(u.args[0]) is not None]


def match(acc: Node) -> Optional[tuple[MoESpec, Node]]:
    """(spec, the combine node) for an accumulator filled by one scatter_add_/index_add_ of sorted expert outputs."""
    if not is_call(acc, "call_function", torch.zeros_like):
        return None
    mutations = alias_mutations(acc)  # through any view of it, too
    if len(mutations) != 1 or mutations[0].target not in ("scatter_add_", "index_add_"):
        return None
    add = mutations[0]
    if len(add.args) != 4 or add.args[1] != 0 or add.kwargs:
        return None
    tok = _token_rows(add.args[2])
    if tok is None or (add.target == "index_add_" and tok is not add.args[2]):
        return None
    got = _token_of(tok)
    if got is None:
        return None
    order, ids = got
    scores = _scores_of(order)
    if len(scores) != 1:
        return None
    score = scores[0]
    ys, position = add.args[3], "input"
    unscaled = _scaled_by(ys, score)
    if unscaled is not None:
        ys, position = unscaled, "output"
    down = _grouped(ys, ids, None)
    if down is None:
        return None
    h, w_down, layout, offs = down
    num_experts = val(w_down).shape[0]
    gated = read_gated(h, lambda n: _grouped(n, ids, num_experts))
    if gated is None:
        return None
    activation, gate, up = gated.activation, gated.gate, gated.up
    if up is not None and up[0] is not gate[0]:
        return None
    if any(p[2] != layout for p in (gate, up) if p is not None):
        return None
    xs = gate[0]
    if position == "input":
        xs = _scaled_by(xs, score)
        if xs is None:
            return None
    if is_call(xs, "call_function", torch.gather) and xs.args[1] == 0 and _token_rows(xs.args[2]) is tok:
        x = xs.args[0]
    elif is_call(xs, "call_function", operator.getitem) and xs.args[1] is tok:
        x = xs.args[0]
    else:
        return None
    xv, av = val(x), val(acc)
    if xv is None or av is None or xv.dim() != 2 or tuple(xv.shape) != tuple(av.shape):
        return None
    weights = _flat(score.args[0])
    wv = val(weights)
    if wv is None or tuple(wv.shape) != tuple(val(ids).shape):  # flattened like the ids, or the order means nothing
        return None
    spec = MoESpec(x, ids, weights, gate[1], up[1] if up else None, w_down, layout, activation, position)
    return spec, add


def rewrite(gm: GraphModule) -> list[Rewrite]:
    """Replace every provable sort + grouped_mm MoE in ``gm``; returns what was rewritten."""
    done = []
    graph = gm.graph
    for acc in [n for n in graph.nodes if is_call(n, "call_function", torch.zeros_like)]:
        got = match(acc)
        if got is None or not inputs_unchanged(got[0]):
            continue
        spec, add = got
        reads = [u for u in acc.users if u is not add]
        y = emit_experts(graph, spec, add.next, val(acc).dtype)
        for r in reads:
            r.replace_input_with(acc, y)
        where = source_line(add)
        graph.erase_node(add)
        graph.eliminate_dead_code()
        done.append(Rewrite(FORM, where, int(val(spec.gate).shape[0]), int(val(spec.ids).shape[-1]), spec.activation,
                            (tuple(val(spec.gate).shape), tuple(val(spec.down).shape)),
                            note=f"routing weight on the {spec.weight_position}; no permuted copy of x"))
    if done:
        graph.lint()
        gm.recompile()
    note_unmatched(gm, FORM, _grouped_mm_offsets,
                   "torch._grouped_mm over expert offsets, but not the sort, histc + cumsum offsets, gather and "
                   "scatter-back of one set of routing ids that this form proves")
    return done


def _grouped_mm_offsets(node: Node) -> Optional[Node]:
    """The offsets of a grouped-GEMM call (what the calls of one MoE share), else None."""
    if is_call(node, "call_function", *_grouped_mm_ops()) and "offs" in node.kwargs:
        return node.kwargs["offs"]
    return None
