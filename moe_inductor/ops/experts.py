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

from typing import Optional

import torch
from torch import Tensor

from .activations import activation_backward, apply_activation, check_activation, is_gated
from .grouped import (
    ROWS_ASSIGNMENT,
    use_triton,
    ROWS_SORTED,
    ROWS_TOKEN,
    SCALE_ACC,
    SCALE_NONE,
    SCALE_OUT,
    backward_middle,
    combine,
    grouped_gemm,
    grouped_weight_grad,
    is_dense_transpose,
    project_reference,
)
from ..kernels.launch import interleaved_pairs
from . import grouped_mm_engine
from .routing import route_metadata

WEIGHT_POSITIONS = ("output", "between", "input")


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


def _wants_combined_gate_up(needs: list[bool]) -> bool:
    """The optional ninth ``needs`` flag of ``experts_backward``."""
    return len(needs) > 8 and needs[8]


def _gate_up_is_one_tensor(w1: Tensor, w1_up: Optional[Tensor]) -> bool:
    """Whether gate and up are the two halves of one real tensor (never true for fake or functional tensors: under
    tracing the halves' gradients stay separate and the compiler handles the slices)."""
    if w1_up is None or type(w1) is not torch.Tensor or type(w1_up) is not torch.Tensor or w1.is_meta:
        return False
    return grouped_mm_engine.combined_up_weights(w1, w1_up) is not None


def _forward_gemms(x, topk_ids, scale_flat, order, offsets, topk, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position,
                   alpha, limit, pre, dropped: bool) -> Tensor:
    T, H = x.shape
    M = order.shape[0]
    h = x.new_empty(M, w1.shape[2])
    grouped_gemm(
        x, w1, offsets, order, topk, h, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED, b2=w1_up, bias=b1, bias2=b1_up,
        scale=scale_flat, scale_mode={"input": SCALE_ACC, "between": SCALE_OUT}.get(weight_position, SCALE_NONE),
        activation=activation, alpha=alpha, limit=limit, pre=pre,
    )
    # Dropped assignments (capacity) are never written by the kernel, so their rows must start at zero. With one
    # choice per token the assignment rows are the token rows: the GEMM writes y itself, and no combine is needed
    # (rows it never writes, dropped or of an out-of-range id, stay zero as the combine would leave them).
    out = x.new_zeros(M, H) if dropped or topk == 1 else x.new_empty(M, H)
    grouped_gemm(
        h, w2, offsets, order, topk, out, a_rows=ROWS_SORTED, c_rows=ROWS_ASSIGNMENT, bias=b2, scale=scale_flat,
        scale_mode=SCALE_OUT if weight_position == "output" else SCALE_NONE,
    )
    return out if topk == 1 else combine(out, topk_ids, w1.shape[0])


def _forward_padded(x, topk_ids, scale_flat, order, offsets, topk, w1, w1_up, w2, b1, b1_up, b2, activation,
                    weight_position, alpha, limit, pre, counts: Tensor, widest: int) -> Tensor:
    """The CPU forward for balanced routing: every expert's rows padded to the widest expert's count, then each
    projection is one batched matmul over the experts. A dozen torch calls whatever E is, where the per-expert loop
    makes a dozen per expert; at the small sizes CPU users run, those calls are most of the time. The padding rows
    are zeros and never leave their buffers."""
    T, H = x.shape
    E = w1.shape[0]
    kept = int(offsets[-1])  # CPU only; rows past it were dropped (capacity) or had ids outside [0, E)
    assignment = order[:kept].long()
    expert = torch.repeat_interleave(torch.arange(E), counts)
    slot = torch.arange(kept) - offsets[:-1].long()[expert]
    token = assignment // topk
    rows = x.new_zeros(E, widest, H)
    rows[expert, slot] = x[token]
    s = scale_flat.new_zeros(E, widest, 1)
    s[expert, slot, 0] = scale_flat[assignment]
    up_mode = {"input": SCALE_ACC, "between": SCALE_OUT}.get(weight_position, SCALE_NONE)
    down_mode = SCALE_OUT if weight_position == "output" else SCALE_NONE
    padded_pre = x.new_zeros(E, widest, pre.shape[1]) if pre is not None else None
    h = project_reference(rows, w1, w1_up, b1[:, None] if b1 is not None else None,
                          b1_up[:, None] if b1_up is not None else None, s, up_mode, activation, alpha, limit,
                          padded_pre)
    if pre is not None:
        pre[:kept] = padded_pre[expert, slot]
    o = project_reference(h.to(x.dtype), w2, None, b2[:, None] if b2 is not None else None, None, s, down_mode,
                          "none", alpha, limit)
    acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = torch.zeros(T, H, dtype=acc_dtype)
    return y.index_add_(0, token, o[expert, slot].to(acc_dtype)).to(x.dtype)


def _forward_per_expert(x, topk_ids, scale_flat, order, offsets, topk, w1, w1_up, w2, b1, b1_up, b2, activation,
                        weight_position, alpha, limit, pre) -> Tensor:
    """The CPU forward: plain torch, one expert at a time, each expert's rows added straight into y.

    The same arithmetic as the two grouped GEMMs + combine (see ``grouped_gemm_reference``), without their (T*k, I)
    and (T*k, H) buffers, whose fresh pages cost more than the work at small sizes. Sums run in fp32 for 16-bit x.
    """
    counts = offsets.diff()
    widest = int(counts.max()) if counts.numel() else 0  # CPU only
    if 0 < widest * w1.shape[0] <= 2 * order.shape[0]:  # balanced enough that padding at most doubles the rows
        return _forward_padded(x, topk_ids, scale_flat, order, offsets, topk, w1, w1_up, w2, b1, b1_up, b2,
                               activation, weight_position, alpha, limit, pre, counts, widest)
    T, H = x.shape
    acc_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
    bounds = offsets.tolist()  # CPU only
    order_l = order.long()
    up_mode = {"input": SCALE_ACC, "between": SCALE_OUT}.get(weight_position, SCALE_NONE)
    down_mode = SCALE_OUT if weight_position == "output" else SCALE_NONE
    for e in range(w1.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        assignment = order_l[lo:hi]
        token = assignment // topk
        s = scale_flat[assignment][:, None]
        h = project_reference(x[token], w1[e], w1_up[e] if w1_up is not None else None,
                              b1[e] if b1 is not None else None, b1_up[e] if b1_up is not None else None,
                              s, up_mode, activation, alpha, limit, pre[lo:hi] if pre is not None else None)
        o = project_reference(h.to(x.dtype), w2[e], None, b2[e] if b2 is not None else None, None, s, down_mode,
                              "none", alpha, limit)
        y.index_add_(0, token, o.to(acc_dtype))
    return y.to(x.dtype)


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
    """The fused experts forward (see the module docstring for shapes and modes); the body of the op.

    Returns:
        y (T, H); pre (T*k, I or 2I), the raw up-projection results kept for backward (empty unless ``save_pre``);
        and the routing metadata order, sorted_expert, offsets (see ops/routing.py).
    """
    topk = topk_ids.shape[1]
    # the implementation, not the op: a nested op call would only add dispatch overhead here
    order, sorted_expert, offsets = route_metadata(topk_ids, w1.shape[0], capacity)
    scale_flat = topk_weights.contiguous().view(-1)
    w_up = grouped_mm_engine.grouped_mm_weights(x, w1, w1_up, w2, b1, b2, weight_position, capacity is not None,
                                                order.shape[0])
    if w_up is not None:  # the compute-bound regime: torch._grouped_mm runs the GEMMs
        y, pre_full = grouped_mm_engine.forward(x, topk_ids, scale_flat, order, offsets, w_up, w2, activation, alpha,
                                                limit)
        return y, pre_full if save_pre else x.new_empty(0), order, sorted_expert, offsets
    n_pre = w1.shape[2] * (2 if w1_up is not None else 1)
    # rows of dropped assignments are never written by the kernel: zero them so the output is fully defined
    alloc = x.new_zeros if capacity is not None else x.new_empty
    pre = alloc(order.shape[0], n_pre) if save_pre else x.new_empty(0)
    args = (x, topk_ids, scale_flat, order, offsets, topk, w1, w1_up, w2, b1, b1_up, b2,
            activation, weight_position, alpha, limit, pre if save_pre else None)
    if use_triton(x):
        y = _forward_gemms(*args, dropped=capacity is not None)
    else:
        y = _forward_per_expert(*args)
    return y, pre, order, sorted_expert, offsets


# The op is the implementation itself, registered under its typed signature (the eager entry point calls the plain
# function when no graph or autograd needs the op).
experts_forward = torch.library.custom_op("moe_inductor::experts_forward", mutates_args=())(experts_forward_impl)


@experts_forward.register_fake
def _(x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position, alpha, limit, capacity,
      save_pre):
    M = topk_ids.shape[0] * topk_ids.shape[1]
    E = w1.shape[0]
    n_pre = w1.shape[2] * (2 if w1_up is not None else 1)
    pre = x.new_empty(M, n_pre) if save_pre else x.new_empty(0)
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
        needs: which of (x, topk_weights, w1, w1_up, w2, b1, b1_up, b2) want a gradient; an optional ninth flag asks
            for the gate and up gradients as one (E, H, 2I) tensor in the dw1 slot (gate and up being the halves of
            one tensor, ``_gate_up_is_one_tensor``), so that nothing has to stitch them together afterwards.
    Returns:
        dx, d_topk_weights, dw1, dw1_up, dw2, db1, db1_up, db2; an empty tensor where none is wanted.
    """
    topk = topk_weights.shape[1]
    M = order.shape[0]
    w_up = grouped_mm_engine.grouped_mm_weights(x, w1, w1_up, w2, b1, b2, weight_position, dropped, M, backward=True)
    if w_up is not None:  # the compute-bound regime, as in the forward
        return grouped_mm_engine.backward(dy, x, topk_ids, topk_weights, w1, w1_up, w_up, w2, pre, order,
                                          sorted_expert, offsets, activation, alpha, limit, needs,
                                          _wants_combined_gate_up(needs))
    E, _, I = w1.shape
    gated = w1_up is not None
    f32 = torch.float32
    scale = topk_weights.contiguous().view(-1)
    expert = sorted_expert.long()
    valid = expert < E
    expert_c = expert.clamp(max=E - 1)
    s_sorted = torch.where(valid, scale[order.long()].to(f32), 0.0)[:, None]
    token = (order.long() // topk)

    if pre.shape[0] != M:  # the forward did not keep it: recompute the raw up projection
        pre = x.new_empty(M, I * (2 if gated else 1))
        tmp = x.new_empty(M, I)
        grouped_gemm(x, w1, offsets, order, topk, tmp, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED, b2=w1_up, pre=pre,
                     activation="none" if not gated else activation, alpha=alpha, limit=limit)
    if weight_position == "output" and use_triton(x):
        # the common case, fused: one pass over (M, I) instead of ~20 (kernels/backward_middle.py)
        g = torch.empty(M, I, dtype=f32, device=x.device)
        grouped_gemm(dy, w2.transpose(1, 2), offsets, order, topk, g, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED)
        h, d_gate, d_up, d_scale_sorted = backward_middle(pre, g, scale, order, sorted_expert, b1, b1_up, activation,
                                                           alpha, limit, E, x.dtype)
        del g
        if b2 is not None:
            d_scale_sorted = d_scale_sorted + (dy[token].to(f32) * b2[expert_c].to(f32)).sum(-1)
        dw2 = db2 = db1 = db1_up = None
        if needs[4]:
            dw2 = grouped_weight_grad(h, dy, offsets, order, topk, _grad_buffer(w2), a_rows=ROWS_SORTED,
                                      g_rows=ROWS_TOKEN, scale=scale)
        del h
        if b2 is not None and needs[7]:
            rows = dy[token].to(f32) * s_sorted
            db2 = _sum_by_expert(rows, expert, E, b2.dtype)
        if b1 is not None and needs[5]:
            db1 = _sum_by_expert(d_gate, expert, E, b1.dtype)
        if b1_up is not None and needs[6]:
            db1_up = _sum_by_expert(d_up, expert, E, b1_up.dtype)
    else:
        d_gate, d_up, d_scale_sorted, dw2, db2, db1, db1_up = _backward_middle_torch(
            dy, x, pre, w2, b1, b1_up, b2, scale, order, offsets, topk, expert, expert_c, valid, s_sorted, token,
            gated, activation, weight_position, alpha, limit, needs)
    return _backward_through_up(x, topk_ids, topk_weights, w1, w1_up, order, offsets, topk, valid, d_gate, d_up,
                                d_scale_sorted, dw2, db2, db1, db1_up, dropped, needs)


def _sum_by_expert(rows: Tensor, expert: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """(E, width) sums of the sorted ``rows`` per expert, in fp32, cast to ``dtype`` (a bias gradient). Rows past
    the experts (expert id E, dropped) land in a spare row that is cut off."""
    sums = torch.zeros(num_experts + 1, rows.shape[1], dtype=torch.float32, device=rows.device)
    return sums.index_add_(0, expert, rows.to(torch.float32))[:num_experts].to(dtype)


def _backward_middle_torch(dy, x, pre, w2, b1, b1_up, b2, scale, order, offsets, topk, expert, expert_c, valid,
                           s_sorted, token, gated, activation, weight_position, alpha, limit, needs):
    """The middle of the backward in plain torch (the CPU path, and the weight positions "between" and "input"):
    returns d_gate, d_up (in x's dtype), d_scale_sorted, dw2, db2, db1, db1_up."""
    M = order.shape[0]
    E, I, H = w2.shape
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
    act = apply_activation(activation, p_gate, p_up, alpha, limit)
    h = act * s_sorted if weight_position == "between" else act

    # g = dy[token] @ w2^T: the gradient of h before any routing-weight scaling
    g = torch.empty(M, I, dtype=f32, device=x.device)
    grouped_gemm(dy, w2.transpose(1, 2), offsets, order, topk, g, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED)
    g.masked_fill_(~valid[:, None], 0.0)

    d_scale_sorted = None
    if weight_position == "output":
        d_scale_sorted = (h * g).sum(-1)
        if b2 is not None:
            d_scale_sorted = d_scale_sorted + (dy[token].to(f32) * b2[expert_c].to(f32)).sum(-1)
    elif weight_position == "between":
        d_scale_sorted = (act * g).sum(-1)
    del act
    dact = g.mul_(s_sorted) if weight_position in ("output", "between") else g  # g itself is dead after this
    del g

    dw2 = db2 = None
    if needs[4]:
        dw2 = grouped_weight_grad(h.to(x.dtype), dy, offsets, order, topk, _grad_buffer(w2), a_rows=ROWS_SORTED,
                                  g_rows=ROWS_TOKEN, scale=scale if weight_position == "output" else None)
    del h
    if b2 is not None and needs[7]:
        rows = dy[token].to(f32) * (s_sorted if weight_position == "output" else valid[:, None].to(f32))
        db2 = _sum_by_expert(rows, expert, E, b2.dtype)

    d_gate, d_up = activation_backward(activation, p_gate, p_up, dact, alpha, limit)
    del dact, p_gate, p_up
    d_gate = d_gate.masked_fill(~valid[:, None], 0.0)
    d_up = d_up.masked_fill(~valid[:, None], 0.0) if gated else None
    db1 = db1_up = None
    if b1 is not None and needs[5]:
        db1 = _sum_by_expert(d_gate, expert, E, b1.dtype)
    if b1_up is not None and needs[6]:
        db1_up = _sum_by_expert(d_up, expert, E, b1_up.dtype)
    if weight_position == "input":
        d_scale_sorted = (d_gate * u_gate).sum(-1) + ((d_up * u_up).sum(-1) if gated else 0.0)
        del u_gate, u_up
        d_gate = d_gate * s_sorted
        d_up = d_up * s_sorted if gated else None
    d_gate = d_gate.to(x.dtype)
    d_up = d_up.to(x.dtype) if gated else None
    return d_gate, d_up, d_scale_sorted, dw2, db2, db1, db1_up


def _backward_through_up(x, topk_ids, topk_weights, w1, w1_up, order, offsets, topk, valid, d_gate, d_up,
                         d_scale_sorted, dw2, db2, db1, db1_up, dropped, needs):
    """The rest of the backward, from the gradients of the raw up projections: dW1, dx and d(routing weights)."""
    T, H = x.shape
    M = order.shape[0]
    E = w1.shape[0]
    gated = w1_up is not None
    f32 = torch.float32
    dw1 = dw1_up = None
    if _wants_combined_gate_up(needs):  # one (E, H, 2I) gradient for the gate/up pair, written as its two halves
        I = w1.shape[2]
        dw1 = _combined_grad_buffer(w1)
        grouped_weight_grad(x, d_gate, offsets, order, topk, dw1[:, :, :I], a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
        grouped_weight_grad(x, d_up, offsets, order, topk, dw1[:, :, I:], a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
    elif needs[2]:
        dw1 = grouped_weight_grad(x, d_gate, offsets, order, topk, _grad_buffer(w1), a_rows=ROWS_TOKEN,
                                  g_rows=ROWS_SORTED)
    if gated and needs[3] and not _wants_combined_gate_up(needs):
        dw1_up = grouped_weight_grad(x, d_up, offsets, order, topk, _grad_buffer(w1_up), a_rows=ROWS_TOKEN,
                                     g_rows=ROWS_SORTED)
    dx = None
    if needs[0]:
        dx_rows = x.new_zeros(M, H) if dropped or topk == 1 else x.new_empty(M, H)  # k = 1: the rows are dx
        pairs = interleaved_pairs(w1, w1_up) if gated and use_triton(x) else None
        if pairs is not None:  # one GEMM over the whole weight, read along its contiguous 2I axis
            d_pairs = torch.stack((d_gate, d_up), -1).view(M, 2 * w1.shape[2])
            grouped_gemm(d_pairs, pairs.transpose(1, 2), offsets, order, topk, dx_rows, a_rows=ROWS_SORTED,
                         c_rows=ROWS_ASSIGNMENT)
        else:
            grouped_gemm(d_gate, w1.transpose(1, 2), offsets, order, topk, dx_rows, a_rows=ROWS_SORTED,
                         c_rows=ROWS_ASSIGNMENT)
        if gated and pairs is None:
            grouped_gemm(d_up, w1_up.transpose(1, 2), offsets, order, topk, dx_rows, a_rows=ROWS_SORTED,
                         c_rows=ROWS_ASSIGNMENT, accumulate=True)
        dx = dx_rows if topk == 1 else combine(dx_rows, topk_ids, E)
    d_weights = None
    if needs[1] and d_scale_sorted is not None:
        d_flat = torch.zeros(M, dtype=f32, device=x.device).index_put_((order.long(),), torch.where(valid, d_scale_sorted, 0.0))
        d_weights = d_flat.view(T, topk).to(topk_weights.dtype)
    elif needs[1]:
        d_weights = torch.zeros_like(topk_weights)
    # absent gradients come back as distinct empty tensors: outputs of a custom op may not alias each other
    return tuple(t if t is not None else x.new_empty(0) for t in (dx, d_weights, dw1, dw1_up, dw2, db1, db1_up, db2))


@experts_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, alpha, limit, dropped, needs):
    def maybe(flag, t, like):
        return like(t) if (flag and t is not None) else x.new_empty(0)

    combined = _wants_combined_gate_up(needs)
    return (
        maybe(needs[0], x, torch.empty_like),
        maybe(needs[1], topk_weights, torch.empty_like),
        maybe(needs[2], w1, _combined_grad_buffer if combined else _grad_buffer),
        maybe(needs[3] and not combined, w1_up, _grad_buffer),
        maybe(needs[4], w2, _grad_buffer),
        maybe(needs[5], b1, torch.empty_like),
        maybe(needs[6], b1_up, torch.empty_like),
        maybe(needs[7], b2, torch.empty_like),
    )


def _setup_context(ctx, inputs, output):
    (x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position, alpha, limit, capacity,
     save_pre) = inputs
    _, pre, order, sorted_expert, offsets = output
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets)
    ctx.options = (activation, weight_position, alpha, limit, capacity is not None)


def _backward(ctx, dy, _dpre, _dorder, _dsorted, _doffsets):
    x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets = ctx.saved_tensors
    activation, weight_position, alpha, limit, dropped = ctx.options
    ni = ctx.needs_input_grad
    needs = [ni[0], ni[2], ni[3], ni[4] and w1_up is not None, ni[5], ni[6] and b1 is not None,
             ni[7] and b1_up is not None, ni[8] and b2 is not None]
    if dy is None:
        dy = torch.zeros_like(x)
    combined = needs[2] and needs[3] and _gate_up_is_one_tensor(w1, w1_up)
    grads = experts_backward(dy.contiguous(), x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order,
                             sorted_expert, offsets, activation, weight_position, alpha, limit, dropped,
                             needs + [combined])
    dx, dtw, dw1, dw1_up, dw2, db1, db1_up, db2 = (g if need else None for g, need in zip(grads, needs))
    if combined:  # two views of one gradient: ops.fused_experts hands it to the parameter without a copy
        I = w1.shape[2]
        dw1, dw1_up = dw1[:, :, :I], dw1[:, :, I:]
    return dx, None, dtw, dw1, dw1_up, dw2, db1, db1_up, db2, None, None, None, None, None, None


experts_forward.register_autograd(_backward, setup_context=_setup_context)

#: the autograd of ``experts_forward`` as (backward, setup_context), for ops with its schema (lowerings/visible.py)
EXPERTS_AUTOGRAD = (_backward, _setup_context)


def to_kn(w: Tensor, layout: str) -> Tensor:
    """A weight (or a stack of them) as (.., in, out), the op's (E, K, N), from its ``layout``: "kn" is that already,
    "nk" (out, in, as nn.Linear stores it) is transposed; a view either way."""
    if layout == "kn":
        return w
    if layout == "nk":
        return w.transpose(-1, -2)
    raise ValueError(f"layout={layout!r}; choose 'nk' (E, out, in), as nn.Linear stores it, or 'kn' (E, in, out)")


def check_weight_position(weight_position: str) -> None:
    """A clear error for a routing-weight position the op does not have."""
    if weight_position not in WEIGHT_POSITIONS:
        raise ValueError(f"weight_position={weight_position!r}; choose one of {WEIGHT_POSITIONS}")


def check_experts_args(x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position):
    """Shape/dtype checks that name the offending argument."""
    check_activation(activation)
    check_weight_position(weight_position)
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H); got shape {tuple(x.shape)}")
    T, H = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be (T={T}, k); got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor; got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must match topk_ids {tuple(topk_ids.shape)}; got {tuple(topk_weights.shape)}")
    if w1.dim() != 3 or w1.shape[1] != H:
        raise ValueError(f"w1 must be (E, H={H}, I) after layout; got shape {tuple(w1.shape)}")
    E, _, I = w1.shape
    if is_gated(activation) != (w1_up is not None):
        raise ValueError(f"activation={activation!r} {'needs' if is_gated(activation) else 'takes no'} separate up weights")
    if w1_up is not None and w1_up.shape != w1.shape:
        raise ValueError(f"the up weights must match the gate weights {tuple(w1.shape)}; got {tuple(w1_up.shape)}")
    if w2.shape != (E, I, H):
        raise ValueError(f"w2 must be (E={E}, I={I}, H={H}) after layout; got shape {tuple(w2.shape)}")
    for name, t in (("w1", w1), ("w1_up", w1_up), ("w2", w2)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    for name, t, n in (("b1", b1, I), ("b1_up", b1_up, I), ("b2", b2, H)):
        if t is not None and tuple(t.shape) != (E, n):
            raise ValueError(f"{name} must be (E={E}, {n}); got shape {tuple(t.shape)}")
    if (b1 is None) != (b1_up is None) and w1_up is not None:
        raise ValueError("b1 and b1_up must both be given or both be None for a gated activation")
