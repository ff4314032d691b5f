"""``moe_inductor::grouped_mm``: the plain grouped GEMM building block, with device offsets.

Shapes: a (M, K) rows already grouped by expert; b (E, K, N) in any strides; offs (E,) int32 cumulative row ends
(the convention of ``torch._grouped_mm``). Rows past ``offs[-1]`` come out as zeros.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backward import _grad_buffer
from ..kernels.launch import Rows
from .grouped import ROWS_SORTED, grouped_gemm, grouped_weight_grad


def _rows(a: Tensor, offs: Tensor) -> Rows:
    """The grouped kernels' view of rows already in group order: each row its own assignment, one per token."""
    order = torch.arange(a.shape[0], dtype=torch.int32, device=a.device)
    return Rows(order, torch.cat([offs.new_zeros(1), offs]).to(torch.int32), 1)


def grouped_mm_reference(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """One matmul per group, in plain torch (reads the offsets back: reference only)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[lo:hi] = a[lo:hi] @ b[e]
        lo = hi
    return out


def _check(a: Tensor, b: Tensor, offs: Tensor) -> None:
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"grouped_mm needs a (M, K) and b (E, K, N); got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if offs.dim() != 1 or offs.shape[0] != b.shape[0]:
        raise ValueError(f"offs must be (E={b.shape[0]},); got {tuple(offs.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a has dtype {a.dtype} but b has {b.dtype}")


@torch.library.custom_op("moe_inductor::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[rows of group e] = a[rows of group e] @ b[e].

    Args:
        a: (M, K); b: (E, K, N); offs: (E,) int32 cumulative row ends, on the device.
    Returns:
        (M, N) in a's dtype.
    """
    _check(a, b, offs)
    out = a.new_zeros(a.shape[0], b.shape[2])
    return grouped_gemm(a, b, _rows(a, offs), out, a_rows=ROWS_SORTED, c_rows=ROWS_SORTED)


@grouped_mm.register_fake
def _(a, b, offs):
    _check(a, b, offs)
    return a.new_empty(a.shape[0], b.shape[2])


@torch.library.custom_op("moe_inductor::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(a: Tensor, grad: Tensor, offs: Tensor, b_like: Tensor) -> Tensor:
    """db[e] = a_e^T @ grad_e, laid out like ``b_like`` (E, K, N)."""
    return grouped_weight_grad(a, grad, _rows(a, offs), _grad_buffer(b_like), a_rows=ROWS_SORTED, g_rows=ROWS_SORTED)


@grouped_mm_weight_grad.register_fake
def _(a, grad, offs, b_like):
    return _grad_buffer(b_like)


def _setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    da = grouped_mm(grad, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    db = grouped_mm_weight_grad(a, grad, offs, b) if ctx.needs_input_grad[1] else None
    return da, db, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
