"""Per-expert row sums: out[e, n] = sum over the sorted rows i of expert e of scale[i] * g[row(i), n], in fp32.

A bias's gradient. One program sums one expert's rows for one block of columns, in row order: deterministic, with no
atomics, and each load is a dense run of columns (or, for a strided ``g``, its own elements only). Row modes are
grouped_gemm.py's (``_rows``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import _rows


@triton.jit
def expert_row_sums_kernel(
    p_g, p_out, p_order, p_scale, p_offsets,
    N, topk,
    stride_gm, stride_gn, stride_oe,
    G_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_e = tl.program_id(0)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    row_start = tl.load(p_offsets + i_e)
    row_end = tl.load(p_offsets + i_e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < row_end
        assignment = tl.load(p_order + o_m, mask=m_m, other=0)
        rows = _rows(G_ROWS, o_m, assignment, topk)
        v = tl.load(p_g + rows[:, None] * stride_gm + o_n[None, :] * stride_gn, mask=m_m[:, None] & m_n[None, :],
                    other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = v * tl.load(p_scale + assignment, mask=m_m, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(p_out + i_e.to(tl.int64) * stride_oe + o_n, tl.sum(acc, axis=0).to(p_out.dtype.element_ty), mask=m_n)
