"""Form "padded_capacity", dispatched by index (Tutel's ``fast_encode`` / ``fast_decode`` written in torch): the
capacity queue of GShard, but no (T, E, C) dispatch tensor. Each kept (token, choice) is written straight into an
(E*C, H) buffer at row ``id * C + location``, the experts run on its (E, C, H) view, and the combine reads the rows
back.

The user code this matches (Tutel's ``extract_critical`` and its CPU kernel's loops; letters, operand order and
integer casts may vary; the queue's other spellings are listed in ``capacity_gating.py``):

    mask_j = zeros(T, E).scatter_(1, idx_j[:, None], 1)           # or one_hot(idx_j, E); choice j = 0..k-1
    loc_j = cumsum(mask_j, 0) - 1 (+ sum(mask_i, 0, keepdim=True) for every earlier choice i, ``+`` or ``+=``)
    pos_j = sum(loc_j * mask_j, dim=1).to(int32)                 # the token's queue position at its expert
    kept_j = (pos_j < C) & (idx_j >= 0)                          # or pos_j < C alone
    buf = zeros(E * C, H)
    buf.index_add_(0, (idx_j * C + pos_j)[kept_j], x[kept_j])    # every choice j
    out = experts(buf.view(E, C, H))                             # bmm / matmul / einsum, biases as padded_capacity
    data = out.reshape(E * C, H)
    y_j = zeros(T, H); y_j[kept_j] = gate_j[kept_j][:, None] * data[(idx_j * C + pos_j)[kept_j]]
    y = y_0 + y_1 + ...

Why it is exact: the positions are GShard's choice-major queue (choice j behind every earlier choice, kept or not),
so within an expert the kept (token, choice) pairs have distinct positions below C: each writes its own row of
the expert's C rows, into zeros, so ``index_add_`` copies the token there unscaled and every other row stays zero.
The experts are row-wise (a bias per expert, no mixing of rows), so row ``id * C + pos`` of their output is
``expert_id(x_t)`` for the one token written there, and the combine gives each kept pair ``gate_j * expert(x_t)``
at its token, 0 for a dropped one: the op with ids (idx_0, .., idx_{k-1}), weights (gate_0, ..) and capacity C,
which drops the same pairs. Rows no token wrote (and their bias) are never read back. ``idx_j >= 0`` holds for
every id the one-hot's ``scatter_`` took (it raises on a negative one, as ``one_hot`` does), so the test drops
nothing. The positions and ids are integers; an int32 cast of them is exact (ids below E, positions below T*k).

Left alone, with the step that failed: a drop at another capacity than the row stride and the slots' C (``<= C``
or ``< C + 1`` would let position C write row 0 of the next expert), positions that are not the choice-major queue
(token-major, or ignoring the earlier choices), rows from other ids than the one-hot's, a choice dispatched and not
combined (or the reverse), a kept mask that differs between the rows and the values, a buffer or slot output read
anywhere else, and any experts ``padded_capacity`` would refuse.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .aliases import alias_mutations, mutated_alias
from .capacity_gating import (_ADD, _MUL, _queue_position, binary, call, column_base, one_hot, order_choices,
                              same_size, shape, size_node, strip_casts, versions_sound)
from .capacity_gating import _zeros as zeros_buffer
from .driver import Match
from .fx_utils import column_of, reach, same_traced, val
from .padded_capacity import _Experts, _is_slots, _regrouped, _stacked_experts
from .slot_layers import op_bias
from .unrolled_loop import _as_nk

_INT_CASTS = ("long", "int")
_AND = (operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and")
_WIDE_INTS = (torch.int32, torch.int64)


def _int_base(node: Any) -> Any:
    """``node`` under casts between 32- and 64-bit integer dtypes (``.long()``, ``.int()``, ``.to(torch.int32)``):
    exact for ids below E and queue positions below T*k."""
    while isinstance(node, Node) and node.args and isinstance(node.args[0], Node):
        src, dst = val(node.args[0]), val(node)
        if src is None or dst is None or src.dtype not in _WIDE_INTS or dst.dtype not in _WIDE_INTS:
            break
        dtype_arg = node.args[1] if len(node.args) == 2 else node.kwargs.get("dtype")
        if not ((call(node, *_INT_CASTS) and len(node.args) == 1 and not node.kwargs)
                or (call(node, "to") and isinstance(dtype_arg, torch.dtype) and len(node.args) + len(node.kwargs) == 2
                    and set(node.kwargs) <= {"dtype"})):
            break
        node = node.args[0]
    return node


@dataclass(frozen=True)
class _Rows:
    """``(ids * C + pos)[kept]``: the buffer rows of one choice's kept pairs."""

    node: Node
    ids: Node  # under integer casts
    pos: Node  # under integer casts
    capacity: Any  # the stride as the graph holds it
    kept: Node


def _rows(node: Any) -> Optional[_Rows]:
    if not (call(node, operator.getitem) and len(node.args) == 2 and isinstance(node.args[1], Node)):
        return None
    flat, kept = node.args
    kv = val(kept)
    if kv is None or kv.dtype != torch.bool or kv.dim() != 1:
        return None
    ab = binary(flat, _ADD)
    for scaled, pos in (ab, ab[::-1]) if ab is not None else ():
        prod = binary(scaled, _MUL)
        for ids, stride in (prod, prod[::-1]) if prod is not None else ():
            ids, pos = _int_base(ids), _int_base(pos)
            iv, pv = val(ids) if isinstance(ids, Node) else None, val(pos) if isinstance(pos, Node) else None
            if iv is None or pv is None or iv.is_floating_point() or pv.is_floating_point():
                continue
            if isinstance(stride, (Node, int)) and not isinstance(stride, bool):
                return _Rows(node, ids, pos, stride, kept)
    return None


def _kept(rows: _Rows, C) -> Union[str, Any]:
    """The capacity (as the graph holds it) of ``rows.kept = lt(pos, C)``, alone or ``&`` with ``ids >= 0``, for
    the rows' pos and ids; why not, when it is not that, or its C is not the slots' ``C``."""
    parts, stack = [], [rows.kept]
    while stack:
        n = stack.pop()
        ab = binary(n, _AND)
        if ab is not None and val(n) is not None and val(n).dtype == torch.bool:
            stack += list(ab)
        else:
            parts.append(n)
    drops = [p for p in parts if call(p, operator.lt, torch.lt, "lt") and len(p.args) == 2 and not p.kwargs]
    signs = [p for p in parts if call(p, operator.ge, torch.ge, "ge") and len(p.args) == 2 and not p.kwargs
             and type(p.args[1]) is int and p.args[1] == 0 and _int_base(p.args[0]) is rows.ids]
    if len(drops) != 1 or len(drops) + len(signs) != len(parts):
        return "its kept rows are not lt(position, C), alone or with ids >= 0"
    pos, cap = drops[0].args
    if _int_base(pos) is not rows.pos:
        return "its capacity drop compares other positions than the rows are written at"
    if not same_size(cap, C):
        return ("its capacity drop compares with another capacity than the slots' C (a position past C would "
                "write another expert's rows)")
    return cap


@dataclass
class _Queued:
    """One choice's queue, as ``capacity_gating.order_choices`` reads it."""

    hot: Any  # the one-hot (capacity_gating.OneHot)
    mask: Node  # what the position's product reads (the one-hot, its buffer)
    earlier: list
    pos: Node
    ids: Node


def _queue(pos: Node, ids: Node, E) -> Union[_Queued, str]:
    """``pos = sum(loc * mask, dim=1)`` with mask the one-hot of ``ids`` over E and loc its choice-major queue."""
    if not (call(pos, torch.sum, "sum") and len(pos.args) in (1, 2) and set(pos.kwargs) <= {"dim"}):
        return "its rows are not at a queue position, sum(loc * one_hot, dim=1)"
    dim = pos.args[1] if len(pos.args) == 2 else pos.kwargs.get("dim")
    prod = binary(pos.args[0], _MUL) if dim in (1, -1) else None
    for loc, mask in (prod, prod[::-1]) if prod is not None else ():
        hot = one_hot(mask) if isinstance(mask, Node) else None
        if hot is None or not isinstance(loc, Node):
            continue
        if _int_base(column_base(hot.idx)) is not ids:
            return "its rows are at the ids of another one-hot than the queue positions count"
        if not hot.has_classes(E):
            return "its queue's one-hot is not over the E experts"
        lv = val(loc)
        if lv is None or lv.is_floating_point():
            return "its queue positions are not integers (a float cumsum may round)"
        earlier = _queue_position(loc, hot)
        if earlier is None:
            return ("its queue positions are not cumsum(one_hot, 0) - 1 plus the counts of the earlier choices: a "
                    "priority order other than the choice-major order the op drops in")
        return _Queued(hot, strip_casts(mask, zero_one=True), earlier, pos, ids)
    return "its rows are not at a queue position, sum(loc * one_hot, dim=1)"


@dataclass(frozen=True)
class _Read:
    """One choice of the combine: ``y[kept] = gate[kept][:, None] * data[rows]`` into zeros ``y``."""

    rows: _Rows
    product: Node
    gate: Node
    picked: Node  # gate[kept]
    write: Node
    out: Node  # the zeros buffer


def _combine_read(read: Node) -> Union[_Read, str]:
    """The choice whose combine reads ``read = data[rows]``, or why it is not one."""
    rows = _rows(read.args[1])
    users = list(read.users)
    if rows is None or len(users) != 1:
        return "a read of the expert outputs is not at (ids * C + position)[kept], read once"
    (product,) = users
    ab = binary(product, _MUL)
    scale = next((s for s in (ab or ()) if s is not read), None) if ab is not None and read in ab else None
    picked = column_of(scale) if isinstance(scale, Node) else None
    if not (call(picked, operator.getitem) and len(picked.args) == 2 and picked.args[1] is rows.kept):
        return "a read of the expert outputs is not scaled by its choice's gate at the same kept rows"
    gate = picked.args[0]
    gv = val(gate)
    if gv is None or not gv.is_floating_point() or gv.dim() != 1:
        return "a choice's gate is not a (T,) float tensor"
    writes = list(product.users)
    write = writes[0] if len(writes) == 1 else None
    if not (call(write, operator.setitem) and write.args[1] is rows.kept and write.args[2] is product):
        return "a scaled read of the expert outputs is not written at its kept rows, y[kept] = ..."
    out = write.args[0]
    ov, pv = val(out), val(product)
    if not (zeros_buffer(out) and ov is not None and pv is not None and ov.dtype == pv.dtype and ov.dim() == 2):
        return "a choice's combine is not written into a zeros (T, H) tensor of its values' dtype"
    return _Read(rows, product, gate, picked, write, out)


def _summed(outs: list[Node]) -> Union[tuple[Node, list[Node]], str]:
    """(end, the add nodes) for ``outs[0] + outs[1] + ...`` (any grouping), every part read by this sum only."""
    if len(outs) == 1:
        return outs[0], []
    adds: list[Node] = []

    def leaves(n: Node) -> list:
        ab = binary(n, (operator.add, torch.add)) if n in adds else None
        return [n] if ab is None else [leaf for a in ab for leaf in leaves(a)]

    top = outs[0]
    while len(readers := [u for u in top.users if not call(u, operator.setitem)]) == 1 and binary(
            readers[0], (operator.add, torch.add)) is not None:
        adds.append(readers[0])
        if not all(leaf in outs for leaf in leaves(readers[0])):  # the sum goes on beyond the choices
            adds.pop()
            break
        top = readers[0]
    if sorted(map(id, leaves(top))) != sorted(map(id, outs)):
        return "the choices' combines are not summed, each once, into one result"
    if any(len([u for u in n.users if not call(u, operator.setitem)]) != 1 for n in outs + adds[:-1]):
        return "a choice's combine (or a partial sum of them) is read beside the sum"
    return top, adds


@dataclass
class _Found:
    experts: _Experts
    x: Node
    choices: list  # _Queued, in queue order
    gates: list  # the gate of each, in the same order
    capacity: Any
    end: Node
    acc: Optional[Node]
    writes: tuple
    transient: tuple


_MARK = "an (E*C, H) buffer filled by index_add_ at rows id * C + position (an index-based capacity dispatch)"


def match(buf: Node) -> Union[_Found, str, None]:
    """The index-dispatched capacity MoE whose (E*C, H) buffer is ``buf``; why not, when ``buf`` is such a buffer
    written at (ids * C + position)[kept] rows; None otherwise."""
    if not zeros_buffer(buf) or len(shape(buf) or ()) != 2:
        return None
    fills = [u for u in buf.users if call(u, "index_add_") and u.args[0] is buf]
    encodes = [_rows(f.args[2]) if len(f.args) == 4 and f.args[1] == 0 and not f.kwargs else None for f in fills]
    if not fills or any(r is None for r in encodes):
        return None
    why = _match_parts(buf, fills, encodes)
    return why if not isinstance(why, str) else f"{_MARK}, but {why}"


def _match_parts(buf: Node, fills: list, encodes: list) -> Union[_Found, str]:
    position = {n: i for i, n in enumerate(buf.graph.nodes)}
    R, H = shape(buf)
    views = [u for u in buf.users if u not in fills]
    if len(views) != 1 or any(position[f] > position[views[0]] for f in fills) or set(alias_mutations(buf)) != set(
            fills):
        return "the buffer is read other than by one view after its writes, or written other than by them"
    slots = next((u for u in _forward_views(views[0]) if len(shape(u) or ()) == 3 and same_traced(shape(u)[2], H)),
                 None)
    if slots is None:
        return "the buffer is not viewed as (E, C, H) slots"
    E, C = shape(slots)[:2]
    if not same_traced(R, E * C) and str(R) != str(E * C):
        return "the buffer's rows are not E * C"
    # the combine: every read of the experts' output at (ids * C + position)[kept] rows, after the experts
    readers = sorted((n for n in reach([slots], lambda n: n.users) if call(n, operator.getitem) and len(n.args) == 2
                      and isinstance(n.args[1], Node) and _rows(n.args[1]) is not None and isinstance(n.args[0], Node)
                      and len(shape(n.args[0]) or ()) == 2 and n.args[0] is not buf), key=position.get)
    datas = {r.args[0] for r in readers}
    if not readers or len(datas) != 1:
        return "the experts' output is not read back at (ids * C + position)[kept] rows of one (E*C, H) view"
    (data,) = datas
    out = next((n for n in _regrouped(data)[1:] if _is_slots(n, E, C, H) is not None and len(shape(n)) == 3), None)
    if out is None:
        return "the rows read back are not a view of the experts' (E, C, H) output"
    reasons: list = []
    experts = [ex for ex in _stacked_experts(out, E, biases=True, reasons=reasons, mixed=True)
               if slots in _regrouped(ex.xin)]
    if not experts:
        return reasons[0] if reasons else "its slot outputs are not experts on the slots (bmm, matmul or einsum)"
    reads = [_combine_read(r) for r in readers]
    failed = [r for r in reads if isinstance(r, str)]
    if failed:
        return failed[0]
    x = {f.args[3].args[0] for f in fills if call(f.args[3], operator.getitem) and len(f.args[3].args) == 2}
    if len(x) != 1 or any(not (call(f.args[3], operator.getitem) and f.args[3].args[1] is r.kept)
                          for f, r in zip(fills, encodes)):
        return "the rows written are not one token tensor's rows at the same kept mask, x[kept]"
    (x,) = x
    if shape(x) is None or len(shape(x)) != 2 or val(x).dtype != val(buf).dtype:
        return "the tokens written are not a (T, H) tensor of the buffer's dtype"
    T = shape(x)[0]
    # each choice: the same (ids, position) dispatched once and combined once, kept and strided at C
    key = lambda r: (r.ids, r.pos)  # noqa: E731
    if len({key(r) for r in encodes}) != len(encodes) or {key(r) for r in encodes} != {key(r.rows) for r in reads} \
            or len(reads) != len(encodes):
        return "its choices are not each dispatched once and combined once (the same ids and positions)"
    held = []
    for r in [*encodes, *(r.rows for r in reads)]:
        if not same_size(r.capacity, C):
            return ("its rows are strided by another capacity than the slots' C (a position past it would reach "
                    "another expert's rows)")
        cap = _kept(r, C)
        if isinstance(cap, str):
            return cap
        held.append(cap)
        iv = val(r.ids)
        if iv.dim() != 1 or not same_traced(iv.shape[0], T):
            return "an expert index is not a (T,) integer tensor"
    queued = [_queue(r.pos, r.ids, E) for r in encodes]
    failed = [q for q in queued if isinstance(q, str)]
    if failed:
        return failed[0]
    ordered = order_choices(queued)
    if ordered is None:
        return ("its queue positions are not choice-major (choice j behind every earlier choice), the order the op "
                "drops in")
    gates = [next(r.gate for r in reads if key(r.rows) == (q.ids, q.pos)) for q in ordered]
    summed = _summed([next(r.out for r in reads if key(r.rows) == (q.ids, q.pos)) for q in ordered])
    if isinstance(summed, str):
        return summed
    top, adds = summed
    writes = tuple(fills) + tuple(r.write for r in reads)
    end, acc = (top, None) if adds else (reads[0].write, top)
    for r in reads:
        if set(alias_mutations(r.out)) != {r.write} or any(position[u] < position[r.write] for u in r.out.users
                                                           if u is not r.write):
            return "a choice's combine buffer is written or read other than by its one write, then the sum"
    # nothing derived from the buffer leaves the region but its result (its writes go with it)
    inside = reach([end, *writes], lambda n: n.all_input_nodes)
    escaped = [n for n in reach([buf], lambda n: [] if n is end else n.users) if n not in inside and n not in writes]
    if escaped:
        return "a value computed from the dispatch buffer (the slots, an expert's output) is read outside the MoE"
    one_hots = [q.hot.fill for q in ordered if q.hot.fill is not None]
    routing = [*(r.node for r in encodes), *(r.rows.node for r in reads), *(r.kept for r in encodes),
               *(f.args[3] for f in fills)]
    if not all(versions_sound(n, [], one_hots) for n in routing) or not all(
            versions_sound(r.product, [out], one_hots, from_inputs=True) for r in reads) or not versions_sound(
            out, [slots], [], from_inputs=True):
        return "its routing or slot tensors are changed in place after they are read"
    if any(mutated_alias(n) for q, g in zip(ordered, gates) for n in (q.hot.idx, g)):
        return "its ids or gates are changed in place"
    capacity = size_node(end, C, held[0])
    if capacity is None:
        return "its symbolic capacity is held by no size of the graph (a capacity tensor needs a host sync)"
    transient = tuple(r.node for r in encodes) + tuple(r.rows.node for r in reads) + tuple(
        f.args[3] for f in fills) + tuple(r.picked for r in reads)
    return _Found(experts[0], x, ordered, gates, capacity, end, acc, writes, transient)


def _forward_views(node: Node) -> list[Node]:
    """``node`` and the reshapes (identity dropouts, same-dtype casts) that read it alone, in order."""
    chain = [node]
    while len(chain[-1].users) == 1:
        (user,) = chain[-1].users
        if chain[-1] not in _regrouped(user)[1:2]:
            break
        chain.append(user)
    return chain


def match_indexed(buf: Node) -> Union[Match, str, None]:
    """The rewrite of ``match``'s region: the op with the proven choices' ids and gates, capacity C."""
    found = match(buf)
    if not isinstance(found, _Found):
        return found
    ex = found.experts
    spec = MoESpec(found.x, None, None, ex.gate, ex.up, ex.down, ex.layout, ex.activation, capacity=found.capacity,
                   b1=ex.biases[0].node if ex.biases[0] else None, b1_up=ex.biases[1].node if ex.biases[1] else None,
                   b2=ex.biases[2].node if ex.biases[2] else None, **dict(ex.fields))

    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        ids = graph.call_function(torch.stack, ([graph.call_method("reshape", (q.hot.idx, -1)) for q in found.choices],),
                                  {"dim": 1})
        weights = graph.call_function(torch.stack, ([graph.call_method("reshape", (g, -1)) for g in found.gates],),
                                      {"dim": 1})
        spec = dataclasses.replace(spec, ids=ids, weights=weights, **{
            f: op_bias(graph, b) for f, b in zip(("b1", "b1_up", "b2"), ex.biases)})
        return _as_nk(graph, spec, ex.layouts) if ex.layouts else spec

    note = (f"capacity {found.capacity}, the same drops; runs the T*k routed rows instead of every padded slot, no "
            "index_add_ dispatch or row gathers")
    return Match(spec, found.end, note=note, acc=found.acc, writes=found.writes, transient=found.transient,
                 derive=derive, top_k=len(found.choices))
