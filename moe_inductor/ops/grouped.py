"""The two grouped primitives every MoE op is built from, each with a plain-torch reference.

``grouped_gemm``         c[rows_c(i)] (+)= epilogue(a[rows_a(i)] @ b[e(i)])   (forward, dX, and dY @ W^T)
``grouped_weight_grad``  dw[e] = sum_i a[rows_a(i)]^T (scale_i * g[rows_g(i)])   (dW grouped over K)

Rows are addressed through the expert-sorted ``order`` (see kernels/grouped_gemm.py for the legend). CUDA tensors run
the Triton kernels; CPU tensors run the reference, or the kernels under the interpreter when
``config.triton_on_cpu`` is set.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import config
from ..kernels.configs import interpreting
from ..kernels.launch import (LazyKernel, cdiv, device_guard, launch_grouped_gemm, launch_grouped_weight_grad,
                              launch_kernel, next_pow2, static_dim, tracing_launches)
from ..kernels.modes import (  # noqa: F401  (re-exported constants)
    ROWS_ASSIGNMENT,
    ROWS_SORTED,
    ROWS_TOKEN,
    SCALE_ACC,
    SCALE_NONE,
    SCALE_OUT,
)
from .activations import ACTIVATIONS, apply_activation

backward_middle_kernel = LazyKernel("backward_middle", "backward_middle_kernel")
combine_kernel = LazyKernel("combine", "combine_kernel")


def is_dense_transpose(w: torch.Tensor) -> bool:
    """Whether each expert of the (E, K, N) weight view ``w`` is the transpose of a dense (N, K) matrix (nn.Linear-style
    storage, whole or the gate or up half of a (E, 2I, H) gate_up tensor). A gradient for such a weight is allocated
    transposed too, so that autograd reads it (or copies it into the parameter) along rows; every other layout gets
    a dense (E, K, N) gradient. The real and the fake kernels both follow this rule: the layouts they return must
    agree."""
    return (w.dim() == 3 and w.stride(1) == 1 and w.stride(2) == w.shape[1]
            and w.stride(0) >= w.shape[1] * w.shape[2])


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and config.triton_on_cpu)


def _rows(mode: int, positions: torch.Tensor, assignment: torch.Tensor, topk: int) -> torch.Tensor:
    if mode == ROWS_SORTED:
        return positions
    if mode == ROWS_TOKEN:
        return assignment // topk
    return assignment


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    *,
    a_rows: int,
    c_rows: int,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    scale_mode: int = SCALE_NONE,
    activation: str = "none",
    alpha: float = 1.702,
    limit: float = 7.0,
    pre: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Writes into ``out`` and returns it. ``b`` is (E, K, N) in any strides; ``pre`` gets the raw GEMM results."""
    if use_triton(a):
        launch_grouped_gemm(
            a, b, offsets, order, topk, out, a_rows=a_rows, c_rows=c_rows, num_rows=order.shape[0], b2=b2,
            bias=bias, bias2=bias2, scale=scale, scale_mode=scale_mode, act_id=ACTIVATIONS[activation][1],
            alpha=alpha, limit=limit, pre=pre, accumulate=accumulate, autotune=config.autotune,
        )
        return out
    return grouped_gemm_reference(
        a, b, offsets, order, topk, out, a_rows=a_rows, c_rows=c_rows, b2=b2, bias=bias, bias2=bias2, scale=scale,
        scale_mode=scale_mode, activation=activation, alpha=alpha, limit=limit, pre=pre, accumulate=accumulate,
    )


def project_reference(rows, w, w2, bias, bias2, s, scale_mode, activation, alpha, limit, pre=None) -> torch.Tensor:
    """One expert's rows through one projection as the kernel's epilogues define it: ``rows @ w`` (and ``@ w2``,
    the up half of a gated activation), raw results into ``pre``, then the routing scale ``s`` when SCALE_ACC, the
    bias, the activation, and ``s`` when SCALE_OUT."""
    acc = rows @ w
    acc2 = rows @ w2 if w2 is not None else None
    if pre is not None:
        pre[..., :w.shape[-1]] = acc
        if acc2 is not None:
            pre[..., w.shape[-1]:] = acc2
    if scale_mode != SCALE_NONE:
        s = s.to(acc.dtype)
    if scale_mode == SCALE_ACC:
        acc = acc * s
        acc2 = acc2 * s if acc2 is not None else None
    if bias is not None:
        acc = acc + bias
        if acc2 is not None:
            acc2 = acc2 + bias2
    h = apply_activation(activation, acc, acc2, alpha, limit)
    return h * s if scale_mode == SCALE_OUT else h


def grouped_gemm_reference(
    a, b, offsets, order, topk, out, *, a_rows, c_rows, b2=None, bias=None, bias2=None, scale=None,
    scale_mode=SCALE_NONE, activation="none", alpha=1.702, limit=7.0, pre=None, accumulate=False,
) -> torch.Tensor:
    """Plain torch, one matmul per non-empty expert, in the input dtype like the eager modules."""
    bounds = offsets.tolist()  # CPU only: the reference may read sizes back
    order_l = order.long()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        positions = torch.arange(lo, hi, device=a.device)
        assignment = order_l[lo:hi]
        rows_a = a[_rows(a_rows, positions, assignment, topk)]
        s = scale[assignment][:, None] if scale_mode != SCALE_NONE else None
        h = project_reference(rows_a, b[e], b2[e] if b2 is not None else None,
                              bias[e] if bias is not None else None, bias2[e] if bias2 is not None else None,
                              s, scale_mode, activation, alpha, limit, pre[lo:hi] if pre is not None else None)
        rows_c = _rows(c_rows, positions, assignment, topk)
        if accumulate:
            out[rows_c] += h.to(out.dtype)
        else:
            out[rows_c] = h.to(out.dtype)
    return out


def grouped_weight_grad(
    a: torch.Tensor,
    g: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    topk: int,
    dw: torch.Tensor,
    *,
    a_rows: int,
    g_rows: int,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes ``dw`` (E, K, N), zeros for empty experts, and returns it."""
    if use_triton(a):
        launch_grouped_weight_grad(a, g, offsets, order, topk, dw, a_rows=a_rows, g_rows=g_rows, scale=scale,
                                   autotune=config.autotune)
        return dw
    return grouped_weight_grad_reference(a, g, offsets, order, topk, dw, a_rows=a_rows, g_rows=g_rows, scale=scale)


def grouped_weight_grad_reference(a, g, offsets, order, topk, dw, *, a_rows, g_rows, scale=None) -> torch.Tensor:
    bounds = offsets.tolist()
    order_l = order.long()
    for e in range(dw.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            dw[e] = 0
            continue
        positions = torch.arange(lo, hi, device=a.device)
        assignment = order_l[lo:hi]
        rows_g = g[_rows(g_rows, positions, assignment, topk)]
        if scale is not None:
            rows_g = (rows_g * scale[assignment].to(rows_g.dtype)[:, None]).to(g.dtype)
        dw[e] = (a[_rows(a_rows, positions, assignment, topk)].t() @ rows_g).to(dw.dtype)
    return dw


def combine(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, row_of: Optional[torch.Tensor] = None,
            scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y (T, H) = sum over k of rows (T*k, H), skipping assignments with an id outside [0, E) (rows never written).

    ``row_of`` (T*k,): assignment t*k + j is read from row ``row_of[t*k + j]`` (rows in expert-sorted order);
    ``scale`` (T*k,): each assignment's row is multiplied by it, in fp32, before the sum.
    """
    T, k = topk_ids.shape
    H = rows.shape[1]
    y = rows.new_empty(T, H)
    if tracing_launches():
        k, H, num_experts = static_dim(k), static_dim(H), static_dim(num_experts)
    if use_triton(rows):
        if T > 0:
            block_h = min(1024, next_pow2(H))
            with device_guard(rows):
                launch_kernel(combine_kernel, (T, cdiv(H, block_h)),
                              (rows, topk_ids.contiguous(), y, row_of if row_of is not None else rows,
                               scale if scale is not None else rows, H, rows.stride(0), y.stride(0)),
                              dict(NUM_EXPERTS=num_experts, TOPK=k, BLOCK_H=block_h, INDEXED=row_of is not None,
                                   SCALED=scale is not None))
        return y
    valid = ((topk_ids >= 0) & (topk_ids < num_experts)).reshape(-1)
    picked = rows[row_of.long()] if row_of is not None else rows  # row_of is a permutation of the rows
    picked = picked.float() * (scale.float()[:, None] if scale is not None else 1.0)
    return torch.where(valid[:, None], picked, 0.0).view(T, k, H).sum(1).to(rows.dtype)


def backward_middle(pre, g, scale, order, sorted_expert, b1, b1_up, activation, alpha, limit, num_experts, dtype,
                     out: Optional[tuple] = None, scale_h: bool = False):
    """(h, d_gate, d_up, d_scale) of the fused middle (kernels/backward_middle.py); h and the gradients in ``dtype``,
    d_up None when the activation is not gated.

    Args:
        out: (d_gate, d_up) buffers to write into (two column halves of one (M, 2I) tensor, say); d_gate's row
            stride is used for both.
        scale_h: store h multiplied by its routing weight.
    """
    M, I = g.shape
    if tracing_launches():
        I, num_experts = static_dim(I), static_dim(num_experts)
    gated, act_id = ACTIVATIONS[activation]
    h = g.new_empty(M, I, dtype=dtype)
    if out is not None:
        d_gate, d_up = out
    else:
        d_gate = g.new_empty(M, I, dtype=dtype)
        d_up = g.new_empty(M, I, dtype=dtype) if gated else None
    d_scale = g.new_empty(M, dtype=torch.float32)
    has_bias = b1 is not None
    b1c = b1.contiguous() if has_bias else g
    b1_upc = b1_up.contiguous() if has_bias and gated else b1c
    if M:
        block_m, block_i = (16, 32) if interpreting() else (16, 256)
        with device_guard(g):
            launch_kernel(
                backward_middle_kernel, (cdiv(M, block_m),),
                (pre, g, scale, order, sorted_expert, b1c, b1_upc, h, d_gate, d_up if gated else d_gate, d_scale,
                 M, I, pre.stride(0), g.stride(0), h.stride(0), d_gate.stride(0), b1c.stride(0) if has_bias else 0,
                 float(alpha), float(limit)),
                dict(NUM_EXPERTS=num_experts, GATED=gated, ACT=act_id, HAS_BIAS=has_bias, BLOCK_M=block_m,
                     BLOCK_I=block_i, SCALE_H=scale_h, num_warps=4),
            )
    return h, d_gate, d_up, d_scale
