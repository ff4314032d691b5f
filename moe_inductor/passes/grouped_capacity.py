"""Form "padded_capacity", grouped: GShard top-k over groups (lucidrains' mixture-of-experts), each group (the batch
row b of a (B, N, D) input) with its own queues and the same capacity C, a (B, N, E, C) combine.

The user code this matches (``tests/corpus/lucidrains_moe.py``):

    mask_j = one_hot(idx_j, E).float()                                # (B, N, E), choice j = 0..k-1
    pos_j = (excl_cumsum(mask_j, dim=-2) + counts of the earlier choices) * mask_j   # excl_cumsum: pad + cumsum
    kept_j = mask_j * (pos_j < C).float(); counts_j = kept_j.sum(dim=-2, keepdim=True)   # (or mask_j.sum)
    combine = sum_j g_j[..., None, None] * ... * one_hot(idx_j, E)[..., None] * slots_j[..., None, :]
    slots_j = one_hot(pos_j.sum(-1).long(), max(pos_max + 2, C))[..., :C]   # traced by data_widths.py
    dispatch = combine.bool().to(combine)
    xin = einsum("bnd,bnec->ebcd", x, dispatch).reshape(E, -1, D)   # experts by einsum / bmm on (E, B*C, D)
    y = einsum("ebcd,bnec->bnd", experts(xin).reshape(E, B, C, D), combine)

Why it is exact: in group b the position of choice j of token n is the number of tokens n' < n of that group whose
choice j is the same expert, plus the group's count of earlier choices of that expert (all of them, or those kept:
they differ only where the earlier choices alone fill the expert, and then choice j is dropped either way). That is
the op's choice-major queue over the group's N tokens. The slot factor ``[pos_j == c]`` over c < C is zero exactly
where the op drops the choice (pos_j >= C), so each of the E*C slots of a group holds at most one (token, choice),
the dispatch (combine's support) copies it unscaled, and the token gets back the product of its (B, N) factors times
its expert's output. The op, called once per group on (x[b], ids[b], weights[b], C), computes the same; B must be a
static size. The (B, N) factors are taken whole as the choice's weight: where they are zero the term is zero, and
the op's output for that choice is zero too; so is its gradient, as eager's (the choice is not dispatched, and the
bias-free experts give a zero row nothing: ``zero_weights.py``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..data_widths import NONNEGATIVE
from ..spec import MoESpec
from .capacity_gating import (binary, call, mask_key, one_hot, same_traced, shape, shaped, size_node, strip_casts,
                              versions_sound)
from .driver import Match
from .fx_utils import einsum_parts, val
from .padded_capacity import _ADD, _dispatch_of, _regrouped, _stacked_experts
from .zero_weights import dispatched_weights

_MUL = (operator.mul, torch.mul)
_LT = (torch.lt, operator.lt, "lt")

#: why a grouped combine is left alone when its routing is not read
NOT_GROUPED_ROUTING = ("a (B, N, E, C) combine over per-group capacity slots, but its routing is not the per-group "
                       "GShard queue this form proves")


def _support_of(node: Any) -> Optional[Node]:
    """combine for a dispatch ``combine.bool().to(combine)`` (a 0/1 cast to combine's dtype), or what
    ``padded_capacity``'s reader takes."""
    if call(node, "to") and len(node.args) == 2 and isinstance(node.args[1], Node) and not node.kwargs:
        src, like = val(node.args[0]), val(node.args[1])
        if src is not None and like is not None and src.dtype is torch.bool and src.device == like.device:
            node = node.args[0]
    return _dispatch_of(node)


def _is_index(node: Any, index: tuple) -> Optional[Node]:
    if call(node, operator.getitem) and isinstance(node.args[0], Node) and node.args[1] == index:
        return node.args[0]
    return None


def _excl_cumsum(node: Any) -> Optional[Node]:
    """m for lucidrains' ``F.pad(m, (0, 0, 1, 0)).cumsum(dim=-2)[..., :-1, :]`` of a (B, N, E) m."""
    padded = _is_index(node, (Ellipsis, slice(None, -1, None), slice(None, None, None)))
    if not (call(padded, torch.cumsum, "cumsum") and len(padded.args) == 1 and padded.kwargs.get("dim") in (-2, 1)
            and set(padded.kwargs) == {"dim"}):
        return None
    pad = padded.args[0]
    if not (call(pad, F.pad, torch._C._nn.pad) and len(pad.args) >= 2 and tuple(pad.args[1]) == (0, 0, 1, 0)):
        return None
    rest = list(pad.args[2:]) + list(pad.kwargs.values())
    if rest not in ([], ["constant"], ["constant", None], ["constant", 0], ["constant", 0.0]):
        return None
    m = pad.args[0]
    return m if len(shape(m) or ()) == 3 else None


def _count(node: Any, C: Any) -> Optional[Node]:
    """The one-hot key of choice i for ``m_i.sum(dim=-2, keepdim=True)``, m_i the choice's mask or its kept part
    ``m_i * lt(pos_i, C).float()`` (pos_i its queue position, proven by the caller through ``positions``)."""
    if not (call(node, torch.sum, "sum") and len(node.args) == 1 and node.kwargs.get("dim") in (-2, 1)
            and node.kwargs.get("keepdim") is True and set(node.kwargs) == {"dim", "keepdim"}):
        return None
    m = node.args[0]
    ab = binary(m, _MUL)
    if ab is not None:
        for a, b in (ab, ab[::-1]):
            keep = strip_casts(b, zero_one=True)
            if call(keep, *_LT) and len(keep.args) == 2 and not keep.kwargs and _same_capacity(keep.args[1], C):
                return ("kept", mask_key(a), keep.args[0])
        return None
    return ("all", mask_key(m), None)


def _same_capacity(handle: Any, C: Any) -> bool:
    """``handle`` (a number or a node of the graph) is the capacity C (an int, or a SymInt node)."""
    if isinstance(handle, (int, float)) and not isinstance(handle, bool):
        return isinstance(C, int) and handle == C
    if isinstance(handle, Node) and call(handle, torch.sym_float) and len(handle.args) == 1:
        handle = handle.args[0]
    return isinstance(C, Node) and handle is C


def _position(prod: Any, C: Any, B, N, E) -> Optional[tuple[Node, list]]:
    """(the mask's key, the earlier counts) for ``(excl_cumsum(m) + counts...) * m`` over (B, N, E)."""
    ab = binary(prod, _MUL)
    if ab is None or not shaped(prod, (B, N, E)):
        return None
    for p, m in (ab, ab[::-1]):
        key = mask_key(m)
        terms, stack = [], [p]
        while stack:
            t = stack.pop()
            if binary(t, _ADD) is not None:
                stack.extend(binary(t, _ADD))
            else:
                terms.append(t)
        cums = [t for t in terms if _excl_cumsum(t) is not None and mask_key(_excl_cumsum(t)) is key]
        counts = [_count(t, C) for t in terms if t not in cums]
        if len(cums) == 1 and None not in counts:
            return key, counts
    return None


def _slot(node: Any, C: Any) -> Optional[Node]:
    """The ``pos.long()`` node for the (B, N, C) slot one-hot ``eq(pos.long()[..., None], arange(u)).long()
    [..., :C]`` (data_widths' trace of safe_one_hot): ``[pos == c]`` for c < C, whatever u >= C is. A
    ``one_hot(pos, C)`` is not read: eager raises on a position >= C, which a rewrite would not."""
    wide = _is_index(node, (Ellipsis, slice(None, C, None)))
    hot = wide.args[0] if call(wide, "long") and len(wide.args) == 1 and not wide.kwargs else None
    if not (call(hot, operator.eq) and len(hot.args) == 2 and not hot.kwargs):
        return None
    column, ar = hot.args
    idx = _is_index(column, (Ellipsis, None)) or (
        column.args[0] if call(column, "unsqueeze") and column.args[1:] == (-1,) and not column.kwargs else None)
    if not (call(ar, torch.arange) and len(ar.args) == 1 and set(ar.kwargs) <= {"device"}):
        return None
    if not (call(idx, "long") and len(idx.args) == 1 and not idx.kwargs):
        return None
    return idx


def _factors(node: Any, B, N, E, C, cap: Any = None) -> Optional[list[tuple[str, Node]]]:
    """The factors of one (B, N, E, C) term, tagged "w" ((B, N)), "e" ((B, N, E)) or "c" ((B, N, C)). A slot
    factor may also be a slice ``[..., :cap]`` proven ``cap`` wide (``_cap_wide``) whose size the trace holds as a
    size of its own (torch 2.11 gives such a slice a fresh unbacked size): the sum of the terms, of width C, then
    has each term's width, ``cap``."""
    ab = binary(node, _MUL)
    if ab is not None and all(isinstance(a, Node) for a in ab) and len(shape(node) or ()) == 4:
        parts = [_factors(a, B, N, E, C, cap) for a in ab]
        return None if None in parts else parts[0] + parts[1]
    for index, tag, want, under in (((Ellipsis, None, None), "w", (B, N, 1, 1), (B, N)),
                                    ((Ellipsis, None), "e", (B, N, E, 1), (B, N, E)),
                                    ((Ellipsis, None, slice(None, None, None)), "c", (B, N, 1, C), (B, N, C))):
        base = _is_index(node, index)
        if base is not None and shaped(node, want) and shaped(base, under):
            return [(tag, base)]
        if tag == "c" and base is not None and cap is not None and _cap_wide(base, cap):
            width = shape(base)[-1]
            if shaped(node, (B, N, 1, width)) and shaped(base, (B, N, width)):
                return [(tag, base)]
    return None


def _cap_wide(node: Any, cap: Any) -> bool:
    """``node`` is ``wide[..., :cap]`` of a ``wide`` whose last size is proven at least ``cap`` (a ``Max`` over
    ``cap``'s own terms and others: safe_one_hot's ``max(idx.max() + 2, C)`` classes), so it is exactly ``cap``
    wide."""
    wide = _is_index(node, (Ellipsis, slice(None, cap, None)))
    if wide is None or not isinstance(cap, Node) or not shape(wide):
        return False
    return _at_least(shape(wide)[-1], cap.meta.get("example_value"))


def _at_least(w: Any, c: Any) -> bool:
    """``w >= c`` for every value of their symbols: ints compared, or ``w`` a ``Max`` over every term of ``c`` (its
    own terms where it is a ``Max`` too) and maybe others."""
    if isinstance(w, int) and isinstance(c, int):
        return w >= c
    if not isinstance(w, torch.SymInt) or not isinstance(c, (int, torch.SymInt)):
        return False
    import sympy

    def terms(e) -> set:
        return set(e.args) if type(e).__name__ == "Max" else {e}

    return terms(c.node.expr if isinstance(c, torch.SymInt) else sympy.Integer(c)) <= terms(w.node.expr)


@dataclasses.dataclass
class _Choice:
    idx: Node
    weights: list
    key: Node  # the mask one-hot's key
    counts: list
    slot_index: Node  # the ``pos.long()`` its slot one-hot reads


def _routing(combine: Node, B, N, E, C, cap) -> Union[list[_Choice], str]:
    """The choices of a combine proven to be a sum of per-group queued choices (C traced, ``cap`` as held), or why
    not."""
    terms, stack = [], [combine]
    while stack:
        t = stack.pop()
        ab = binary(t, _ADD)
        if ab is not None and shaped(t, (B, N, E, C)):
            stack.extend(ab)
        else:
            terms.append(t)
    choices = []
    for term in terms:
        factors = _factors(term, B, N, E, C, cap)
        if factors is None:
            return f"{NOT_GROUPED_ROUTING}: a term is not a product of (B, N, 1, 1), (B, N, E, 1), (B, N, 1, C) views"
        experts = [n for tag, n in factors if tag == "e"]
        slots = [n for tag, n in factors if tag == "c"]
        weights = [n for tag, n in factors if tag == "w"]
        hot = one_hot(experts[0]) if len(experts) == 1 else None
        if hot is None or hot.fill is not None or not hot.has_classes(E) or len(slots) != 1 or not weights:
            return f"{NOT_GROUPED_ROUTING}: a term is not gate * one_hot(expert, E) * slot one-hot"
        if any(not val(w).is_floating_point() for w in weights):
            return f"{NOT_GROUPED_ROUTING}: a term's (B, N) factor is not floating point"
        slot_index = _slot(slots[0], cap)
        pos = slot_index.args[0] if slot_index is not None else None
        summed = pos.args[0] if call(pos, torch.sum, "sum") and len(pos.args) == 1 and pos.kwargs == {
            "dim": -1} else None
        read = _position(summed, cap, B, N, E) if summed is not None else None
        if read is None:
            return f"{NOT_GROUPED_ROUTING}: a slot is not the per-group queue position of its choice"
        key, counts = read
        mhot = one_hot(key)
        if mhot is None or mhot.idx is not hot.idx or not mhot.has_classes(E) or mhot.fill is not None:
            return f"{NOT_GROUPED_ROUTING}: a slot's queue is not the queue of the term's expert choice"
        choices.append(_Choice(hot.idx, weights, key, counts, slot_index))
    choices.sort(key=lambda c: len(c.counts))
    for j, c in enumerate(choices):
        if len(c.counts) != j:
            return f"{NOT_GROUPED_ROUTING}: the queues are not choice-major (choice j behind every earlier choice)"
        behind = []
        for how, key, lt_pos in c.counts:
            i = next((i for i in range(j) if choices[i].key is key), None)
            if i is None:
                return f"{NOT_GROUPED_ROUTING}: a queue counts a mask that is not an earlier choice's"
            if how == "kept" and not _is_position_of(lt_pos, choices[i], cap, B, N, E):
                return f"{NOT_GROUPED_ROUTING}: a count keeps the earlier choice at another position"
            behind.append(i)
        if sorted(behind) != list(range(j)):
            return f"{NOT_GROUPED_ROUTING}: the queues are not choice-major (choice j behind every earlier choice)"
    return choices


def _is_position_of(node: Any, c: _Choice, C, B, N, E) -> bool:
    read = _position(node, C, B, N, E)
    return read is not None and read[0] is c.key and len(read[1]) == len(c.counts) and all(
        a[:2] == b[:2] for a, b in zip(read[1], c.counts))


def _y_parts(y: Node) -> Optional[tuple[Node, Node]]:
    """(combine, slot outputs) for ``einsum("ebcd,bnec->bnd", out, combine)``."""
    parsed = einsum_parts(y)
    if parsed is None or len(parsed[2]) != 2:
        return None
    subs, out, ops = parsed
    for ci, oi in ((1, 0), (0, 1)):
        cs, os_ = subs[ci], subs[oi]
        if len(cs) == 4 and len(set(cs)) == 4 and len(os_) == 4 and os_[:3] == cs[2] + cs[0] + cs[3] \
                and os_[3] not in cs and out == cs[0] + cs[1] + os_[3]:
            return ops[ci], ops[oi]
    return None


def match_grouped(y: Node) -> Union[Match, str, None]:
    """The proven grouped capacity MoE ending at ``y``; why not, when ``y`` is a (B, N, E, C) combine."""
    parts = _y_parts(y)
    if parts is None:
        return None
    # a dispatch may be the support of the gating's combine or of the cast the combine einsum reads (the emitter
    # casts the gates to x's dtype the same way): padded_capacity._match_parts says why either is exact
    read, out = parts
    combine = strip_casts(read)
    s = shape(combine)
    if s is None or len(s) != 4 or combine.op == "placeholder":
        return None
    B, N, E, C = s
    base = "a (B, N, E, C) combine over per-group capacity slots, but"
    if type(B) is not int:
        return f"{base} its group count B is symbolic (the op runs once per group)"
    slots = shape(out)
    if slots is None or len(slots) != 4 or not all(same_traced(a, b) for a, b in zip(slots[:3], (E, B, C))):
        return f"{base} its slot outputs are not (E, B, C, D)"
    # every reshape keeps the row-major order: with E in front and the feature size last on both sides, row r of
    # an expert's (E, B*C, .) slots is slot (r // C, r % C) of the (E, B, C, .) ones
    flat = [n for n in _regrouped(out)[1:] if len(shape(n) or ()) == 3 and same_traced(shape(n)[0], E)
            and same_traced(shape(n)[2], slots[3])]
    experts = [ex for n in flat for ex in _stacked_experts(n, E)]
    dispatched = None
    for ex in experts:
        rows = shape(ex.xin)
        if rows is None or len(rows) != 3:
            continue
        xin = next((n for n in _regrouped(ex.xin) if shaped(n, (E, B, C, rows[2]))), None)
        parsed = einsum_parts(xin) if xin is not None else None
        if parsed is None or len(parsed[2]) != 2:
            continue
        subs, o, ops = parsed
        for xi, di in ((0, 1), (1, 0)):
            xs, ds = subs[xi], subs[di]
            if len(ds) == 4 and len(set(ds)) == 4 and xs == ds[0] + ds[1] + xs[2:] and len(xs) == 3 \
                    and xs[2] not in ds and o == ds[2] + ds[0] + ds[3] + xs[2]:
                support = _support_of(ops[di])
                if support is combine or support is read:
                    dispatched = (ex, ops[xi], val(support).dtype)
    if dispatched is None:
        return f"{base} its slots are not experts on a dispatch of combine's support"
    ex, x, support = dispatched
    if shape(x) is None or len(shape(x)) != 3 or not (same_traced(shape(x)[0], B) and same_traced(shape(x)[1], N)):
        return f"{base} the dispatched tokens are not (B, N, D)"
    slot_c = _capacity_node(combine, C)
    if slot_c is None:
        return f"{base} its symbolic capacity C is held by no size in the graph (the op takes an int or a size)"
    choices = _routing(combine, B, N, E, C, slot_c)
    if isinstance(choices, str):
        return choices
    inputs = [x, *(c.idx for c in choices), *(w for c in choices for w in c.weights)]
    if not versions_sound(y, inputs, []):
        return f"{base} its gating tensors are changed in place after they are read"
    checks = tuple(n for n in y.graph.nodes if _checked_class(n) is not None and _proven_nonnegative(
        _checked_class(n), choices))
    spec = MoESpec(x, None, None, ex.gate, ex.up, ex.down, ex.layout, ex.activation, capacity=slot_c,
                   **dict(ex.fields))

    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        ids = graph.call_function(torch.stack, ([c.idx for c in choices],), {"dim": -1})
        columns = []
        for c in choices:
            w = c.weights[0]
            for other in c.weights[1:]:
                w = graph.call_function(operator.mul, (w, other))
            columns.append(w)
        weights = graph.call_function(torch.stack, (columns,), {"dim": -1})
        # a zero weight's choice is not dispatched; the experts are bias-free, so its eager gradient is zero
        # (zero_weights.py)
        return dataclasses.replace(spec, ids=ids, weights=dispatched_weights(graph, weights, support))

    note = f"capacity {C} per group, the same drops, one op call per group ({B}); no (B, N, E, C) dispatch"
    return Match(spec, y, note=note, derive=derive, top_k=len(choices), writes=checks, groups=B)


def _capacity_node(combine: Node, C: Any) -> Any:
    """C as the graph holds it: an int, or the SymInt node a slot one-hot is sliced to (else any node holding that
    size); None when no node holds it. A slice proven as wide as its stop (``_cap_wide``) whose own size is C
    names its stop too (torch 2.11 gives the slice a size of its own)."""
    if type(C) is int:
        return C
    for n in combine.graph.nodes:
        if call(n, operator.getitem) and isinstance(n.args[1], tuple) and len(n.args[1]) == 2 \
                and n.args[1][0] is Ellipsis and isinstance(n.args[1][1], slice):
            stop = n.args[1][1].stop
            if not isinstance(stop, Node):
                continue
            if same_traced(stop.meta.get("example_value"), C):
                return stop
            if shape(n) and same_traced(shape(n)[-1], C) and _cap_wide(n, stop):
                return stop
    return size_node(combine, C)


def _checked_class(node: Node) -> Optional[Node]:
    """x for data_widths' ``_assert_async((x >= 0).all(), ...)``."""
    if not (node.meta.get(NONNEGATIVE) and call(node, torch._assert_async) and node.args):
        return None
    every = node.args[0]
    ge = every.args[0] if call(every, "all") and len(every.args) == 1 else None
    return ge.args[0] if call(ge, operator.ge) and len(ge.args) == 2 and ge.args[1] == 0 else None


def _proven_nonnegative(x: Node, choices: list) -> bool:
    """A data-width one_hot's class tensor that is a proven queue position: a sum of exclusive cumsums and counts
    of 0/1 masks, times a 0/1 mask, so never negative, and eager's check of it never raises."""
    return any(x is c.slot_index for c in choices)
