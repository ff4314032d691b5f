"""The split loop's bounded-slices spelling, for the "split_loop" form: the rows sorted by expert, each projection a
zeros buffer written slice by slice between ``cumsum`` bounds of the counts, then ``index_add_`` back.

The user code this matches (Snowflake's ArcticTraining, ``torch_group_gemm_fn``, its pure-torch path):

    flat = ids.t().reshape(-1)                       # k-major slots: slot j * T + t is (t, j)
    hot = F.one_hot(flat, num_classes=E).t()         # (E, T * k)
    slots = torch.cat([torch.where(hot[i])[0] for i in range(E)])
    scores = weights.t().reshape(-1)[slots]; tok = slots % T
    cum = hot.sum(dim=-1).cumsum(0)
    def group_gemm(A, B, cum):
        C = torch.zeros((cum[-1], B.shape[-1]), dtype=A.dtype)
        for i in range(len(cum)):
            start = 0 if i == 0 else cum[i - 1]; end = cum[i]
            C[start:end, :] = torch.matmul(A[start:end, :], B[i])
        return C
    h = group_gemm(x[tok], w_gate_up, cum)           # (E, H, 2I); gate/up interleaved or halves, or two buffers
    h = (h[..., 1::2] + 0.0) * F.silu(h[..., 0::2] * 1.0)
    out = torch.zeros(T, H).index_add_(0, tok, group_gemm(h, w_down, cum) * scores[:, None])

Also taken: the token-major flattening (``ids.reshape(-1)``, ``tok = slots // k``); ``torch.mm`` / ``@``; the counts
as ``hot.sum(-1)`` of the same one-hot (or any count vector of the same ids that passes/counts.py proves); the
bounds read by ``cum.tolist()``; the result's rows as ``moe_output.shape[0] // k``.

What is proven, each from the graph: ``slots`` is the cat, in expert order 0..E-1, of ``where(hot[e])`` of one
one-hot of the flattened top-k ids over E classes: every slot exactly once, block e holding the slots whose id is e
(in ascending order), of size ``counts[e]``. The counts are that one-hot's row sums (or proven counts of the same
ids) and ``cum`` their ``cumsum``; each buffer is zeros of ``cum[-1]`` (= T * k) rows and the projection's width,
written by E ``setitem``s only, write e at rows ``[cum[e-1], cum[e])`` (``[0, cum[0])`` for e = 0) with
``matmul(A[same rows], B[e])``, every e once, and read by nothing but the next step, after the last write: so each
buffer is the grouped GEMM of its rows by their experts. The first buffer's rows are ``x[tok]`` with ``tok`` the
token of each slot (``slots % T`` for the k-major flattening, ``slots // k`` for the token-major one); the second's
are the activation of the first (read by gated_reads.py, a ``* 1.0`` or ``+ 0.0`` seen through); the routing weight
is ``weights``' entry at each slot under the same flattening; the combine adds row p at ``tok[p]`` into zeros of
(T, H). Anything short is left alone, with the reason.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .counts import count_item, per_expert_counts, topk_ids_over
from .driver import Match
from .aliases import alias_mutations
from .fx_utils import ONE_HOT, column_of, comes_before, flat_of, is_call, known_equal, val
from .gated_reads import GatedRead, activation_of, fused_gate_up

_ALL = slice(None, None, None)

#: the form's mark: a buffer written by per-expert matmuls between cumsum bounds
MARK = "the loop of cumsum-bounded matmuls is a grouped GEMM"


def _zeros_rows(node) -> Optional[tuple]:
    """(rows, cols) of ``torch.zeros((rows, cols), ...)`` (or ``torch.zeros(rows, cols)``), else None."""
    if not is_call(node, "call_function", torch.zeros) or set(node.kwargs) - {"device", "dtype", "layout"}:
        return None
    shape = node.args[0] if len(node.args) == 1 and isinstance(node.args[0], (tuple, list)) else node.args
    return tuple(shape) if len(shape) == 2 else None


def _transposed(node) -> Optional[Node]:
    """``m`` for ``m.t()``, ``m.T`` or ``m.transpose(0, 1)`` of a 2-d m."""
    if is_call(node, "call_method", "t") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if is_call(node, "call_function", getattr) and node.args[1] == "T":
        return node.args[0]
    if is_call(node, "call_method", "transpose") and not node.kwargs and set(node.args[1:]) in ({0, 1}, {-1, -2}):
        return node.args[0]
    return None


def _flattening(flat) -> Optional[tuple[Node, str]]:
    """(ids, "k_major" | "token_major") for ``ids.t().reshape(-1)`` or ``ids.reshape(-1)`` of a 2-d ids."""
    inner = flat_of(flat) if isinstance(flat, Node) else None
    if inner is None:
        return None
    ids = _transposed(inner)
    if ids is not None and val(ids) is not None and val(ids).dim() == 2:
        return ids, "k_major"
    return (inner, "token_major") if val(inner) is not None and val(inner).dim() == 2 else None


def _sorted_slots(slots) -> Optional[tuple[Node, Node, str, int, tuple]]:
    """(the one-hot's (E, T*k) transpose, ids, layout, E, the where nodes) for ``slots`` = ``cat([where(hot[e])[0]
    for e in range(E)])``, in order, of ``hot = one_hot(flat_ids, E).t()`` of top-k ids over E; else None."""
    if not is_call(slots, "call_function", torch.cat) or len(slots.args) != 1 or slots.kwargs not in ({}, {"dim": 0}):
        return None
    parts, hot_t, picks = slots.args[0], None, []
    for e, part in enumerate(parts):
        if not (is_call(part, "call_function", operator.getitem) and part.args[1] == 0):
            return None
        where = part.args[0]
        if not (is_call(where, "call_function", torch.where) and len(where.args) == 1 and not where.kwargs):
            return None
        row = where.args[0]
        if not (is_call(row, "call_function", operator.getitem) and type(row.args[1]) is int and row.args[1] == e):
            return None
        if hot_t is not None and row.args[0] is not hot_t:
            return None
        hot_t = row.args[0]
        picks += [part, where, row]
    hot = _transposed(hot_t) if hot_t is not None else None
    if not is_call(hot, "call_function", *ONE_HOT):
        return None
    num_experts = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else None)
    flat = _flattening(hot.args[0])
    if not isinstance(num_experts, int) or num_experts != len(parts) or flat is None:
        return None
    ids, layout = flat
    if not topk_ids_over(ids, num_experts) or any(alias_mutations(n) for n in (hot, hot_t, slots)):
        return None
    return hot_t, ids, layout, num_experts, tuple(picks)


def _counts_match(counts, hot_t: Node, ids: Node, num_experts: int) -> bool:
    """``counts`` holds each expert's number of slots: ``hot_t.sum(-1)`` of the same one-hot, or a count vector
    of the same ids (passes/counts.py)."""
    if is_call(counts, "call_method", "sum") and counts.args[0] is hot_t and (
            counts.args[1:] in ((-1,), (1,)) and not counts.kwargs
            or len(counts.args) == 1 and counts.kwargs in ({"dim": -1}, {"dim": 1})):
        return not alias_mutations(counts)
    found = per_expert_counts(counts)
    return found is not None and found == (ids, num_experts) and not alias_mutations(counts)


def _cumsum_of(cum) -> Optional[Node]:
    """``c`` for ``c.cumsum(0)`` / ``torch.cumsum(c, 0)`` (dim by keyword too), else None."""
    if not (is_call(cum, "call_method", "cumsum") or is_call(cum, "call_function", torch.cumsum)):
        return None
    args, kwargs = tuple(cum.args), dict(cum.kwargs)
    dim = kwargs.pop("dim", args[1] if len(args) > 1 else None)
    return args[0] if dim == 0 and not kwargs and len(args) <= 2 and isinstance(args[0], Node) else None


def _row_bounds(index) -> Optional[tuple]:
    """(start, stop) of an index ``[start:stop]`` or ``[start:stop, :]`` (step 1), else None."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] == _ALL:
        index = index[0]
    if not isinstance(index, slice) or index.step not in (None, 1) or index.stop is None:
        return None
    return (0 if index.start is None else index.start), index.stop


def _bound(b, cum: Node) -> Optional[int]:
    """j for a bound that is ``cum[j].item()`` (or ``cum.tolist()[j]`` as Dynamo traces it); -1 for a literal 0."""
    if type(b) is int:
        return -1 if b == 0 else None
    found = count_item(b)
    if found is None or found[0] is not cum or found[1] < 0:
        return None
    return found[1]


#: what Dynamo reads of a data-dependent slice to check its size: no read of its values
_SIZE_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_storage_offset.default, torch.ops.aten.sym_stride.int)


def _real_users(node: Node) -> list:
    """``node``'s readers, less Dynamo's reads of its size or storage offset."""
    return [u for u in node.users if not is_call(u, "call_function", *_SIZE_READS)]


def _matmul(node) -> Optional[tuple[Node, Node]]:
    if (is_call(node, "call_function", torch.matmul, torch.mm, operator.matmul) and len(node.args) == 2
            and not node.kwargs):
        return node.args
    return None


def grouped_gemm(buf: Node, cum: Node, num_experts: int) -> Union[tuple, str, None]:
    """(rows, weight (E, K, N), writes, transient) where ``buf`` is zeros of ``cum[-1]`` rows filled, expert e at rows
    ``[cum[e-1], cum[e])``, by ``rows[same] @ weight[e]`` and by nothing else; a reason where it is such a buffer
    but a check fails; None where it is no such buffer."""
    shape = _zeros_rows(buf)
    writes = [u for u in buf.users if is_call(u, "call_function", operator.setitem) and u.args[0] is buf
              and _matmul(u.args[2]) is not None]
    if shape is None or not writes:
        return None
    if set(alias_mutations(buf)) != set(writes):
        return f"{MARK}, but the buffer is changed in place otherwise than by its E writes"
    rows_n = shape[0]
    rows_n = rows_n.args[0] if is_call(rows_n, "call_method", "item") and len(rows_n.args) == 1 else rows_n
    if not (is_call(rows_n, "call_function", operator.getitem) and rows_n.args[0] is cum
            and rows_n.args[1] in (-1, num_experts - 1)):
        return f"{MARK}, but the buffer's rows are not the last running sum of the counts"
    rows, weight, seen, transient = None, None, set(), []
    for w in writes:
        bounds = _row_bounds(w.args[1])
        lo, hi = (_bound(bounds[0], cum), _bound(bounds[1], cum)) if bounds is not None else (None, None)
        if lo is None or hi is None or hi != lo + 1 or hi in seen:
            return f"{MARK} only if write e covers rows cum[e-1]:cum[e] of the counts' cumsum, each expert once"
        seen.add(hi)
        a, b = _matmul(w.args[2])
        if not is_call(a, "call_function", operator.getitem) or _row_bounds(a.args[1]) != bounds:
            return f"{MARK} only if each matmul reads the rows it writes"
        if rows is not None and a.args[0] is not rows:
            return f"{MARK} only if every expert's rows come from one tensor"
        rows = a.args[0]
        if not (is_call(b, "call_function", operator.getitem) and type(b.args[1]) is int and b.args[1] == hi):
            return f"{MARK} only if expert e's rows are multiplied by the e-th weight"
        if weight is not None and b.args[0] is not weight:
            return f"{MARK} only if every expert's weight is one stacked tensor"
        weight = b.args[0]
        transient += [a, w.args[2], b] + [x for x in bounds if isinstance(x, Node)]
        if len(_real_users(w.args[2])) != 1 or len(_real_users(a)) != 1:
            return f"{MARK}, but an expert's rows or product is read besides its write"
    if seen != set(range(num_experts)):
        return f"{MARK} only if every expert 0..E-1 writes its rows"
    bv, rv, wv = val(buf), val(rows), val(weight)
    if bv is None or rv is None or wv is None or wv.dim() != 3 or wv.shape[0] != num_experts or rv.dim() != 2:
        return f"{MARK}, but its shapes are not (rows, K) by (E, K, N)"
    if bv.dtype != rv.dtype or bv.dtype != wv.dtype or not known_equal(bv.shape[1], wv.shape[2]):
        return f"{MARK}, but the buffer's dtype or width is not the products'"
    if alias_mutations(weight) or alias_mutations(rows):
        return f"{MARK}, but its rows or weight are changed in place"
    last = next(n for n in reversed(buf.graph.nodes) if n in writes)
    readers = [u for u in _real_users(buf) if u not in writes]
    if any(not comes_before(last, u) for u in readers):
        return f"{MARK}, but the buffer is read before its last write"
    return rows, weight, tuple(writes), tuple(transient)


def _identity_of(node) -> Node:
    """``t`` for ``t * 1.0``, ``t + 0.0`` (either order) or ``t - 0.0``: literal identities, read through."""
    while is_call(node, "call_function", operator.mul, operator.add, operator.sub) and len(node.args) == 2:
        a, b = node.args
        unit = 1 if node.target is operator.mul else 0
        if isinstance(a, Node) and type(b) in (int, float) and b == unit:
            node = a
        elif isinstance(b, Node) and type(a) in (int, float) and a == unit and node.target is not operator.sub:
            node = b
        else:
            break
    return node


def _gated(h, read) -> Optional[GatedRead]:
    """``act(gate) [* up]`` as gated_reads.py reads it, literal identities on gate and up seen through."""
    if is_call(h, "call_function", operator.mul) and len(h.args) == 2:
        for a, b in (h.args, h.args[::-1]):
            act = activation_of(a) if isinstance(a, Node) and isinstance(b, Node) else None
            if act is None:
                continue
            gate_in, up_in = _identity_of(act[1]), _identity_of(b)
            fused = fused_gate_up(gate_in, up_in)
            if fused is not None:
                gate = read(fused[0])
                return GatedRead(f"{act[0]}_glu", a, gate_in, up_in, gate, None, fused[1]) if gate else None
            gate, up = read(gate_in), read(up_in)
            return GatedRead(f"{act[0]}_glu", a, gate_in, up_in, gate, up) if gate and up else None
    act = activation_of(h) if isinstance(h, Node) else None
    if act is None:
        return None
    gate = read(_identity_of(act[1]))
    return GatedRead(act[0], h, act[1], None, gate, None) if gate else None


def _private_chain(start: Node, end: Node, allowed: set) -> bool:
    """Every node from ``start``'s readers up to ``end`` is read only inside ``allowed`` (nothing outside the region
    reads an intermediate the rewrite removes)."""
    frontier, seen = [start], set()
    while frontier:
        n = frontier.pop()
        if n in seen or n is end:
            continue
        seen.add(n)
        for u in _real_users(n):
            if u not in allowed:
                return False
            frontier.append(u)
    return True


def _combine(acc: Node):
    """(the write, the token index, the expert outputs, the scores) for zeros ``acc`` with one
    ``index_add_(0, tok, ys * scores[:, None])``, else None."""
    writes = alias_mutations(acc)
    if len(writes) != 1 or not is_call(writes[0], "call_method", "index_add_") or writes[0].args[0] is not acc:
        return None
    write = writes[0]
    if len(write.args) != 4 or write.kwargs or write.args[1] != 0:
        return None
    tok, src = write.args[2], write.args[3]
    if not (is_call(src, "call_function", operator.mul) and len(src.args) == 2):
        return None
    for ys, col in (src.args, src.args[::-1]):
        scores = column_of(col) if isinstance(col, Node) else None
        if scores is not None and isinstance(ys, Node):
            return write, tok, ys, scores, src, col
    return None


def _token_slots(tok, layout: str, T, k: int) -> Optional[Node]:
    """``slots`` for ``slots % T`` (k-major) or ``slots // k`` (token-major)."""
    if layout == "k_major" and is_call(tok, "call_function", operator.mod, torch.remainder):
        n = tok.args[1] if len(tok.args) == 2 else None
        n = n.meta.get("example_value") if isinstance(n, Node) else n  # a traced size, in a dynamic graph
        if n is not None and not isinstance(n, torch.Tensor) and known_equal(n, T):
            return tok.args[0]
    if layout == "token_major" and is_call(tok, "call_function", operator.floordiv) and len(tok.args) == 2:
        if type(tok.args[1]) is int and tok.args[1] == k:
            return tok.args[0]
    return None


def match(acc: Node) -> Union[Match, str, None]:
    """The MoE whose bounded-slices grouped GEMM outputs ``acc`` adds back to the tokens; why not, where ``acc``
    receives a cumsum-bounded matmul buffer (the form's mark) and a check fails; None otherwise."""
    found = _zeros_rows(acc) and _combine(acc)
    if not found:
        return None
    write, tok_node, ys, scores, src, col = found
    # ys: the second buffer; its slices' bounds name the cumsum
    if not is_call(ys, "call_function", torch.zeros):
        if is_call(ys, "call_function", torch.ones, torch.empty, torch.full) and any(
                is_call(u, "call_function", operator.setitem) and _matmul(u.args[2]) for u in ys.users):
            return f"{MARK} only into a buffer of zeros"
        return None
    bounds_from = [u for u in ys.users if is_call(u, "call_function", operator.setitem)]
    cums = {count_item(b)[0] for w in bounds_from if _row_bounds(w.args[1]) for b in _row_bounds(w.args[1])
            if isinstance(b, Node) and count_item(b)}
    if len(cums) != 1:
        return None
    cum = cums.pop()
    counts = _cumsum_of(cum)
    if counts is None:
        return f"{MARK} only if its bounds are the running sums (cumsum) of the experts' counts"
    wv = val(scores)
    if not is_call(scores, "call_function", operator.getitem) or not isinstance(scores.args[1], Node):
        return f"{MARK}, but the routing weight is not a gather of the flat weights at the sorted slots"
    slots = scores.args[1]
    sorted_ = _sorted_slots(slots)
    if sorted_ is None:
        return f"{MARK}, but the slots are not the cat of where(one_hot(flat top-k ids, E).t()[e]) for e in 0..E-1"
    hot_t, ids, layout, num_experts, picks = sorted_
    T, k = val(ids).shape
    if _flattening(scores.args[0]) is None or _flattening(scores.args[0])[1] != layout:
        return f"{MARK}, but the routing weights are not flattened like the ids"
    weights = _flattening(scores.args[0])[0]
    if val(weights) is None or tuple(val(weights).shape) != tuple(val(ids).shape) or wv is None:
        return f"{MARK}, but the routing weights are not (T, k) like the ids"
    if not _counts_match(counts, hot_t, ids, num_experts):
        return f"{MARK}, but its bounds are not running sums of each expert's number of slots of the same ids"
    if _token_slots(tok_node, layout, T, k) is not slots:
        return f"{MARK}, but the rows are not added back at the tokens of the sorted slots"
    down = grouped_gemm(ys, cum, num_experts)
    if not isinstance(down, tuple):
        return down or f"{MARK}, but the combined rows are not its buffer"
    h, w_down, down_writes, down_transient = down
    firsts = {}

    def read(node):
        got = grouped_gemm(node, cum, num_experts) if is_call(node, "call_function", torch.zeros) else None
        if isinstance(got, tuple):
            firsts[node] = got
            return got
        return None

    gated = _gated(h, read)
    if gated is None:
        bad = [r for r in firsts.values() if isinstance(r, str)]
        return bad[0] if bad else f"{MARK}, but the second GEMM's rows are not an activation of the first's"
    projections = [p for p in (gated.gate, gated.up) if p is not None]
    xs = projections[0][0]
    if any(p[0] is not xs for p in projections):
        return f"{MARK}, but the gate and up projections read different rows"
    if not is_call(xs, "call_function", operator.getitem) or xs.args[1] is not tok_node:
        return f"{MARK}, but the experts' rows are not x at the tokens the outputs are added back at"
    x = xs.args[0]
    xv, av = val(x), val(acc)
    if xv is None or av is None or xv.dim() != 2 or not known_equal(xv.shape[0], T):
        return f"{MARK}, but the tokens are not (T, H) like the ids"
    rows = _zeros_rows(acc)[0]
    sized = is_call(rows, "call_function", operator.floordiv) and rows.args[1] == k and is_call(
        rows.args[0], "call_function", torch.ops.aten.sym_size.int) and rows.args[0].args == (ys, 0)
    if not (known_equal(av.shape[0], T) or sized) or not known_equal(av.shape[1], xv.shape[1]):
        return f"{MARK}, but the combined result is not (T, H)"
    if av.dtype != val(ys).dtype:
        return f"{MARK}, but the combined result's dtype is not the experts'"
    # every intermediate the rewrite removes is read only inside the region
    region = {write, src, col, ys, *down_writes, *down_transient}
    firsts_writes, firsts_transient = (), ()
    for buf, got in firsts.items():
        firsts_writes += got[2]
        firsts_transient += got[3]
    region |= set(firsts_writes) | set(firsts_transient) | set(firsts)
    gate_nodes = {gated.act, gated.gate_in, gated.up_in, h, *(a for a in h.args if isinstance(a, Node))}
    for n in list(gate_nodes):
        cur = n
        while isinstance(cur, Node) and cur not in firsts:  # the identity and slice steps down to the buffer
            region.add(cur)
            cur = next((a for a in cur.args if isinstance(a, Node)), None)
    if not all(_private_chain(b, write, region) for b in (*firsts, ys)):
        return f"{MARK}, but an intermediate of the experts is read outside the MoE"
    w_gate = projections[0][1]
    w_up = gated.up[1] if gated.up is not None else None
    spec = MoESpec(x, ids, weights, w_gate, w_up, w_down, "kn", gated.activation, "output",
                   **gated.spec_fields())
    note = f"{num_experts} cumsum-bounded per-expert matmul loops and their host reads of the bounds removed"
    transient = (*picks, *down_transient, *firsts_transient, ys, *firsts)
    return Match(spec, write, note, acc=acc, writes=(*firsts_writes, *down_writes, write), transient=transient)
