"""The backward of ``moe_inductor::experts_forward``, as two ops and as one.

The compiled backward runs two ops: ``experts_backward_middle`` (through the down projection and the activation,
the last reader of the forward's saved ``pre``) and ``experts_backward_up`` (dW1, dx and the routing weights'
gradient, from the middle's ``d_pre``). Between them Inductor frees ``pre``, which one op would hold until it
returned: on Mixtral's training step (T = 4096) that was 448 MiB a layer at the step's peak, where every weight
gradient is alive (RESULTS.md, twenty-second session). ``experts_backward`` is the two in one call, for callers
outside autograd.

Both halves choose their path alike from shapes, dtypes and strides: ``torch._grouped_mm`` where
``grouped_mm_engine.grouped_mm_weights`` takes the call, else our Triton kernels (the plain-torch middle on the CPU
and for the "between" and "input" weight positions). Between the two ops, d_pre (M, n_pre) holds the gradients of
the raw up projection, in x's dtype: an interleaved gate/up's (gate, up) column pairs where its whole gradient is
wanted (``_paired``), else [gate | up] halves.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..kernels.launch import tracing_launches
from ..kernels.weight_views import interleaved_pairs
from . import grouped_mm_engine
from .activations import NO_ACTIVATION, Activation, activation_backward, apply_activation
from .call import ExpertsCall, ExpertWeights, Routing
from .grouped import (
    ROWS_ASSIGNMENT,
    ROWS_SORTED,
    ROWS_TOKEN,
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
from .grouped_mm_engine import gate_up_columns


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
    """An empty gradient for ``w`` laid out like it where it is dense (a transposed view stays transposed); per-expert
    weights (``expert_lists.PerExpert``) give one laid out as each expert's weight is."""
    if not isinstance(w, Tensor):
        return w.grad_buffer()
    if is_dense_transpose(w):  # one tensor of those strides, not a view: a traced launch writes it whole
        E, K, N = w.shape
        return torch.empty_strided((E, K, N), (K * N, 1, K), dtype=w.dtype, device=w.device)
    return w.new_empty(w.shape)


def _combined_grad_buffer(w1: Tensor) -> Tensor:
    """An empty (E, H, 2I) gradient for a gate/up pair held as one tensor, laid out as such a tensor is: the transpose
    of a dense (E, 2I, H) when ``w1`` is column-major (nn.Linear style), dense (E, H, 2I) otherwise."""
    E, H, I = w1.shape
    if w1.stride(1) == 1:  # one tensor of those strides, not a view (see _grad_buffer)
        return torch.empty_strided((E, H, 2 * I), (2 * I * H, 1, H), dtype=w1.dtype, device=w1.device)
    return w1.new_empty(E, H, 2 * I)


def _pairs_grad_buffer(w1: Tensor) -> Tensor:
    """An empty (E, H, I, 2) gradient for an interleaved gate/up pair whose gate is ``w1`` (E, H, I), laid out as
    the whole weight's ``pairs_view`` is: of a dense (E, 2I, H) when ``w1`` is column-major, of (E, H, 2I) else.
    A view of ``_combined_grad_buffer``'s (E, H, 2I) tensor, which the weight-gradient kernel writes whole."""
    E, H, I = w1.shape
    return _combined_grad_buffer(w1).view(E, H, I, 2)


class _SortedRows(NamedTuple):
    """Per sorted row: its expert (E past the experts), that expert clamped into range, whether it is one, its
    routing weight (zero past the experts), its token."""

    expert: Tensor
    expert_c: Tensor
    valid: Tensor
    s_sorted: Tensor
    token: Tensor


def _paired(w1: Tensor, w1_up: Optional[Tensor], needs: Needs) -> bool:
    """Whether d_pre holds (gate, up) column pairs (else [gate | up] halves): the weight is interleaved and its
    whole gradient is wanted. The engine's rule too (``is_interleaved`` of the whole weight it reads)."""
    return (needs.gate_up_pairs and w1_up is not None and isinstance(w1, Tensor)
            and interleaved_pairs(w1, w1_up) is not None)


def _call_and_routing(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, weights: tuple,
                      activation: str, alpha: float, limit: float, weight_position: str, order: Tensor,
                      sorted_expert: Tensor, offsets: Tensor, dropped: bool) -> tuple[ExpertsCall, Routed]:
    """The call and its routing as the op's flat arguments give them (the forward's routing metadata)."""
    w1 = weights[0]
    call = ExpertsCall(x, Routing(topk_ids, topk_weights), ExpertWeights(*weights),
                       Activation(activation, alpha, limit), weight_position)
    routed = Routed(topk_ids, topk_weights.contiguous().view(-1), order, sorted_expert, offsets, w1.shape[0], dropped)
    return call, routed


def _engine_weights(call: ExpertsCall, routed: Routed) -> Optional[Tensor]:
    """The up weights ``torch._grouped_mm`` reads when the backward runs on it (both halves ask alike), else None."""
    w = call.weights
    return grouped_mm_engine.grouped_mm_weights(call.x, w.w1, w.w1_up, w.w2, w.b1, w.b2, call.weight_position,
                                                routed.dropped, routed.order.shape[0], backward=True)


def middle_grads(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, needs: Needs) -> tuple:
    """The backward's first half: (d_pre, d_scale_sorted, dw2, db2, db1, db1_up), None where not made."""
    x, w = call.x, call.weights
    M = routed.order.shape[0]
    w_up = _engine_weights(call, routed)
    if w_up is not None:  # the compute-bound regime, as in the forward
        return grouped_mm_engine.middle_grads(dy, call, routed, w_up, pre, needs)
    E, _, I = w.w1.shape
    gated = w.w1_up is not None
    if pre.shape[0] != M:  # the forward did not keep it: recompute the raw up projection
        pre = x.new_empty(M, I * (2 if gated else 1))
        tmp = x.new_empty(M, I)
        grouped_gemm(x, w.w1, routed.rows, tmp, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED,
                     epi=epilogue(call.activation if gated else NO_ACTIVATION, b2=w.w1_up, pre=pre))
    if call.weight_position == "output" and use_triton(x):
        return _backward_middle_fused(dy, call, routed, pre, _sorted_rows(routed, E), needs)
    return _backward_middle_torch(dy, call, routed, pre, _sorted_rows(routed, E), needs)


def up_grads(call: ExpertsCall, routed: Routed, d_pre: Tensor, d_scale_sorted: Optional[Tensor],
             needs: Needs) -> tuple:
    """The backward's second half, from ``middle_grads``' d_pre and d_scale_sorted: (dx, d_weights, dw1, dw1_up),
    None where not wanted."""
    w_up = _engine_weights(call, routed)
    if w_up is not None:
        return grouped_mm_engine.up_grads(call, routed, w_up, d_pre, d_scale_sorted, needs)
    return _up_grads(call, routed, d_pre, d_scale_sorted, needs)


def _sorted_rows(routed: Routed, E: int) -> _SortedRows:
    expert = routed.sorted_expert.long()
    valid = expert < E
    order_l = routed.order.long()
    return _SortedRows(expert, expert.clamp(max=E - 1), valid,
                       torch.where(valid, routed.scale[order_l].to(torch.float32), 0.0)[:, None],
                       order_l // routed.topk)


def _backward_middle_fused(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, rows: _SortedRows,
                           needs: Needs) -> tuple:
    """The middle of the backward for the common case, fused: one pass over (M, I) instead of ~20
    (kernels/backward_middle.py)."""
    x, w = call.x, call.weights
    M = routed.order.shape[0]
    E, _, I = w.w1.shape
    f32 = torch.float32
    g = torch.empty(M, I, dtype=f32, device=x.device)
    grouped_gemm(dy, w.w2.transpose(1, 2), routed.rows, g, a_rows=ROWS_TOKEN, c_rows=ROWS_SORTED)
    # an interleaved weight's gradients are written as its (gate, up) column pairs: dx's GEMM and the whole weight's
    # gradient read them so, with no stack of the two afterwards; else as the halves of one tensor, which the
    # backward's second op takes whole
    gated = w.w1_up is not None
    paired = _paired(w.w1, w.w1_up, needs)
    d_pre = x.new_empty(M, 2 * I if gated else I)
    h, d_gate, d_up, d_scale_sorted = backward_middle(pre, g, routed.sorted, (w.b1, w.b1_up), call.activation,
                                                      x.dtype, out=d_pre, paired=paired)
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
    db1, db1_up = gate_up_bias_grads(d_gate, d_up, d_pre if paired else None, routed,
                                     (w.b1 if needs.b1 else None, w.b1_up if needs.b1_up else None))
    return d_pre, d_scale_sorted, dw2, db2, db1, db1_up


def _sum_by_expert(rows: Tensor, expert: Tensor, num_experts: int, dtype: torch.dtype) -> Tensor:
    """(E, width) sums of the sorted ``rows`` per expert, in fp32, cast to ``dtype`` (a bias gradient). Rows past
    the experts (expert id E, dropped) land in a spare row that is cut off."""
    sums = torch.zeros(num_experts + 1, rows.shape[1], dtype=torch.float32, device=rows.device)
    return sums.index_add_(0, expert, rows.to(torch.float32))[:num_experts].to(dtype)


def _backward_middle_torch(dy: Tensor, call: ExpertsCall, routed: Routed, pre: Tensor, rows: _SortedRows,
                           needs: Needs) -> tuple:
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
    # one (M, n_pre) tensor in x's dtype, the layout ``_paired`` names (the cast to x's dtype is this copy)
    d_pre = x.new_empty(M, I * (2 if gated else 1))
    for column, d in zip(gate_up_columns(d_pre, gated, _paired(w.w1, w.w1_up, needs)), (d_gate, d_up)):
        if d is not None:
            column.copy_(d)
    return d_pre, d_scale_sorted, dw2, db2, db1, db1_up


def _up_grads(call: ExpertsCall, routed: Routed, d_pre: Tensor, d_scale_sorted: Optional[Tensor], needs: Needs) -> tuple:
    """The rest of the backward on our kernels, from the gradients of the raw up projections (d_pre, laid out as
    ``_paired`` says): (dx, d_weights, dw1, dw1_up), None where not wanted."""
    x, w = call.x, call.weights
    w1, w1_up = w.w1, w.w1_up
    paired = _paired(w1, w1_up, needs)
    d_gate, d_up = gate_up_columns(d_pre, w1_up is not None, paired)
    T, H = x.shape
    M = routed.order.shape[0]
    topk = routed.topk
    rows = routed.rows
    gated = w1_up is not None
    f32 = torch.float32
    dw1 = dw1_up = None
    # an interleaved pair's gradients as the columns of one (M, 2I) tensor, as the weight holds them (the middle
    # writes them so where the whole weight's gradient is wanted)
    d_pairs = d_pre if paired else None
    if needs.combined_gate_up and needs.gate_up_pairs:  # one GEMM for the whole interleaved weight
        if d_pairs is None:
            d_pairs = torch.stack((d_gate, d_up), -1).view(M, 2 * w1.shape[2])
        whole = _combined_grad_buffer(w1)  # the (E, H, 2I) tensor under the pairs' view
        grouped_weight_grad(x, d_pairs, rows, whole, a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
        dw1 = whole.view(w1.shape[0], w1.shape[1], w1.shape[2], 2)
    elif needs.combined_gate_up and tracing_launches() and not paired:
        # one (E, H, 2I) gradient from the [gate | up] halves of d_pre in one launch: a traced launch must write a
        # whole tensor (Inductor clones a written view without the rest of its storage)
        dw1 = _combined_grad_buffer(w1)
        grouped_weight_grad(x, d_pre, rows, dw1, a_rows=ROWS_TOKEN, g_rows=ROWS_SORTED)
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
        pairs = interleaved_pairs(w1, w1_up) if gated and isinstance(w1, Tensor) else None
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
    if needs.topk_weights and d_scale_sorted is not None:
        valid = routed.sorted_expert < routed.num_experts
        d_flat = torch.zeros(M, dtype=f32, device=x.device).index_put_(
            (routed.order.long(),), torch.where(valid, d_scale_sorted, 0.0))
        d_weights = d_flat.view(T, topk).to(topk_weights.dtype)
    elif needs.topk_weights:
        d_weights = torch.zeros_like(topk_weights)
    return dx, d_weights, dw1, dw1_up



def _empty_or(t: Optional[Tensor], like: Tensor) -> Tensor:
    """``t``, or a distinct empty tensor where it is None: outputs of a custom op may not alias each other."""
    return t if t is not None else like.new_empty(0)


def experts_backward_middle_impl(
    dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w1_up: Optional[Tensor], w2: Tensor,
    b1: Optional[Tensor], b1_up: Optional[Tensor], b2: Optional[Tensor], pre: Tensor, order: Tensor,
    sorted_expert: Tensor, offsets: Tensor, activation: str, weight_position: str, alpha: float, limit: float,
    dropped: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward's first half (arguments as ``experts_backward``'s). Returns d_pre (M, n_pre) in x's dtype,
    d_scale_sorted (M,) fp32 (empty unless the routing weights want a gradient), dw2, db1, db1_up, db2 (empty where
    not wanted)."""
    call, routed = _call_and_routing(x, topk_ids, topk_weights, (w1, w1_up, w2, b1, b1_up, b2), activation,
                                     alpha, limit, weight_position, order, sorted_expert, offsets, dropped)
    need = Needs(*needs)
    d_pre, d_scale, dw2, db2, db1, db1_up = middle_grads(dy, call, routed, pre, need)
    return (d_pre, _empty_or(d_scale if need.topk_weights else None, x), _empty_or(dw2, x), _empty_or(db1, x),
            _empty_or(db1_up, x), _empty_or(db2, x))


# The ops are the implementations themselves, registered under their typed signatures; lowerings/visible_backward.py
# registers the same bodies as Inductor-visible ops.
experts_backward_middle = torch.library.custom_op("moe_inductor::experts_backward_middle",
                                                  mutates_args=())(experts_backward_middle_impl)


@experts_backward_middle.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, alpha, limit, dropped, needs):
    need = Needs(*needs)
    M = order.shape[0]
    n_pre = w1.shape[2] * (2 if w1_up is not None else 1)
    d_scale = x.new_empty(M, dtype=torch.float32) if need.topk_weights else x.new_empty(0)
    return (x.new_empty(M, n_pre), d_scale, *_fake_middle_grads(need, x, w2, b1, b1_up, b2))


def experts_backward_up_impl(
    d_pre: Tensor, d_scale_sorted: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor,
    w1_up: Optional[Tensor], w2: Tensor, b1: Optional[Tensor], b1_up: Optional[Tensor], b2: Optional[Tensor],
    order: Tensor, sorted_expert: Tensor, offsets: Tensor, activation: str, weight_position: str, alpha: float,
    limit: float, dropped: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward's second half, from ``experts_backward_middle``'s d_pre and d_scale_sorted. Returns dx,
    d_topk_weights, dw1, dw1_up (empty where not wanted; dw1 combined as ``experts_backward``'s)."""
    call, routed = _call_and_routing(x, topk_ids, topk_weights, (w1, w1_up, w2, b1, b1_up, b2), activation,
                                     alpha, limit, weight_position, order, sorted_expert, offsets, dropped)
    need = Needs(*needs)
    grads = up_grads(call, routed, d_pre, d_scale_sorted if need.topk_weights else None, need)
    return tuple(_empty_or(t, x) for t in grads)


experts_backward_up = torch.library.custom_op("moe_inductor::experts_backward_up",
                                              mutates_args=())(experts_backward_up_impl)


@experts_backward_up.register_fake
def _(d_pre, d_scale_sorted, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, order, sorted_expert, offsets,
      activation, weight_position, alpha, limit, dropped, needs):
    return _fake_up_grads(Needs(*needs), x, topk_weights, w1, w1_up)


def _maybe(flag: bool, t: Optional[Tensor], like, x: Tensor) -> Tensor:
    return like(t) if (flag and t is not None) else x.new_empty(0)


def _fake_up_grads(need: Needs, x: Tensor, topk_weights: Tensor, w1: Tensor, w1_up: Optional[Tensor]) -> tuple:
    """dx, d_topk_weights, dw1, dw1_up as the second half makes them (empty where not wanted)."""
    return (
        _maybe(need.x, x, torch.empty_like, x),
        _maybe(need.topk_weights, topk_weights, torch.empty_like, x),
        _maybe(need.w1, w1, (_pairs_grad_buffer if need.gate_up_pairs else _combined_grad_buffer)
               if need.combined_gate_up else _grad_buffer, x),
        _maybe(need.w1_up and not need.combined_gate_up, w1_up, _grad_buffer, x),
    )


def _fake_middle_grads(need: Needs, x: Tensor, w2: Tensor, b1: Optional[Tensor], b1_up: Optional[Tensor],
                       b2: Optional[Tensor]) -> tuple:
    """dw2, db1, db1_up, db2 as the first half makes them (empty where not wanted)."""
    return (_maybe(need.w2, w2, _grad_buffer, x), _maybe(need.b1, b1, torch.empty_like, x),
            _maybe(need.b1_up, b1_up, torch.empty_like, x), _maybe(need.b2, b2, torch.empty_like, x))


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
    """Gradients of ``experts_forward``, the two halves in one call.

    Args:
        needs: which of (x, topk_weights, w1, w1_up, w2, b1, b1_up, b2) want a gradient, and the optional flags
            ``combined_gate_up`` and ``gate_up_pairs`` (``Needs``' fields, in order).
    Returns:
        dx, d_topk_weights, dw1, dw1_up, dw2, db1, db1_up, db2; an empty tensor where none is wanted.
    """
    call, routed = _call_and_routing(x, topk_ids, topk_weights, (w1, w1_up, w2, b1, b1_up, b2), activation,
                                     alpha, limit, weight_position, order, sorted_expert, offsets, dropped)
    need = Needs(*needs)
    d_pre, d_scale, dw2, db2, db1, db1_up = middle_grads(dy, call, routed, pre, need)
    dx, d_weights, dw1, dw1_up = up_grads(call, routed, d_pre, d_scale if need.topk_weights else None, need)
    return tuple(_empty_or(t, x) for t in (dx, d_weights, dw1, dw1_up, dw2, db1, db1_up, db2))


@experts_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets, activation,
      weight_position, alpha, limit, dropped, needs):
    need = Needs(*needs)
    return (*_fake_up_grads(need, x, topk_weights, w1, w1_up), *_fake_middle_grads(need, x, w2, b1, b1_up, b2))
