"""The gating half of the padded-capacity proof for T5X's token-priority scheme (Hunyuan-Large's ``topkgating``),
beside ``capacity_gating.py``'s one term per choice and ``stacked_choices.py``'s (k, T, E) stack.

The user code this reads:

    ids = torch.topk(probs_or_logits, k)[1]                          # (T, k), over the E experts
    flat = ids.transpose(0, 1).reshape(-1)                           # row j*T + t holds choice j of token t
    mask = F.one_hot(flat, E)                                        # (k*T, E), any 0/1 dtype
    priority = torch.cumsum(mask, dim=0) * mask - 1                  # queue position at the hit, -1 elsewhere
    priority = priority.reshape(k, T, E).transpose(0, 1).max(dim=1)[0]   # (T, E): the position of t's choice of e
    valid = torch.logical_and(priority >= 0, priority < C)
    priority = torch.masked_fill(priority, ~valid, 0)
    dispatch = F.one_hot(priority, C).to(torch.bool)                 # (T, E, C)
    dispatch = torch.masked_fill(dispatch, ~valid.unsqueeze(-1).expand(-1, -1, C), 0)
    combine = torch.einsum("te,tec->tec", probs, dispatch)           # or probs.unsqueeze(-1) * dispatch

Why it is exact: the cumsum over the k-major rows numbers every assignment of an expert in the op's choice-major
order (every first choice, in token order, then every second one), each counted whether kept or not, as the op
counts them; ``* mask - 1`` leaves -1 where a row does not hit the expert. topk's indices of a row are distinct
(each is one of the row's E positions), so at most one of a token's k rows hits expert e and the max over the k
rows is that row's position, or -1 where none does. ``valid`` keeps the positions below C, the op's drop, and the
dispatch is then one_hot(position, C) on the kept (token, expert) pairs and zero elsewhere. Positions of one expert
are distinct, so a slot holds at most one token.

The dispatch here is that mask, not ``combine.bool()``: the slot of a kept pair holds its token even where its
probability is zero (an underflow), and the combine then adds ``0 * expert(x_t)`` for it. The op, given the ids,
the weights ``gather(probs, 1, ids)`` and C, runs that kept choice too and adds the same zero-weighted product, so
the two agree as long as the experts' outputs are finite (a non-finite slot output is multiplied by every token's
zero weights in eager's combine, the padded form's known limit). A dispatch mask that is not the very mask the
combine multiplies (another threshold, another queue) is a different computation and is left alone; so is a queue
over the token-major rows ``ids.reshape(-1)`` (every choice of a token before the next token).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from .capacity_gating import (_SUB, binary, call, dims, mask_key, one_hot, same_size, same_traced, shape, shaped,
                              strip_casts)
from .fx_utils import einsum_parts, val
from .stacked_choices import StackedChoices

_MUL = (operator.mul, torch.mul)
_RESHAPES = ("view", "reshape", torch.reshape)
_FLAT = _RESHAPES + ("flatten", torch.flatten)
_NOT = (operator.invert, torch.logical_not, "logical_not", torch.bitwise_not, "bitwise_not")

#: why a token-priority combine is left alone when its routing is not read
NOT_PRIORITY = ("a (T, E, C) combine of a (T, E) gate and a token-priority dispatch mask, but its gating is not the "
                "T5X token-priority routing this form proves")


@dataclass
class PriorityChoices(StackedChoices):
    """The k choices of T5X's token priority: ``ids`` (T, k) from topk, ``gate`` the (T, E) probabilities read at
    each kept expert, dropped past ``capacity`` (as held); ``dispatch`` the (T, E, C) mask the combine multiplies."""

    dispatch: Optional[Node] = None


def _swaps_first_two(node: Any) -> Optional[Node]:
    """x for ``x.transpose(0, 1)`` / ``torch.transpose(x, 0, 1)`` / ``x.t()`` (2-D) / ``x.permute(1, 0, ..)``."""
    if not (isinstance(node, Node) and node.args and isinstance(node.args[0], Node)) or node.kwargs:
        return None
    if call(node, "transpose", torch.transpose) and set(dims(node)) == {0, 1}:
        return node.args[0]
    if call(node, "t", torch.t) and len(node.args) == 1 and len(shape(node) or ()) == 2:
        return node.args[0]
    order = dims(node) if call(node, "permute", torch.permute) else ()
    if order and tuple(d % len(order) for d in order) == (1, 0, *range(2, len(order))):
        return node.args[0]
    return None


def _topk_ids(node: Any, E) -> Optional[tuple[Node, int]]:
    """(ids, k) for ``ids = topk(s, k)[1]`` over the last dim of a (T, E) s (k a static int): each row's k indices
    are distinct experts."""
    if not (call(node, operator.getitem) and node.args[1] == 1 and call(node.args[0], torch.topk, "topk")):
        return None
    top = node.args[0]
    kw = dict(top.kwargs)
    if set(kw) - {"k", "dim", "largest", "sorted"} or not 1 <= len(top.args) <= 3:
        return None
    for name, arg in zip(("k", "dim"), top.args[1:]):
        if name in kw:
            return None
        kw[name] = arg
    sv, k = val(top.args[0]) if isinstance(top.args[0], Node) else None, kw.get("k")
    if sv is None or sv.dim() != 2 or not same_traced(sv.shape[1], E) or kw.get("dim", -1) not in (-1, 1) \
            or type(k) is not int:
        return None
    return node, k


def _flat_ids(flat: Any, k: int, T, E) -> Union[Node, str, None]:
    """ids for ``ids.transpose(0, 1).reshape(-1)`` of (T, k) ids from topk (k-major rows); TOKEN_MAJOR's reason for
    ``ids.reshape(-1)``; else None."""
    if not (call(flat, *_FLAT) and isinstance(flat.args[0], Node) and not flat.kwargs and shaped(flat, (k * T,))):
        return None
    src = flat.args[0]
    if call(src, "contiguous") and len(src.args) == 1 and not src.kwargs:  # the same values, laid out anew
        src = src.args[0]
    swapped = _swaps_first_two(src)
    ids = _topk_ids(swapped if swapped is not None else src, E)
    if ids is None or ids[1] != k or not shaped(ids[0], (T, k)):
        return None
    if swapped is None:
        return (f"{NOT_PRIORITY}: its queue runs over the (token, choice) rows in token-major order (every choice of "
                "a token before the next token), not the choice-major order the op drops in")
    return ids[0]


def _priority(node: Any, T, E) -> Union[tuple[Node, int], str, None]:
    """(ids, k) for the (T, E) ``max(((cumsum(m, 0) * m - 1).reshape(k, T, E)).transpose(0, 1), dim=1)[0]`` of the
    one-hot m of k-major flat topk ids (or the max over dim 0 of the (k, T, E) reshape); a reason, or None."""
    if not (call(node, operator.getitem) and node.args[1] == 0 and call(node.args[0], torch.max, "max")):
        return None
    top = node.args[0]
    if len(top.args) not in (1, 2) or set(top.kwargs) - {"dim"} or not isinstance(top.args[0], Node):
        return None
    dim = top.args[1] if len(top.args) == 2 else top.kwargs.get("dim")
    rows, d = top.args[0], None
    under = _swaps_first_two(rows)
    if under is not None and len(shape(rows) or ()) == 3:
        rows, d = under, 1
    elif len(shape(rows) or ()) == 3:
        d = 0
    if d is None or dim is None or dim % 3 != d or not shaped(node, (T, E)):
        return None
    k = shape(rows)[0]
    if type(k) is not int or not shaped(rows, (k, T, E)):
        return None
    if not (call(rows, *_RESHAPES) and isinstance(rows.args[0], Node) and not rows.kwargs):
        return None
    ranked = rows.args[0]
    sub = binary(ranked, _SUB)
    if sub is None or sub[1] != 1 or not shaped(ranked, (k * T, E)):
        return None
    prod = binary(sub[0], _MUL)
    for cum, m in (prod, prod[::-1]) if prod is not None else ():
        if not (call(cum, torch.cumsum, "cumsum") and set(cum.kwargs) <= {"dim"} and len(cum.args) in (1, 2)):
            continue
        if (cum.args[1] if len(cum.args) == 2 else cum.kwargs.get("dim")) != 0:
            continue
        hot = one_hot(m)
        if hot is None or hot.fill is not None or not hot.has_classes(E) or mask_key(cum.args[0]) is not hot.key:
            continue
        ids = _flat_ids(strip_casts(hot.idx, zero_one=True), k, T, E)
        if isinstance(ids, str):
            return ids
        if ids is not None:
            return ids, k
    return None


def _comparison(node: Any, targets: tuple, flipped: tuple) -> Optional[tuple]:
    """(a, b) for ``a OP b`` with OP in targets, or ``b OP' a`` with OP' in flipped."""
    if call(node, *targets) and len(node.args) == 2 and not node.kwargs:
        return node.args
    if call(node, *flipped) and len(node.args) == 2 and not node.kwargs:
        return node.args[::-1]
    return None


def _valid(node: Any, C) -> Optional[tuple[Node, Any]]:
    """(priority, capacity) for ``logical_and(priority >= 0, priority < capacity)`` (or ``&``, either order) with
    the capacity the slots' C."""
    if not (call(node, torch.logical_and, "logical_and", operator.and_, torch.bitwise_and) and len(node.args) == 2
            and not node.kwargs):
        return None
    for a, b in (node.args, node.args[::-1]):
        ge = _comparison(a, (operator.ge, torch.ge, "ge"), (operator.le, torch.le, "le"))
        lt = _comparison(b, (operator.lt, torch.lt, "lt"), (operator.gt, torch.gt, "gt"))
        if ge is None or lt is None or ge[1] != 0 or not isinstance(ge[0], Node) or lt[0] is not ge[0]:
            continue
        if same_size(lt[1], C):
            return ge[0], lt[1]
    return None


def _invalid(node: Any, C, slots: bool) -> Optional[tuple[Node, Any]]:
    """(priority, capacity) for ``~valid`` over the (T, E) pairs; with ``slots``, over the (T, E, C) slots:
    ``unsqueeze(-1)``-ed (or ``[..., None]``) and optionally expanded, in any order with the negation (without the
    new last axis a (T, E) mask would broadcast against (E, C)). Where it is True nothing is kept."""
    negated = unsqueezed = False
    while isinstance(node, Node):
        if call(node, *_NOT) and len(node.args) == 1 and not node.kwargs and not negated:
            negated, node = True, node.args[0]
        elif call(node, "expand", "expand_as") and not node.kwargs and len(shape(node) or ()) == 3:
            node = node.args[0]
        elif not unsqueezed and len(shape(node) or ()) == 3 and (
                (call(node, "unsqueeze", torch.unsqueeze) and len(node.args) == 2 and node.args[1] in (-1, 2))
                or (call(node, operator.getitem) and node.args[1] in ((Ellipsis, None),
                                                                       (slice(None), slice(None), None)))):
            unsqueezed, node = True, node.args[0]
        else:
            break
    return _valid(node, C) if negated and unsqueezed == slots else None


def _masked(node: Any, value_ok=lambda v: type(v) in (int, float, bool) and v == 0) -> Optional[tuple[Node, Node]]:
    """(x, where) for ``masked_fill(x, where, 0)`` (function or method)."""
    if call(node, torch.masked_fill, "masked_fill") and len(node.args) == 3 and not node.kwargs \
            and isinstance(node.args[0], Node) and value_ok(node.args[2]):
        return node.args[0], node.args[1]
    return None


def _priority_dispatch(D: Any, T, E, C) -> Union[tuple[Node, int, Any], str]:
    """(ids, k, capacity) for the token-priority dispatch mask D (see the module docstring), or why not."""
    outer = _masked(D)
    drop = _invalid(outer[1], C, slots=True) if outer is not None else None
    if drop is None:
        return f"{NOT_PRIORITY}: its dispatch mask is not masked_fill(one_hot(priority, C), ~valid, 0)"
    priority, cap = drop
    hot = one_hot(outer[0])
    inner = _masked(strip_casts(hot.idx, zero_one=True)) if hot is not None and hot.fill is None else None
    if inner is None or not hot.has_classes(C) or inner[0] is not priority \
            or _invalid(inner[1], C, slots=False) != drop:
        return (f"{NOT_PRIORITY}: its slot one-hot is not of the priority zeroed where it is not valid, "
                "one_hot(masked_fill(priority, ~valid, 0), C)")
    read = _priority(priority, T, E)
    if isinstance(read, str):
        return read
    if read is None:
        return (f"{NOT_PRIORITY}: its priority is not the max over the k choices of cumsum(mask, 0) * mask - 1 of the "
                "one-hot of topk ids in k-major rows")
    return (*read, cap)


def _product(combine: Node, T, E, C) -> Optional[tuple[Node, Node]]:
    """(probs (T, E), D (T, E, C)) for ``einsum("te,tec->tec", probs, D)`` or ``probs.unsqueeze(-1) * D`` (either
    order); D under 0/1 casts."""
    parsed = einsum_parts(combine)
    pairs = []
    if parsed is not None and len(parsed[2]) == 2:
        subs, out, ops = parsed
        for pi, di in ((0, 1), (1, 0)):
            if len(out) == 3 and len(set(out)) == 3 and subs[di] == out and subs[pi] == out[:2]:
                pairs.append((ops[pi], ops[di]))
    elif (ab := binary(combine, _MUL)) is not None:
        for p, d in (ab, ab[::-1]):
            if call(p, "unsqueeze", torch.unsqueeze) and len(p.args) == 2 and p.args[1] in (-1, 2) and not p.kwargs:
                pairs.append((p.args[0], d))
            elif call(p, operator.getitem) and p.args[1] in ((Ellipsis, None), (slice(None), slice(None), None)):
                pairs.append((p.args[0], d))
    for probs, D in pairs:
        pv = val(probs) if isinstance(probs, Node) else None
        if pv is not None and pv.is_floating_point() and shaped(probs, (T, E)) and shaped(D, (T, E, C)):
            return probs, strip_casts(D, zero_one=True)
    return None


def priority_routing(combine: Node, T, E, C) -> Union[PriorityChoices, str, None]:
    """The routing of a combine that is a (T, E) gate times a token-priority dispatch mask (see the module
    docstring); why not, when it is such a product of a mask that is masked_fill-ed; None when it is not one."""
    found = _product(combine, T, E, C)
    if found is None or _masked(found[1]) is None:
        return None
    probs, D = found
    read = _priority_dispatch(D, T, E, C)
    if isinstance(read, str):
        return read
    ids, k, cap = read
    return PriorityChoices(ids, k, probs, cap, dispatch=D)
