"""The experts backward visible to Inductor, where the forward is (``lowerings/visible.py``).

Why: the backward's two ops (``experts_backward_middle``, ``experts_backward_up``) are opaque to Inductor, so each
call crosses the dispatcher into our Python, which launches every kernel and allocates every buffer itself. In a
training step of about a thousand tokens the GPU work is short enough that this host time decides the step: on the
H100 every family's 1024-token step ran slower with the experts rewritten than left to Inductor (0.59x Qwen3-MoE,
``benchmarks/RESULTS.md``, thirty-eighth session), with our step's kernels no slower than Inductor's. Registered as
``torch.library.triton_op``\\ s, the same bodies are traced by AOT autograd into the compiled backward graph: the
Triton launches sit in Inductor's generated wrapper, and the torch ops around them (index casts, masks, the routing
weights' scatter) become Inductor's kernels.

Which calls: the backward of an ``experts_forward_visible`` call (only Inductor compiles without CUDA graphs swap
that op in), with a static row count, and only where the ``torch._grouped_mm`` engine cannot take the backward
(``grouped_mm_engine.may_take_backward_of``): the engine decides per call, and a traced launch never takes it, so
where it may run the opaque ops keep it. With a symbolic row count the opaque ops run as well. Under
``config.visible_engine_backward`` a static backward the engine takes is traced as well: its GEMMs become
``aten._grouped_mm`` nodes of the graph.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import config
from ..kernels.launch import traceable_launches
from ..ops import grouped_mm_engine
from ..ops.backward import (experts_backward_middle, experts_backward_middle_impl, experts_backward_up,
                            experts_backward_up_impl)


# The signatures repeat the opaque ops' (ops/backward.py): triton_op infers the op schema from these annotations.
@torch.library.triton_op("moe_inductor::experts_backward_middle_visible", mutates_args=())
def experts_backward_middle_visible(
    dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w1_up: Optional[Tensor], w2: Tensor,
    b1: Optional[Tensor], b1_up: Optional[Tensor], b2: Optional[Tensor], pre: Tensor, order: Tensor,
    sorted_expert: Tensor, offsets: Tensor, activation: str, weight_position: str, alpha: float, limit: float,
    dropped: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_backward_middle`` with its launches visible to Inductor."""
    with traceable_launches():
        return experts_backward_middle_impl(dy, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order,
                                            sorted_expert, offsets, activation, weight_position, alpha, limit,
                                            dropped, needs)


@torch.library.triton_op("moe_inductor::experts_backward_up_visible", mutates_args=())
def experts_backward_up_visible(
    d_pre: Tensor, d_scale_sorted: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor,
    w1_up: Optional[Tensor], w2: Tensor, b1: Optional[Tensor], b1_up: Optional[Tensor], b2: Optional[Tensor],
    order: Tensor, sorted_expert: Tensor, offsets: Tensor, activation: str, weight_position: str, alpha: float,
    limit: float, dropped: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``experts_backward_up`` with its launches visible to Inductor."""
    with traceable_launches():
        return experts_backward_up_impl(d_pre, d_scale_sorted, x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up,
                                        b2, order, sorted_expert, offsets, activation, weight_position, alpha, limit,
                                        dropped, needs)


def backward_traceable(x: Tensor, w2: Tensor, biased: bool, num_rows) -> bool:
    """Whether a visible forward's backward can be traced as well: a static row count, the engine unable to take it
    (shapes and settings only: these are fake tensors while AOT autograd traces), and no host-made TMA descriptors
    (a traced launch cannot take those, and the opaque op would)."""
    if not isinstance(num_rows, int) or config.gemm_tma_descriptors == "host":
        return False
    return not grouped_mm_engine.may_take_backward_of(x, w2, biased, num_rows)


def engine_backward_traceable(x: Tensor, w2: Tensor, biased: bool, num_rows) -> bool:
    """Whether a visible forward's backward, which the engine may take, is traced with the engine's GEMMs as graph
    nodes (``config.visible_engine_backward``): a static row count and no host-made TMA descriptors. The engine's
    own checks on the real layout still run while tracing; where they refuse, the traced body runs our kernels.

    The gathers of the tokens that the weight gradients read are our kernel (``kernels/gather.py``), not
    Inductor's: Inductor lays out its own gather, read through dW1's transpose (GPT-OSS's (E, H, 2I) weight), with
    the grouped dimension contiguous, and ``torch._grouped_mm`` then asserts on any group not a multiple of 8."""
    if not config.visible_engine_backward or not isinstance(num_rows, int) or config.gemm_tma_descriptors == "host":
        return False
    return grouped_mm_engine.may_take_backward_of(x, w2, biased, num_rows)


def pick_backward_ops(x: Tensor, w2: Tensor, biased: bool, order: Tensor) -> tuple[Callable, Callable]:
    """The backward's (middle, up) op pair for a visible forward's saved context (``ops.experts.backward_through``)."""
    if not config.visible_backward:
        return experts_backward_middle, experts_backward_up
    rows = order.shape[0]
    fused = backward_traceable(x, w2, biased, rows)
    if fused or engine_backward_traceable(x, w2, biased, rows):
        from torch._dynamo.utils import counters

        counters["moe_inductor_visible"]["backward" if fused else "engine_backward"] += 1
        ops = torch.ops.moe_inductor
        return ops.experts_backward_middle_visible, ops.experts_backward_up_visible
    return experts_backward_middle, experts_backward_up
