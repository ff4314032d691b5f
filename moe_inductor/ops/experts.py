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
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..kernels.launch import interleaved_pairs
from . import cpu_path, grouped_mm_engine
from .activations import NO_ACTIVATION, Activation, activation_backward, apply_activation
from .call import ExpertsCall, ExpertWeights, Routing, from_op_args, gate_up_pairs, gate_up_whole
from .grouped import (
    ROWS_ASSIGNMENT,
    ROWS_SORTED,
    ROWS_TOKEN,
    SCALE_ACC,
    SCALE_NONE,
    SCALE_OUT,
    Routed,
    backward_middle,
    combine,
    down_bias_scale_grad,
    epilogue,
    gate_up_bias_grads,
    grouped_gemm,
    grouped_weight_grad,
    is_dense_transpose,
    sum_rows_by_expert,
    use_triton,
)
from .routing import prepare_routing


class Needs(NamedTuple):
    """Which gradients ``experts_backward`` makes (its ``needs`` list, by name); ``combined_gate_up`` asks for the
    gate and up gradients as one (E, H, 2I) tensor in the w1 slot (gate and up being the halves of one tensor,
    ``_gate_up_is_one_tensor``), so that nothing has to stitch them together afterwards; with ``gate_up_pairs``
    that tensor is (E, H, I, 2), the gradient of an interleaved weight's ``pairs_view`` (gate and up being its
    even and odd columns)."""

    x: bool
    topk_weights: bool
    w1: bool
    w1_up: bool
    w2: bool
    b1: bool
    b1_up: bool
    b2: bool
    combined_gate_up: bool = False
    gate_up_pairs: bool = False


def _grad_buffer(w: Tensor) -> Tensor:
    """An empty gradient for ``w`` laid out like it where it is dense (a transposed view stays transposed)."""
    if is_dense_transpose(w):
        return w.new_empty(w.shape[0], w.shape[2], w.shape[1]).transpose(1, 2)
    return w.new_empty(w.shape)


def _combined_grad_buffer(w1: Tensor) -> Tensor:
    """An empty (E, H, 2I) gradient for a gate/up pair held as one tensor, laid out as such a tensor is: the transpose
    of a dense (E, 2I, H) when ``w1`` is column-major (nn.Linear style), dense (E, H, 2I) otherwise."""
    E, H, I = w1.shape
    if w1.stride(1) == 1:
        return w1.new_empty(E, 2 * I, H).transpose(1, 2)
    return w1.new_empty(E, H, 2 * I)


def _pairs_grad_buffer(w1: Tensor) -> Tensor:
    """An empty (E, H, I, 2) gradient for an interleaved gate/up pair whose gate is ``w1`` (E, H, I), laid out as
    the whole weight's ``pairs_view`` is: of a dense (E, 2I, H) when ``w1`` is column-major, of (E, H, 2I) else."""
    E, H, I = w1.shape
    if w1.stride(1) == 1:
        return w1.new_empty(E, I, 2, H).permute(0, 3, 1, 2)
    return w1.new_empty(E, H, I, 2)


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


def _forward_gemms(call: ExpertsCall, routed: Routed, pre: Optional[Tensor]) -> Tensor:
    """The forward on the Triton kernels: two grouped GEMMs and the combine."""
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
    return out if topk == 1 else combine(out, routed.topk_ids, w.w1.shape[0])


def experts_forward_call(call: ExpertsCall) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused experts forward of a call with stacked weights (see the module docstring for shapes and modes).

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


@torch.library.custom_op("moe_inductor::experts_backward", mutates_args=())
def experts_backward(
    dy: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w1_up: Optional[Tensor],
    w2: Tensor,
    b1: Optional[Tensor],
    b1_up: Optional[Tensor],
    b2: Optional[Tensor],
    pre: Tensor,
    order: Tensor,
    sorted_expert: Tensor,
    offsets: Tensor,
    activation: str,
    weight_position: str,
    alpha: float,
    limit: float,
    dropped: bool,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``experts_forward``.

    Args:
        needs: which of (x, topk_weights, w1, w1_up, w2, b1, b1_up, b2) want a gradient, and an optional ninth flag
            (``Needs``' fields, in order).
    Returns:
        dx, d_topk_weights, dw1, dw1_up, dw2, db1, db1_up, db2; an empty tensor where none is wanted.
    """
    call = ExpertsCall(x, Routing(topk_ids, topk_weights), ExpertWeights(w1, w1_up, w2, b1, b1_up, b2),
                       Activation(activation, alpha, limit), weight_position)
    routed = Routed(topk_ids, topk_weights.contiguous().view(-1), order, sorted_expert, offsets, w1.shape[0], dropped)
    return _backward(dy, call, routed, pre, Needs(*needs))


class _SortedRows(NamedTuple):
    """Per sorted row: its expert (E past the experts), that expert clamped into range, whether it is one, its
    routing weight (zero past the experts), its token."""

    expert: Tensor
    expert_c: Tensor
    valid: Tensor
    s_sorted: Tensor
    token: Tensor


class _MiddleGrads(NamedTuple):
    """What the middle of the backward gives the rest: the gradients of the raw up projections (in x's dtype), of
    each sorted row's routing weight, and of the down weights and the biases (None where not made)."""

    d_gate: Tensor
    d_up: Optional[Tensor]
    d_scale_sorted: Optional[Tensor]
    dw2: Optional[Tensor]
    db2: Optional[Tensor]
    db1: Optional[Tensor]
    db1_up: Optional[Tensor]
    d_pairs: Optional[Tensor] = None  # (M, 2I): d_gate and d_up are its even and odd columns


def _backward(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, needs: Needs) -> tuple:
    x, w = call.x, call.weights
    M = routed.order.shape[0]
    w_up = grouped_mm_engine.grouped_mm_weights(x, w.w1, w.w1_up, w.w2, w.b1, w.b2, call.weight_position,
                                                routed.dropped, M, backward=True)
    if w_up is not None:  # the compute-bound regime, as in the forward
        return grouped_mm_engine.backward(dy, call, routed, w_up, pre, needs)
    E, _, I = w.w1.shape
    gated = w.w1_up is not None
    f32 = torch.float32
    expert = routed.sorted_expert.long()
    valid = expert < E
    order_l = routed.order.long()
    rows = _SortedRows(expert, expert.clamp(max=E - 1), valid,
                       torch.where(valid, routed.scale[order_l].to(f32), 0.0)[:, None], order_l // routed.topk)

    if pre.shape[0] != M:  # the forward did not keep it: recompute the raw up projection
        pre = x.new_empty(M, I * (2 if gated else 1))
        tmp = x.new_empty(M, I)
        grouped_gemm(x, w.w1, routed.rows, tmp, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED,
                     epi=epilogue(call.activation if gated else NO_ACTIVATION, b2=w.w1_up, pre=pre))
    if call.weight_position == "output" and use_triton(x):
        mid = _backward_middle_fused(dy, call, routed, pre, rows, needs)
    else:
        mid = _backward_middle_torch(dy, call, routed, pre, rows, needs)
    return _backward_through_up(call, routed, valid, mid, needs)


def _backward_middle_fused(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, rows: _SortedRows,
                           needs: Needs) -> _MiddleGrads:
    """The middle of the backward for the common case, fused: one pass over (M, I) instead of ~20
    (kernels/backward_middle.py)."""
    x, w = call.x, call.weights
    M = routed.order.shape[0]
    E, _, I = w.w1.shape
    f32 = torch.float32
    g = torch.empty(M, I, dtype=f32, device=x.device)
    grouped_gemm(dy, w.w2.transpose(1, 2), routed.rows, g, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED)
    # an interleaved weight's gradients are written as its (gate, up) column pairs: dx's GEMM and the whole weight's
    # gradient read them so, with no stack of the two afterwards
    d_pairs = x.new_empty(M, 2 * I) if needs.gate_up_pairs and interleaved_pairs(w.w1, w.w1_up) is not None else None
    h, d_gate, d_up, d_scale_sorted = backward_middle(
        pre, g, routed.sorted, (w.b1, w.b1_up), call.activation, x.dtype,
        out=(d_pairs[:, 0::2], d_pairs[:, 1::2]) if d_pairs is not None else None)
    del g
    if w.b2 is not None and needs.topk_weights:  # only the routing weights' gradient reads d_scale
        d_scale_sorted = d_scale_sorted + down_bias_scale_grad(dy, w.b2, rows.token, rows.expert_c)
    dw2 = db2 = db1 = db1_up = None
    if needs.w2:
        dw2 = grouped_weight_grad(h, dy, routed.rows, _grad_buffer(w.w2), a_rows=ROWS_SORTED, g_rows=ROWS_TOKEN,
                                  scale=routed.scale)
    del h
    if w.b2 is not None and needs.b2:
        db2 = sum_rows_by_expert(dy, routed, ROWS_TOKEN, w.b2.dtype, scale=routed.scale)
    db1, db1_up = gate_up_bias_grads(d_gate, d_up, d_pairs, routed,
                                     (w.b1 if needs.b1 else None, w.b1_up if needs.b1_up else None))
    return _MiddleGrads(d_gate, d_up, d_scale_sorted, dw2, db2, db1, db1_up, d_pairs)


def _sum_by_expert(rows: Tensor, expert: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """(E, width) sums of the sorted ``rows`` per expert, in fp32, cast to ``dtype`` (a bias gradient). Rows past
    the experts (expert id E, dropped) land in a spare row that is cut off."""
    sums = torch.zeros(num_experts + 1, rows.shape[1], dtype=torch.float32, device=rows.device)
    return sums.index_add_(0, expert, rows.to(torch.float32))[:num_experts].to(dtype)


def _backward_middle_torch(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, rows: _SortedRows,
                           needs: Needs) -> _MiddleGrads:
    """The middle of the backward in plain torch (the CPU path, and the weight positions "between" and "input")."""
    x, w, act, weight_position = call.x, call.weights, call.activation, call.weight_position
    b1, b1_up, b2 = w.b1, w.b1_up, w.b2
    expert, expert_c, valid, s_sorted, token = rows
    gated = w.w1_up is not None
    M = routed.order.shape[0]
    E, I, H = w.w2.shape
    f32 = torch.float32
    # The elementwise middle runs in fp32 on (M, I) tensors; each one is released (or reused in place) as soon as it
    # is dead, which keeps the backward's transient memory to a few of them.
    u_gate = pre[:, :I].to(f32)
    u_up = pre[:, I:].to(f32) if gated else None
    p_gate, p_up = u_gate, u_up
    if weight_position == "input":
        p_gate = p_gate * s_sorted
        p_up = p_up * s_sorted if gated else None
    if b1 is not None:
        p_gate = p_gate + b1[expert_c].to(f32)
        if gated:
            p_up = p_up + b1_up[expert_c].to(f32)
    if weight_position != "input":  # only the "input" position reads the raw projections again (d_scale)
        del u_gate, u_up
    h_act = apply_activation(act.name, p_gate, p_up, act.alpha, act.limit)
    h = h_act * s_sorted if weight_position == "between" else h_act

    # g = dy[token] @ w2^T: the gradient of h before any routing-weight scaling
    g = torch.empty(M, I, dtype=f32, device=x.device)
    grouped_gemm(dy, w.w2.transpose(1, 2), routed.rows, g, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED)
    g.masked_fill_(~valid[:, None], 0.0)

    d_scale_sorted = None
    if weight_position == "output":
        d_scale_sorted = (h * g).sum(-1)
        if b2 is not None:
            d_scale_sorted = d_scale_sorted + down_bias_scale_grad(dy, b2, token, expert_c)
    elif weight_position == "between":
        d_scale_sorted = (h_act * g).sum(-1)
    del h_act
    dact = g.mul_(s_sorted) if weight_position in ("output", "between") else g  # g itself is dead after this
    del g

    dw2 = db2 = None
    if needs.w2:
        dw2 = grouped_weight_grad(h.to(x.dtype), dy, routed.rows, _grad_buffer(w.w2), a_rows=ROWS_SORTED,
                                  g_rows=ROWS_TOKEN, scale=routed.scale if weight_position == "output" else None)
    del h
    if b2 is not None and needs.b2:
        scaled = dy[token].to(f32) * (s_sorted if weight_position == "output" else valid[:, None].to(f32))
        db2 = _sum_by_expert(scaled, expert, E, b2.dtype)

    d_gate, d_up = activation_backward(act.name, p_gate, p_up, dact, act.alpha, act.limit)
    del dact, p_gate, p_up
    d_gate = d_gate.masked_fill(~valid[:, None], 0.0)
    d_up = d_up.masked_fill(~valid[:, None], 0.0) if gated else None
    db1 = db1_up = None
    if b1 is not None and needs.b1:
        db1 = _sum_by_expert(d_gate, expert, E, b1.dtype)
    if b1_up is not None and needs.b1_up:
        db1_up = _sum_by_expert(d_up, expert, E, b1_up.dtype)
    if weight_position == "input":
        d_scale_sorted = (d_gate * u_gate).sum(-1) + ((d_up * u_up).sum(-1) if gated else 0.0)
        del u_gate, u_up
        d_gate = d_gate * s_sorted
        d_up = d_up * s_sorted if gated else None
    d_gate = d_gate.to(x.dtype)
    d_up = d_up.to(x.dtype) if gated else None
    return _MiddleGrads(d_gate, d_up, d_scale_sorted, dw2, db2, db1, db1_up)


def _backward_through_up(call: ExpertsCall, routed: Routed, valid: Tensor, mid: _MiddleGrads, needs: Needs) -> tuple:
    """The rest of the backward, from the gradients of the raw up projections: dW1, dx and d(routing weights)."""
    x, w = call.x, call.weights
    w1, w1_up = w.w1, w.w1_up
    d_gate, d_up = mid.d_gate, mid.d_up
    T, H = x.shape
    M = routed.order.shape[0]
    topk = routed.topk
    rows = routed.rows
    gated = w1_up is not None
    f32 = torch.float32
    dw1 = dw1_up = None
    # an interleaved pair's gradients as the columns of one (M, 2I) tensor, as the weight holds them (the fused
    # middle writes them so)
    d_pairs = mid.d_pairs
    if needs.combined_gate_up and needs.gate_up_pairs:  # one GEMM for the whole interleaved weight
        if d_pairs is None:
            d_pairs = torch.stack((d_gate, d_up), -1).view(M, 2 * w1.shape[2])
        dw1 = _pairs_grad_buffer(w1)
        grouped_weight_grad(x, d_pairs, rows, dw1.flatten(2), a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
    elif needs.combined_gate_up:  # one (E, H, 2I) gradient for the gate/up pair, written as its two halves
        I = w1.shape[2]
        dw1 = _combined_grad_buffer(w1)
        grouped_weight_grad(x, d_gate, rows, dw1[:, :, :I], a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
        grouped_weight_grad(x, d_up, rows, dw1[:, :, I:], a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
    elif needs.w1:
        dw1 = grouped_weight_grad(x, d_gate, rows, _grad_buffer(w1), a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
    if gated and needs.w1_up and not needs.combined_gate_up:
        dw1_up = grouped_weight_grad(x, d_up, rows, _grad_buffer(w1_up), a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
    dx = None
    if needs.x:
        dx_rows = x.new_zeros(M, H) if routed.dropped or topk == 1 else x.new_empty(M, H)  # k = 1: the rows are dx
        pairs = interleaved_pairs(w1, w1_up) if gated else None
        if pairs is not None:  # one GEMM over the whole weight, read along its contiguous 2I axis
            if d_pairs is None:
                d_pairs = torch.stack((d_gate, d_up), -1).view(M, 2 * w1.shape[2])
            grouped_gemm(d_pairs, pairs.transpose(1, 2), rows, dx_rows, a_rows=ROWS_SORTED, c_rows=ROWS_ASSIGNMENT)
        else:
            grouped_gemm(d_gate, w1.transpose(1, 2), rows, dx_rows, a_rows=ROWS_SORTED, c_rows=ROWS_ASSIGNMENT)
        if gated and pairs is None:
            grouped_gemm(d_up, w1_up.transpose(1, 2), rows, dx_rows, a_rows=ROWS_SORTED, c_rows=ROWS_ASSIGNMENT,
                         epi=epilogue(accumulate=True))
        dx = dx_rows if topk == 1 else combine(dx_rows, routed.topk_ids, routed.num_experts)
    d_weights = None
    topk_weights = call.routing.topk_weights
    if needs.topk_weights and mid.d_scale_sorted is not None:
        d_flat = torch.zeros(M, dtype=f32, device=x.device).index_put_(
            (routed.order.long(),), torch.where(valid, mid.d_scale_sorted, 0.0))
        d_weights = d_flat.view(T, topk).to(topk_weights.dtype)
    elif needs.topk_weights:
        d_weights = torch.zeros_like(topk_weights)
    # absent gradients come back as distinct empty tensors: outputs of a custom op may not alias each other
    grads = (dx, d_weights, dw1, dw1_up, mid.dw2, mid.db1, mid.db1_up, mid.db2)
    return tuple(t if t is not None else x.new_empty(0) for t in grads)


@experts_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, alpha, limit, dropped, needs):
    def maybe(flag, t, like):
        return like(t) if (flag and t is not None) else x.new_empty(0)

    need = Needs(*needs)
    return (
        maybe(need.x, x, torch.empty_like),
        maybe(need.topk_weights, topk_weights, torch.empty_like),
        maybe(need.w1, w1, (_pairs_grad_buffer if need.gate_up_pairs else _combined_grad_buffer)
              if need.combined_gate_up else _grad_buffer),
        maybe(need.w1_up and not need.combined_gate_up, w1_up, _grad_buffer),
        maybe(need.w2, w2, _grad_buffer),
        maybe(need.b1, b1, torch.empty_like),
        maybe(need.b1_up, b1_up, torch.empty_like),
        maybe(need.b2, b2, torch.empty_like),
    )


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
    x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets = ctx.saved_tensors
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
    grads = experts_backward(dy.contiguous(), x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order,
                             sorted_expert, offsets, activation, weight_position, alpha, limit, dropped, list(needs))
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
