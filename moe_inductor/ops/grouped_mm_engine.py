"""The experts op's GEMMs through ``torch._grouped_mm`` (CUTLASS on Hopper), for the compute-bound regime.

Why: with few large experts and many rows each (Mixtral at T >= 4096: 8 experts, ~1000 rows each, 4096 x 14336
weights) the GEMMs are compute-bound, and there our Triton grouped GEMM reaches about 480 TFLOP/s against CUTLASS's
~650 (benchmarks/RESULTS.md). Fusing the gather into the GEMM saves little there, since the GEMM dwarfs a copy of x.
So in that regime the op keeps its routing, activation, combine and backward middle (our kernels) and hands the
four GEMMs to ``torch._grouped_mm``. Everywhere else (small experts, short batches, biases, capacity, other
weight positions) the fused Triton kernels stay: they win there.

``config.gemm_engine`` picks: "auto" (the rule in ``grouped_mm_weights``), "triton" (never this), "grouped_mm"
(whenever the layout allows; also on the CPU with ``config.triton_on_cpu``, where the tests drive it).

Nothing here reads a tensor's values on the host: the choice depends on shapes, dtypes and strides only, and the
group boundaries are the device offsets of the routing metadata.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..kernels.launch import launch_activation, tracing_launches
from .activations import Activation
from .call import ExpertsCall
from .grouped import Routed, backward_middle, combine, is_dense_transpose, kernel_activation, use_triton


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _dense_enough(w: Tensor) -> bool:
    """``torch._grouped_mm``'s layout rule for a (E, K, N) operand: one of the two inner strides is 1, the other a
    multiple of 16 bytes that covers the row, and experts do not overlap."""
    E, K, N = w.shape
    s0, s1, s2 = w.stride()
    inner_ok = (s2 == 1 and s1 >= N and s1 % 8 == 0) or (s1 == 1 and s2 >= K and s2 % 8 == 0)
    return inner_ok and s0 >= K * N and s0 % 8 == 0 and w.data_ptr() % 16 == 0


def combined_up_weights(w1: Tensor, w1_up: Optional[Tensor]) -> Optional[Tensor]:
    """The (E, H, 2I) [gate | up] view when ``w1`` and ``w1_up`` are the two halves of one tensor (HF's
    ``gate_up_proj``, either layout), ``w1`` itself when not gated, else None. No copy is made."""
    if w1_up is None:
        return w1
    E, H, I = w1.shape
    if w1_up.stride() != w1.stride() or w1_up.dtype != w1.dtype:
        return None
    if w1_up.untyped_storage().data_ptr() != w1.untyped_storage().data_ptr():
        return None
    s0, s1, s2 = w1.stride()
    if w1_up.storage_offset() - w1.storage_offset() != I * s2:  # up's columns start right after gate's
        return None
    return w1.as_strided((E, H, 2 * I), (s0, s1, s2))


def _large_experts(H: int, I: int) -> bool:
    """"auto"'s size rule: experts of at least ``config.grouped_mm_min_expert_weights`` weights per projection."""
    return H * I >= config.grouped_mm_min_expert_weights


def may_take_experts_of(w2: Tensor) -> bool:
    """Whether experts of this size can take the engine at some token count (its size rule alone, shapes only).
    ``w2`` is the (E, I, H) down weight: unlike w1, which may hold the gate and up weights whole, it has the
    experts' own width."""
    E, I, H = w2.shape
    return config.gemm_engine == "grouped_mm" or (config.gemm_engine == "auto" and _large_experts(H, I))


def engine_mode(backward: bool = False) -> str:
    """The engine setting in force for the forward or the backward: ``config.gemm_engine``, which
    ``config.gemm_engine_backward`` overrides for the backward when set."""
    mode = config.gemm_engine_backward if backward and config.gemm_engine_backward is not None else config.gemm_engine
    if mode not in ("auto", "triton", "grouped_mm"):
        raise ValueError(f"moe_inductor: gemm engine must be 'auto', 'triton' or 'grouped_mm', got {mode!r}")
    return mode


def grouped_mm_weights(x: Tensor, w1: Tensor, w1_up: Optional[Tensor], w2: Tensor, b1: Optional[Tensor],
                       b2: Optional[Tensor], weight_position: str, dropped: bool, num_rows,
                       backward: bool = False) -> Optional[Tensor]:
    """The (E, H, n_pre) up weights to run through ``torch._grouped_mm`` when this call should, else None.
    ``backward``: decide for the backward's GEMMs (``config.gemm_engine_backward``, when set, overrides the mode;
    "auto" then asks ``config.grouped_mm_backward_min_rows_per_expert`` rows per expert and no size rule).

    "auto" takes this path only where it was measured to win on the H200: bf16 on Hopper, at least
    ``config.grouped_mm_min_rows_per_expert`` rows per expert on average, and experts of at least
    ``config.grouped_mm_min_expert_weights`` weights per projection (H * I).
    """
    mode = engine_mode(backward)
    if mode == "triton" or tracing_launches() or isinstance(num_rows, torch.SymInt) or num_rows == 0:
        return None
    E, H, I = w1.shape
    # the size rule first: it is the cheapest test, and most calls (decode, small experts) stop here
    if mode == "auto" and backward:  # the backward's weight gradients favour CUTLASS at any expert size measured
        if num_rows < config.grouped_mm_backward_min_rows_per_expert * E:
            return None
    elif mode == "auto" and (num_rows < config.grouped_mm_min_rows_per_expert * E or not _large_experts(H, I)):
        return None
    if weight_position != "output" or dropped or b1 is not None or b2 is not None:
        return None
    if x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm") or not use_triton(x) or H % 8 or I % 8:
        return None
    if x.is_cuda and not _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return None
    if not x.is_cuda and mode != "grouped_mm":
        return None
    w_up = combined_up_weights(w1, w1_up)
    if w_up is None or not _dense_enough(w_up) or not _dense_enough(w2):
        return None
    return w_up


def _row_of(order: Tensor) -> Tensor:
    """The inverse permutation of ``order``: the sorted row of each assignment."""
    M = order.shape[0]
    return torch.empty_like(order).scatter_(0, order.long(), torch.arange(M, dtype=order.dtype, device=order.device))


def forward(x: Tensor, routed: Routed, w_up: Tensor, w2: Tensor, act: Activation) -> tuple[Tensor, Tensor]:
    """(y, pre): the experts forward with "output" routing weights; pre (M, n_pre) is the raw up projection."""
    group_ends = routed.offsets[1:]
    x_sorted = x.index_select(0, routed.order.long() // routed.topk)
    pre = torch._grouped_mm(x_sorted, w_up, offs=group_ends)
    del x_sorted
    h = launch_activation(pre, kernel_activation(act))
    out_sorted = torch._grouped_mm(h, w2, offs=group_ends)
    del h
    y = combine(out_sorted, routed.topk_ids, w2.shape[0], row_of=_row_of(routed.order), scale=routed.scale)
    return y, pre


def _weight_grad(a: Tensor, g: Tensor, group_ends: Tensor, like: Tensor) -> Tensor:
    """Per expert a_e^T @ g_e, (E, K, N), computed in the layout of ``like`` (a transposed weight gets a transposed
    gradient, so that autograd does not copy it): ``is_dense_transpose``'s rule, which the fake kernel follows."""
    if is_dense_transpose(like):
        return torch._grouped_mm(g.t(), a, offs=group_ends).transpose(1, 2)
    return torch._grouped_mm(a.t(), g, offs=group_ends)


def backward(dy: Tensor, call: ExpertsCall, routed: Routed, w_up: Tensor, pre: Tensor, needs) -> tuple:
    """The gradients of ``forward`` (see ``experts_backward`` for ``needs``, an ``experts.Needs``, and the returned
    tuple); ``needs.combined_gate_up``: the gate and up gradients as one (E, H, 2I) tensor in the dw1 slot."""
    x, w, act = call.x, call.weights, call.activation
    topk_weights = call.routing.topk_weights
    w1, w1_up, w2 = w.w1, w.w1_up, w.w2
    order, offsets, topk = routed.rows
    sorted_expert = routed.sorted_expert
    combined_gate_up = needs.combined_gate_up
    T, H = x.shape
    M = order.shape[0]
    E, _, I = w1.shape
    gated = w1_up is not None
    group_ends = offsets[1:]
    token = order.long() // topk
    # Workspace is freed as soon as it is dead, and x sorted (M x H) is gathered only for dW1, after dy sorted (also
    # M x H) is gone: one fewer such tensor at the backward's peak than gathering both up front.
    if pre.shape[0] != M:  # the forward did not keep it
        pre = torch._grouped_mm(x.index_select(0, token), w_up, offs=group_ends)
    dy_sorted = dy.index_select(0, token)
    g = torch._grouped_mm(dy_sorted, w2.transpose(1, 2), offs=group_ends)  # d h, before the routing weight
    d_pre = x.new_empty(M, pre.shape[1])
    h_scaled, _, _, d_scale_sorted = backward_middle(pre, g, routed.sorted, (None, None), act, x.dtype,
                                                     out=(d_pre[:, :I], d_pre[:, I:] if gated else None), scale_h=True)
    del g
    dw2 = _weight_grad(h_scaled, dy_sorted, group_ends, w2) if needs.w2 else None
    del h_scaled, dy_sorted, pre
    dw1 = dw1_up = None
    if combined_gate_up or needs.w1 or needs.w1_up:
        x_sorted = x.index_select(0, token)
        if combined_gate_up:  # one GEMM over d_pre
            dw1 = _weight_grad(x_sorted, d_pre, group_ends, w_up)
        else:  # two GEMMs: the gradients of an op must not be views of one tensor
            dw1 = _weight_grad(x_sorted, d_pre[:, :I], group_ends, w1) if needs.w1 else None
            dw1_up = _weight_grad(x_sorted, d_pre[:, I:], group_ends, w1_up) if needs.w1_up else None
        del x_sorted
    dx = None
    if needs.x:
        dx_sorted = torch._grouped_mm(d_pre, w_up.transpose(1, 2), offs=group_ends)
        del d_pre
        dx = combine(dx_sorted, routed.topk_ids, E, row_of=_row_of(order))
    d_weights = None
    if needs.topk_weights:
        # rows of out-of-range ids (masked choices) were never computed: their h, and so their sum, may be garbage
        d_scale_sorted = torch.where(sorted_expert < E, d_scale_sorted, 0.0)
        d_flat = torch.zeros(M, dtype=torch.float32, device=x.device).index_put_((order.long(),), d_scale_sorted)
        d_weights = d_flat.view(T, topk).to(topk_weights.dtype)
    grads = (dx, d_weights, dw1, dw1_up, dw2, None, None, None)  # no biases on this path
    return tuple(t if t is not None else x.new_empty(0) for t in grads)  # distinct empties: outputs may not alias
