"""The expert activation as its own pass, for when the up projection ran outside our GEMM (``torch._grouped_mm``,
ops/grouped_mm_engine.py): h[r] = act(pre[r, :I], pre[r, I:]) for a gated activation, act(pre[r]) otherwise.

One read of pre and one write of h, with the arithmetic in fp32 as in the GEMM epilogue (kernels/grouped_gemm.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import _activation


@triton.jit
def activation_kernel(
    p_pre, p_h,
    M, I,
    stride_pre_m, stride_h_m,
    alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rows = o_m.to(tl.int64)
    m_all = (o_m < M)[:, None] & (o_i < I)[None, :]
    p_gate = p_pre + rows[:, None] * stride_pre_m + o_i[None, :]
    gate = tl.load(p_gate, mask=m_all, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(p_gate + I, mask=m_all, other=0.0).to(tl.float32)
    else:
        up = gate
    h = _activation(gate, up, GATED, ACT, alpha, limit)
    tl.store(p_h + rows[:, None] * stride_h_m + o_i[None, :], h.to(p_h.dtype.element_ty), mask=m_all)
