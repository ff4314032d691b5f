"""The deterministic combine: y[t] = sum_j rows[t*k + j], skipping assignments whose expert id is out of range.

Skipping by id (not trusting the row) matters: a row of an out-of-range id is never written by the GEMMs, so this
keeps garbage out of y without a memset of the whole (T*k, H) buffer.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    p_rows, p_ids, p_y,
    H,
    stride_rows_m, stride_y_t,
    NUM_EXPERTS: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(p_ids + i_t * TOPK + j)
        valid = (e >= 0) & (e < NUM_EXPERTS)
        b_row = tl.load(p_rows + (i_t * TOPK + j) * stride_rows_m + o_h, mask=m_h & valid, other=0.0)
        acc += b_row.to(tl.float32)
    tl.store(p_y + i_t * stride_y_t + o_h, acc.to(p_y.dtype.element_ty), mask=m_h)
