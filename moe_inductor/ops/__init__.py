"""The ``moe_inductor::`` ops and their eager entry point ``fused_experts``."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import config
from ..kernels.weight_views import same_storage
from .activations import ACTIVATIONS, GPTOSS_ALPHA, GPTOSS_LIMIT, Activation, apply_activation, is_gated
from .call import ExpertsCall, ExpertWeights, Routing, check_call, op_call, pairs_view
from . import expert_lists  # noqa: F401  (registers moe_inductor::experts_forward_list)
from .experts import experts_backward, experts_forward, experts_forward_impl, to_kn
from .grouped_mm import grouped_mm, grouped_mm_reference
from .reference import moe_reference
from .routing import assert_ids_in_range, check_topk_ids, route, route_reference

WeightArg = Union[Tensor, tuple[Tensor, Tensor]]

__all__ = [
    "ACTIVATIONS", "Activation", "ExpertWeights", "ExpertsCall", "Routing", "apply_activation", "experts_backward",
    "experts_forward", "expert_weight_views", "fused_experts", "grouped_mm", "grouped_mm_reference", "moe_reference", "op_call", "route", "route_reference",
]


def _split_gate_up(t: Tensor, interleaved: bool, dim: int = -1) -> tuple[Tensor, Tensor]:
    """(gate, up) views of ``t`` along ``dim``: its even and odd entries when interleaved, else its two halves."""
    lead = (slice(None),) * (dim % t.dim())
    if interleaved:
        return t[lead + (slice(0, None, 2),)], t[lead + (slice(1, None, 2),)]
    half = t.shape[dim] // 2
    return t[lead + (slice(None, half),)], t[lead + (slice(half, None),)]


class _SplitGateUp(torch.autograd.Function):
    """(gate, up) = the two column halves (or the even and odd columns) of a (E, H, 2I) gate/up weight, as views.

    Autograd's own slicing would give the parameter two full-size zero-filled gradients (one per slice) and then add
    them: for Mixtral's 1.9 GB gate_up_proj (DeepSeek-V3's is 15 GB) that is several extra passes and as much
    transient memory. Here two gradients that the experts op returns as the halves of one tensor become the
    parameter's gradient as they are, and other gradients are written into one fresh tensor.
    """

    @staticmethod
    def forward(w: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
        return _split_gate_up(w, interleaved)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # (a separate setup_context lets torch.func transforms use it)
        w, interleaved = inputs
        ctx.w_shape, ctx.interleaved = w.shape, interleaved

    @staticmethod
    def backward(ctx, d_gate: Optional[Tensor], d_up: Optional[Tensor]) -> tuple[Tensor, None]:
        half = ctx.w_shape[2] // 2
        if (not ctx.interleaved and d_gate is not None and d_up is not None and d_gate.stride() == d_up.stride()
                and same_storage(d_gate, d_up)
                and d_up.storage_offset() - d_gate.storage_offset() == half * d_gate.stride(2)):
            return d_gate.as_strided(ctx.w_shape, d_gate.stride(), d_gate.storage_offset()), None
        ref = d_gate if d_gate is not None else d_up
        grad = ref.new_zeros(ctx.w_shape) if d_gate is None or d_up is None else ref.new_empty(ctx.w_shape)
        for part, d_part in zip(_split_gate_up(grad, ctx.interleaved), (d_gate, d_up)):
            if d_part is not None:
                part.copy_(d_part)
        return grad, None


def expert_weight_views(
    w1: WeightArg,
    w2: Tensor,
    b1: Optional[WeightArg],
    *,
    activation: str,
    layout: str,
    gate_up: str,
) -> tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor], Optional[Tensor]]:
    """Turn user-held weights into the op's logical (E, K, N) views, without copying.

    Returns (w1 or gate, up or None, w2, b1 or gate bias, up bias or None).
    """
    gated = is_gated(activation)
    if isinstance(w1, tuple):
        gate, up = (to_kn(w, layout) for w in w1)
        bg, bu = b1 if b1 is not None else (None, None)
        return gate, up, to_kn(w2, layout), bg, bu
    if not gated:
        return to_kn(w1, layout), None, to_kn(w2, layout), b1, None
    if gate_up not in ("concat", "interleaved"):
        raise ValueError(f"gate_up={gate_up!r}; choose 'concat' (gate then up) or 'interleaved'")
    interleaved = gate_up == "interleaved"
    out_dim = -2 if layout == "nk" else -1  # the gate/up axis of the weight as the user holds it
    if w1.dim() == 3 and w1.shape[out_dim] % 2:
        raise ValueError(f"a gated activation needs an even up width; w1 has {w1.shape[out_dim]} output columns")
    # Eagerly, with a gradient to make, the split is ours (see _SplitGateUp). Traced, the compiler's slices are
    # fine, provided they are taken of the weight as the user holds it and transposed after: the gradient of the
    # slices is then assembled in the parameter's own layout, and autograd need not copy it into that layout.
    if w1.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        views = _SplitGateUp.apply(to_kn(w1, layout), interleaved)
    else:
        views = tuple(to_kn(v, layout) for v in _split_gate_up(w1, interleaved, out_dim))
    bias = _split_gate_up(b1, interleaved) if b1 is not None else (None, None)
    return views[0], views[1], to_kn(w2, layout), bias[0], bias[1]


#: Benchmarks set this to give the op a fused gate/up weight whole in eager calls too, so that the op alone runs the
#: backward a compiled training step runs (benchmarks/bench_experts.py, profile_experts.py). Users leave it off.
_whole_gate_up_eagerly = False


def fused_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: WeightArg,
    w2: Tensor,
    *,
    b1: Optional[WeightArg] = None,
    b2: Optional[Tensor] = None,
    activation: str = "silu_glu",
    layout: str = "nk",
    gate_up: str = "concat",
    weight_position: str = "output",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    capacity: Optional[int] = None,
    name: Optional[str] = None,
) -> Tensor:
    """Run E experts over routed tokens and combine them: ``y = sum_k w_k * down_e(act(up_e(x)))``.

    Args:
        x: (..., H) tokens.
        topk_ids: (..., k) integer expert ids in [0, E); topk_weights: (..., k) routing weights.
        w1: the up (or gate+up) weights, (E, N1, H) for ``layout="nk"`` (nn.Linear, HF Mixtral/Qwen) or (E, H, N1)
            for ``layout="kn"`` (GPT-OSS); for a gated activation N1 = 2I, gate and up ``"concat"``-enated or
            ``"interleaved"``; or a tuple (gate, up) of two such tensors of width I.
        w2: the down weights, (E, H, I) for "nk" or (E, I, H) for "kn".
        b1: optional up bias (E, N1) (or a (gate, up) tuple); b2: optional down bias (E, H).
        activation: one of ``moe_inductor.ops.ACTIVATIONS``; ``alpha``/``limit`` parameterise "gptoss_glu",
            ``limit`` "clamped_silu_glu" (Step-3.7's ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)``).
        weight_position: "output" (default), "between" the projections, or "input" (Llama4).
        capacity: optional per-expert capacity; assignments past it are dropped in GShard/Switch priority order.
        name: the layer, for error messages (``model.layers.3.mlp.experts``).
    Returns:
        (..., H) in x's dtype. Differentiable w.r.t. x, topk_weights, weights and biases.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ids = topk_ids.reshape(-1, topk_ids.shape[-1])
    tw = topk_weights.reshape(-1, topk_weights.shape[-1])
    g, u, d, bg, bu = expert_weight_views(w1, w2, b1, activation=activation, layout=layout, gate_up=gate_up)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x2, tw, g, u, d, bg, bu, b2)
    )
    call = ExpertsCall(x2, Routing(ids, tw, capacity), ExpertWeights(g, u, d, bg, bu, b2),
                       Activation(activation, float(alpha), float(limit)), weight_position, wants_grad)
    check_call(call)
    # ids outside [0, E) raise, as eager indexing does: with their values where reading them costs nothing (CPU)
    # or where eager GPU code may sync; else (traced, or captured into a CUDA graph) on the device, without a sync
    # (traced code must not ask whether a CUDA graph is being captured: Dynamo breaks the graph on that call)
    compiling = torch.compiler.is_compiling()
    capturing = not compiling and x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not compiling and (not x.is_cuda or (config.validate_routing and not capturing)):
        check_topk_ids(ids, g.shape[0], name)
    elif config.validate_routing:
        assert_ids_in_range(ids, g.shape[0], name)
    # Traced with a gradient to make, a fused gate/up weight goes to the op whole (op_call's gate_up; an interleaved
    # one as its pairs_view): the backward graph then holds one gradient for it, not two slices' gradients
    # stitched together in a further pass.
    whole = None
    if (compiling or _whole_gate_up_eagerly) and wants_grad and u is not None and isinstance(w1, torch.Tensor):
        whole = to_kn(w1, layout) if gate_up == "concat" else pairs_view(to_kn(w1, layout))
    op, args = op_call(call, gate_up=whole)
    # Eager inference runs the op's body directly: the same code, without the dispatcher's per-call overhead.
    # Traced or differentiable calls go through the op, so graphs see it and autograd finds its backward.
    direct = not wants_grad and not torch.compiler.is_compiling()
    y, *_ = experts_forward_impl(*args) if direct else op(*args)
    return y.reshape(*lead, y.shape[-1])
