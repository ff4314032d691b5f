"""The gating half of the padded-capacity proof for the k choices stacked in one (k, T, E) mask (nanoMoE's
``Router``), beside ``capacity_gating.py``'s one term per choice. The user code this reads:

    mask = F.one_hot(ids, E)                                   # ids (T, k) (or (B, S, k), T = B*S), from topk
    mask = mask.view(T, k, E).permute(1, 0, 2)                 # (k, T, E): choice j's masks in row j
    rank = torch.cumsum(mask.reshape(k * T, E), dim=0) - 1     # one queue per expert, over the rows j*T + t
    rank = rank.reshape(k, T, E)
    mask *= torch.lt(rank, C)                                  # or mask = mask * lt(rank, C)
    slot = F.one_hot(torch.sum(mask * rank, dim=-1), C)        # (k, T, C)
    weights = mask * probs.view(T, E)[None, :]                 # probs a (T, E) gate, read at the kept expert
    combine = torch.sum(weights.unsqueeze(3) * slot.unsqueeze(2), dim=0)      # (T, E, C)

Why it is exact: the reshape of the (k, T, E) mask to (k*T, E) puts (choice j, token t) at row j*T + t, so the
cumsum numbers every assignment of an expert in the op's choice-major priority order (every first choice, in token
order, then every second one, ...), each counted whether kept or not, as the op counts them. The drop keeps the
first C of each queue; the kept position is the slot (a dropped assignment's row of ``mask`` is zero, so its weight
is zero whatever slot it names). Summed over j, combine[t, e, c] is probs[t, e] where a kept choice of t took slot c
of e: the op, given ids and the weights ``gather(probs, 1, ids)``, drops and weights the same. A cumsum over the
(T, k, E) mask reshaped (T*k, E) numbers the assignments token-major (t's choices, then t+1's): another drop order,
left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.fx import Graph, Node

from .capacity_gating import _SUB, binary, call, dims, one_hot, same_size, same_traced, shape, shaped, strip_casts
from .fx_utils import einsum_parts, val

_MUL = (operator.mul, torch.mul, operator.imul, "mul_")
_RESHAPES = ("view", "reshape", torch.reshape)

#: why a stacked combine is left alone when its routing is not read
NOT_STACKED = ("a (T, E, C) combine summed over a (k, T, E) stack of choices, but its gating is not the GShard "
               "routing this form proves")
TOKEN_MAJOR = (f"{NOT_STACKED}: its queue positions are a cumsum over the (choice, token) rows in token-major order "
               "(every choice of a token before the next token), not the choice-major order the op drops in")


def _new_axis(node: Any, d: int) -> Optional[Node]:
    """x for ``x.unsqueeze(d)``, ``x[:, :, None]`` (full slices, one None at d) or ``x[..., None]`` (d = 3), a 4-D
    result."""
    if not (isinstance(node, Node) and node.args and isinstance(node.args[0], Node) and not node.kwargs
            and len(shape(node) or ()) == 4):
        return None
    if call(node, "unsqueeze", torch.unsqueeze) and len(node.args) == 2 and node.args[1] % 4 == d:
        return node.args[0]
    index = node.args[1] if call(node, operator.getitem) else None
    if not isinstance(index, tuple) or index.count(None) != 1:
        return None
    if index == (Ellipsis, None):
        return node.args[0] if d == 3 else None
    full = all(i is None or i == slice(None) for i in index)
    return node.args[0] if full and index.index(None) == d else None


def _summed_stack(combine: Node) -> Optional[tuple[Node, Node]]:
    """(weights (k, T, E), slots (k, T, C)) for ``sum(w.unsqueeze(3) * s.unsqueeze(2), dim=0)`` or
    ``einsum("kte,ktc->tec", w, s)``."""
    parsed = einsum_parts(combine)
    if parsed is not None and len(parsed[2]) == 2:
        subs, out, ops = parsed
        for wi, si in ((0, 1), (1, 0)):
            ws, ss = subs[wi], subs[si]
            if len(ws) == 3 and len(ss) == 3 and len(set(ws + ss)) == 4 and ws[:2] == ss[:2] and (
                    out == ws[1:] + ss[2]):
                return ops[wi], ops[si]
        return None
    if not (call(combine, torch.sum, "sum") and len(combine.args) in (1, 2)):
        return None
    dim = combine.args[1] if len(combine.args) == 2 else combine.kwargs.get("dim")
    if dim not in (0, (0,), [0]) or set(combine.kwargs) - {"dim"} or len(shape(combine.args[0]) or ()) != 4:
        return None
    ab = binary(combine.args[0], _MUL)
    for a, b in (ab, ab[::-1]) if ab is not None else ():
        w, s = _new_axis(a, 3), _new_axis(b, 2)
        if w is not None and s is not None:
            return w, s
    return None


def _stacked_one_hot(node: Any, k, T, E) -> Optional[Node]:
    """ids (T, k) or (.., k) with T tokens in all, for ``one_hot(ids, E).view(T, k, E).permute(1, 0, 2)`` (or
    ``.transpose(0, 1)``; the view may be absent): row j of the (k, T, E) result is choice j's one-hot."""
    node = strip_casts(node, zero_one=True)
    if not (call(node, "permute", torch.permute) and dims(node) == (1, 0, 2)) and not (
            call(node, "transpose", torch.transpose) and set(dims(node)) == {0, 1}):
        return None
    tke = node.args[0]
    if not (shaped(node, (k, T, E)) and shaped(tke, (T, k, E))):
        return None
    if call(tke, *_RESHAPES) and isinstance(tke.args[0], Node) and not tke.kwargs:
        tke = tke.args[0]  # a reshape of (.., k, E) to (T, k, E) keeps each token's (k, E) block in token order
    hot = one_hot(tke)
    ids = hot.idx if hot is not None and hot.fill is None and hot.has_classes(E) else None
    iv = val(ids)
    if iv is None or iv.is_floating_point() or iv.dtype == torch.bool or iv.dim() < 2:
        return None
    lead = 1
    for n in iv.shape[:-1]:
        lead = lead * n
    return ids if same_traced(iv.shape[-1], k) and same_traced(lead, T) else None


def _reshaped(node: Any, want: tuple) -> Optional[Node]:
    if call(node, *_RESHAPES) and isinstance(node.args[0], Node) and not node.kwargs and shaped(node, want):
        return node.args[0]
    return None


def _queue(rank: Any, mask: Node, k, T, E) -> Union[bool, str]:
    """``rank`` is ``(cumsum(mask.reshape(k*T, E), 0) - 1).reshape(k, T, E)`` (the minus before or after the
    reshape): True; a reason when it is the cumsum of the (T, k, E) mask under ``mask``'s permute, taken back to
    (k, T, E) (token-major); else False."""
    back = rank.args[0] if call(rank, "permute", torch.permute, "transpose", torch.transpose) and (
        dims(rank) == (1, 0, 2) or set(dims(rank)) == {0, 1}) else None
    order = (T, k, E) if back is not None else (k, T, E)
    rank = back if back is not None else rank
    under = _reshaped(rank, order)
    sub = binary(under if under is not None else rank, _SUB)
    if sub is None or sub[1] != 1 or not isinstance(sub[0], Node):
        return False
    cum = sub[0] if under is not None else _reshaped(sub[0], order)
    if not (call(cum, torch.cumsum, "cumsum") and set(cum.kwargs) <= {"dim"}
            and (cum.args[1] if len(cum.args) > 1 else cum.kwargs.get("dim")) == 0):
        return False
    flat = _reshaped(cum.args[0], (k * T, E))
    rows = strip_casts(flat, zero_one=True) if flat is not None else None
    if rows is not None and back is None and rows is strip_casts(mask, zero_one=True):
        return True
    if rows is not None and back is not None and call(mask, "permute", torch.permute, "transpose",
                                                      torch.transpose) and rows is mask.args[0]:
        return TOKEN_MAJOR
    return False


@dataclass
class StackedChoices:
    """k choices stacked in one (k, T, E) mask: ``ids`` as the one-hot read them ((T, k), or (.., k) over T
    tokens), ``gate`` the (T, E) probabilities read at each kept expert, dropped past ``capacity`` (as held)."""

    ids: Node
    k: int
    gate: Node
    capacity: Any

    def inputs(self) -> list[Node]:
        return [self.ids, self.gate]

    def op_routing(self, graph: Graph) -> tuple[Node, Node]:
        """The op's (T, k) ids and weights: choice j's weight is the gate at its expert."""
        ids = self.ids if val(self.ids).dim() == 2 else graph.call_method("reshape", (self.ids, -1, self.k))
        return ids, graph.call_method("gather", (self.gate, 1, ids))


def stacked_routing(combine: Node, T, E, C) -> Union[StackedChoices, str, None]:
    """The routing of a combine summed over a (k, T, E) stack of choices (see the module docstring); why not, when
    ``combine`` is such a sum; None when it is not one."""
    parts = _summed_stack(combine)
    if parts is None:
        return None
    weights, slots = parts
    ws, ss = shape(weights), shape(slots)
    if ws is None or ss is None or len(ws) != 3 or type(ws[0]) is not int or not shaped(weights, (ws[0], T, E)) \
            or not shaped(slots, (ws[0], T, C)):
        return f"{NOT_STACKED}: its factors are not (k, T, E) weights and (k, T, C) slots"
    k = ws[0]
    ab = binary(weights, _MUL)
    found, reason = None, f"{NOT_STACKED}: its weights are not a kept (k, T, E) one-hot times a (T, E) gate"
    for kept, gate in (ab, ab[::-1]) if ab is not None else ():
        kept = strip_casts(kept, zero_one=True)
        drop = binary(kept, _MUL)
        base = gate.args[0] if call(gate, operator.getitem) and gate.args[1] in (
            (None, slice(None)), (None, slice(None), slice(None)), (None,)) else gate.args[0] if call(
            gate, "unsqueeze", torch.unsqueeze) and gate.args[1:] == (0,) else gate
        gv = val(base)
        if drop is None or gv is None or not gv.is_floating_point() or not shaped(base, (T, E)):
            continue
        for m, keep in (drop, drop[::-1]):
            keep = strip_casts(keep, zero_one=True)
            if not (call(keep, torch.lt, operator.lt, "lt") and len(keep.args) == 2 and not keep.kwargs):
                continue
            ids = _stacked_one_hot(m, k, T, E)
            if ids is None:
                reason = f"{NOT_STACKED}: its mask is not the one-hot of (T, k) ids with the choices stacked first"
                continue
            if not same_size(keep.args[1], C):
                reason = f"{NOT_STACKED}: its capacity drop compares with a capacity other than the slots' C"
                continue
            queue = _queue(keep.args[0], m, k, T, E)
            if queue is not True:
                reason = queue or (f"{NOT_STACKED}: the positions it drops at are not cumsum(mask.reshape(k*T, E), "
                                   "0) - 1 of the stacked mask")
                continue
            found = (kept, keep.args[0], ids, base, keep.args[1])
    if found is None:
        return reason
    kept, rank, ids, gate, cap = found
    hot = one_hot(slots)
    position = strip_casts(hot.idx, zero_one=True) if hot is not None and hot.fill is None else None
    if position is None or not hot.has_classes(C):
        return f"{NOT_STACKED}: its slot factor is not a one-hot over the C slots"
    dim = position.args[1] if len(position.args) > 1 else position.kwargs.get("dim")
    prod = binary(position.args[0], _MUL) if call(position, torch.sum, "sum") and dim in (-1, 2) and set(
        position.kwargs) <= {"dim"} else None
    if prod is None or {strip_casts(p, zero_one=True) for p in prod} != {kept, rank}:
        return f"{NOT_STACKED}: its slot is not the kept position, sum(mask * rank, dim=-1)"
    return StackedChoices(ids, k, gate, cap)
