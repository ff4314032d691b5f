"""Form "sorted_grouped_mm": sort the assignments by expert, run ``torch._grouped_mm`` per projection, scatter back
(torchtitan's MoE; hand-written versions of HF's grouped_mm path).

The user code this matches (the routing score may scale the expert input, as torchtitan does by default, or its
output; the combine may be ``scatter_add_``, ``index_add_`` or torchtitan's unsort, below):

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

    # or torchtitan's unsort, the score on the input, or applied here by a bmm:
    buf = torch.zeros(T * k, H); buf[order] = ys
    out = buf.reshape(-1, k, H).sum(dim=1)          # or torch.bmm(weights.reshape(-1, 1, k), buf...).squeeze(1)

    # or transformers v5's, by the inverse permutation (its counts are histc of the sorted ids):
    inv = torch.empty_like(order); inv[order] = torch.arange(T * k)
    out = ys[inv].view(T, k, H).sum(dim=1)

The grouped GEMMs may also be a loop over per-expert chunks of the sorted rows (torchtitan's for-loop experts:
``torch.split(xs, counts.tolist())``, one MLP per chunk on ``w[e]``, ``torch.cat``; split_experts.py reads it).

Same-dtype casts (torchtitan's ``x.bfloat16()``, ``w.bfloat16()``, ``.type_as(x)`` on a bf16 model) are seen
through; gate and up may be one fused weight split by ``chunk(2, -1)``.

Every piece is checked to come from the same flattened ids: the sort, the counts behind the offsets, the token index
and the score gather. Anything else is left alone.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match, Unmatched
from .counts import bincount_of, host_copy_of, marked_counts
from .aliases import alias_mutations
from .fx_utils import (ONE_HOT, arange_length, column_of, comes_before, flat_of, is_call, known_equal, same_view,
                       size_is, val)
from .gated_reads import read_gated
from .sliced_gemm import sliced_projection
from .split_experts import split_loop_experts

FORM = "sorted_grouped_mm"


def _strip(node, *methods) -> Node:
    """Skip dtype casts like ``.float()`` / ``.int()`` / ``.to(...)``."""
    while is_call(node, "call_method", *methods):
        node = node.args[0]
    return node


def _sort_order(order: Node) -> Optional[Node]:
    """The (T, k) ids whose flattening ``order`` sorts: ``argsort(flat)`` or ``sort(flat)[1]``, as functions or as
    methods (DeepSeek-V2's ``topk_ids.view(-1).argsort()``). Stable or not: rows of one expert may come in any
    order, as every reader of the order reads it alike."""
    if (is_call(order, "call_function", torch.argsort) or is_call(order, "call_method", "argsort")) and (
            order.args[1:] in ((), (0,), (-1,)) and set(order.kwargs) <= {"stable"}):
        return flat_of(order.args[0])
    if is_call(order, "call_function", operator.getitem) and order.args[1] == 1:
        sort = order.args[0]
        if (is_call(sort, "call_function", torch.sort) or is_call(sort, "call_method", "sort")) and (
                sort.args[1:] in ((), (0,), (-1,)) and set(sort.kwargs) <= {"stable"}):
            return flat_of(sort.args[0])
    return None


def _sorted_values_of(node) -> Optional[Node]:
    """The (T, k) ids for their flat values in sorted order: ``sort(ids.view(-1))[0]``, or ``flat[order]`` with
    ``order`` the sort order of that same ``flat``."""
    if not is_call(node, "call_function", operator.getitem):
        return None
    if node.args[1] == 0:
        sort = node.args[0]
        if is_call(sort, "call_function", torch.sort) and len(sort.args) == 1 and set(sort.kwargs) <= {"stable"}:
            return flat_of(sort.args[0])
        return None
    flat, order = node.args
    ids = flat_of(flat) if isinstance(order, Node) else None
    return ids if ids is not None and _sort_order(order) is ids else None


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
    """``cumsum(counts, 0, dtype=int32)`` of per-expert counts of the same flattened ids, or the integer cumsum
    cast after it (``cumsum(counts, 0).to(torch.int32)``, ``.int()``: exact, as T * k is far below 2**31)."""
    if (is_call(offs, "call_method", "int") and len(offs.args) == 1 and not offs.kwargs) or (
            is_call(offs, "call_method", "to") and offs.args[1:] == (torch.int32,) and not offs.kwargs):
        inner = offs.args[0]
        if not (_is_cumsum(inner) and val(inner) is not None and not val(inner).is_floating_point()
                and set(inner.kwargs) <= {"dim"}):
            return False
        offs = inner
    elif not (_is_cumsum(offs) and offs.kwargs.get("dtype") == torch.int32):
        return False
    if (offs.args[1:] or (offs.kwargs.get("dim"),))[0] != 0:
        return False
    return _counts_of(offs.args[0], ids, num_experts)


def _is_cumsum(node) -> bool:
    """``torch.cumsum(t, ...)`` or ``t.cumsum(...)``: the input first either way."""
    return is_call(node, "call_function", torch.cumsum) or is_call(node, "call_method", "cumsum")


def _integer_cast_of(node) -> Node:
    """``t`` for ``t.long()`` / ``t.int()`` / ``t.to(an integer dtype)``: exact on counts (a cast to a float type
    of fewer bits is not, so it is not seen through)."""
    while isinstance(node, Node) and val(node) is not None and not val(node).is_floating_point() and (
            is_call(node, "call_method", "long", "int", "to")) and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _counts_of(counts, ids: Node, num_experts: int) -> bool:
    """``counts`` holds, for e = 0..E-1, how many of the flattened ids are e: ``histc`` over E unit bins,
    ``bincount(flat, minlength=E)`` or ``one_hot(flat, E).sum(0)``, possibly cast to an integer dtype (torchtitan's
    histc gives the ids' dtype)."""
    marked = marked_counts(counts)  # DeepSeek-V2's scatter_ of ones into zeros(T, E), summed over tokens
    if marked is not None:
        return marked == (ids, num_experts)
    counts = _integer_cast_of(host_copy_of(counts))
    if is_call(counts, "call_function", torch.histc):
        bins = counts.kwargs.get("bins", counts.args[1] if len(counts.args) > 1 else None)
        lo = counts.kwargs.get("min", counts.args[2] if len(counts.args) > 2 else None)
        hi = counts.kwargs.get("max", counts.args[3] if len(counts.args) > 3 else None)
        # with bins = E and min 0, max E or E - 1 puts id v in bin v exactly
        counted = _strip(counts.args[0], "float", "int", "to")
        # the flat ids, or their sorted values (transformers v5 counts those): the same multiset, the same counts
        return (bins == num_experts and lo == 0 and hi in (num_experts, num_experts - 1)
                and (flat_of(counted) is ids or _sorted_values_of(counted) is ids))
    counted = bincount_of(counts, num_experts)
    if counted is not None:
        return flat_of(counted) is ids or _sorted_values_of(counted) is ids
    # one_hot(flat, E).sum(0): the same counts (one_hot raises where histc would drop an id out of range)
    if is_call(counts, "call_method", "sum") and (counts.args[1:] or (counts.kwargs.get("dim"),))[0] == 0:
        hot = counts.args[0]
        if is_call(hot, "call_function", *ONE_HOT):
            classes = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else None)
            return classes == num_experts and flat_of(hot.args[0]) is ids and set(counts.kwargs) <= {"dim"}
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
    """``t`` when ``node`` is ``t * scores.reshape(-1, 1)`` (or ``scores[:, None]``, ``scores.unsqueeze(-1)``; or
    ``t * scores`` where ``scores`` is that column already, ``weights.view(-1)[order, None]``), possibly inside
    casts."""
    node = _strip(node, "to")
    if not is_call(node, "call_function", operator.mul):
        return None
    is_column = isinstance(scores.args[1], tuple)  # _scores_of's (order, None) index
    for t, s in (node.args, node.args[::-1]):
        s = _strip(s, "to", "float")
        if (s is scores) if is_column else (column_of(s, 1) is scores):
            return _strip(t, "float", "to")
    return None


def _scores_of(order: Node) -> list[Node]:
    """The ``weights.view(-1)[order]`` gathers that read the routing weights in sorted order, or their column read
    in the same index (``weights.view(-1)[order, None]``) (floating values: the ids' own ``flat[order]``, which v5
    counts, is not one)."""
    return [u for u in order.users if is_call(u, "call_function", operator.getitem)
            and (u.args[1] is order or _column_index(u.args[1], order))
            and flat_of(u.args[0]) is not None and val(u) is not None and val(u).is_floating_point()]


def _column_index(index, order: Node) -> bool:
    """Whether ``index`` is ``(order, None)``: a gather by ``order`` and a trailing unit dimension, in one index."""
    return isinstance(index, tuple) and len(index) == 2 and index[0] is order and index[1] is None


@dataclass
class _Combine:
    """How the sorted expert outputs ``ys`` go back to token order, read from the buffer they are written into."""

    ys: Node
    order: Node  # the sort order of the flat ids
    end: Node  # the node holding the combined (T, H) result: replaced by the op
    writes: tuple  # the buffer's in-place writes, erased with the region
    weights: Optional[Node] = None  # (T, k) routing weights applied after the unsort (a bmm), else None
    #: the (T, H) of the result where its traced shape is not exact (a view's inferred width over unbacked rows)
    shape: Optional[tuple] = None


def _scatter_back(acc: Node) -> Optional[_Combine]:
    """``acc = zeros_like(x); acc.scatter_add_(0, tok.reshape(-1, 1).expand(-1, H), ys)`` (or ``index_add_(0, tok,
    ys)``) with ``tok = order // k``."""
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
    if got is None or any(comes_before(u, add) for u in acc.users if u is not add):
        return None  # (a read of the zeros before the scatter must not see the op's result)
    xv, av, iv = val(add.args[3]), val(acc), val(add.args[2])
    if xv is None or av is None or av.dim() != 2:
        return None
    if add.target == "scatter_add_" and (iv is None or iv.dim() != 2 or not known_equal(iv.shape[1], av.shape[1])):
        return None  # an index narrower than the buffer adds only its first columns
    return _Combine(add.args[3], got[0], add, (add,))


def _unsort_back(acc: Node) -> Optional[_Combine]:
    """torchtitan's unsort: ``buf = torch.zeros(T * k, H); buf[order] = ys; buf.reshape(-1, k, H).sum(dim=1)``, or
    with the scores applied here, ``torch.bmm(scores.reshape(-1, 1, k), buf.reshape(-1, k, H).float())
    .to(dtype).squeeze(1)``. ``order`` is a permutation of the T*k rows, so every row is written once."""
    if not (is_call(acc, "call_function", torch.zeros) or is_call(acc, "call_method", "new_zeros")):
        return None
    mutations = alias_mutations(acc)
    if len(mutations) != 1 or not is_call(mutations[0], "call_function", operator.setitem):
        return None
    write = mutations[0]
    if write.args[0] is not acc or not isinstance(write.args[1], Node) or not isinstance(write.args[2], Node):
        return None
    order, ys = write.args[1], write.args[2]
    ids = _sort_order(order)
    av, yv, iv = val(acc), val(ys), val(ids) if ids is not None else None
    if av is None or yv is None or iv is None or iv.dim() != 2 or av.dim() != 2 or tuple(yv.shape) != tuple(av.shape):
        return None
    rows, k, width = av.shape[0], iv.shape[1], av.shape[1]
    if rows != iv.shape[0] * k or yv.dtype != av.dtype:
        return None
    reads = [u for u in acc.users if u is not write]
    if len(reads) != 1 or not comes_before(write, reads[0]):
        return None
    grouped = reads[0]
    if not (is_call(grouped, "call_method", "reshape", "view") and len(grouped.args) == 4 and tuple(
            grouped.args[2:]) == (k, width) and grouped.args[1] in (-1, iv.shape[0]) and len(grouped.users) == 1):
        return None
    user = next(iter(grouped.users))
    if is_call(user, "call_method", "sum") and (user.args[1:] == (1,) and not user.kwargs or (
            len(user.args) == 1 and user.kwargs == {"dim": 1})):
        return _Combine(ys, order, user, (write,))
    # bmm(scores (T, 1, k), buf (T, k, H)) [.to(dtype)] .squeeze(1)
    bmm_in = user if not is_call(user, "call_method", "float") else (next(iter(user.users)) if len(user.users) == 1
                                                                      else None)
    if not (is_call(bmm_in, "call_function", torch.bmm) and len(bmm_in.args) == 2 and bmm_in.args[1] is (
            user if bmm_in is not user else grouped)) or len(bmm_in.users) != 1:
        return None
    scores = _no_op_cast(bmm_in.args[0])
    if not (is_call(scores, "call_method", "reshape", "view") and tuple(scores.args[1:]) in ((-1, 1, k),
                                                                                           (iv.shape[0], 1, k))):
        return None
    weights = scores.args[0]
    wv = val(weights)
    if wv is None or tuple(wv.shape) != tuple(iv.shape):
        return None
    end = next(iter(bmm_in.users))
    if is_call(end, "call_method", "to") and len(end.users) == 1:
        end = next(iter(end.users))
    if not (is_call(end, "call_method", "squeeze") and end.args[1:] == (1,) and not end.kwargs):
        return None
    return _Combine(ys, order, end, (write,), weights=weights)


def _inverse_unsort(inv: Node) -> Optional[_Combine]:
    """transformers v5's unsort: ``inv = torch.empty_like(order); inv[order] = torch.arange(n); ys[inv].view(T, k,
    H).sum(dim=1)``. ``inv`` is the inverse of the permutation ``order`` of the n = T*k rows, so ``ys[inv]`` is the
    buffer ``buf[order] = ys`` of torchtitan's unsort, every row written once."""
    if not is_call(inv, "call_function", torch.empty_like) or len(inv.args) != 1:
        return None
    order = inv.args[0]
    mutations = alias_mutations(inv)
    if len(mutations) != 1 or not is_call(mutations[0], "call_function", operator.setitem):
        return None
    write = mutations[0]
    if write.args[0] is not inv or write.args[1] is not order or not isinstance(write.args[2], Node):
        return None
    ids = _sort_order(order)
    iv, ov = val(ids) if ids is not None else None, val(order)
    if iv is None or ov is None or iv.dim() != 2 or ov.dim() != 1:
        return None
    n, k = ov.shape[0], iv.shape[1]
    length = arange_length(write.args[2])
    if length is None or not known_equal(length, n) or not known_equal(n, iv.shape[0] * k):
        return None
    reads = [u for u in inv.users if u is not write]
    if len(reads) != 1 or not comes_before(write, reads[0]):
        return None
    gathered = reads[0]
    if not (is_call(gathered, "call_function", operator.getitem) and gathered.args[1] is inv
            and isinstance(gathered.args[0], Node) and len(gathered.users) == 1):
        return None
    ys = gathered.args[0]
    yv = val(ys)
    if yv is None or yv.dim() != 2 or not known_equal(yv.shape[0], n):
        return None
    grouped = next(iter(gathered.users))
    if not (is_call(grouped, "call_method", "reshape", "view") and len(grouped.args) == 4 and tuple(
            grouped.args[2:]) == (k, yv.shape[1]) and size_is(grouped.args[1], iv.shape[0])
            and len(grouped.users) == 1):
        return None
    user = next(iter(grouped.users))
    if is_call(user, "call_method", "sum") and (user.args[1:] == (1,) and not user.kwargs or (
            len(user.args) == 1 and user.kwargs == {"dim": 1})):
        return _Combine(ys, order, user, (write,))
    return None


def _weighted_unsort(acc: Node) -> Optional[_Combine]:
    """DeepSeek-V2's ``moe_infer`` unsort, the routing weights applied after it: ``buf = torch.empty_like(ys);
    buf[order] = ys; buf.view(T, k, -1).type(w.dtype).mul_(w.unsqueeze(-1)).sum(dim=1).type(buf.dtype)`` (casts
    optional, ``*`` for ``mul_``). ``order`` is a permutation of the T*k rows, so every row of the buffer is written
    once before it is read."""
    if not (is_call(acc, "call_function", torch.empty_like, torch.zeros_like, torch.zeros, torch.empty)
            or is_call(acc, "call_method", "new_zeros", "new_empty")):
        return None
    mutations = alias_mutations(acc)
    # ``buf[order] = ys``, or Unsloth's ``buf.index_copy_(0, order, ys)``: row order[i] of buf is ys[i] either way
    sets = [m for m in mutations if is_call(m, "call_function", operator.setitem) or (
        is_call(m, "call_method", "index_copy_") and len(m.args) == 4 and m.args[1] == 0 and not m.kwargs)]
    if len(sets) != 1 or sets[0].args[0] is not acc or not all(isinstance(a, Node) for a in sets[0].args[-2:]):
        return None
    write, (order, ys) = sets[0], sets[0].args[-2:]
    ids = _sort_order(order)
    av, yv, iv = val(acc), val(ys), val(ids) if ids is not None else None
    if av is None or yv is None or iv is None or iv.dim() != 2 or av.dim() != 2 or yv.dim() != 2 or not all(
            map(known_equal, yv.shape, av.shape)):  # (ys's rows are unbacked: a plain == raises, not answers)
        return None
    T, k, width = iv.shape[0], iv.shape[1], av.shape[1]
    # a buffer like ys (its rows the sum of the loop's pieces, unbacked) has T*k rows wherever eager runs: the
    # order's T*k indices write into it, and ys goes into those T*k places
    like_ys = is_call(acc, "call_function", torch.empty_like, torch.zeros_like) and acc.args[:1] == (ys,)
    if not (known_equal(av.shape[0], T * k) or like_ys) or yv.dtype != av.dtype:
        return None
    reads = [u for u in acc.users if u is not write]
    if len(reads) != 1 or not comes_before(write, reads[0]):
        return None
    grouped = reads[0]
    if same_view(grouped) is acc and len(grouped.users) == 1:  # ``out.view_as(X)`` of its own shape
        grouped = _single_user(grouped)
    if not (is_call(grouped, "call_method", "reshape", "view") and len(grouped.args) == 4 and size_is(
            grouped.args[1], T) and grouped.args[2] == k and size_is(grouped.args[3], width)):
        return None
    cast = _single_user(grouped)
    if not is_call(cast, "call_method", "type", "float", "to") or val(cast) is None or val(cast).dtype not in (
            torch.float32, av.dtype):
        cast = grouped  # no cast: the product in the buffer's dtype
    scaled = _single_user(cast)
    if not (is_call(scaled, "call_method", "mul_", "mul") or is_call(scaled, "call_function", operator.mul)) or len(
            scaled.args) != 2 or scaled.kwargs or scaled.args[0] is not cast:
        return None
    weights = column_of(scaled.args[1], 2)
    wv = val(weights) if weights is not None else None
    if wv is None or tuple(wv.shape) != tuple(iv.shape) or set(mutations) - {write, scaled}:
        return None
    # the in-place product is read through its result, or through the tensor it wrote (nothing else reads that)
    readers = [u for u in (*scaled.users, *(cast.users if scaled.target == "mul_" else ())) if u is not scaled]
    if len(readers) != 1 or not (is_call(readers[0], "call_method", "sum") and (
            readers[0].args[1:] == (1,) and not readers[0].kwargs or (
            len(readers[0].args) == 1 and readers[0].kwargs == {"dim": 1}))):
        return None
    end = readers[0]
    back = _single_user(end)
    if is_call(back, "call_method", "type", "to") and val(back) is not None and val(back).dtype == av.dtype:
        end = back
    # (an in-place product writes a tensor only the sum reads: it goes with the region as dead code)
    return _Combine(ys, order, end, (write,), weights=weights, shape=(T, width))


def _single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _no_op_cast(node):
    """``t`` for ``t.bfloat16()`` / ``t.float()`` / ``t.to(dtype)`` / ``t.type_as(u)`` that keeps t's dtype."""
    while is_call(node, "call_method", "bfloat16", "float", "half", "to", "type_as") and isinstance(node.args[0], Node):
        inner, outer = val(node.args[0]), val(node)
        if inner is None or outer is None or inner.dtype != outer.dtype:
            break
        node = node.args[0]
    return node


def _written_by_grouped_mm(acc: Node) -> bool:
    """``acc`` is a zeros buffer whose one in-place write (``scatter_add_``, ``index_add_``, ``acc[i] = v``) writes
    the output of a grouped GEMM (maybe scaled or cast): the form's mark, where the rows it writes are not proven."""
    if not _buffer(acc):
        return False
    mutations = alias_mutations(acc)
    if len(mutations) != 1 or not (is_call(mutations[0], "call_method", "scatter_add_", "index_add_") or is_call(
            mutations[0], "call_function", operator.setitem)):
        return False
    src = mutations[0].args[-1] if mutations[0].args else None
    for _ in range(4):
        if not isinstance(src, Node):
            return False
        if _grouped_mm_offsets(src) is not None:
            return True
        src = src.args[0] if is_call(src, "call_method", "to", "float", "bfloat16", "half", "type_as") else (
            next((a for a in src.args if isinstance(a, Node)), None) if is_call(src, "call_function", operator.mul)
            else None)
    return False


def match(acc: Node) -> Union[Match, str, None]:
    """The MoE whose sorted expert outputs ``acc`` takes back to token order (scatter_add_/index_add_ into zeros,
    or torchtitan's unsort); why not, where ``acc`` receives grouped GEMM outputs (the form's mark) and a check
    fails; None when ``acc`` is no such buffer."""
    combine = _scatter_back(acc) or _unsort_back(acc) or _inverse_unsort(acc) or _weighted_unsort(acc)
    if combine is None:
        if _written_by_grouped_mm(acc):
            return ("the grouped GEMM outputs are written back at rows that are not order // k (or order, unsorted) "
                    "of one stable sort of the flat ids, each row once")
        return None
    order = combine.order
    ids = _sort_order(order)
    k = val(ids).shape[1]
    scores = _scores_of(order)
    if len(scores) > 1:
        return None
    score = scores[0] if scores else None
    ys, position = _no_op_cast(combine.ys), None
    unscaled = _scaled_by(ys, score) if score is not None else None
    if unscaled is not None:
        ys, position = unscaled, "output"
    down, transient = _grouped(_no_op_cast(ys), ids, None), ()
    sliced = None if down is not None else sliced_projection(
        same_view(_no_op_cast(ys)), lambda counts, n: _counts_of(counts, ids, n))
    if down is not None:
        h, w_down, layout, offs = down
        num_experts = val(w_down).shape[0]
        gated = read_gated(_no_op_cast(h), lambda n: _grouped(n, ids, num_experts))
    elif sliced is not None:  # or zeros written expert by expert at running slices (Unsloth's reference)
        w_down, layout = sliced.weight, sliced.layout

        def read(n):
            p = sliced_projection(same_view(_no_op_cast(n)), lambda counts, e: _counts_of(counts, ids, e))
            return None if p is None else (p.rows, p.weight, p.layout, p)

        gated = read_gated(same_view(_no_op_cast(sliced.rows)), read)
        projections = [sliced] + [g[3] for g in (gated.gate, gated.up) if g is not None] if gated else []
        transient = tuple(t for p in projections for t in p.transient)
    else:  # or a loop over per-expert chunks of the sorted rows (torchtitan's for-loop experts)
        looped = split_loop_experts(_no_op_cast(ys), lambda counts, n: _counts_of(counts, ids, n))
        w_down, layout, gated, transient = looped if looped is not None else (None, None, None, ())
    if gated is None:
        return None
    activation, gate, up = gated.activation, gated.gate, gated.up
    if up is not None and _no_op_cast(up[0]) is not _no_op_cast(gate[0]):
        return "the gate and up projections read different inputs"
    if any(p[2] != layout for p in (gate, up) if p is not None):
        return "the projections mix weight layouts"
    xs = same_view(_no_op_cast(gate[0]))
    scaled_in = _scaled_by(xs, score) if score is not None else None
    if scaled_in is not None:
        if position is not None:  # the score on the input and the output: w^2, not what the op computes
            return "the routing weight scales both the experts' input and their output (w squared, not w)"
        xs, position = _no_op_cast(scaled_in), "input"
    if combine.weights is not None:
        if position is not None:  # scaled twice again
            return "the routing weight scales the experts' rows and again the unsorted result (w squared, not w)"
        weights, position = combine.weights, "output"
    else:
        if position is None:  # no routing weight at all
            return "no routing weight scales the experts' input or output"
        weights = flat_of(score.args[0])
    tok = None
    if is_call(xs, "call_function", torch.gather) and xs.args[1] == 0:
        tok = _token_rows(xs.args[2])
        x = xs.args[0]
        if val(xs) is None or val(x) is None or not known_equal(val(xs).shape[-1], val(x).shape[-1]):
            tok = None  # a narrower index gathers only the first columns of each row
    elif is_call(xs, "call_function", operator.getitem):
        tok, x = xs.args[1], xs.args[0]
    if tok is None or _token_of(tok) != (order, ids):
        return "the experts' rows are not the tokens x[order // k] of the sort they are written back by"
    if combine.writes[0].target in ("scatter_add_", "index_add_") and _token_rows(combine.writes[0].args[2]) is not tok:
        return "the rows read are not the rows written back"
    xv, ev = val(x), val(combine.end if combine.end is not combine.writes[0] else acc)
    shape = combine.shape or (tuple(ev.shape) if ev is not None else None)
    if xv is None or shape is None or xv.dim() != 2 or not all(map(known_equal, shape, xv.shape)) or len(shape) != 2:
        return "the tokens and the combined result do not have one (T, H) shape"
    wv = val(weights)
    if wv is None or tuple(wv.shape) != tuple(val(ids).shape) or k != val(ids).shape[1]:
        return "the routing weights are not (T, k) like the sorted ids"  # flattened like them, or order means nothing
    def w(n):  # the user's parameter (or each expert's), not a same-dtype cast of it
        return tuple(map(_no_op_cast, n)) if isinstance(n, tuple) else _no_op_cast(n)

    spec = MoESpec(x, ids, weights, w(gate[1]), w(up[1]) if up else None, w(w_down), layout, activation, position,
                   **gated.spec_fields())
    if sliced is not None:  # the projections' slice writes go with the region
        writes = tuple(w for p in projections for w in p.writes)
        combine = dataclasses.replace(combine, writes=combine.writes + writes)
    note = f"routing weight on the {spec.weight_position}; no permuted copy of x"
    if transient:  # a loop over per-expert pieces sized by counts read on the host
        num_experts = len(gate[1]) if isinstance(gate[1], tuple) else val(gate[1]).shape[0]
        note += f"; the loop over {num_experts} experts and its host reads of the counts removed"
    if combine.end is combine.writes[0] and combine.end.users:  # ``return out.scatter_add_(...)``
        if set(acc.users) != {combine.end}:
            return "the buffer and the value of its in-place write are both read"
        return Match(spec, combine.end, note, writes=combine.writes, transient=transient)
    if combine.end is combine.writes[0]:  # scattered into acc in place: its later reads read the op
        return Match(spec, combine.end, note, acc=acc, writes=combine.writes, transient=transient)
    return Match(spec, combine.end, note, where=combine.writes[0], writes=combine.writes, transient=transient)


def _grouped_mm_offsets(node: Node) -> Optional[Node]:
    """The offsets of a grouped-GEMM call (what the calls of one MoE share), else None."""
    if is_call(node, "call_function", *_grouped_mm_ops()) and "offs" in node.kwargs:
        return node.kwargs["offs"]
    return None


def _buffer(node: Node) -> bool:
    return is_call(node, "call_function", torch.zeros_like, torch.zeros) or is_call(node, "call_method", "new_zeros")


def _index_buffer(node: Node) -> bool:
    """``torch.empty_like(order)``: the inverse permutation transformers v5 unsorts by (``_inverse_unsort``); or
    an empty buffer the sorted outputs are put back into (``_weighted_unsort``)."""
    return is_call(node, "call_function", torch.empty_like, torch.empty) or is_call(node, "call_method", "new_empty")


def _written_buffer(node: Node, depth: int = 8) -> Optional[Node]:
    """The zeros buffer that ``node``'s value reaches an in-place write of, within ``depth`` steps."""
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                written = (is_call(u, "call_method", "scatter_add_", "index_add_") or is_call(
                    u, "call_function", operator.setitem)) and u.args and isinstance(u.args[0], Node)
                if written and _buffer(u.args[0]):
                    return u.args[0]
                nxt.append(u)
        frontier = nxt
    return None


def _unexplained_offsets(node: Node) -> Optional[Node]:
    """The offsets of a grouped-GEMM call left in the graph, unless the proof from the buffer it is written into
    already said why that region stays (the note is then the proof's, not this general one)."""
    offs = _grouped_mm_offsets(node)
    if offs is None:
        return None
    buffer = _written_buffer(node)
    return None if buffer is not None and match(buffer) is not None else offs


rewrite = Form(FORM, (Anchor(_buffer, match), Anchor(_index_buffer, match)), Unmatched(
    _unexplained_offsets, "torch._grouped_mm over expert offsets, but not the sort, histc + cumsum offsets, gather and "
    "scatter-back of one set of routing ids that this form proves"))
"""Replace every provable sort + grouped_mm MoE in a GraphModule; returns what was rewritten."""
