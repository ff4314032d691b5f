"""On the CPU, under the Inductor inner compiler, the experts forward as aten ops that Inductor fuses, around one
op that runs the per-expert matmuls (``moe_inductor::cpu_grouped_mm``), in inference and training graphs alike.

Why: ``moe_inductor::experts_forward`` is opaque to Inductor, so on the CPU its routing, gather, activation,
routing-weight scale and combine run as ~17 separate aten calls behind the dispatcher and our Python (and its
backward as ~40 more), while ``backend="inductor"`` fuses the same steps of transformers' grouped_mm path into a few
generated C++ kernels around its own opaque per-expert matmul loop. Here Inductor sees everything but the matmul
loop, which needs the per-expert row counts on the host (one ``tolist`` per call) and so cannot be traced.

In a graph AOTAutograd differentiates, the matmuls are ``cpu_grouped_mm_autograd``, the same kernel with a backward
(``register_autograd``): one more op, ``cpu_grouped_mm_backward``, makes both of its gradients in one pass over the
experts (the rows through the transposed weights, and one ``a_e^T @ g_e`` per expert for the weights).
AOTAutograd differentiates everything else, so a training graph's backward is Inductor's too.

The traced forward computes on all T*k assignment rows, so that no shape depends on the routing: rows past
``offsets[-1]`` (capacity drops, ids outside [0, E)) are zeros out of the matmul op and are masked out of the
combine. The arithmetic is ``ops/cpu_path.py``'s: raw up projections (``pre`` for a backward), the routing scale
on the accumulator ("input"), after the activation ("between") or after the down projection ("output"), biases,
and the combine in fp32 for 16-bit inputs.

A bf16 inference graph takes ``torch._grouped_mm`` for the matmuls instead, where this torch runs it on the CPU
(``aten_grouped_mm_serves``): Inductor then calls aten's per-expert loop with none of our Python around it, which
measured faster in bf16 (RESULTS.md, twentieth session). Its rows past ``offsets[-1]`` are undefined, so they are
masked by a select; its backward would leave their gradient undefined too, so differentiated graphs keep our op.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..kernels.weight_views import interleaved_pairs
from ..ops.activations import apply_activation
from ..ops.call import from_op_args
from ..ops.cpu_path import project_up
from ..ops.grouped import project, project_weight_grad, row_sizes, use_triton
from ..ops.grouped_mm_engine import combined_up_weights
from ..ops.routing import route_reference


def _cpu_grouped_mm(a: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor]) -> Tensor:
    """Per-expert matmuls of expert-sorted rows: (M, K) ``a``, whose rows of expert e are
    [offsets[e], offsets[e+1]), times (E, K, N) ``w``; with ``w_second`` (E, K, N) too, the (M, 2N) [a@w | a@w_second]
    (``project_up``: one matmul per expert where the two are one tensor's halves or interleaved columns). Rows past
    ``offsets[-1]`` are zero."""
    M = a.shape[0]
    sizes, kept = row_sizes(offsets, M)
    out = a.new_empty(M, w.shape[2] * (1 if w_second is None else 2))
    if kept < M:
        out[kept:].zero_()
    return project_up(a, sizes, w, w_second, out)


def _cpu_grouped_mm_backward(grad: Tensor, a: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor],
                             need_a: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """The gradients of ``cpu_grouped_mm`` from the gradient ``grad`` of its (M, N) or (M, 2N) output, in one pass
    over the experts (one host read of their sizes, one split of the rows):

    - (M, K) ``da``: ``grad[:, :N] @ w[e]^T (+ grad[:, N:] @ w_second[e]^T)`` per expert, zero past the experts;
    - (E, K, N) or (E, K, 2N) ``dw``: ``a[rows of e]^T @ grad[rows of e]`` per expert, zero for an expert with no
      rows: w's gradient and then w_second's, as the columns of ``grad`` hold them.

    An empty tensor where not wanted. Whether the two weights are one tensor's halves or its interleaved columns is
    decided here, on the real tensors, as in the forward."""
    M = grad.shape[0]
    sizes, kept = row_sizes(offsets, M)
    n = w.shape[2]
    da = dw = grad.new_empty(0)
    if need_a:
        da = grad.new_empty(M, w.shape[1])
        if kept < M:
            da[kept:].zero_()
        both = combined_up_weights(w, w_second)
        pairs = interleaved_pairs(w, w_second) if both is None else None
        if both is not None:  # one matmul per expert through the whole gate/up weight
            project(grad, sizes, both.transpose(1, 2), da)
        elif pairs is not None:  # the gradient's two halves interleaved as the weight's columns are
            project(torch.stack((grad[:, :n], grad[:, n:]), -1).view(M, 2 * n), sizes, pairs.transpose(1, 2), da)
        else:
            project(grad[:, :n], sizes, w.transpose(1, 2), da)
            if w_second is not None:
                da[:kept] += project(grad[:, n:], sizes, w_second.transpose(1, 2), torch.empty_like(da))[:kept]
    if need_w:
        dw = project_weight_grad(a, grad, sizes, a.new_empty(w.shape[0], a.shape[1], grad.shape[1]))
    return da, dw


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
_LIB.define("cpu_grouped_mm_backward(Tensor grad, Tensor a, Tensor offsets, Tensor w, Tensor? w_second, bool need_a, "
            "bool need_w) -> (Tensor, Tensor)")
_LIB.impl("cpu_grouped_mm_backward", _cpu_grouped_mm_backward, "CPU")


def _grouped_mm_fake(a, offsets, w, w_second):
    return a.new_empty(a.shape[0], w.shape[2] * (1 if w_second is None else 2))


torch.library.register_fake("moe_inductor::cpu_grouped_mm", _grouped_mm_fake)
torch.library.register_fake("moe_inductor::cpu_grouped_mm_autograd", _grouped_mm_fake)


@torch.library.register_fake("moe_inductor::cpu_grouped_mm_backward")
def _(grad, a, offsets, w, w_second, need_a, need_w):
    return (grad.new_empty(grad.shape[0], w.shape[1]) if need_a else grad.new_empty(0),
            a.new_empty(w.shape[0], a.shape[1], grad.shape[1]) if need_w else grad.new_empty(0))


cpu_grouped_mm = torch.ops.moe_inductor.cpu_grouped_mm.default
cpu_grouped_mm_autograd = torch.ops.moe_inductor.cpu_grouped_mm_autograd.default
cpu_grouped_mm_backward = torch.ops.moe_inductor.cpu_grouped_mm_backward.default


def _setup(ctx, inputs, output):
    a, offsets, w, w_second = inputs
    ctx.save_for_backward(a, offsets, w, w_second)
    ctx.second = w_second is not None


def _backward(ctx, grad):
    """Rows past ``offsets[-1]`` are zeros whatever ``a`` holds: their gradient is zero, as the matmuls give it."""
    a, offsets, w, w_second = ctx.saved_tensors
    n = w.shape[2]
    need_a, need_w1 = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    need_w2 = ctx.second and ctx.needs_input_grad[3]
    da, dw = cpu_grouped_mm_backward(grad, a, offsets, w, w_second, need_a, need_w1 or need_w2)
    return (da if need_a else None, None, dw[..., :n] if need_w1 else None, dw[..., n:] if need_w2 else None)


torch.library.register_autograd("moe_inductor::cpu_grouped_mm_autograd", _backward, setup_context=_setup)


@functools.lru_cache(maxsize=None)
def aten_grouped_mm_serves(dtype: torch.dtype) -> bool:
    """Whether an inference graph in ``dtype`` takes ``torch._grouped_mm`` for its matmuls instead of
    ``cpu_grouped_mm``: in bf16, where its per-expert loop in C++ measured faster than ours (in fp32 ours is the
    faster; RESULTS.md, twentieth session), and only where this torch runs it on the CPU and gets it right (asked
    once, on a tiny case with an empty expert)."""
    if dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.arange(1, 4, dtype=dtype).repeat_interleave(8).view(3, 8)
        y = torch._grouped_mm(a, torch.ones(3, 8, 8, dtype=dtype), offs=torch.tensor([1, 1, 3], dtype=torch.int32))
        return y.shape == (3, 8) and y[:, 0].tolist() == [8.0, 16.0, 24.0]
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False


def _grouped_mm_takes(t: Optional[Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` takes ``t`` (rows, or an (E, K, N) weight): one of its matrix dims of stride 1,
    and its other strides and its start on 16-byte boundaries, as the op checks."""
    if t is None:
        return True
    size = t.element_size()
    if t.stride(-1) != 1 and t.stride(-2) != 1:
        return False
    return (t.storage_offset() * size) % 16 == 0 and all(
        (s * size) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def _aten_up_weights(w1: Tensor, w1_up: Optional[Tensor]) -> Optional[tuple[tuple[Tensor, ...], bool]]:
    """The weights ``torch._grouped_mm`` multiplies for the up projection, and whether they are one interleaved
    (gate, up) pair weight: the one (E, K, 2N) view where the two are one tensor's halves or its interleaved columns,
    else the two tensors; None where the op does not take them (a stride-2 view that is not half of a pair, say)."""
    both = combined_up_weights(w1, w1_up)
    if both is not None and _grouped_mm_takes(both):
        return (both,), False
    pairs = interleaved_pairs(w1, w1_up)
    if pairs is not None and _grouped_mm_takes(pairs):
        return (pairs,), True
    if w1_up is not None and _grouped_mm_takes(w1) and _grouped_mm_takes(w1_up):
        return (w1, w1_up), False
    return None


def _aten_matmuls_fit(x: Tensor, w1: Tensor, w1_up: Optional[Tensor], w2: Tensor) -> bool:
    """Whether ``_aten_up`` and the down projection can run this layer through ``torch._grouped_mm``: rows of H
    and I elements on 16-byte boundaries, and weights it takes."""
    H, I = x.shape[1], w2.shape[1]
    if (H * x.element_size()) % 16 or (I * x.element_size()) % 16:
        return False
    return _aten_up_weights(w1, w1_up) is not None and _grouped_mm_takes(w2)


def _aten_up(rows: Tensor, offsets: Tensor, w1: Tensor, w1_up: Optional[Tensor]) -> Tensor:
    """``cpu_grouped_mm``'s up projection by ``torch._grouped_mm`` (inference only; ``_aten_matmuls_fit`` first):
    [rows @ w1[e] | rows @ w1_up[e]] per expert. Rows past ``offsets[-1]`` are left undefined (the caller masks
    them): its backward would leave their gradient so too, which is why differentiated graphs keep
    ``cpu_grouped_mm_autograd``."""
    weights, interleaved = _aten_up_weights(w1, w1_up)
    outs = [torch._grouped_mm(rows, w, offs=offsets[1:]) for w in weights]
    if interleaved:  # (gate, up) column pairs come out as the weight holds them; the halves, as cpu_grouped_mm's
        outs = [outs[0][:, 0::2], outs[0][:, 1::2]]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def experts_forward_traced(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward`` with its arguments, in aten ops and ``cpu_grouped_mm`` (the same five outputs), for
    Inductor to trace on the CPU."""
    return _traced(args, aten_matmuls=False)


def experts_forward_traced_aten_matmuls(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward_traced`` with an inference graph's matmuls as ``torch._grouped_mm`` (where
    ``aten_grouped_mm_serves`` says so; a differentiated graph keeps ``cpu_grouped_mm_autograd``)."""
    return _traced(args, aten_matmuls=True)


def _traced(args: tuple, aten_matmuls: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
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
    aten_matmuls = aten_matmuls and not differentiated and _aten_matmuls_fit(x, w.w1, w.w1_up, w.w2)
    if aten_matmuls:
        # rows past offsets[-1] come out undefined: zeros, as cpu_grouped_mm gives them (a select, not a product,
        # so that no inf or nan there reaches anything)
        h = torch.where(valid, _aten_up(rows, offsets, w.w1, w.w1_up), 0.0)
    else:
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
    if aten_matmuls:
        o = torch._grouped_mm(a.to(x.dtype), w.w2, offs=offsets[1:])  # its undefined rows: masked below
    else:
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
                aten = aten_grouped_mm_serves(x.dtype)
                node.target = experts_forward_traced_aten_matmuls if aten else experts_forward_traced
                swapped += 1
    if swapped:
        from torch._dynamo.utils import counters

        counters["moe_inductor_cpu_lowering"]["swapped"] += swapped
        gm.recompile()
    return swapped
