"""Routing metadata in two Triton launches: a per-chunk histogram, then a stable counting-sort placement.

Assignments are visited in priority order p: token-major (p = t*k + j) without capacity, choice-major
(p = j*T + t) with it, the drop order of GShard and Switch. Chunk c holds priorities [c*CHUNK, (c+1)*CHUNK).
Bucket E collects out-of-range ids. The placement of an assignment of expert e with global slot s (its rank among
the assignments of e in priority order) is
  kept      (s < cap[e]):  kept_off[e] + s
  dropped   (s >= cap[e]): drop_off[e] + s - cap[e]     (after every kept row, grouped by expert; bucket E last)
with cap[E] = 0. The result equals ops/routing.py's ``route_reference`` exactly.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_keys(p_ids, i_c, M, T, num_experts, CHOICE_MAJOR: tl.constexpr, TOPK: tl.constexpr,
                CHUNK: tl.constexpr):
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    m_p = o_p < M
    if CHOICE_MAJOR:
        assignment = (o_p % T) * TOPK + o_p // T
    else:
        assignment = o_p
    e = tl.load(p_ids + assignment, mask=m_p, other=0).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    return e, assignment, m_p


@triton.jit
def route_count_kernel(p_ids, p_counts, M, T, num_experts,
                       CHOICE_MAJOR: tl.constexpr, TOPK: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr):
    i_c = tl.program_id(0)
    e, _, m_p = _chunk_keys(p_ids, i_c, M, T, num_experts, CHOICE_MAJOR, TOPK, CHUNK)
    hist = tl.histogram(e, BINS, mask=m_p)
    tl.store(p_counts + i_c * BINS + tl.arange(0, BINS), hist)


@triton.jit
def route_place_kernel(p_ids, p_counts, p_order, p_sorted_expert, p_offsets, M, T, num_experts, capacity, num_chunks,
                       CHOICE_MAJOR: tl.constexpr, TOPK: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                       SINGLE: tl.constexpr):
    i_c = tl.program_id(0)
    o_b = tl.arange(0, BINS)
    e, _, m_p = _chunk_keys(p_ids, i_c, M, T, num_experts, CHOICE_MAJOR, TOPK, CHUNK)
    if SINGLE:  # one chunk: count here and skip the separate histogram launch
        mine = tl.histogram(e, BINS, mask=m_p)
        total = mine
        before = tl.zeros((BINS,), dtype=tl.int32)
    else:
        total = tl.zeros((BINS,), dtype=tl.int32)
        before = tl.zeros((BINS,), dtype=tl.int32)
        for c in range(0, num_chunks):
            row = tl.load(p_counts + c * BINS + o_b)
            total += row
            before += tl.where(c < i_c, row, 0)
        mine = tl.load(p_counts + i_c * BINS + o_b)
    cap = tl.where(o_b < num_experts, capacity, 0)
    kept = tl.minimum(total, cap)
    dropped = total - kept
    kept_off = tl.cumsum(kept, 0) - kept
    drop_off = tl.sum(kept, 0) + tl.cumsum(dropped, 0) - dropped
    if i_c == 0:
        tl.store(p_offsets + o_b, kept_off, mask=o_b <= num_experts)

    # stable local sort by (expert, position in chunk); padding sorts last
    local = tl.arange(0, CHUNK)
    key = tl.where(m_p, e, BINS) * CHUNK + local
    key = tl.sort(key)
    e_s = key // CHUNK
    l_s = key % CHUNK
    m_s = e_s < BINS
    e_g = tl.minimum(e_s, BINS - 1)
    # slot = before[e] + (pos - local_start[e]); fold the per-expert terms so that three gathers suffice
    shift = before - (tl.cumsum(mine, 0) - mine)
    room = tl.gather(cap - shift, e_g, 0)
    kept_base = tl.gather(kept_off + shift, e_g, 0)
    drop_base = tl.gather(drop_off + shift - cap, e_g, 0)
    is_kept = local < room
    dest = tl.where(is_kept, kept_base + local, drop_base + local)
    o_p = i_c * CHUNK + l_s
    if CHOICE_MAJOR:
        assignment = (o_p % T) * TOPK + o_p // T
    else:
        assignment = o_p
    tl.store(p_order + dest, assignment, mask=m_s)
    tl.store(p_sorted_expert + dest, tl.where(is_kept, e_s, num_experts), mask=m_s)
