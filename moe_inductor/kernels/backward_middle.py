"""The elementwise middle of the experts backward, fused (routing weight on the expert output).

Between the two GEMMs of the backward, per sorted row r and column j of the intermediate width I:
  p = pre[r] (+ b1[expert])                    the raw up projection the forward kept (gate, and up when gated)
  h = act(p)                                   re-made for dW2
  d_scale[r] = sum_j h * g                     g = dy[token] @ W2^T, the gradient of h before the routing weight
  d_gate, d_up = act'(p) * (g * scale[r])      the gradients of the raw projections
(with SCALE_H, h is stored as h * scale[r]: d_scale is summed before that.)
Done in torch this is some twenty passes over (M, I) fp32 tensors; here it is one read of pre and g and one write
of h, d_gate and d_up in the input dtype. d_gate and d_up are two tensors of one stride, the halves of one (M, 2I)
tensor given whole (UP_AFTER_GATE), or (PAIRS) its even and odd columns, an interleaved weight's layout: then each
tile is stored as one contiguous run of (gate, up) pairs, not as two stride-2 stores. (A launch Inductor traces must
be given whole tensors to write: it clones a written view without the rest of its storage.) Rows past the experts
(dropped by a capacity) get zero gradients.
The arithmetic is ops/activations.py's, in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import _sigmoid, _unary_act


@triton.jit
def _unary_grad(x, ACT: tl.constexpr):
    """d act(x) / dx for the unary activations (ids as in _unary_act)."""
    if ACT == 0:
        d = x * 0.0 + 1.0
    elif ACT == 1:
        d = (x > 0.0).to(tl.float32)
    elif ACT == 2:  # Phi(x) + x * phi(x)
        d = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == 3:  # the tanh approximation, as aten.gelu_backward(approximate="tanh") writes it
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 * _sigmoid(2.0 * inner) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    else:  # silu
        s = _sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    return d


@triton.jit
def backward_middle_kernel(
    p_pre, p_g, p_scale, p_order, p_sorted_expert, p_b1, p_b1_up,
    p_h, p_d_gate, p_d_up, p_d_scale,
    M, I,
    stride_pre_m, stride_g_m, stride_h_m, stride_d_m, stride_b_e,
    alpha, limit,
    NUM_EXPERTS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, SCALE_H: tl.constexpr = False, PAIRS: tl.constexpr = False,
    UP_AFTER_GATE: tl.constexpr = False,
):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    expert = tl.load(p_sorted_expert + o_m, mask=m_m, other=NUM_EXPERTS)
    valid = m_m & (expert < NUM_EXPERTS)
    assignment = tl.load(p_order + o_m, mask=valid, other=0)
    scale = tl.load(p_scale + assignment, mask=valid, other=0.0).to(tl.float32)
    expert_c = tl.minimum(expert, NUM_EXPERTS - 1).to(tl.int64)
    rows = o_m.to(tl.int64)
    # the clamped glus' parameters in fp32, as in _activation (Inductor's wrapper passes Python floats as fp64
    # scalars); new names, since a traced launch may pass alpha and limit as constexprs, and a loop may not change
    # a variable's type
    alpha_f, limit_f = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)
    d_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        m_i = o_i < I
        m_all = m_m[:, None] & m_i[None, :]
        m_valid = valid[:, None] & m_i[None, :]
        gate = tl.load(p_pre + rows[:, None] * stride_pre_m + o_i[None, :], mask=m_all, other=0.0).to(tl.float32)
        if HAS_BIAS:
            gate += tl.load(p_b1 + expert_c[:, None] * stride_b_e + o_i[None, :], mask=m_all, other=0.0).to(tl.float32)
        g = tl.load(p_g + rows[:, None] * stride_g_m + o_i[None, :], mask=m_valid, other=0.0)
        if GATED:
            up = tl.load(p_pre + rows[:, None] * stride_pre_m + I + o_i[None, :], mask=m_all, other=0.0).to(tl.float32)
            if HAS_BIAS:
                up += tl.load(p_b1_up + expert_c[:, None] * stride_b_e + o_i[None, :], mask=m_all,
                              other=0.0).to(tl.float32)
            if ACT == 5:  # GPT-OSS glu: (clamp(up) + 1) * gate_c * sigmoid(alpha * gate_c), gate_c = min(gate, limit)
                gate_c = tl.minimum(gate, limit_f)
                up_c = tl.minimum(tl.maximum(up, -limit_f), limit_f)
                sig = _sigmoid(gate_c * alpha_f)
                glu = gate_c * sig
                h = (up_c + 1.0) * glu
                d_glu = (sig + gate_c * alpha_f * sig * (1.0 - sig)) * (gate <= limit_f).to(tl.float32)
                dact = g * scale[:, None]
                d_gate = dact * (up_c + 1.0) * d_glu
                d_up = dact * glu * ((up >= -limit_f) & (up <= limit_f)).to(tl.float32)
            elif ACT == 6:  # Step-3.7: min(silu(gate), limit) * clamp(up, -limit, limit); a clamp that binds
                # passes no gradient, one at its bound does (autograd's clamp), and a NaN stays a NaN forward
                s = _sigmoid(gate)
                silu = gate * s
                silu_c = tl.minimum(silu, limit_f, propagate_nan=tl.PropagateNan.ALL)
                up_c = tl.minimum(tl.maximum(up, -limit_f, propagate_nan=tl.PropagateNan.ALL), limit_f,
                                  propagate_nan=tl.PropagateNan.ALL)
                h = silu_c * up_c
                dact = g * scale[:, None]
                d_gate = tl.where(silu <= limit_f, dact * up_c, 0.0) * (s * (1.0 + gate * (1.0 - s)))
                d_up = tl.where((up >= -limit_f) & (up <= limit_f), dact * silu_c, 0.0)
            else:
                u = _unary_act(gate, ACT)
                h = u * up
                dact = g * scale[:, None]
                d_gate = dact * up * _unary_grad(gate, ACT)
                d_up = dact * u
            d_up = tl.where(m_valid, d_up, 0.0)
            if UP_AFTER_GATE:  # one (M, 2I) tensor through p_d_gate, its up half from column I
                tl.store(p_d_gate + rows[:, None] * stride_d_m + I + o_i[None, :],
                         d_up.to(p_d_gate.dtype.element_ty), mask=m_all)
            elif not PAIRS:
                tl.store(p_d_up + rows[:, None] * stride_d_m + o_i[None, :], d_up.to(p_d_up.dtype.element_ty),
                         mask=m_all)
        else:
            h = _unary_act(gate, ACT)
            d_gate = g * scale[:, None] * _unary_grad(gate, ACT)
        d_scale += tl.sum(h * g, axis=1)
        d_gate = tl.where(m_valid, d_gate, 0.0)
        if SCALE_H:  # h * scale, the A operand of dW2 = (h * scale)^T @ dy[token] when dy is not scaled
            h = h * scale[:, None]
        tl.store(p_h + rows[:, None] * stride_h_m + o_i[None, :], h.to(p_h.dtype.element_ty), mask=m_all)
        if PAIRS and GATED:  # [m, 2i + c] = (d_gate, d_up)[c][m, i]: one store of the interleaved tile
            o_p = 2 * i0 + tl.arange(0, 2 * BLOCK_I)
            both = tl.reshape(tl.join(d_gate, d_up), (BLOCK_M, 2 * BLOCK_I))
            tl.store(p_d_gate + rows[:, None] * stride_d_m + o_p[None, :], both.to(p_d_gate.dtype.element_ty),
                     mask=m_m[:, None] & (o_p < 2 * I)[None, :])
        else:
            tl.store(p_d_gate + rows[:, None] * stride_d_m + o_i[None, :], d_gate.to(p_d_gate.dtype.element_ty),
                     mask=m_all)
    tl.store(p_d_scale + o_m, d_scale, mask=m_m)
