"""The deterministic combine: y[t] = sum_j rows[t*k + j], skipping assignments whose expert id is out of range.

With INDEXED, row t*k + j is read at ``row_of[t*k + j]`` instead (rows left in expert-sorted order, as
``torch._grouped_mm`` writes them), and with SCALED it is multiplied by ``scale[t*k + j]`` (the routing weight) in fp32.
With BIASED the assignment's expert's bias row ``bias[e]`` is added to its row before the scale (a down projection's
bias, when the GEMM that wrote the rows had no bias epilogue).

Skipping by id (not trusting the row) matters: a row of an out-of-range id is never written by the GEMMs, so this
keeps garbage out of y without a memset of the whole (T*k, H) buffer.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    p_rows, p_ids, p_y, p_row_of, p_scale, p_bias,
    H,
    stride_rows_m, stride_y_t, stride_bias_e,
    NUM_EXPERTS: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
    INDEXED: tl.constexpr = False, SCALED: tl.constexpr = False, BIASED: tl.constexpr = False,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(p_ids + i_t * TOPK + j)
        valid = (e >= 0) & (e < NUM_EXPERTS)
        row = i_t * TOPK + j
        if INDEXED:
            row = tl.load(p_row_of + row, mask=valid, other=0).to(tl.int64)
        b_row = tl.load(p_rows + row * stride_rows_m + o_h, mask=m_h & valid, other=0.0).to(tl.float32)
        if BIASED:
            e_c = tl.minimum(tl.maximum(e, 0), NUM_EXPERTS - 1).to(tl.int64)
            b_row += tl.load(p_bias + e_c * stride_bias_e + o_h, mask=m_h & valid, other=0.0).to(tl.float32)
        if SCALED:
            b_row = b_row * tl.load(p_scale + i_t * TOPK + j, mask=valid, other=0.0).to(tl.float32)
        acc += b_row
    tl.store(p_y + i_t * stride_y_t + o_h, acc.to(p_y.dtype.element_ty), mask=m_h)
