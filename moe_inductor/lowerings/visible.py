"""``config.visible_kernels`` (on by default): the experts forward as a ``torch.library.triton_op``, so that
Inductor traces into it and launches our Triton kernels from its own generated wrapper.

Why: ``moe_inductor::experts_forward`` is opaque to Inductor, so every call crosses the dispatcher into our Python
(launch decisions, argument lists, Triton's ``JITFunction.run`` per kernel): about 195 us of host time a layer on
the H200, which makes short prefills host-bound (benchmarks/RESULTS.md). Inside Inductor's wrapper the same
launches cost a few microseconds each and no Python of ours runs: for the 4-layer Qwen3-MoE prefill at T = 512,
20 forwards took 46 ms of host time against 167 ms with the opaque op and 55 ms for Inductor's own path (cProfile,
RESULTS.md).

Experts large enough for the ``torch._grouped_mm`` engine (ops/grouped_mm_engine.py) stay opaque: the engine decides
per call from the token count, which a traced graph cannot, and at their size the host time is small against the GPU
time. Layers with biases stay opaque only where their row count is unknown or reaches the engine's rule for them, so
their decode keeps the visible launches. Calls whose static row count takes the TMA weight loads
(``config.gemm_tma_weights``) through host-made descriptors (``config.gemm_tma_descriptors = "host"``) stay opaque as
well: those cannot be traced on torch 2.11. Descriptors the kernel makes itself can. The backward of a visible call
is visible too where the engine cannot take it and its row count is static (lowerings/visible_backward.py); else
it runs the opaque backward ops.

What changes under tracing (``kernels.launch.traceable_launches``): launches go through ``wrap_triton``; with a
symbolic token count (a dynamic graph), routing takes its two-launch path (right for every token count, no guard on
it), the GEMM grid covers all E experts, and a GEMM config is picked from the token count's example value, since it
only changes speed. A static graph makes the same choices as the opaque op. The op has the same schema, outputs
and autograd as ``experts_forward``; ``swap_in_visible_ops`` swaps it into a graph just before the inner compile.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..kernels.launch import traceable_launches
from ..kernels.tma import tma_weights_apply
from ..ops import grouped_mm_engine
from ..ops.call import from_op_args
from ..ops.experts import EXPERTS_AUTOGRAD, backward_through, experts_forward_call
from .visible_backward import pick_backward_ops
from ..ops.grouped import use_triton


# The signature repeats experts_forward_impl's: triton_op infers the op schema from these annotations.
@torch.library.triton_op("moe_inductor::experts_forward_visible", mutates_args=())
def experts_forward_visible(
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
    """``experts_forward`` with its Triton launches visible to Inductor (GPU tensors, or CPU under the interpreter
    with ``config.triton_on_cpu``)."""
    call = from_op_args((x, topk_ids, topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, weight_position, alpha,
                         limit, capacity, save_pre))
    with traceable_launches():
        return experts_forward_call(call)


def _visible_backward(ctx, dy, _dpre, _dorder, _dsorted, _doffsets):
    """The opaque op's gradients, through the visible backward ops where they can be traced
    (lowerings/visible_backward.py)."""
    return backward_through(ctx, dy, pick=pick_backward_ops)


experts_forward_visible.register_autograd(_visible_backward, setup_context=EXPERTS_AUTOGRAD[1])


def _example(node: object) -> Optional[Tensor]:
    """The fake tensor Dynamo recorded for an argument node (``example_value`` in Dynamo graphs, ``val`` after aot;
    None for constants and unrecorded nodes)."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def swap_in_visible_ops(gm: torch.fx.GraphModule) -> int:
    """Point every ``experts_forward`` call on Triton-run tensors at ``experts_forward_visible``, except for experts
    the grouped_mm engine may take; returns how many were swapped."""
    swapped = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.moe_inductor.experts_forward.default:
            x, ids, w2 = _example(node.args[0]), _example(node.args[1]), _example(node.args[5])
            biased = any(a is not None for a in node.args[6:9])
            rows = ids.shape[0] * ids.shape[1] if ids is not None else None
            # (a weight view our rewrite made may carry no example value: then only the engine rule is unknown, and
            # both ops compute the same)
            engine_may_run = w2 is not None and grouped_mm_engine.may_take_experts_of(
                w2, biased, rows if isinstance(rows, int) else None)
            # calls that would read their weights through host-made TMA descriptors stay opaque too: a trace cannot
            # take those (descriptors the kernel makes itself it can)
            tma_may_run = (config.gemm_tma_descriptors == "host" and config.gemm_tma_weights in ("auto", "on")
                           and x is not None and w2 is not None
                           and isinstance(rows, int)
                           and tma_weights_apply(x, w2, None, rows, w2.shape[0], config.gemm_tma_weights,
                                                 config.tma_min_rows_per_expert, "host"))
            if x is not None and use_triton(x) and not engine_may_run and not tma_may_run:
                node.target = torch.ops.moe_inductor.experts_forward_visible.default
                swapped += 1
    if swapped:
        from torch._dynamo.utils import counters

        counters["moe_inductor_visible"]["swapped"] += swapped
        gm.recompile()
    return swapped
