"""On the CPU, under the Inductor inner compiler, the experts forward as aten ops that Inductor fuses, around one
op that runs the per-expert matmuls (``moe_inductor::cpu_grouped_mm``), in inference and training graphs alike.

Why: ``moe_inductor::experts_forward`` is opaque to Inductor, so on the CPU its routing, gather, activation,
routing-weight scale and combine run as ~17 separate aten calls behind the dispatcher and our Python (and its
backward as ~40 more), while ``backend="inductor"`` fuses the same steps of transformers' grouped_mm path into a few
generated C++ kernels around its own opaque per-expert matmul loop. Here Inductor sees everything but the matmul
loop, which needs the per-expert row counts on the host (one ``tolist`` per call) and so cannot be traced.

In a graph AOTAutograd differentiates, the matmuls are ``cpu_grouped_mm_autograd``, the same kernel with a backward
(``register_autograd``): its input gradient is the same per-expert loop through the transposed weights
(``cpu_grouped_mm_input_grad``), its weight gradient one ``a_e^T @ g_e`` per expert (``cpu_grouped_weight_grad``).
AOTAutograd differentiates everything else, so a training graph's backward is Inductor's too.

The traced forward computes on all T*k assignment rows, so that no shape depends on the routing: rows past
``offsets[-1]`` (capacity drops, ids outside [0, E)) are zeros out of the matmul op and are masked out of the
combine. The arithmetic is ``ops/cpu_path.py``'s: raw up projections (``pre`` for a backward), the routing scale
on the accumulator ("input"), after the activation ("between") or after the down projection ("output"), biases,
and the combine in fp32 for 16-bit inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops.activations import apply_activation
from ..ops.call import from_op_args
from ..ops.grouped import project, use_triton
from ..kernels.launch import interleaved_pairs
from ..ops.grouped_mm_engine import combined_up_weights
from ..ops.routing import route_reference


def _cpu_grouped_mm(a: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor]) -> Tensor:
    """Per-expert matmuls of expert-sorted rows: (M, K) ``a``, whose rows of expert e are
    [offsets[e], offsets[e+1]), times (E, K, N) ``w``; with ``w_second`` (E, K, N) too, the (M, 2N) [a@w | a@w_second]
    (one matmul on the combined weight when the two are the halves of one tensor). Rows past ``offsets[-1]`` are
    zero."""
    bounds = offsets.tolist()
    M, kept = a.shape[0], bounds[-1]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])] + [M - kept]
    n = w.shape[2]
    out = a.new_empty(M, n * (1 if w_second is None else 2))
    if kept < M:
        out[kept:].zero_()
    both = combined_up_weights(w, w_second)
    pairs = interleaved_pairs(w, w_second) if both is None else None
    if both is not None:
        project(a, sizes, both, out)
    elif pairs is not None:  # a matmul reads a stride-2 view through a copy: read the whole weight, split the columns
        joint = project(a, sizes, pairs, a.new_empty(M, 2 * n))[:kept]
        out[:kept, :n], out[:kept, n:] = joint[:, 0::2], joint[:, 1::2]
    else:  # two tensors: each half of the output gets its own matmul
        project(a, sizes, w, out[:, :n])
        project(a, sizes, w_second, out[:, n:])
    return out


def _cpu_grouped_mm_input_grad(g: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor]) -> Tensor:
    """(M, K): the gradient of ``cpu_grouped_mm``'s ``a`` from the gradient ``g`` of its output,
    ``g[:, :N] @ w[e]^T (+ g[:, N:] @ w_second[e]^T)`` per expert; rows past ``offsets[-1]`` are zero. Whether the
    two weights are one tensor's halves is decided here, on the real tensors, as in the forward."""
    bounds = offsets.tolist()
    M, kept = g.shape[0], bounds[-1]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])] + [M - kept]
    n = w.shape[2]
    out = g.new_empty(M, w.shape[1])
    if kept < M:
        out[kept:].zero_()
    both = combined_up_weights(w, w_second)
    if both is not None:  # one matmul per expert through the whole gate/up weight
        return project(g, sizes, both.transpose(1, 2), out)
    pairs = interleaved_pairs(w, w_second)
    if pairs is not None:  # the gradient's two halves interleaved as the weight's columns are
        joint = torch.stack((g[:, :n], g[:, n:]), -1).view(M, 2 * n)
        return project(joint, sizes, pairs.transpose(1, 2), out)
    project(g[:, :n], sizes, w.transpose(1, 2), out)
    if w_second is not None:
        out[:kept] += project(g[:, n:], sizes, w_second.transpose(1, 2), torch.empty_like(out))[:kept]
    return out


def _cpu_grouped_weight_grad(a: Tensor, g: Tensor, offsets: Tensor, num_experts: int) -> Tensor:
    """(E, K, N): ``a[rows of e]^T @ g[rows of e]`` for each expert e (rows as in ``cpu_grouped_mm``), zeros for an
    expert with no rows: the gradient of ``cpu_grouped_mm``'s weight."""
    bounds = offsets.tolist()
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])] + [a.shape[0] - bounds[-1]]
    dw = a.new_empty(num_experts, a.shape[1], g.shape[1])
    for n, ra, rg, d in zip(sizes, a.split_with_sizes(sizes), g.split_with_sizes(sizes), dw.unbind(0)):
        if n:
            torch.mm(ra.t(), rg, out=d)
        else:
            d.zero_()
    return dw


def _cpu_grouped_mm_no_grad(a: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor]) -> Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, w, w_second)):
        raise RuntimeError("moe_inductor::cpu_grouped_mm has no backward: a graph that differentiates it takes "
                           "moe_inductor::cpu_grouped_mm_autograd")
    return _cpu_grouped_mm(a, offsets, w, w_second)


# Defined through torch.library.Library rather than custom_op: the op runs twice per layer in host-bound graphs, and
# over its body's own time custom_op's Python dispatch adds about 50 us a call on the 2-core CPU machine, a plain CPU
# kernel about 20 us (RESULTS.md, CPU). A registered backward costs a Python autograd kernel on every call, grad mode
# on or off (about 20 us more), so the matmuls come as two ops of one kernel: ``cpu_grouped_mm`` with no backward,
# for graphs AOTAutograd does not differentiate, and ``cpu_grouped_mm_autograd`` with one.
_LIB = torch.library.Library("moe_inductor", "FRAGMENT")
_LIB.define("cpu_grouped_mm(Tensor a, Tensor offsets, Tensor w, Tensor? w_second) -> Tensor")
_LIB.impl("cpu_grouped_mm", _cpu_grouped_mm_no_grad, "CPU")
_LIB.define("cpu_grouped_mm_autograd(Tensor a, Tensor offsets, Tensor w, Tensor? w_second) -> Tensor")
_LIB.impl("cpu_grouped_mm_autograd", _cpu_grouped_mm, "CPU")
_LIB.define("cpu_grouped_mm_input_grad(Tensor g, Tensor offsets, Tensor w, Tensor? w_second) -> Tensor")
_LIB.impl("cpu_grouped_mm_input_grad", _cpu_grouped_mm_input_grad, "CPU")
_LIB.define("cpu_grouped_weight_grad(Tensor a, Tensor g, Tensor offsets, int num_experts) -> Tensor")
_LIB.impl("cpu_grouped_weight_grad", _cpu_grouped_weight_grad, "CPU")


def _grouped_mm_fake(a, offsets, w, w_second):
    return a.new_empty(a.shape[0], w.shape[2] * (1 if w_second is None else 2))


torch.library.register_fake("moe_inductor::cpu_grouped_mm", _grouped_mm_fake)
torch.library.register_fake("moe_inductor::cpu_grouped_mm_autograd", _grouped_mm_fake)


@torch.library.register_fake("moe_inductor::cpu_grouped_mm_input_grad")
def _(g, offsets, w, w_second):
    return g.new_empty(g.shape[0], w.shape[1])


@torch.library.register_fake("moe_inductor::cpu_grouped_weight_grad")
def _(a, g, offsets, num_experts):
    return a.new_empty(num_experts, a.shape[1], g.shape[1])


cpu_grouped_mm = torch.ops.moe_inductor.cpu_grouped_mm.default
cpu_grouped_mm_autograd = torch.ops.moe_inductor.cpu_grouped_mm_autograd.default
cpu_grouped_mm_input_grad = torch.ops.moe_inductor.cpu_grouped_mm_input_grad.default
cpu_grouped_weight_grad = torch.ops.moe_inductor.cpu_grouped_weight_grad.default


def _setup(ctx, inputs, output):
    a, offsets, w, w_second = inputs
    ctx.save_for_backward(a, offsets, w, w_second)
    ctx.second = w_second is not None


def _backward(ctx, grad):
    """Rows past ``offsets[-1]`` are zeros whatever ``a`` holds: their gradient is zero, as the matmuls give it."""
    a, offsets, w, w_second = ctx.saved_tensors
    n = w.shape[2]
    g1, g2 = (grad[:, :n], grad[:, n:]) if ctx.second else (grad, None)
    da = dw = dw_second = None
    if ctx.needs_input_grad[0]:
        da = cpu_grouped_mm_input_grad(grad, offsets, w, w_second)
    if ctx.needs_input_grad[2]:
        dw = cpu_grouped_weight_grad(a, g1, offsets, w.shape[0])
    if ctx.second and ctx.needs_input_grad[3]:
        dw_second = cpu_grouped_weight_grad(a, g2, offsets, w.shape[0])
    return da, None, dw, dw_second


torch.library.register_autograd("moe_inductor::cpu_grouped_mm_autograd", _backward, setup_context=_setup)


def experts_forward_traced(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward`` with its arguments, in aten ops and ``cpu_grouped_mm`` (the same five outputs), for
    Inductor to trace on the CPU."""
    call = from_op_args(args)
    x, w, act, position = call.x, call.weights, call.activation, call.weight_position
    T, H = x.shape
    E, _, I = w.w1.shape
    k = call.routing.topk_ids.shape[1]
    order, sorted_expert, offsets = route_reference(call.routing.topk_ids, E, call.routing.capacity)
    M = T * k
    assignment = order.long()
    valid = (sorted_expert < E)[:, None]
    expert = sorted_expert.long().clamp(max=E - 1)
    # Rows move between assignment order and sorted order as stores through a permutation (``index_copy``), never as
    # gathers: a gather's gradient is a scatter-add, which Inductor's C++ kernels make an atomic add per element,
    # while a store's gradient is a gather. ``slot`` is the inverse of ``order``: assignment a sits at sorted row
    # slot[a].
    slot = torch.empty_like(assignment).index_copy_(0, assignment, torch.arange(M, device=x.device))
    rows = x.new_empty(M, H).index_copy(0, slot, x[:, None].expand(T, k, H).reshape(M, H))
    weights = call.routing.topk_weights.reshape(M)
    s = weights.new_empty(M).index_copy(0, slot, weights)[:, None]
    gated = w.w1_up is not None
    inputs = (x, call.routing.topk_weights, w.w1, w.w1_up, w.w2, w.b1, w.b1_up, w.b2)
    differentiated = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    matmuls = cpu_grouped_mm_autograd if differentiated else cpu_grouped_mm
    h = matmuls(rows, offsets, w.w1, w.w1_up)
    gate, up = (h[:, :I], h[:, I:]) if gated else (h, None)
    if position == "input":
        gate, up = gate * s.to(h.dtype), (up * s.to(h.dtype) if gated else None)
    if w.b1 is not None:
        gate = gate + w.b1[expert]
        up = up + w.b1_up[expert] if gated else None
    a = apply_activation(act.name, gate, up, act.alpha, act.limit)
    if position == "between":
        a = a * s.to(a.dtype)
    o = matmuls(a.to(x.dtype), offsets, w.w2, None)
    if w.b2 is not None:
        o = o + w.b2[expert]
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    o = o.to(acc)
    if position == "output":
        o = o * s.to(acc)
    o = torch.where(valid, o, 0.0)  # a dropped row's bias or scale must not reach y
    y = o.new_empty(M, H).index_copy(0, assignment, o).view(T, k, H).sum(1).to(x.dtype)
    pre = h if call.save_pre else x.new_empty(0)
    return y, pre, order, sorted_expert, offsets


def _example(node: object) -> Optional[object]:
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def swap_in_cpu_lowering(gm: torch.fx.GraphModule) -> int:
    """Point every ``experts_forward`` call on plain CPU tensors at ``experts_forward_traced``; returns how many were
    swapped."""
    swapped = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.moe_inductor.experts_forward.default
                and not node.kwargs):
            x = _example(node.args[0])
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not use_triton(x):
                node.target = experts_forward_traced
                swapped += 1
    if swapped:
        from torch._dynamo.utils import counters

        counters["moe_inductor_cpu_lowering"]["swapped"] += swapped
        gm.recompile()
    return swapped
