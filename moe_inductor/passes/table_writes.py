"""A routing table's boolean-mask writes into the tokens spread over the experts, a spelling of form "unrolled_loop"
(``match_table_writes``). The user code this matches is transformers v4's NLLB-MoE (``NllbMoeSparseMLP``, fairseq's
NLLB-200 MoE), whose top-2 router with capacity hands the experts a (T, E) table of kept gates:

    R = g1[:, None] * M1 + g2[:, None] * M2             # M_j = one_hot(idx_j, E) * keep_j: at most K = 2 nonzeros a row
    mask = R.bool()                                      # (T, E)
    buf = torch.einsum("bm,be->ebm", x, mask)            # (E, T, H): buf[e, t] = x[t] * mask[t, e]
    for e, expert in enumerate(experts):                 # each of range(E) once
        rows = mask[:, e]
        out = expert(buf[e, rows])                       # buf[e, rows] is x[rows] (times True), before e's write
        out *= c                                         # optional: a constant (eval's 1 - moe_token_dropout)
        buf[e, rows] = torch.einsum("b,be->be", R[rows, e], out)      # or R[rows, e][:, None] * out
    y = buf.sum(dim=0)

Shape legend: T tokens, H hidden, E experts, K the table's terms (its most nonzeros a row).

Row t of y is ``sum over e with R[t, e] != 0 of R[t, e] * c * expert_e(x[t])``, plus ``x[t] * 0`` for each e the
row does not pick (0, or NaN where x is not finite). Each term of R is a float column times a one-hot with the
router's drops in it (``kept_masks.kept_product``) or a plain one-hot: nonzero at most at its own expert of a row
(where its gate is finite; a non-finite gate makes the whole row non-finite in both). So a row has at most K
nonzeros, and ``topk(mask, K)`` finds them all: the op runs over those ids (a picked zero the out-of-range id E,
which the op skips) with weights ``R.gather(-1, ids) * c``, and ``x * 0`` is added to each row that leaves an expert
out (every row where E > K), so that it keeps eager's ``x * 0`` terms (NaN stays NaN). The constant c moves from the expert's output to its
weight: one rounding apart.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .driver import CHANGED_IN_PLACE, Match
from .aliases import alias_mutations, mutated_alias
from .fx_utils import einsum_parts, is_call, redirect_later_readers, val
from .kept_masks import _one_hot, bool_cast_of, choice_column, kept_product

_ALL = slice(None, None, None)


def _terms(table: Node, top: bool = False) -> Optional[list[Node]]:
    """The terms of ``t1 + t2 + ...`` (``torch.add`` too, no alpha), a lone node its own one term; None where a
    partial sum or a term is changed in place (``t1[:, 0] += 1`` puts a second nonzero in a row). The ``top`` sum's
    own changes are the caller's to check."""
    if not top and mutated_alias(table):
        return None
    if (is_call(table, "call_function", operator.add, torch.add) and len(table.args) == 2 and not table.kwargs
            and all(isinstance(a, Node) for a in table.args)):
        left, right = (_terms(a) for a in table.args)
        return None if left is None or right is None else left + right
    return [table]


def _one_per_row(term: Node, lead: int, E: int) -> bool:
    """Whether ``term`` is ``s * M`` (either order), s a float (T, 1) column, M a (T, E) integer one-hot with the
    router's drops in it or a plain one-hot over E: nonzero at most at M's one position of each row."""
    if not (is_call(term, "call_function", operator.mul, torch.mul) and len(term.args) == 2 and not term.kwargs):
        return False
    for s, hot in (term.args, term.args[::-1]):
        sv, hv = val(s), val(hot)
        if not isinstance(hot, Node) or sv is None or hv is None or not sv.is_floating_point():
            continue
        if tuple(sv.shape) != (lead, 1) or tuple(hv.shape) != (lead, E):
            continue
        got = kept_product(hot) or (_one_hot(hot) if not mutated_alias(hot) else None)
        if got is not None and got[1] == E:
            return True
    return False


def _table_mask(mask: Node) -> Optional[tuple[Node, int]]:
    """(R, K) when ``mask`` is ``R.bool()`` (``.to(torch.bool)``, ``R != 0``) of a float (T, E) table R whose rows
    have at most K nonzeros (a sum of K ``_one_per_row`` terms, K no more than E; ``match_table_writes`` checks that neither
    is changed in place)."""
    table = bool_cast_of(mask)
    if table is None and is_call(mask, "call_function", operator.ne, torch.ne) and len(mask.args) == 2 and (
            mask.args[1] == 0):
        table = mask.args[0]
    if table is None:
        return None
    tv = val(table) if isinstance(table, Node) else None
    if tv is None or tv.dim() != 2 or not tv.is_floating_point() or not isinstance(tv.shape[-1], int):
        return None
    terms = _terms(table, top=True)
    if not terms or not all(_one_per_row(t, tv.shape[0], tv.shape[-1]) for t in terms):
        return None
    return table, min(len(terms), tv.shape[-1])  # no row has more nonzeros than experts either


def table_buffer(node: Node) -> bool:
    """The mark: ``einsum("bm,be->ebm", x, mask)`` of (T, H) tokens and a (T, E) boolean mask."""
    parts = einsum_parts(node)
    if parts is None or parts[0] != ["bm", "be"] or parts[1] != "ebm":
        return False
    xv, mv = (val(n) for n in parts[2])
    return xv is not None and mv is not None and xv.dim() == 2 and mv.dim() == 2 and mv.dtype == torch.bool and (
        xv.is_floating_point())


def _slot(index, mask: Node) -> Optional[int]:
    """e for the index ``(e, mask[:, e])`` of buf's expert e, at the rows of the mask's column e."""
    if not (isinstance(index, tuple) and len(index) == 2 and type(index[0]) is int and isinstance(index[1], Node)):
        return None
    got = choice_column(index[1])
    return index[0] if got is not None and got[0] is mask and got[1] == index[0] else None


def _weighted(value: Node, table: Node, mask: Node, e: int) -> Optional[tuple[Node, Node]]:
    """(out, the read of R) for ``einsum("b,be->be", R[mask[:, e], e], out)`` (either operand order) or
    ``R[mask[:, e], e][:, None] * out`` (either order, ``.unsqueeze(-1)`` too)."""
    def gate_read(n) -> bool:
        return (is_call(n, "call_function", operator.getitem) and n.args[0] is table and isinstance(n.args[1], tuple)
                and len(n.args[1]) == 2 and n.args[1][1] == e and isinstance(n.args[1][0], Node)
                and choice_column(n.args[1][0]) == (mask, e))

    parts = einsum_parts(value)
    if parts is not None and len(parts[2]) == 2:
        for (ws, os_), (w, o) in ((parts[0], parts[2]), (parts[0][::-1], parts[2][::-1])):
            if ws == "b" and os_ == "be" and parts[1] == "be" and gate_read(w):
                return o, w
        return None
    if is_call(value, "call_function", operator.mul) and len(value.args) == 2 and not value.kwargs:
        for col, o in (value.args, value.args[::-1]):
            base = None
            if is_call(col, "call_function", operator.getitem) and col.args[1] == (_ALL, None):
                base = col.args[0]
            elif is_call(col, "call_method", "unsqueeze") and tuple(col.args[1:]) in ((-1,), (1,)):
                base = col.args[0]
            if isinstance(o, Node) and isinstance(base, Node) and gate_read(base):
                return o, base
    return None


def _constant_scale(out: Node) -> tuple[Node, Optional[float]]:
    """(o, c) for ``o *= c`` / ``o * c`` of a Python number c, o read by nothing else; else (out, None)."""
    if is_call(out, "call_function", operator.imul, operator.mul) and len(out.args) == 2 and (
            type(out.args[1]) in (int, float)) and isinstance(out.args[0], Node):
        inner = out.args[0]
        if all(u is out for u in inner.users):
            return inner, float(out.args[1])
    return out, None


def match_table_writes(buf: Node) -> Union[Match, str, None]:
    """NLLB-MoE's loop (see the module docstring) ending in ``buf.sum(dim=0)``."""
    from .masked_writes import _masked_body, _one_spec
    from .expert_projections import biased_linear
    from .emit import per_expert_for_op
    from .unrolled_loop import _Body

    _, _, (x, mask) = einsum_parts(buf)
    got = _table_mask(mask)
    if got is None:
        return None
    table, K = got
    if mutated_alias(table) or mutated_alias(mask):  # the rows may then hold more than K nonzeros, or other weights
        return CHANGED_IN_PLACE
    xv, E = val(x), val(mask).shape[-1]
    writes = alias_mutations(buf)
    position = {n: i for i, n in enumerate(buf.graph.nodes)}
    slots = [(w, _slot(w.args[1], mask)) for w in writes if is_call(w, "call_function", operator.setitem)
             and w.args[0] is buf]
    if len(slots) != len(writes) or any(e is None for _, e in slots):
        return "the spread tokens are changed by something other than one write per expert at its mask's rows"
    experts = [e for _, e in slots]
    if sorted(experts) != list(range(E)):
        return f"the loop writes experts {sorted(experts)}, not each of range({E}) once"
    sums = [u for u in buf.users if u not in writes and is_call(u, "call_method", "sum")]
    if len(sums) != 1 or tuple(sums[0].args[1:]) not in ((0,), ()) or (
            len(sums[0].args) == 1 and sums[0].kwargs != {"dim": 0}) or (
            len(sums[0].args) > 1 and sums[0].kwargs):
        return "the spread tokens are not summed over the experts once (buf.sum(dim=0))"
    end = sums[0]
    write_of = {e: w for w, e in slots}
    # the loop's reads of its own slices (each x[rows]: they read no write), its writes and the sum: nothing else
    # may see the written buffer, which the rewrite removes
    slices = [u for u in buf.users if is_call(u, "call_function", operator.getitem)
              and _slot(u.args[1], mask) is not None and position[u] < position[write_of[_slot(u.args[1], mask)]]]
    if any(u not in writes and u is not end and u not in slices for u in buf.users):
        return "the spread tokens are read by something other than the loop's reads before its writes and the sum"
    bodies, reads, scales = [], [], set()
    for e in range(E):
        w = write_of[e]
        weighted = _weighted(w.args[2], table, mask, e) if isinstance(w.args[2], Node) else None
        if weighted is None:
            return f"expert {e}'s write is not its output scaled by its own column of the table at its rows"
        out, gate = weighted
        out, c = _constant_scale(out)
        scales.add(c)

        def rows(n, e=e):  # x for buf[e, mask[:, e]]: expert e's slice at its own rows, before its write
            ok = (is_call(n, "call_function", operator.getitem) and n.args[0] is buf
                  and _slot(n.args[1], mask) == e and position[n] < position[write_of[e]])
            return x if ok else None

        def projection(n, e=e):
            return biased_linear(n, e)

        body = _masked_body(out, e, rows=rows, scaled=lambda n: None, projection=projection, look=False,
                            required=False)
        if isinstance(body, str):
            return body
        xe, gated, down, layout, stacked, sliced = body[:6]
        if sliced is not None:
            return "row blocks of flat weights are not read with a routing table"
        if rows(xe) is None:
            return f"expert {e} does not read the spread tokens at its own slice and rows before its write"
        gate_p, up = gated.gate, gated.up
        if up is not None and (gate_p[4] is None) != (up[4] is None):
            return f"expert {e}'s gate projection has a bias and its up projection none, or the other way round"
        reads += [xe, gate]
        spec = MoESpec(x, mask, table, gate_p[1], up[1] if up else None, down[1], layout, gated.activation,
                       b1=gate_p[4], b1_up=up[4] if up else None, b2=down[4], **gated.spec_fields())
        bodies.append(_Body(e, spec, mask, w, stacked))
    if len(scales) != 1:
        return "the experts' outputs are not all scaled by one constant"
    (c,) = scales
    one = _one_spec(bodies)
    if isinstance(one, str):
        return one
    spec, num_experts, _ = one
    biases = [b for t in (spec.b1, spec.b1_up, spec.b2) if isinstance(t, tuple) for b in t]
    if biases and spec.gate_up is not None:
        return "the experts' fused gate/up projections have biases: the op splits a fused weight only when stacked"
    if any(mutated_alias(b) for b in biases) or mutated_alias(x):
        return CHANGED_IN_PLACE
    if position[end] < max(position[w] for w in writes):
        return "the spread tokens are summed before the loop's last write"
    ev = val(end)
    if ev is None or tuple(ev.shape) != tuple(xv.shape) or ev.dtype != xv.dtype:
        return "the sum over the experts is not (T, H) of the tokens' dtype"
    biased = isinstance(spec.gate, tuple) and any(b is not None for b in (spec.b1, spec.b1_up, spec.b2))

    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        spec = per_expert_for_op(graph, spec) if biased else spec
        picked = graph.call_function(torch.topk, (graph.call_method("to", (mask, torch.uint8)), K), {"dim": -1})
        hit = graph.call_method("bool", (graph.call_function(operator.getitem, (picked, 0)),))
        cols = graph.call_function(operator.getitem, (picked, 1))
        ids = graph.call_function(torch.where, (hit, cols, num_experts))
        weights = graph.call_method("gather", (table, -1, cols))
        if c is not None:  # c on the expert's output in eager: the same factor on its weight here
            weights = graph.call_function(operator.mul, (weights, c))
        # eager's x * 0 for each expert a row does not pick (NaN stays NaN): every row has one where E > K; where
        # E == K only a row whose mask is not all set (a token capacity dropped)
        _plus_zero_times(graph, end, x, unless_all=None if num_experts > K else mask)
        return dataclasses.replace(spec, ids=ids, weights=weights)

    note = (f"{E} boolean-mask selections (host syncs) and the (E, T, H) spread of the tokens removed; the (T, E) "
            f"table read as top-{K} ids and weights (a picked zero is the op's out-of-range id)"
            + ("; per-expert weights read where they lie" if isinstance(spec.gate, tuple) else "")
            + (f"; the constant {c} on the experts' outputs moved to their weights" if c is not None else ""))
    return Match(spec, end, note, where=write_of[0], writes=tuple(writes), transient=tuple(reads), derive=derive,
                 top_k=K)


def _plus_zero_times(graph: Graph, end: Node, x: Node, unless_all: Optional[Node] = None) -> None:
    """Point the readers of ``end`` at ``end + x * 0``, inserted right after it; the driver then puts the op's
    result in ``end``'s place. ``unless_all``: a (T, E) mask; a row whose mask is all set adds 0 instead."""
    with graph.inserting_after(end):
        zero = graph.call_function(operator.mul, (x, 0.0))
    if unless_all is not None:
        with graph.inserting_after(zero):
            every = graph.call_method("all", (unless_all, -1), {"keepdim": True})
        with graph.inserting_after(every):
            zero = graph.call_function(torch.where, (every, 0.0, zero))
    with graph.inserting_after(zero):
        total = graph.call_function(operator.add, (end, zero))
    if val(end) is not None:
        total.meta["example_value"] = val(end)
    redirect_later_readers(end, end, total)  # every reader of end comes after it
