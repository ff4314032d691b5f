"""Form "padded_capacity": GShard / Switch / fairseq gating into (T, E, C) dispatch and combine tensors, experts run
on a padded (E, C, H) buffer. Top-1 and top-k (k choices, each queued behind the earlier ones).

The user code this matches (letters, operand order, unsqueeze spellings and dtype casts may vary):

    mask_j = one_hot(idx_j, E)                                   # choice j of every token, j = 0..k-1
    loc_j = cumsum(mask_j, dim=0) - 1 (+ sum(mask_i, dim=0, keepdim=True) for every earlier choice i)
    mask_j = mask_j * lt(loc_j, C)                               # drop what is past the capacity
    slot_j = one_hot(sum(loc_j * mask_j, dim=1), C)              # (T, C)
    combine = sum over j of gate_j[:, None, None] * mask_j[:, :, None] * slot_j[:, None, :]   # (T, E, C)
    dispatch = combine.bool().to(x.dtype)                        # or combine != 0
    xin = einsum("tec,th->ech", dispatch, x)                     # (E, C, H)
    out = einsum("eci,ehi->ech", act(einsum("ech,eih->eci", xin, w1)) [* einsum(.., w3)], w2)
    y = einsum("tec,ech->th", combine, out)

Why it is exact: the queue positions come from a cumsum over tokens, so within an expert every kept (token, choice)
gets its own slot (choice j queues behind all earlier choices, kept or not, which drops exactly what the op drops
when it fills each expert in choice-major priority order j*T + t). A slot therefore holds one token or none, the
dispatch copies that token unscaled, and the combine returns gate_j * expert_e(x_t) to its token. The op does the
same with ids (idx_0, .., idx_{k-1}), weights (gate_0, ..) and capacity C, without the padding. A dispatch that is
not the exact support of combine (``combine > 0.5``), a mask without the drop, or a queue that ignores the earlier
choices, is a different computation and is left alone.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match, every_node
from .fx_utils import einsum_parts, mutated_alias, split_gated, val

FORM = "padded_capacity"

_ONE_HOT = (F.one_hot, torch._C._nn.one_hot)
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)
_CASTS = ("float", "double", "half", "bfloat16", "long", "int", "bool")


def _call(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def _shape(node: Any) -> Optional[tuple]:
    v = val(node) if isinstance(node, Node) else None
    return tuple(v.shape) if v is not None else None


def _strip_casts(node: Any, zero_one: bool = False) -> Any:
    """The tensor under dtype casts. ``zero_one`` is for tensors of 0s and 1s (masks, one-hots), where every cast is
    exact; otherwise only float-to-float casts go (the emitter casts the routing weights to x's dtype the same way)."""
    while isinstance(node, Node) and node.args and isinstance(node.args[0], Node) and not node.kwargs:
        is_cast = (node.op == "call_method" and (
            (node.target == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.dtype))
            or (node.target == "type_as" and len(node.args) == 2)
            or (node.target in _CASTS and len(node.args) == 1)))
        if not is_cast:
            break
        if not zero_one:
            src, dst = val(node.args[0]), val(node)
            if src is None or dst is None or not (src.is_floating_point() and dst.is_floating_point()):
                break
        node = node.args[0]
    return node


def _new_axis(node: Any) -> Optional[tuple[Node, int]]:
    """(base, d) when ``node`` is ``base`` with one new axis at position d of a 3D result."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    base = node.args[0]
    if node.op == "call_method" and node.target == "unsqueeze" and len(node.args) == 2 and not node.kwargs:
        return base, node.args[1] % 3
    if node.op == "call_function" and node.target is torch.unsqueeze and len(node.args) == 2 and not node.kwargs:
        return base, node.args[1] % 3
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        if len(index) == 3 and index.count(None) == 1 and all(i is None or i == slice(None) for i in index):
            return base, index.index(None)
    return None


def _flatten(node: Node, targets: tuple, keep_going) -> list:
    if _call(node, *targets) and len(node.args) == 2 and not node.kwargs and keep_going(node):
        return _flatten(node.args[0], targets, keep_going) + _flatten(node.args[1], targets, keep_going)
    return [node]


@dataclass
class _Choice:
    gate: Node  # (T, 1, 1) weight of this choice
    idx: Node  # (T,) expert of this choice
    one_hot: Node  # one_hot(idx, E) before the drop
    mask: Node  # after the drop
    earlier: list  # the (dropped or not) masks of the earlier choices this one queues behind
    capacity: Any  # C as the graph holds it: an int, or the node of a symbolic size
    loc: Node  # the queue positions the drop and the slot were computed from


def _dim_arg(node: Node, position: int, default=None):
    return node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)


def _cumsum_over_tokens(node: Any) -> Optional[Node]:
    if _call(node, torch.cumsum, "cumsum") and _dim_arg(node, 1) == 0 and set(node.kwargs) <= {"dim"}:
        return _strip_casts(node.args[0], zero_one=True)
    return None


def _token_count(node: Any) -> Optional[Node]:
    """``m`` for ``sum(m, dim=0, keepdim=True)``."""
    if _call(node, torch.sum, "sum") and _dim_arg(node, 1) == 0 and node.kwargs.get("keepdim") is True \
            and set(node.kwargs) <= {"dim", "keepdim"} and len(node.args) <= 2:
        return _strip_casts(node.args[0], zero_one=True)
    return None


def _queue_position(loc: Node, one_hot: Node) -> Optional[list]:
    """The earlier choices' masks for ``loc = cumsum(one_hot, 0) - 1 + sum(m_i, 0, keepdim=True) + ...``."""
    terms: list[tuple[int, Any]] = []

    def walk(node, sign):
        if _call(node, *_ADD) and len(node.args) == 2 and not node.kwargs:
            walk(node.args[0], sign)
            walk(node.args[1], sign)
        elif _call(node, operator.sub, torch.sub) and len(node.args) == 2 and not node.kwargs:
            walk(node.args[0], sign)
            walk(node.args[1], -sign)
        else:
            terms.append((sign, node))

    walk(loc, 1)
    constant = sum(s * t for s, t in terms if isinstance(t, int) and not isinstance(t, bool))
    tensors = [(s, t) for s, t in terms if not isinstance(t, int)]
    cumsums = [t for s, t in tensors if s == 1 and _cumsum_over_tokens(t) is one_hot]
    earlier = [_token_count(t) for s, t in tensors if s == 1 and t not in cumsums]
    if constant != -1 or len(cumsums) != 1 or any(e is None for e in earlier) or any(s != 1 for s, _ in tensors):
        return None
    if len(earlier) != len(tensors) - 1:
        return None
    return earlier


def _same_size(handle: Any, size: Any) -> bool:
    """``handle`` (an int in the graph, or the node of a symbolic size) is the size ``size`` of a traced tensor."""
    if isinstance(handle, int) and not isinstance(handle, bool):
        return isinstance(size, int) and handle == size
    traced = handle.meta.get("example_value", handle.meta.get("val")) if isinstance(handle, Node) else None
    if not isinstance(traced, torch.SymInt):
        return False
    if isinstance(size, torch.SymInt):
        return str(traced.node.expr) == str(size.node.expr)
    # a plain int size made from a symbolic one: Dynamo specialised it (one_hot's num_classes), under a guard
    return isinstance(size, int) and traced.node.hint == size


def _dropped_mask(mask: Node, capacity) -> Optional[tuple[Node, Node, Node, list, Any]]:
    """(idx, one_hot, loc, earlier, the capacity as written) for ``mask = one_hot(idx, E) * lt(loc, capacity)`` with loc a queue position."""
    if not (_call(mask, *_MUL) and len(mask.args) == 2 and not mask.kwargs):
        return None
    for a, b in (mask.args, mask.args[::-1]):
        hot, keep = _strip_casts(a, zero_one=True), _strip_casts(b, zero_one=True)
        if not (_call(hot, *_ONE_HOT) and isinstance(hot.args[0], Node)):
            continue
        if not (_call(keep, torch.lt, operator.lt, "lt") and len(keep.args) == 2 and not keep.kwargs):
            continue
        loc, cap = keep.args
        if not isinstance(loc, Node) or not _same_size(cap, capacity):
            continue
        earlier = _queue_position(loc, hot)
        if earlier is not None:
            return hot.args[0], hot, loc, earlier, cap
    return None


def _num_classes(one_hot: Node):
    return one_hot.kwargs.get("num_classes", one_hot.args[1] if len(one_hot.args) > 1 else None)


def _term_factors(node: Any, T, E, C) -> list:
    """The factors of one combine term, through products of (T, E, C) or (T, E, 1) tensors and batched outer products
    ``bmm(a (T, E, 1), b (T, 1, C))`` (fairseq's spelling: a sum over a size-1 axis is a plain product)."""
    if _call(node, *_MUL) and len(node.args) == 2 and not node.kwargs and _shape(node) in ((T, E, C), (T, E, 1)):
        return _term_factors(node.args[0], T, E, C) + _term_factors(node.args[1], T, E, C)
    if (_call(node, torch.bmm, torch.matmul, operator.matmul, "bmm", "matmul") and len(node.args) == 2
            and not node.kwargs and _shape(node.args[0]) == (T, E, 1) and _shape(node.args[1]) == (T, 1, C)):
        return _term_factors(node.args[0], T, E, C) + _term_factors(node.args[1], T, E, C)
    return [node]


def _gate_folded(node: Any, T, E) -> list:
    """``[gate (T, 1), mask]`` for ``gate[:, None] * mask`` (either order), else ``[node]``: only a (T, 1) factor is
    split off, so the dropped mask's own product ``one_hot * lt(...)`` stays whole."""
    if _call(node, *_MUL) and len(node.args) == 2 and not node.kwargs and _shape(node) == (T, E):
        for g, rest in (node.args, node.args[::-1]):
            if _shape(g) == (T, 1):
                return [g] + _gate_folded(rest, T, E)
    return [node]


def _choice(term: Node, T, E, C) -> Optional[_Choice]:
    """One ``gate[:, None, None] * mask[:, :, None] * one_hot(slot, C)[:, None, :]`` term of combine; the gate may
    also be folded into the mask first (``(gate[:, None] * mask)[:, :, None]``)."""
    leaves = _term_factors(term, T, E, C)
    if not all(isinstance(n, Node) for n in leaves):
        return None
    gates, masks, slots = [], [], []
    for leaf in leaves:
        axis = _new_axis(leaf)
        if axis is not None and axis[1] == 2 and _shape(leaf) == (T, E, 1):
            inner = _strip_casts(axis[0])  # float casts only: it may carry the gate
            for part in _gate_folded(inner, T, E):
                if _shape(part) == (T, E):
                    masks.append(_strip_casts(part, zero_one=True))
                elif _shape(part) == (T, 1):
                    gates.append(part)
                else:
                    return None
        elif axis is not None and axis[1] == 1 and _shape(leaf) == (T, 1, C):
            slots.append(_strip_casts(axis[0], zero_one=True))
        elif _shape(leaf) == (T, 1, 1):
            gates.append(leaf)
        else:
            return None
    if len(gates) != 1 or len(masks) != 1 or len(slots) != 1:
        return None
    gate, mask, slot = gates[0], masks[0], slots[0]
    if not (_call(slot, *_ONE_HOT) and _same_size(_num_classes(slot), C) and isinstance(slot.args[0], Node)):
        return None
    dropped = _dropped_mask(mask, C)
    if dropped is None or _num_classes(dropped[1]) != E:
        return None
    idx, hot, loc, earlier, cap = dropped
    # the slot is the queue position of the kept (token, expert): sum(loc * mask, dim=1)
    position = _strip_casts(slot.args[0], zero_one=True)
    if not (_call(position, torch.sum, "sum") and _dim_arg(position, 1) in (1, -1) and set(position.kwargs) <= {"dim"}):
        return None
    prod = position.args[0]
    if not (_call(prod, *_MUL) and len(prod.args) == 2 and set(prod.args) == {loc, mask}):
        return None
    return _Choice(gate, idx, hot, mask, earlier, cap, loc)


def _order_choices(choices: list[_Choice]) -> Optional[list[_Choice]]:
    """Choice j queues behind exactly choices 0..j-1 (their masks before or after the drop)."""
    ordered = sorted(choices, key=lambda c: len(c.earlier))
    for j, choice in enumerate(ordered):
        if len(choice.earlier) != j:
            return None
        wanted = [{ordered[i].one_hot, ordered[i].mask} for i in range(j)]
        used = [[i for i, w in enumerate(wanted) if e in w] for e in choice.earlier]
        if sorted(i for u in used for i in u) != list(range(j)) or any(len(u) != 1 for u in used):
            return None
    return ordered


def _slot_projection(node: Any) -> list[tuple[Node, Node, str]]:
    """(input (E, C, K), weight, layout) readings of ``einsum("ecK,eNK->ecN", xin, w)`` (either weight layout), or
    of ``torch.bmm(xin, w)`` / ``xin @ w`` with w (E, K, N), or w (E, N, K) as ``w.transpose(1, 2)``."""
    if _call(node, torch.bmm, operator.matmul, torch.matmul) and len(node.args) == 2 and not node.kwargs:
        xin, w = node.args
        layout = "kn"
        if _call(w, "transpose") and set(w.args[1:]) in ({1, 2}, {-2, -1}):
            w, layout = w.args[0], "nk"
        xv, wv = val(xin), val(w) if isinstance(w, Node) else None
        if xv is None or wv is None or xv.dim() != 3 or wv.dim() != 3 or xv.shape[0] != wv.shape[0]:
            return []
        return [(xin, w, layout)]
    parsed = einsum_parts(node) if isinstance(node, Node) else None
    if parsed is None or len(parsed[2]) != 2:
        return []
    subs, out, ops = parsed
    found = []
    for xi, wi in ((0, 1), (1, 0)):
        xs, ws = subs[xi], subs[wi]
        if len(xs) != 3 or len(ws) != 3 or len(set(xs)) != 3 or len(set(ws)) != 3 or ws[0] != xs[0]:
            continue
        e, c, k = xs
        if k not in ws[1:] or c in ws:
            continue
        n = ws[1] if ws[2] == k else ws[2]
        if n in xs or out != e + c + n:
            continue
        found.append((ops[xi], ops[wi], "kn" if ws[1] == k else "nk"))
    return found


def _dispatch_of(node: Any) -> Optional[Node]:
    """``combine`` for ``combine.bool()`` / ``combine != 0`` (then casts of the 0/1 result): exactly combine's
    support. No cast may sit under the test: a narrower float could round a small gate to zero."""
    for _ in range(8):
        if not isinstance(node, Node):
            return None
        if _call(node, "bool") and len(node.args) == 1 and not node.kwargs:
            return node.args[0]
        if _call(node, "to") and len(node.args) == 2 and node.args[1] is torch.bool and not node.kwargs:
            return node.args[0]
        if _call(node, operator.ne, torch.ne, "ne") and len(node.args) == 2 and node.args[1] in (0, 0.0) \
                and not node.kwargs:
            return node.args[0]
        under = _strip_casts(node, zero_one=True)
        if under is node:
            return None
        node = node.args[0]  # one cast at a time, so the test itself is seen
    return None


@dataclass
class _Match:
    spec_parts: tuple
    choices: list[_Choice]
    capacity: Any


def _capacity_combines(y: Node) -> list[tuple[Node, Node]]:
    """(combine, slot outputs) operand pairs for which ``y`` is ``einsum("tec,ech->th", combine, out)``: the mark
    of this form (a (T, E, C) combine over the experts' padded slots), whether or not the rest is provable."""
    parsed = einsum_parts(y)
    if parsed is None or len(parsed[2]) != 2:
        return []
    subs, out_subs, ops = parsed
    pairs = []
    for ci, oi in ((0, 1), (1, 0)):
        cs, os_ = subs[ci], subs[oi]
        if len(cs) == 3 and len(os_) == 3 and len(set(cs + os_)) == 4 and os_[:2] == cs[1:] and (
                out_subs == cs[0] + os_[2]):
            pairs.append((ops[ci], ops[oi]))
    return pairs


def match(y: Node) -> Optional[_Match]:
    for combine, out in _capacity_combines(y):
        found = _match_parts(_strip_casts(combine), out)
        if found is not None:
            return found
    return None


def _match_parts(combine: Node, out: Node) -> Optional[_Match]:
    shape = _shape(combine)
    if shape is None or len(shape) != 3:
        return None
    T, E, C = shape
    for down_in, down_w, layout in _slot_projection(out):
        split = split_gated(down_in)
        if split is None:
            continue
        activation, _, gate_in, up_node = split
        gate = _slot_projection(gate_in)
        up = _slot_projection(up_node) if up_node is not None else [None]
        for g in gate:
            for u in up:
                if u is not None and (u[0] is not g[0] or u[2] != g[2]):
                    continue
                if g[2] != layout:
                    continue
                m = _match_routing(combine, g[0], T, E, C)
                if m is None:
                    continue
                x, choices = m
                wv = val(down_w)
                if wv is None or wv.shape[0] != E or val(g[1]).shape[0] != E:
                    continue
                capacity = C if isinstance(C, int) else choices[0].capacity  # the op takes an int or a size node
                return _Match((x, g[1], u[1] if u is not None else None, down_w, layout, activation), choices,
                              capacity)
    return None


def _match_routing(combine: Node, xin: Node, T, E, C) -> Optional[tuple[Node, list[_Choice]]]:
    """(x, the choices) when ``xin = einsum("tec,th->ech", support(combine), x)`` and combine is a proven sum of
    capacity-dropped choices."""
    parsed = einsum_parts(xin)
    if parsed is None or len(parsed[2]) != 2:
        return None
    subs, out_subs, ops = parsed
    x = None
    for di, xi in ((0, 1), (1, 0)):
        ds, xs = subs[di], subs[xi]
        if len(ds) == 3 and len(xs) == 2 and len(set(ds + xs)) == 4 and xs[0] == ds[0] and out_subs == ds[1:] + xs[1]:
            if _dispatch_of(ops[di]) is combine:
                x = ops[xi]
    if x is None or _shape(x) is None or len(_shape(x)) != 2 or _shape(x)[0] != T:
        return None
    # a sum started from 0 (``combine = 0`` then ``combine = combine + term`` per choice) adds a literal zero
    terms = [t for t in _flatten(combine, _ADD, lambda n: _shape(n) == (T, E, C))
             if not (type(t) in (int, float) and t == 0)]
    choices = [_choice(t, T, E, C) if isinstance(t, Node) else None for t in terms]
    if not choices or any(c is None for c in choices):
        return None
    ordered = _order_choices(choices)
    if ordered is None or len({c.capacity for c in ordered}) != 1:  # one capacity for every choice
        return None
    proven = [combine, *terms] + [n for c in ordered for n in (c.one_hot, c.mask, c.idx, c.loc, c.gate)]
    if any(mutated_alias(n) for n in proven):  # nothing the proof read may change afterwards, through any view
        return None
    if any(val(c.idx) is None or tuple(val(c.idx).shape) != (T,) or val(c.idx).is_floating_point() for c in ordered):
        return None
    return x, ordered


def match_capacity(y: Node) -> Union[Match, str, None]:
    """The padded-capacity MoE whose (T, E, C) combine ends at ``y``; or why not, when ``y`` is such a combine."""
    found = match(y)
    if found is None:
        if _capacity_combines(y):
            return ("a (T, E, C) combine over capacity slots, but its dispatch, slot projections or gating (one_hot, "
                    "cumsum queue positions, capacity drops, gates) are not the GShard/Switch routing this form proves")
        return None
    x, gate_w, up_w, down_w, layout, activation = found.spec_parts
    # the routing is proven (``_match_routing``); the op's (T, k) ids and weights are stacked from its choices
    spec = MoESpec(x, None, None, gate_w, up_w, down_w, layout, activation, capacity=found.capacity)

    def routing(graph: Graph, spec: MoESpec) -> MoESpec:
        ids = graph.call_function(torch.stack, ([c.idx for c in found.choices],), {"dim": 1})
        columns = [graph.call_method("reshape", (c.gate, -1)) for c in found.choices]
        weights = graph.call_function(torch.stack, (columns,), {"dim": 1})
        return dataclasses.replace(spec, ids=ids, weights=weights)

    E, gv, dv = int(val(gate_w).shape[0]), val(gate_w), val(down_w)
    # multiply-adds of one slot through the experts: the up projection(s) and the down projection
    slot_flops = 2 * (gv[0].numel() * (2 if up_w is not None else 1) + dv[0].numel())
    padded = f"{E} x {found.capacity} slots = {E * found.capacity * slot_flops / 1e6:.2f} MFLOP per call" \
        if isinstance(found.capacity, int) else "the padded slots"
    return Match(spec, y, note=f"capacity {found.capacity}, the same drops; runs the T*k routed rows instead of "
                 f"{padded}, no (T, E, C) dispatch einsum", derive=routing, top_k=len(found.choices))


rewrite = Form(FORM, (Anchor(every_node, match_capacity),))
"""Replace every provable padded-capacity MoE in a GraphModule; returns what was rewritten."""
