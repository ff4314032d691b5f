"""Form "padded_capacity": GShard / Switch / fairseq / DeepSpeed gating into (T, E, C) dispatch and combine tensors,
experts run on a padded (E, C, H) buffer. Top-1 and top-k (k choices, each queued behind the earlier ones).

The user code this matches (letters, operand order, unsqueeze spellings and dtype casts may vary; the gating's
other spellings are listed in ``capacity_gating.py``):

    mask_j = one_hot(idx_j, E)                                   # choice j of every token, j = 0..k-1
    loc_j = cumsum(mask_j, dim=0) - 1 (+ sum(mask_i, dim=0, keepdim=True) for every earlier choice i)
    mask_j = mask_j * lt(loc_j, C)                               # drop what is past the capacity
    slot_j = one_hot(sum(loc_j * mask_j, dim=1), C)              # (T, C)
    combine = sum over j of gate_j[:, None, None] * mask_j[:, :, None] * slot_j[:, None, :]   # (T, E, C)
    dispatch = combine.bool().to(x.dtype)                        # or combine != 0
    xin = einsum("tec,th->ech", dispatch, x)                     # (E, C, H)
    out = einsum("eci,ehi->ech", act(einsum("ech,eih->eci", xin, w1)) [* einsum(.., w3)], w2)
    y = einsum("tec,ech->th", combine, out)

Beside the einsums: fairseq's ``mm(dispatch.permute(1, 2, 0).view(E*C, T), x)`` and nanoMoE's
``dispatch.permute(1, 2, 0).type_as(x) @ x`` dispatch, and ``mm(combine.view(T, E*C), out.view(E*C, H))`` combine;
experts as ``torch.bmm`` / ``@`` on stacked weights, with or without per-expert biases broadcast over the slots
(``+ b[:, None, :]``, ``+= b`` of an (E, 1, N) parameter: ``slot_layers.py``), or as one module per expert on
``xin.chunk(E, dim)`` (fairseq's and DeepSpeed's ModuleList, nn.Linear with or without biases) joined by ``cat``
along the same dim, whose weights go to the list op as lists, read where they lie. The (E, C, H) buffer may pass
through reshapes that regroup it (``reshape(1, E, -1, H)``): a reshape keeps the row-major order, so slot (e, c)
stays where it was; so does a dropout that is the identity (p == 0 or not training, ``slot_layers.py``), also
between the projections. nanoMoE's gating, the k choices stacked in one (k, T, E) mask and summed by
``sum(dim=0)``, is read by ``stacked_choices.py``; T5X's token priority (Hunyuan-Large's ``topkgating``), whose
dispatch is the 0/1 mask its combine multiplies rather than the combine's support, by ``priority_choices.py``.

Why it is exact: the queue positions come from a cumsum over tokens, so within an expert every kept (token, choice)
gets its own slot (choice j queues behind all earlier choices, kept or not, which drops exactly what the op drops
when it fills each expert in choice-major priority order j*T + t). A slot therefore holds one token or none, the
dispatch copies that token unscaled, and the combine returns gate_j * expert_e(x_t) to its token (an empty slot's
output, bias and all, is multiplied by a zero combine weight). The op does the same with ids (idx_0, ..,
idx_{k-1}), weights (gate_0, ..) and capacity C, without the padding. A kept choice whose gate is exactly zero is
not dispatched (it is outside combine's support), which changes its gradients only: the op gets ``gate * (gate !=
0)``, and biased experts a term beside it that gives that gate eager's gradient (``zero_weights.py``). A dispatch that is not the exact support of
combine (``combine > 0.5``, or slots moved), a mask without the drop, a queue that ignores the earlier choices (or
puts them in another order), or a capacity that differs between the drop and the slots, is a different computation
and is left alone; so are a bias that varies per slot and a dropout that may drop (p > 0 in training).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .capacity_gating import (Choice, call, choice, dims, order_choices, same_traced, shape, size_node, strip_casts,
                              versions_sound)
from .driver import Anchor, Form, Match, every_node
from .fx_utils import einsum_parts, val
from .gated_reads import clamped_silu_glu, read_gated, split_gated
from .slot_layers import Bias, biased, dropout, op_bias, per_expert_bias, through_dropouts
from .priority_choices import PriorityChoices, priority_routing
from .stacked_choices import StackedChoices, stacked_routing
from .expert_projections import biased_linear
from .emit import list_op_runs, per_expert_for_op
from .zero_weights import dispatched_weights, has_biases, zero_weight_term

FORM = "padded_capacity"

_ADD = (operator.add, torch.add)
_MM = (torch.mm, torch.matmul, operator.matmul, "mm", "matmul")
_RESHAPES = ("view", "reshape", torch.reshape)


def _flatten(node: Node, targets: tuple, keep_going) -> list:
    if call(node, *targets) and len(node.args) == 2 and not node.kwargs and keep_going(node):
        return _flatten(node.args[0], targets, keep_going) + _flatten(node.args[1], targets, keep_going)
    return [node]


def _regrouped(node: Any) -> list[Node]:
    """``node`` and what it is a reshape (or an identity dropout) of, outermost first: every one holds the same
    elements in the same row-major order."""
    chain = []
    while isinstance(node, Node):
        chain.append(node)
        identity = dropout(node)  # p == 0 or not training: the same elements, in the same order
        if identity is not None and identity[1] is None:
            node = identity[0]
            continue
        if not (call(node, *_RESHAPES) and node.args and isinstance(node.args[0], Node) and not node.kwargs):
            break
        node = node.args[0]
    return chain


def _is_slots(node: Node, E, C, H=None) -> Optional[int]:
    """d when ``node`` is (1, .., 1, E, C, H) with E at axis d: the padded slots, under leading ones."""
    s = shape(node)
    if s is None or len(s) < 3 or any(not same_traced(n, 1) for n in s[:-3]):
        return None
    if not (same_traced(s[-3], E) and same_traced(s[-2], C) and (H is None or same_traced(s[-1], H))):
        return None
    return len(s) - 3


def _slot_projection(node: Any) -> list[tuple[Node, Node, str]]:
    """(input (E, C, K), weight, layout) readings of ``einsum("ecK,eNK->ecN", xin, w)`` (either weight layout), or
    of ``torch.bmm(xin, w)`` / ``xin @ w`` with w (E, K, N), or w (E, N, K) as ``w.transpose(1, 2)`` or
    ``w.permute(0, 2, 1)`` (Tutel's ``FusedExpertsNetwork``)."""
    if call(node, torch.bmm, operator.matmul, torch.matmul) and len(node.args) == 2 and not node.kwargs:
        xin, w = node.args
        layout = "kn"
        if call(w, "transpose") and set(w.args[1:]) in ({1, 2}, {-2, -1}):
            w, layout = w.args[0], "nk"
        elif call(w, "permute", torch.permute) and not w.kwargs and dims(w) == (0, 2, 1):
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


@dataclass(frozen=True)
class _Experts:
    """The experts run on the slots ``xin``: weights stacked (E, ., .) or per expert (tuples), as the spec takes."""

    xin: Node
    gate: Any
    up: Any
    down: Any
    layout: str
    activation: str
    biases: tuple = (None, None, None)  # b1, b1_up, b2: per-expert tuples, or stacked ``slot_layers.Bias``
    fields: tuple = ()  # the gated reading's spec fields (gate_up, alpha, limit)
    #: (gate, up, down) layouts where the stacked projections mix them (``layout`` is then the down's), else ()
    layouts: tuple = ()


def _projections(node: Any, biases: bool, reasons: list) -> list[tuple[Node, Node, str, Optional[Bias]]]:
    """(input, weight, layout, bias or None) readings of a slot projection under identity dropouts; with a
    per-expert bias added (``slot_layers``) when ``biases``. Why a reading failed goes to ``reasons``."""
    node, why = through_dropouts(node)
    if why is not None:
        reasons.append(why)
        return []
    found = [(*r, None) for r in _slot_projection(node)]
    for product, b in biased(node) if biases else ():
        for xin, w, layout in _slot_projection(product):
            bias = per_expert_bias(b, w, layout, shape(product)[-2])
            if isinstance(bias, str):
                reasons.append(bias)
            else:
                found.append((xin, w, layout, bias))
    return found


def _stacked_experts(out: Node, E, biases: bool = False, reasons: Optional[list] = None,
                     mixed: bool = False) -> list[_Experts]:
    """Experts by einsum / bmm on stacked weights, ``out`` (E, C, H) their down projection; with per-expert biases
    when ``biases`` (the op then gets them, see ``match_capacity``). Why a reading failed goes to ``reasons``.
    ``mixed``: the gate/up projections may be in another layout than the down one (``_Experts.layouts``; the
    reader then hands the op transposed views)."""
    reasons = [] if reasons is None else reasons
    found = []
    for down_in, down_w, layout, b2 in _projections(out, biases, reasons):
        hidden, why = through_dropouts(down_in)
        clamped = clamped_silu_glu(hidden) if why is None else None
        split = clamped[:4] if clamped is not None else split_gated(hidden) if why is None else None
        if split is None:
            reasons += [why] if why is not None else []
            continue
        activation, _, gate_in, up_node = split
        fields = (("limit", clamped[4]),) if activation == "clamped_silu_glu" else ()
        ups = _projections(up_node, biases, reasons) if up_node is not None else [None]
        for g in _projections(gate_in, biases, reasons):
            for u in ups:
                if (u is not None and (u[0] is not g[0] or u[2] != g[2])) or (g[2] != layout and not mixed):
                    continue
                if val(down_w) is None or val(down_w).shape[0] != E or val(g[1]).shape[0] != E:
                    continue
                if u is not None and (g[3] is None) != (u[3] is None):
                    reasons.append("one of the gate and up projections has a bias and the other has none")
                    continue
                layouts = (g[2], g[2] if u is not None else None, layout) if g[2] != layout else ()
                found.append(_Experts(g[0], g[1], u[1] if u is not None else None, down_w, layout, activation,
                                      (g[3], u[3] if u is not None else None, b2), fields, layouts))
    return found


def _chunk_of(piece: Any, e: int, E: int, d: int) -> Optional[Node]:
    """X for ``X.chunk(E, dim=d)[e]`` or ``X.split(1, dim=d)[e]`` with X of size E along d: expert e's slots."""
    if not (call(piece, operator.getitem) and piece.args[1] == e):
        return None
    parts = piece.args[0]
    if not (call(parts, "chunk", torch.chunk, "split", torch.split) and len(parts.args) >= 2):
        return None
    X, n = parts.args[0], parts.args[1]
    dim = parts.args[2] if len(parts.args) > 2 else parts.kwargs.get("dim", 0)
    if set(parts.kwargs) - {"dim"} or not isinstance(dim, int) or shape(X) is None:
        return None
    wanted = E if parts.target in ("chunk", torch.chunk) else 1
    if n != wanted or dim % len(shape(X)) != d or not same_traced(shape(X)[d], E):
        return None
    return X


def _per_expert_experts(out: Node, E, C) -> Union[_Experts, str, None]:
    """One module per expert: ``cat([expert_e(X.chunk(E, d)[e]) for e], dim=d)``, each expert an MLP of nn.Linear
    layers (biases allowed) on its own chunk; None when ``out`` is not such a cat, a reason when a piece fails."""
    if not (call(out, torch.cat, torch.concat) and out.args and isinstance(out.args[0], (list, tuple))):
        return None
    pieces = list(out.args[0])
    d = _is_slots(out, E, C)
    dim = out.args[1] if len(out.args) > 1 else out.kwargs.get("dim", 0)
    if d is None or not isinstance(dim, int) or dim % len(shape(out)) != d or len(pieces) != E:
        return None
    source, readings = None, []
    for e, piece in enumerate(pieces):
        piece, why = through_dropouts(piece)
        down = biased_linear(piece, e) if isinstance(piece, Node) and why is None else None
        if down is None or down[3]:
            return why or f"expert {e}'s output is not an nn.Linear (or F.linear) on its own weights"
        hidden, why = through_dropouts(down[0])
        gated = read_gated(hidden, lambda n: biased_linear(n, e)) if why is None else None
        if why is not None:
            return why
        if gated is None or gated.gate[3] or (gated.up is not None and gated.up[3]):
            return f"expert {e}'s hidden state is not a known activation of its own projections"
        gate, up = gated.gate, gated.up
        if (up is not None and up[0] is not gate[0]) or any(p[2] != down[2] for p in (gate, up) if p is not None):
            return f"expert {e}'s projections read different inputs or mix weight layouts"
        X = _chunk_of(gate[0], e, E, d)
        if X is None or (source is not None and X is not source):
            return f"expert {e} does not run on chunk {e} of the one (E, C, H) slot buffer"
        source = X
        readings.append((gated, gate, up, down))
    first = readings[0][0]
    same = (first.activation, first.up is None, first.spec_fields())
    if any((g.activation, g.up is None, g.spec_fields()) != same for g, _, _, _ in readings):
        return "the experts differ in activation or gating"

    def column(i: int, of: int) -> Optional[tuple]:
        nodes = [r[of][i] if r[of] is not None else None for r in readings]
        return None if all(n is None for n in nodes) else tuple(nodes)

    gate, up, down = column(1, 1), column(1, 2), column(1, 3)
    b1, b1_up, b2 = column(4, 1), column(4, 2), column(4, 3)
    if any(t is not None and None in t for t in (b1, b1_up, b2)):
        return "some experts' projections have biases and others none"
    if (b1 is not None or b1_up is not None) and first.gate_up is not None:
        return "the experts' fused gate/up projections have biases: the op splits a fused weight only when stacked"
    if any(len({tuple(val(w).shape) for w in t}) != 1 for t in (gate, up, down, b1, b1_up, b2) if t is not None):
        return "the experts' weights differ in shape"
    return _Experts(source, gate, up, down, "nk", first.activation, (b1, b1_up, b2), tuple(first.spec_fields().items()))


def _experts_on(out: Node, E, C) -> Union[list[_Experts], str]:
    """The readings of ``out`` (the slot outputs, through reshapes) as experts on slots, or why there are none."""
    found, reasons = [], []
    for node in _regrouped(out):
        if _is_slots(node, E, C) is None:
            continue
        if len(shape(node)) == 3:
            found += _stacked_experts(node, E, biases=True, reasons=reasons)
        per = _per_expert_experts(node, E, C)
        if isinstance(per, _Experts):
            found.append(per)
        elif isinstance(per, str):
            reasons.insert(0, per)
    return found or (reasons[0] if reasons else
                     "its slot outputs are not experts on the slots (einsum, bmm or one module per chunk)")


def _dispatch_of(node: Any) -> Optional[Node]:
    """``combine`` for ``combine.bool()`` / ``combine.to(torch.bool)`` (``dtype=``, ``.type``) / ``combine != 0``
    (then casts of the 0/1 result): exactly combine's support. No cast may sit under the test: a narrower float
    could round a small gate to zero."""
    for _ in range(8):
        if not isinstance(node, Node):
            return None
        if call(node, "bool") and len(node.args) == 1 and not node.kwargs:
            return node.args[0]
        if call(node, "to", "type") and len(node.args) == 2 and node.args[1] is torch.bool and not node.kwargs:
            return node.args[0]
        if call(node, "to") and len(node.args) == 1 and node.kwargs == {"dtype": torch.bool}:
            return node.args[0]
        if call(node, operator.ne, torch.ne, "ne") and len(node.args) == 2 and node.args[1] in (0, 0.0) \
                and not node.kwargs:
            return node.args[0]
        under = strip_casts(node, zero_one=True)
        if under is node:
            return None
        node = node.args[0]  # one cast at a time, so the test itself is seen
    return None


def _permute_dims(perm: Node) -> tuple:
    args = perm.args[1:]
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)


def _dispatched(xin: Node, T, E, C) -> Optional[tuple[Node, Node]]:
    """(dispatch (T, E, C), x (T, H)) when ``xin`` (through reshapes) is ``einsum("tec,th->ech", dispatch, x)``,
    ``mm(dispatch.permute(1, 2, 0).view(E*C, T), x)`` or ``dispatch.permute(1, 2, 0) @ x``: slot (e, c) holds
    sum_t dispatch[t, e, c] * x[t]."""
    for node in _regrouped(xin):
        parsed = einsum_parts(node)
        if parsed is not None and len(parsed[2]) == 2:
            subs, out_subs, ops = parsed
            for di, xi in ((0, 1), (1, 0)):
                ds, xs = subs[di], subs[xi]
                if len(ds) == 3 and len(xs) == 2 and len(set(ds + xs)) == 4 and xs[0] == ds[0] and (
                        out_subs == ds[1:] + xs[1]):
                    return ops[di], ops[xi]
        if call(node, *_MM) and len(node.args) == 2 and not node.kwargs and len(shape(node) or ()) == 3:
            # nanoMoE's ``dispatch.permute(1, 2, 0).type_as(x) @ x``: (E, C, T) @ (T, H); a cast of the permuted
            # 0/1 dispatch is exact
            perm, x = strip_casts(node.args[0], zero_one=True), node.args[1]
            s = shape(perm.args[0]) if call(perm, "permute", torch.permute) and not perm.kwargs else None
            if s is not None and len(s) == 3 and _permute_dims(perm) == (1, 2, 0) and len(shape(x) or ()) == 2 \
                    and same_traced(s[0], T) and same_traced(s[1], E) and same_traced(s[2], C):
                return perm.args[0], x
        if call(node, *_MM) and len(node.args) == 2 and not node.kwargs and len(shape(node) or ()) == 2:
            flat, x = node.args
            chain = _regrouped(flat)
            perm = chain[-1]
            if len(chain) < 2 or not (call(perm, "permute", torch.permute) and not perm.kwargs):
                continue
            s = shape(perm.args[0])
            if _permute_dims(perm) != (1, 2, 0) or s is None or len(s) != 3 or len(shape(flat)) != 2:
                continue
            if not (same_traced(s[0], T) and same_traced(s[1], E) and same_traced(s[2], C)
                    and same_traced(shape(flat)[1], T)):
                continue
            return perm.args[0], x
    return None


def _capacity_combines(y: Node) -> list[tuple[Node, Node]]:
    """(combine, slot outputs) operand pairs for which ``y`` is ``einsum("tec,ech->th", combine, out)`` or
    ``mm(combine.view(T, E*C), out.view(E*C, H))``: the mark of this form (a (T, E, C) combine over the experts'
    padded slots), whether or not the rest is provable."""
    parsed = einsum_parts(y)
    pairs = []
    if parsed is not None and len(parsed[2]) == 2:
        subs, out_subs, ops = parsed
        for ci, oi in ((0, 1), (1, 0)):
            cs, os_ = subs[ci], subs[oi]
            if len(cs) == 3 and len(os_) == 3 and len(set(cs + os_)) == 4 and os_[:2] == cs[1:] and (
                    out_subs == cs[0] + os_[2]):
                pairs.append((ops[ci], ops[oi]))
    elif call(y, *_MM) and len(y.args) == 2 and not y.kwargs and len(shape(y) or ()) == 2:
        a, b = y.args
        combine = next((n for n in _regrouped(a)[1:] if len(shape(n) or ()) == 3), None)
        cs, as_, bs = shape(combine), shape(a), shape(b)
        if cs is None or as_ is None or bs is None or len(as_) != 2 or len(bs) != 2 or not same_traced(as_[0], cs[0]):
            return pairs
        slots = next((n for n in _regrouped(b)[1:] if _is_slots(n, cs[1], cs[2], bs[1]) is not None), None)
        if slots is not None:
            pairs.append((combine, slots))
    return pairs


@dataclass
class _Match:
    experts: _Experts
    x: Node
    choices: Union[list[Choice], StackedChoices]
    capacity: Any
    #: the dtype of the tensor whose support the dispatch is; None where the dispatch is a mask that holds
    #: zero-weight choices too (T5X's token priority)
    support: Optional[torch.dtype]


def match(y: Node) -> Union[_Match, str, None]:
    """The proven padded-capacity MoE ending at ``y``; the first reason it is not, when ``y`` is a capacity
    combine; None when it is not one."""
    reason = None
    for combine, out in _capacity_combines(y):
        found = _match_parts(y, strip_casts(combine), out, read=combine)
        if isinstance(found, _Match):
            return found
        reason = reason or found
    return reason


def _match_parts(y: Node, combine: Node, out: Node, read: Node) -> Union[_Match, str]:
    """``combine`` is the gating's (T, E, C) tensor under float casts; ``read`` is what the combine einsum reads
    (that tensor, or a cast of it). A dispatch may be the support of either: of ``read``, it is exactly the slots
    whose combine weight is nonzero where the weights are applied (the emitter casts the gates to x's dtype, as
    ``read`` is when the model runs in bf16 with float32 gating)."""
    s = shape(combine)
    if s is None or len(s) != 3:
        return "the combine is not a (T, E, C) tensor"
    if combine.op == "placeholder":
        return ("the (T, E, C) combine weights are an input of this graph: the gating that made them, and its "
                "capacity drops, were traced into another graph (a graph break before the combine), so nothing "
                "here can prove them")
    T, E, C = s
    experts = _experts_on(out, E, C)
    if isinstance(experts, str):
        return f"a (T, E, C) combine over capacity slots, but {experts}"
    reason = "a (T, E, C) combine over capacity slots, but its slots are not filled by a dispatch of combine's support"
    priority = priority_routing(combine, T, E, C)
    for ex in experts:
        dispatched = _dispatched(ex.xin, T, E, C)
        support = None if dispatched is None else _dispatch_of(dispatched[0])
        # T5X's token priority dispatches by the 0/1 mask its combine multiplies (priority_choices.py says why that
        # is exact where a probability underflows to zero); any other dispatch must be combine's support
        by_mask = dispatched is not None and isinstance(priority, PriorityChoices) and strip_casts(
            dispatched[0], zero_one=True) is priority.dispatch
        if not by_mask and (support is None or (support is not combine and support is not read)):
            if dispatched is not None and isinstance(priority, str):
                reason = priority
            elif dispatched is not None and priority is not None:
                reason = ("a (T, E, C) combine over capacity slots, but its slots are not filled by the token-priority "
                          "mask its combine weights, nor by a dispatch of combine's support")
            continue
        x = dispatched[1]
        if shape(x) is None or len(shape(x)) != 2 or not same_traced(shape(x)[0], T):
            continue
        # the routing the dispatch was proven against: the token priority's when its mask fills the slots
        stacked = priority if by_mask else stacked_routing(combine, T, E, C)
        stacked = priority if stacked is None and priority is not None else stacked
        choices = _routing(combine, T, E, C) if stacked is None else stacked
        if isinstance(choices, str):
            return choices
        if isinstance(choices, StackedChoices):  # nothing above its ids and gate is read
            sound = versions_sound(y, [x, *choices.inputs()], [], from_inputs=True)
        else:
            inputs = [x, *(n for c in choices for n in (c.idx, c.gate, c.full) if n is not None)]
            sound = versions_sound(y, inputs, [f for c in choices for f in c.fills()])
        if not sound:
            return ("a (T, E, C) combine over capacity slots whose gating tensors are changed in place after "
                    "they are read")
        held = choices.capacity if isinstance(choices, StackedChoices) else choices[0].capacity
        capacity = size_node(y, C, held)  # the op takes an int or a size node, never a tensor
        if capacity is None:
            return ("a (T, E, C) combine over capacity slots whose symbolic capacity no size in the graph holds "
                    "(a capacity tensor cannot reach the op without a host sync)")
        return _Match(ex, x, choices, capacity, None if by_mask else val(support).dtype)
    return reason


def _routing(combine: Node, T, E, C) -> Union[list[Choice], str]:
    """The choices of a combine that is a proven sum of capacity-dropped choices, or why not."""
    # a sum started from 0 (``combine = 0`` then ``combine = combine + term`` per choice) adds a literal zero
    terms = [t for t in _flatten(combine, _ADD, lambda n: shape(n) == (T, E, C))
             if not (type(t) in (int, float) and t == 0)]
    choices = [choice(t, T, E, C) if isinstance(t, Node) else "a term is a constant" for t in terms]
    base = "a (T, E, C) combine over capacity slots, but its gating is not the GShard routing this form proves"
    failed = [c for c in choices if isinstance(c, str)]
    if not choices or failed:
        return f"{base}: {failed[0] if failed else 'it has no terms'}"
    ordered = order_choices(choices)
    if ordered is None:
        return (f"{base}: the queue positions are not choice-major (choice j behind every earlier choice), the "
                "order the op drops in")
    if len({c.capacity for c in ordered}) != 1:
        return f"{base}: the choices are dropped at different capacities"
    for c in ordered:
        iv = val(c.idx)
        if iv is None or iv.is_floating_point() or not (tuple(iv.shape) == (T,) or tuple(iv.shape) == (T, 1)):
            return f"{base}: an expert index is not a (T,) integer tensor"
    return ordered


def _op_routing(graph: Graph, choices: list[Choice]) -> tuple[Node, Node]:
    """The op's (T, k) ids and weights, stacked from the proven choices."""
    # fairseq's scatter one-hot takes (T, 1) ids: the op's column is their (T,) view
    ids = graph.call_function(torch.stack, ([c.idx if val(c.idx).dim() == 1 else graph.call_method(
        "reshape", (c.idx, -1)) for c in choices],), {"dim": 1})
    columns = []
    for c in choices:
        if c.full is not None:  # a (T, E) gate times the one-hot: its entry at the kept expert
            column = graph.call_method("view", (c.idx, -1, 1))
            columns.append(graph.call_method("reshape", (graph.call_method("gather", (c.full, 1, column)), -1)))
        else:
            columns.append(graph.call_method("reshape", (c.gate, -1)))
    return ids, graph.call_function(torch.stack, (columns,), {"dim": 1})


def match_capacity(y: Node) -> Union[Match, str, None]:
    """The padded-capacity MoE whose (T, E, C) combine ends at ``y``; or why not, when ``y`` is such a combine."""
    found = match(y)
    if not isinstance(found, _Match):
        return found
    ex = found.experts
    per_expert = isinstance(ex.gate, tuple)
    b1, b1_up, b2 = (b.node if isinstance(b, Bias) else b for b in ex.biases)
    # the routing is proven; the op's (T, k) ids and weights are stacked from its choices by ``derive``
    spec = MoESpec(found.x, None, None, ex.gate, ex.up, ex.down, ex.layout, ex.activation, capacity=found.capacity,
                   b1=b1, b1_up=b1_up, b2=b2, **dict(ex.fields))

    stacked = isinstance(found.choices, StackedChoices)
    # per-expert weights stay lists for the list op, which reads them where they lie (a stack in the graph would
    # copy every expert's weights at each call)
    lists = per_expert and list_op_runs(spec)

    raw = []  # the (T, k) weights as the gating made them, for ``plus``

    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        ids, weights = found.choices.op_routing(graph) if stacked else _op_routing(graph, found.choices)
        raw.append(weights)
        if found.support is not None:  # a zero weight's choice is not dispatched: zero_weights.py
            weights = dispatched_weights(graph, weights, found.support)
        spec = dataclasses.replace(spec, ids=ids, weights=weights)
        if not per_expert:  # a stacked (E, 1, N) bias as the op's (E, N) view
            spec = dataclasses.replace(spec, **{f: op_bias(graph, b) for f, b in zip(("b1", "b1_up", "b2"),
                                                                                     ex.biases)})
        else:
            spec = per_expert_for_op(graph, spec)
        return spec

    gv = val(ex.gate[0] if per_expert else ex.gate)
    dv = val(ex.down[0] if per_expert else ex.down)
    E = len(ex.gate) if per_expert else int(gv.shape[0])
    # multiply-adds of one slot through the experts: the up projection(s) and the down projection
    per_slot = lambda v: v.numel() if per_expert else v[0].numel()  # noqa: E731
    slot_flops = 2 * (per_slot(gv) * (2 if ex.up is not None else 1) + per_slot(dv))
    padded = f"{E} x {found.capacity} slots = {E * found.capacity * slot_flops / 1e6:.2f} MFLOP per call" \
        if isinstance(found.capacity, int) else "the padded slots"
    note = (f"capacity {found.capacity}, the same drops; runs the T*k routed rows instead of {padded}, no (T, E, C) "
            "dispatch" + ("" if not per_expert else "; per-expert weights read where they lie (the list op)" if lists
                          else "; per-expert weights stacked at each call (an activation the list op does not run)"))
    k = found.choices.k if stacked else len(found.choices)

    def plus(graph: Graph, spec: MoESpec) -> Node:
        return zero_weight_term(graph, spec, raw[-1], found.support, E, k, y, val(y).dtype)

    # biased experts' output on an empty slot is not zero: that is a zero weight's gradient in eager, wanted only
    # where a backward can run (Dynamo guards on the grad mode it traced in)
    zero_rows = found.support is not None and has_biases(spec) and torch.is_grad_enabled()
    note += "; a zero-row pass of each expert for the gradients of zero weights" if zero_rows else ""
    return Match(spec, y, note=note, derive=derive, top_k=k, plus=plus if zero_rows else None)


def _match_grouped(y: Node) -> Union[Match, str, None]:
    from .grouped_capacity import match_grouped  # it reads this module's readers

    return match_grouped(y)


def _match_indexed(buf: Node) -> Union[Match, str, None]:
    from .indexed_capacity import match_indexed  # it reads this module's readers

    return match_indexed(buf)


rewrite = Form(FORM, (Anchor(every_node, match_capacity), Anchor(every_node, _match_grouped),
                      Anchor(every_node, _match_indexed)))
"""Replace every provable padded-capacity MoE in a GraphModule; returns what was rewritten."""
