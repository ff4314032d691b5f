"""The split loop's MiniMind spelling, for the "split_loop" form: each expert's slice of the sorted order run and
``scatter_add_``-ed into zeros on its own, one write per expert, no ``cat``.

The user code this matches is MiniMind's ``moe_infer`` (jingyaogong/minimind, copied by its many forks; its
cumulative host counts are traced as running sums by moe_inductor/host_cumsum.py):

    expert_cache = torch.zeros_like(x)
    idxs = flat_ids.argsort(); token_idxs = idxs // k
    for i, end in enumerate(cum):                  # cum: running sums of the per-expert counts
        start = 0 if i == 0 else cum[i - 1]
        if start == end: continue
        exp_token_idx = token_idxs[start:end]
        expert_out = experts[i](x[exp_token_idx])
        expert_out.mul_(weights.view(-1, 1)[idxs[start:end]])
        expert_cache.scatter_add_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out)

Also taken: ``index_add_(0, tok[s:e], y)`` for the scatter; ``.expand(-1, H)`` (or ``unsqueeze(1)``, ``[:, None]``)
for the repeated index; the weight multiplied out of place (``scatter_add_(..., y * w)``) or as
``weights.view(-1)[idxs[s:e]].unsqueeze(-1)``; the rows as ``x[tok][s:e]`` or ``x.index_select(0, tok[s:e])``; one
module per expert or a stacked weight's ``w[e]``.

What is proven, each from the graph: ``tok`` is ``order // k`` with ``order`` a sort of the (T, k) top-k ids'
flattening; the writes' slices are contiguous runs of the sorted order from row 0, ``[0, c_0)``, ``[c_0, c_0 +
c_1)``, ..., each size ``c_e`` being ``counts[e]`` of one vector that holds every expert's number of assignments of
the same ids, every expert 0..E-1 once: so slice e is exactly expert e's assignments. Per expert, the scatter index,
the rows of x and the routing weight read that same slice (of ``tok``, ``tok`` and ``order``); the weight is the
(T, k) weights' entry at each row's assignment; the expert is expert e's whole MLP on its own weights, its output
weighted and written, and read by nothing else. The buffer is zeros of x's shape and dtype, written by these E
writes only, and read by nothing before the last. Anything short is left alone, with the reason.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

from torch.fx import Node

from ..spec import MoESpec
from .counts import _zeros_table, count_item, topk_ids_over
from .driver import Match
from .aliases import alias_mutations, inplace_users
from .fx_utils import column_of, comes_before, flat_of, is_call, known_equal, val
from .slot_layers import through_dropouts
from .slice_runs import size_after, slice_bounds
from .sorted_grouped_mm import _counts_of


@dataclass(frozen=True)
class _Body:
    """One expert's write, read back to the expert: its slice of the sorted order, its MLP and its weight."""

    e: int
    bounds: tuple  # (start, stop) of expert e's rows in the sorted order
    write: Node
    scale: Optional[Node]  # the in-place ``mul_`` that weights the output, to erase with the write
    x: Node
    weights: Node  # the (T, k) routing weights
    gate: Node
    up: Optional[Node]
    down: Node
    layout: str
    stacked: bool
    activation: str
    fields: tuple
    slices: tuple  # the slices of the sorted order it reads (index, rows, weight), whose size checks go with it


def _same(a, b) -> bool:
    """Two slice bounds are one value: the same node, or equal ints (``None`` as a start is 0)."""
    a, b = (0 if a is None else a), (0 if b is None else b)
    return a is b if isinstance(a, Node) or isinstance(b, Node) else a == b


def _slice_of(node, base: Node) -> Optional[tuple]:
    """(start, stop) for ``base[start:stop]``, else None."""
    bounds = slice_bounds(node)
    return bounds if bounds is not None and node.args[0] is base else None


def _index_rows(index: Node, width) -> Optional[Node]:
    """``t`` for a scatter index whose row j is ``t[j]`` in every one of ``width`` columns: ``t.view(-1, 1)``
    (``reshape``, ``unsqueeze(1 | -1)``, ``[:, None]``) then ``.repeat(1, width)`` or ``.expand(-1, width)``."""
    if is_call(index, "call_method", "repeat") and not index.kwargs and (
            tuple(index.args[1:]) in ((1, width), ((1, width),))):
        column = index.args[0]
    elif is_call(index, "call_method", "expand") and not index.kwargs and tuple(index.args[1:]) == (-1, width):
        column = index.args[0]
    else:
        return None
    return column_of(column, 1)


def _write(node: Node, acc: Node, width) -> Optional[tuple[Node, Node]]:
    """(the 1-d token index, the value added) for ``acc.scatter_add_(0, t-rows index, v)`` or
    ``acc.index_add_(0, t, v)`` (positional or by name), else None."""
    if not (is_call(node, "call_method", "scatter_add_", "index_add_") and node.args and node.args[0] is acc):
        return None
    names = ("dim", "index", "src") if node.target == "scatter_add_" else ("dim", "index", "source")
    bound = {**dict(zip(names, node.args[1:])), **node.kwargs}
    if len(node.args) > 4 or set(bound) != set(names) or bound["dim"] != 0 or not isinstance(bound["index"], Node):
        return None
    rows = _index_rows(bound["index"], width) if node.target == "scatter_add_" else bound["index"]
    return None if rows is None else (rows, bound[names[2]])


def _flat_column(table: Node) -> Optional[Node]:
    """``w`` for its flattening as a column: ``w.view(-1, 1)`` (``reshape``) of a 2-d w, or ``w.view(-1)`` given a
    trailing 1 (``.unsqueeze(-1)``, ``[:, None]``, ``.view(-1, 1)``)."""
    if is_call(table, "call_method", "view", "reshape") and tuple(table.args[1:]) in ((-1, 1), ((-1, 1),)) and (
            not table.kwargs and val(table.args[0]) is not None and val(table.args[0]).dim() == 2):
        return table.args[0]
    flat = column_of(table, 1)
    return flat_of(flat) if flat is not None else None


def _weight_column(s) -> Optional[tuple[Node, Node]]:
    """(the (T, k) weights, the order slice) for a column of routing weights read at sorted rows:
    ``weights.view(-1, 1)[o]`` or ``weights.view(-1)[o].unsqueeze(-1)`` (``[:, None]``, ``.view(-1, 1)``)."""
    if not isinstance(s, Node):
        return None
    if is_call(s, "call_function", operator.getitem) and isinstance(s.args[1], Node) and isinstance(s.args[0], Node):
        weights = _flat_column(s.args[0])
        return None if weights is None else (weights, s.args[1])
    flat = column_of(s, 1)
    if is_call(flat, "call_function", operator.getitem) and isinstance(flat.args[1], Node):
        weights = flat_of(flat.args[0])
        return None if weights is None else (weights, flat.args[1])
    return None


def _weighted(value: Node, write: Node) -> Union[tuple[Node, Node, Optional[Node]], str]:
    """(the expert's output, the weight column, the in-place ``mul_`` or None) for the value a write adds: ``y``
    weighted in place before the write (``y.mul_(s)``, y read by nothing else) or ``y * s`` read by the write only."""
    if is_call(value, "call_function", operator.mul) and len(value.args) == 2 and not value.kwargs:
        if set(value.users) != {write}:
            return "the weighted expert output is read besides its write"
        for y, s in (value.args, value.args[::-1]):
            if isinstance(y, Node) and _weight_column(s) is not None:
                # read by the weighting only: no view of it, and no change of it in place, is anywhere else
                return (y, s, None) if set(y.users) == {value} else "the expert's output is read besides its weighting"
        return "the expert's output is multiplied by something other than its rows' routing weights"
    muls = inplace_users(value)
    if len(muls) != 1 or not is_call(muls[0], "call_method", "mul_") or len(muls[0].args) != 2 or muls[0].kwargs:
        return "no routing weight multiplies the expert's output (in place or out of place) before its write"
    mul = muls[0]
    if mul.users or set(value.users) != {mul, write} or not comes_before(mul, write):
        return "the expert's output is read besides its weighting and its write"
    return value, mul.args[1], mul


def _rows(xe: Node, tok: Node) -> Optional[tuple[Node, tuple, Node]]:
    """(x, bounds, the slice read) for an expert's input rows read at a slice of the sorted tokens: ``x[tok[s:e]]``,
    ``x.index_select(0, tok[s:e])`` or ``xs[s:e]`` of ``xs = x[tok]``."""
    from .split_loop import _token_rows

    if is_call(xe, "call_function", operator.getitem) and isinstance(xe.args[1], Node):
        bounds = _slice_of(xe.args[1], tok)
        return None if bounds is None else (xe.args[0], bounds, xe.args[1])
    if is_call(xe, "call_method", "index_select") and len(xe.args) == 3 and xe.args[1] == 0 and not xe.kwargs:
        bounds = _slice_of(xe.args[2], tok)
        return None if bounds is None else (xe.args[0], bounds, xe.args[2])
    bounds = slice_bounds(xe)
    x = _token_rows(xe.args[0], tok) if bounds is not None else None
    return None if x is None else (x, bounds, xe)


def _same_bounds(got: Optional[tuple], bounds: tuple) -> bool:
    return got is not None and _same(got[0], bounds[0]) and _same(got[1], bounds[1])


def _only_through(out: Node, y: Node) -> bool:
    """Every node from the projection ``out`` up to ``y`` (identity dropouts) is read by the next one only."""
    node = y
    while node is not out:
        node = node.args[0]
        if len(node.users) != 1:
            return False
    return True


def _body(write: Node, acc: Node, d, width) -> Union[_Body, str]:
    """Expert e's write, read back from the buffer to its rows, or why not."""
    from .expert_projections import expert_mlp

    got = _write(write, acc, width)
    if got is None:
        return "a write into the buffer is not a scatter_add_ / index_add_ of a token index along dim 0"
    index, value = got
    bounds = _slice_of(index, d.tok)
    if bounds is None:
        return "a write's token index is not a slice of the sorted tokens (order // k)"
    size = size_after(*bounds)
    read = count_item(size) if size is not None else None
    if read is None:
        return "a write's slice of the sorted tokens is not a run of one count ``counts[e]`` past the one before"
    e = read[1]
    weighted = _weighted(value, write)
    if isinstance(weighted, str):
        return f"expert {e}: {weighted}"
    y, s, mul = weighted
    column = _weight_column(s)
    if column is None or not _same_bounds(_slice_of(column[1], d.order), bounds):
        return f"expert {e}'s routing weights are not read at its own slice of the sorted order"
    out, why = through_dropouts(y)
    if why is not None:
        return f"expert {e}: {why}"
    if not _only_through(out, y):
        return f"expert {e}'s output is read besides its weighting"
    mlp = expert_mlp(out, e)
    if isinstance(mlp, str):
        return mlp
    w_down, layout, stacked, gated = mlp
    gate, up = gated.gate, gated.up
    rows = _rows(gate[0], d.tok)
    if rows is None or not _same_bounds(rows[1], bounds):
        return f"expert {e} does not read x at its own slice of the sorted tokens"
    if up is not None and up[0] is not gate[0] and not (
            _rows(up[0], d.tok) is not None and _rows(up[0], d.tok)[0] is rows[0]
            and _same_bounds(_rows(up[0], d.tok)[1], bounds)):
        return f"expert {e}'s gate and up projections read different rows"
    if any(p[2] != layout or p[3] != stacked for p in (gate, up) if p is not None):
        return "the projections mix weight layouts or stacked and per-expert weights"
    slices = (index, column[1], rows[2])
    return _Body(e, bounds, write, mul, rows[0], column[0], gate[1], up[1] if up else None, w_down, layout, stacked,
                 gated.activation, tuple(sorted(gated.spec_fields().items())), slices)


def _one_spec(bodies: list[_Body], d) -> Union[tuple[MoESpec, int], str]:
    """The spec of E bodies, every expert 0..E-1 once over contiguous runs of the sorted order from row 0; or why
    not."""
    from .split_loop import _expert_weights

    bodies = sorted(bodies, key=lambda b: b.e)
    first = bodies[0]
    shared = (first.x, first.weights, first.layout, first.stacked, first.activation, first.fields, first.up is None)
    if any((b.x, b.weights, b.layout, b.stacked, b.activation, b.fields, b.up is None) != shared for b in bodies):
        return "the experts differ in more than their weights and rows"
    num_experts = int(val(first.down).shape[0]) if first.stacked else len(bodies)
    if [b.e for b in bodies] != list(range(num_experts)):
        return f"the writes are of experts {[b.e for b in bodies]}, not each of range({num_experts}) once"
    if not _same(first.bounds[0], 0) or any(not _same(b.bounds[0], a.bounds[1]) for a, b in zip(bodies, bodies[1:])):
        return "the experts' slices are not contiguous runs of the sorted order from row 0"
    counts = {count_item(size_after(*b.bounds))[0] for b in bodies}
    if len(counts) != 1 or not _counts_of(counts.pop(), d.ids, num_experts) or not topk_ids_over(d.ids, num_experts):
        return "the slices' sizes are not every expert's number of assignments of the sorted ids"
    gate = _expert_weights([b.gate for b in bodies], first.stacked)
    up = _expert_weights([b.up for b in bodies], first.stacked) if first.up is not None else None
    down = _expert_weights([b.down for b in bodies], first.stacked)
    if gate is None or down is None or (first.up is not None and up is None):
        return "the per-expert weights are not one weight per expert (or one stacked weight) of one shape"
    if not first.stacked and len({id(w) for ws in (gate, up or (), down) for w in ws}) != len(gate) * (
            3 if up else 2):
        return "a weight is shared between experts or projections"
    wv, iv = val(first.weights), val(d.ids)
    if wv is None or not wv.is_floating_point() or tuple(wv.shape) != tuple(iv.shape):
        return "the routing weights are not (T, k) like the ids"
    return MoESpec(first.x, d.ids, first.weights, gate, up, down, first.layout, first.activation,
                   weight_position="output", **dict(first.fields)), num_experts


def _marked(acc: Node) -> Optional[tuple[list[Node], object]]:
    """(the buffer's writes, the dispatch) where zeros ``acc`` is written by a scatter whose token index is a slice
    of a sorted order's tokens: this form's mark; else None."""
    from .split_loop import _dispatch

    av = val(acc)
    if not _zeros_table(acc) or av is None or av.dim() != 2:
        return None
    writes = alias_mutations(acc)
    width = av.shape[1]
    for w in writes:
        got = _write(w, acc, width)
        if got is not None and slice_bounds(got[0]) is not None and isinstance(got[0].args[0], Node):
            d = _dispatch(got[0].args[0])
            if d is not None and d.order is not None:
                return writes, d
    return None


def match(acc: Node) -> Union[Match, str, None]:
    """The per-expert writes into the zeros buffer ``acc`` (module docstring); why not, once the buffer is marked
    as such a loop's; None when it is not."""
    marked = _marked(acc)
    if marked is None:
        return None
    writes, d = marked
    av = val(acc)
    bodies = []
    for w in writes:
        body = _body(w, acc, d, av.shape[1])
        if isinstance(body, str):
            return body
        bodies.append(body)
    got = _one_spec(bodies, d)
    if isinstance(got, str):
        return got
    spec, num_experts = got
    xv = val(spec.x)
    if xv is None or xv.dim() != 2 or av.dtype != xv.dtype or not all(map(known_equal, av.shape, xv.shape)):
        return "the buffer is not zeros of x's (T, H) shape and dtype"
    if not known_equal(xv.shape[0], val(d.ids).shape[0]):  # order // k numbers the ids' rows: x's rows must be those
        return "x and the ids have different numbers of rows"
    if alias_mutations(d.tok) or alias_mutations(d.order):
        return "the sorted order or its tokens are changed in place"
    position = {n: i for i, n in enumerate(acc.graph.nodes)}
    last = max(writes, key=position.__getitem__)
    if any(u not in writes and position[u] < position[last] for u in acc.users):
        return "the buffer is read or viewed before its last write"
    if any(w.users for w in writes):
        return "the value of a write into the buffer is read"
    roots = [d.tok] + [n for b in bodies for n in b.slices] + [size_after(*b.bounds) for b in bodies]
    note = f"{num_experts} per-expert scatters of the sorted slices into one op"
    return Match(spec, last, note, acc=acc, writes=tuple(w for w in writes) + tuple(
        b.scale for b in bodies if b.scale is not None), transient=tuple(roots))
