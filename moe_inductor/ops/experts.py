"""The fused experts op: y = sum over k of w_k * down_e(act(up_e(x))), forward and backward.

Shapes: x (T, H); topk_ids, topk_weights (T, k); M = T*k; E experts; I the intermediate width.
  w1 (E, H, I)  the up projection, or the gate when ``w1_up`` is given (a gated activation)
  w1_up (E, H, I), w2 (E, I, H); b1, b1_up (E, I); b2 (E, H)
Weights are logical (E, K, N) views in any strides: a (E, N, K) nn.Linear-style parameter is passed as
``w.transpose(1, 2)``, a concatenated gate/up as two slices, an interleaved one as two stride-2 slices. Nothing is
copied per call.

``weight_position`` says where the routing weight enters, as each model family does it:
  "output"  y = sum_k w_k * down(act(up(x)))             (Mixtral, Qwen, DeepSeek, GPT-OSS)
  "between" y = sum_k down(w_k * act(up(x)))
  "input"   y = sum_k down(act(up(w_k * x)))             (Llama4)

A choice whose id lies outside [0, E) is a choice of no expert: it adds nothing to y and its routing weight gets a
zero gradient (ops/routing.py drops it and never reads its weights). The FX passes rely on it: a capacity router's
dropped rows given the id E (passes/kept_masks.py), zero-computation experts' ids past the routed ones
(passes/zero_experts.py); tests/test_zero_experts.py holds every CPU implementation to it. ``fused_experts``, the
user's entry point, raises on such ids instead, as eager indexing does.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import cpu_path, grouped_mm_engine
from .backward import Needs, experts_backward, experts_backward_middle, experts_backward_up  # noqa: F401 (re-exported)
from .call import ExpertsCall, from_op_args, gate_up_pairs, gate_up_whole
from .grouped import (
    ROWS_ASSIGNMENT,
    ROWS_SORTED,
    ROWS_TOKEN,
    SCALE_ACC,
    SCALE_NONE,
    SCALE_OUT,
    Routed,
    combine,
    epilogue,
    grouped_gemm,
    use_triton,
)
from .routing import prepare_routing


def _gate_up_is_one_tensor(w1: Tensor, w1_up: Optional[Tensor]) -> bool:
    """Whether gate and up are the two halves of one real tensor (never true for fake or functional tensors: under
    tracing the halves' gradients stay separate and the compiler handles the slices)."""
    if w1_up is None or type(w1) is not torch.Tensor or type(w1_up) is not torch.Tensor or w1.is_meta:
        return False
    return grouped_mm_engine.combined_up_weights(w1, w1_up) is not None


def _scale_modes(weight_position: str) -> tuple[int, int]:
    """Where the routing weight enters each projection: (up, down) scale modes of the GEMM epilogue."""
    up = {"input": SCALE_ACC, "between": SCALE_OUT}.get(weight_position, SCALE_NONE)
    return up, SCALE_OUT if weight_position == "output" else SCALE_NONE


def _forward_gemms(call: ExpertsCall, routed: Routed, pre: Optional[Tensor], num_experts: Optional[int] = None
                   ) -> Tensor:
    """The forward on the Triton kernels: two grouped GEMMs and the combine. ``num_experts``: the E the ids are
    checked against in the combine, where the weights hold other than E experts (per-assignment copies,
    ops/expert_lists.py)."""
    x, w = call.x, call.weights
    T, H = x.shape
    M = routed.order.shape[0]
    topk = routed.topk
    up_mode, down_mode = _scale_modes(call.weight_position)
    h = x.new_empty(M, w.w1.shape[2])
    grouped_gemm(x, w.w1, routed.rows, h, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED,
                 epi=epilogue(call.activation, b2=w.w1_up, bias=w.b1, bias2=w.b1_up, scale=routed.scale,
                              scale_mode=up_mode, pre=pre))
    # Dropped assignments (capacity) are never written by the kernel, so their rows must start at zero. With one
    # choice per token the assignment rows are the token rows: the GEMM writes y itself, and no combine is needed
    # (rows it never writes, dropped or of an out-of-range id, stay zero as the combine would leave them).
    out = x.new_zeros(M, H) if routed.dropped or topk == 1 else x.new_empty(M, H)
    grouped_gemm(h, w.w2, routed.rows, out, a_rows=ROWS_SORTED, c_rows=ROWS_ASSIGNMENT,
                 epi=epilogue(bias=w.b2, scale=routed.scale, scale_mode=down_mode))
    return out if topk == 1 else combine(out, routed.topk_ids, num_experts or w.w1.shape[0])


def experts_forward_call(call: ExpertsCall) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused experts forward of a call with stacked weights, or per-expert ones read through their tables
    (kernels/weight_table.py; see the module docstring for shapes and modes).

    Returns:
        y (T, H); pre (T*k, I or 2I), the raw up-projection results kept for backward (empty unless
        ``call.save_pre``); and the routing metadata order, sorted_expert, offsets (see ops/routing.py).
    """
    x, w = call.x, call.weights
    # the implementation, not the op: a nested op call would only add dispatch overhead here
    routed = prepare_routing(call.routing, w.w1.shape[0])
    M = routed.order.shape[0]
    w_up = grouped_mm_engine.grouped_mm_weights(x, w.w1, w.w1_up, w.w2, w.b1, w.b2, call.weight_position,
                                                routed.dropped, M)
    if w_up is not None:  # the compute-bound regime: torch._grouped_mm runs the GEMMs
        y, pre = grouped_mm_engine.forward(x, routed, w_up, w.w2, call.activation, (w.b1, w.b1_up, w.b2),
                                           grouped_mm_engine.is_interleaved(w_up, w.w1), call.save_pre)
        return y, pre, routed.order, routed.sorted_expert, routed.offsets
    n_pre = w.w1.shape[2] * (2 if w.w1_up is not None else 1)
    # rows of dropped assignments are never written by the kernel: zero them so the output is fully defined
    alloc = x.new_zeros if routed.dropped else x.new_empty
    pre = alloc(M, n_pre) if call.save_pre else x.new_empty(0)
    forward = _forward_gemms if use_triton(x) else cpu_path.forward_sorted
    y = forward(call, routed, pre if call.save_pre else None)
    return y, pre, routed.order, routed.sorted_expert, routed.offsets


def experts_forward_impl(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w1_up: Optional[Tensor],
    w2: Tensor,
    b1: Optional[Tensor],
    b1_up: Optional[Tensor],
    b2: Optional[Tensor],
    activation: str,
    weight_position: str,
    alpha: float,
    limit: float,
    capacity: Optional[int],
    save_pre: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The body of the op, under its typed signature (the op's schema; ``ops.call.op_call`` builds these
    arguments): ``experts_forward_call`` of the call they describe."""
    return experts_forward_call(from_op_args((x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation,
                                              weight_position, alpha, limit, capacity, save_pre)))


# The op is the implementation itself, registered under its typed signature (the eager entry point calls the plain
# function when no graph or autograd needs the op).
experts_forward = torch.library.custom_op("moe_inductor::experts_forward", mutates_args=())(experts_forward_impl)


@experts_forward.register_fake
def _(*args):
    call = from_op_args(args)
    x, topk_ids, w1 = call.x, call.routing.topk_ids, call.weights.w1
    M = topk_ids.shape[0] * topk_ids.shape[1]
    E = w1.shape[0]
    n_pre = w1.shape[2] * (2 if call.weights.w1_up is not None else 1)
    pre = x.new_empty(M, n_pre) if call.save_pre else x.new_empty(0)
    ids = topk_ids.new_empty(M, dtype=torch.int32)
    return x.new_empty(x.shape), pre, ids, torch.empty_like(ids), topk_ids.new_empty(E + 1, dtype=torch.int32)


def _setup_context(ctx, inputs, output):
    call = from_op_args(inputs)
    (x, (topk_ids, topk_weights, capacity), (w1, w1_up, w2, b1, b1_up, b2, _)) = call.x, call.routing, call.weights
    _, pre, order, sorted_expert, offsets = output
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets)
    ctx.options = (*call.activation, call.weight_position, capacity is not None)
    # one input, one gradient: (E, H, 2I) halves or (E, H, I, 2) pairs
    ctx.gate_up_whole = gate_up_whole(inputs[3], inputs[4], call.activation.name)
    ctx.gate_up_pairs = gate_up_pairs(inputs[3], inputs[4], call.activation.name)


def _autograd_backward(ctx, dy, _dpre, _dorder, _dsorted, _doffsets):
    return backward_through(ctx, dy)


def backward_through(ctx, dy, pick: Optional[Callable] = None) -> tuple:
    """The gradients of an ``experts_forward``-schema op from its saved context, through the backward's two ops:
    ``experts_backward_middle`` and ``experts_backward_up``, or the pair ``pick(x, w2, biased, order)`` returns
    (lowerings/visible_backward.py picks Inductor-visible ones where it can trace them)."""
    x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets = ctx.saved_tensors
    middle_op, up_op = (experts_backward_middle, experts_backward_up) if pick is None else pick(
        x, w2, any(b is not None for b in (b1, b1_up, b2)), order)
    activation, alpha, limit, weight_position, dropped = ctx.options
    ni = ctx.needs_input_grad
    pairs = ctx.gate_up_pairs
    whole = ctx.gate_up_whole or pairs
    needs = Needs(ni[0], ni[2], ni[3], (ni[3] if whole else ni[4]) and w1_up is not None, ni[5],
                  ni[6] and b1 is not None, ni[7] and b1_up is not None, ni[8] and b2 is not None)
    if dy is None:
        dy = torch.zeros_like(x)
    one_tensor = whole or _gate_up_is_one_tensor(w1, w1_up)
    needs = needs._replace(combined_gate_up=needs.w1 and needs.w1_up and one_tensor,
                           gate_up_pairs=pairs and needs.w1 and needs.w1_up)
    # Two ops, not one: the compiled backward frees ``pre`` between them (ops/backward.py)
    shared = (x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2)
    options = (order, sorted_expert, offsets, activation, weight_position, alpha, limit, dropped, list(needs))
    d_pre, d_scale, dw2, db1, db1_up, db2 = middle_op(dy.contiguous(), *shared, pre, *options)
    dx, dtw, dw1, dw1_up = up_op(d_pre, d_scale, *shared, *options)
    grads = (dx, dtw, dw1, dw1_up, dw2, db1, db1_up, db2)
    dx, dtw, dw1, dw1_up, dw2, db1, db1_up, db2 = (g if need else None for g, need in zip(grads, needs))
    if whole:  # the gate/up weight came as one input: its gradient is the combined one
        dw1_up = None
    elif needs.combined_gate_up:  # two views of one gradient: ops.fused_experts hands it to the parameter uncopied
        I = w1.shape[2]
        dw1, dw1_up = dw1[:, :, :I], dw1[:, :, I:]
    return dx, None, dtw, dw1, dw1_up, dw2, db1, db1_up, db2, None, None, None, None, None, None


experts_forward.register_autograd(_autograd_backward, setup_context=_setup_context)

#: the autograd of ``experts_forward`` as (backward, setup_context), for ops with its schema (lowerings/visible.py)
EXPERTS_AUTOGRAD = (_autograd_backward, _setup_context)


def to_kn(w: Tensor, layout: str) -> Tensor:
    """A weight (or a stack of them) as (.., in, out), the op's (E, K, N), from its ``layout``: "kn" is that already,
    "nk" (out, in, as nn.Linear stores it) is transposed; a view either way."""
    if layout == "kn":
        return w
    if layout == "nk":
        return w.transpose(-1, -2)
    raise ValueError(f"layout={layout!r}; choose 'nk' (E, out, in), as nn.Linear stores it, or 'kn' (E, in, out)")
