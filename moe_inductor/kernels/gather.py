"""Rows of a tensor by index, in a fresh row-major tensor: out[i, :] = x[rows[i], :].

The engine's traced backward (``config.visible_engine_backward``) gathers its GEMM operands with this kernel rather
than ``index_select``. Inductor lays out its own gather for its consumer: read only through a transpose by a weight
gradient's ``torch._grouped_mm``, it is written so that the transpose is dense, the grouped dimension contiguous, and
``torch._grouped_mm`` then asserts on the device unless every group's size is a multiple of 16 bytes. A kernel's
output buffer keeps the row-major layout it was allocated with.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .launch import cdiv, device_guard, launch_kernel, static_dim, tracing_launches


@triton.jit
def gather_rows_kernel(p_x, p_out, p_rows, M, N, stride_xm, stride_xn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    mask = m_m[:, None] & (o_n < N)[None, :]
    row = tl.load(p_rows + o_m, mask=m_m, other=0).to(tl.int64)
    v = tl.load(p_x + row[:, None] * stride_xm + o_n[None, :] * stride_xn, mask=mask)
    tl.store(p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :], v, mask=mask)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(M, H): ``x.index_select(0, rows)`` for ``x`` (T, H) and ``rows`` (M,), written by our kernel into a fresh
    row-major tensor."""
    M, H = rows.shape[0], x.shape[1]
    out = x.new_empty(M, H)
    if tracing_launches():
        H = static_dim(H)
    block_m, block_n = (16, 32) if configs.interpreting() else (32, 128)
    if M:
        with device_guard(x):
            launch_kernel(gather_rows_kernel, (cdiv(M, block_m), cdiv(H, block_n)),
                          (x, out, rows, M, H, x.stride(0), x.stride(1), out.stride(0)),
                          dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4))
    return out
