"""The expert activation as its own pass, for when the up projection ran outside our GEMM (``torch._grouped_mm``,
ops/grouped_mm_engine.py): h[r] = act(pre[r, :I], pre[r, I:]) for a gated activation, act(pre[r]) otherwise.

INTERLEAVED: a gated pre holds (gate, up) in its even and odd columns (GPT-OSS's gate_up_proj, run as one weight).
SEPARATE_UP: pre holds the gate only, (M, I), and the up projection is its own (M, I) tensor ``p_up_in`` (gate and
up weights that are two tensors, each run through its own GEMM).
HAS_BIAS: the row's expert's biases (b1, and b1_up when gated) are added to gate and up first; the expert is
``sorted_expert[r]``, clamped into range (rows past the experts are never read by the combine).
With STORE_PRE, pre is also written back out as [gate | up] halves (the layout the backward reads), without biases.

One read of pre and one write of h, with the arithmetic in fp32 as in the GEMM epilogue (kernels/grouped_gemm.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import _activation


@triton.jit
def activation_kernel(
    p_pre, p_h, p_sorted_expert, p_b1, p_b1_up, p_pre_out, p_up_in,
    M, I,
    stride_pre_m, stride_h_m, stride_b_e, stride_pre_out_m, stride_up_m,
    alpha, limit,
    GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    INTERLEAVED: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, NUM_EXPERTS: tl.constexpr = 1,
    STORE_PRE: tl.constexpr = False, SEPARATE_UP: tl.constexpr = False,
):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rows = o_m.to(tl.int64)
    m_m = o_m < M
    m_all = m_m[:, None] & (o_i < I)[None, :]
    if INTERLEAVED:
        p_gate = p_pre + rows[:, None] * stride_pre_m + 2 * o_i[None, :]
        p_up = p_gate + 1
    elif SEPARATE_UP:
        p_gate = p_pre + rows[:, None] * stride_pre_m + o_i[None, :]
        p_up = p_up_in + rows[:, None] * stride_up_m + o_i[None, :]
    else:
        p_gate = p_pre + rows[:, None] * stride_pre_m + o_i[None, :]
        p_up = p_gate + I
    gate = tl.load(p_gate, mask=m_all, other=0.0)
    if GATED:
        up = tl.load(p_up, mask=m_all, other=0.0)
    else:
        up = gate
    if STORE_PRE:
        p_out = p_pre_out + rows[:, None] * stride_pre_out_m + o_i[None, :]
        tl.store(p_out, gate, mask=m_all)
        if GATED:
            tl.store(p_out + I, up, mask=m_all)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if HAS_BIAS:
        expert = tl.load(p_sorted_expert + o_m, mask=m_m, other=0)
        expert_c = tl.minimum(expert, NUM_EXPERTS - 1).to(tl.int64)
        p_b = expert_c[:, None] * stride_b_e + o_i[None, :]
        gate += tl.load(p_b1 + p_b, mask=m_all, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(p_b1_up + p_b, mask=m_all, other=0.0).to(tl.float32)
        else:
            up = gate
    h = _activation(gate, up, GATED, ACT, alpha, limit)
    tl.store(p_h + rows[:, None] * stride_h_m + o_i[None, :], h.to(p_h.dtype.element_ty), mask=m_all)
