"""On the CPU, under the Inductor inner compiler, the experts forward of an inference graph as aten ops that
Inductor fuses, around one opaque op that runs the per-expert matmuls (``moe_inductor::cpu_grouped_mm``).

Why: ``moe_inductor::experts_forward`` is opaque to Inductor, so on the CPU its routing, gather, activation,
routing-weight scale and combine run as ~17 separate aten calls behind the dispatcher and our Python, while
``backend="inductor"`` fuses the same steps of transformers' grouped_mm path into a few generated C++ kernels around
its own opaque per-expert matmul loop. On the 2-layer quickstart model the opaque op is 1.1-1.2x slower than
Inductor's path; this lowering is 0.87-0.96x of it (benchmarks/RESULTS.md, CPU). Here Inductor sees everything but
the matmul loop, which needs the per-expert row counts on the host (one ``tolist`` per call) and so cannot be
traced.

The traced forward computes on all T*k assignment rows, so that no shape depends on the routing: rows past
``offsets[-1]`` (capacity drops, ids outside [0, E)) are zeros out of the matmul op and are masked out of the
combine. The arithmetic is ``ops/cpu_path.py``'s: raw up projections (``pre`` for a backward), the routing scale
on the accumulator ("input"), after the activation ("between") or after the down projection ("output"), biases,
and the combine in fp32 for 16-bit inputs.

Only inference graphs take it (``_builds_no_backward``): the matmul op has no autograd, and a training graph keeps
the opaque op, whose backward is ``experts_backward``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops.activations import apply_activation
from ..ops.call import from_op_args
from ..ops.cpu_path import project
from ..ops.grouped import use_triton
from ..ops.grouped_mm_engine import combined_up_weights
from ..ops.routing import route_reference


def _cpu_grouped_mm(a: Tensor, offsets: Tensor, w: Tensor, w_second: Optional[Tensor]) -> Tensor:
    """Per-expert matmuls of expert-sorted rows: (M, K) ``a``, whose rows of expert e are
    [offsets[e], offsets[e+1]), times (E, K, N) ``w``; with ``w_second`` (E, K, N) too, the (M, 2N) [a@w | a@w_second]
    (one matmul on the combined weight when the two are the halves of one tensor). Rows past ``offsets[-1]`` are
    zero."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, w, w_second)):
        raise RuntimeError("moe_inductor::cpu_grouped_mm has no backward: it serves inference graphs only")
    bounds = offsets.tolist()
    M, kept = a.shape[0], bounds[-1]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])] + [M - kept]
    n = w.shape[2]
    out = a.new_empty(M, n * (1 if w_second is None else 2))
    if kept < M:
        out[kept:].zero_()
    both = combined_up_weights(w, w_second)
    if both is not None:
        project(a, sizes, both, out)
    else:  # two tensors: each half of the output gets its own matmul
        project(a, sizes, w, out[:, :n])
        project(a, sizes, w_second, out[:, n:])
    return out


# Defined through torch.library.Library rather than custom_op: the op runs twice per layer in host-bound graphs, and
# over its body's own time custom_op's Python dispatch adds about 50 us a call on the 2-core CPU machine, a plain CPU
# kernel about 20 us (RESULTS.md, CPU). It has no autograd kernel; the kernel refuses inputs that need a gradient.
_LIB = torch.library.Library("moe_inductor", "FRAGMENT")
_LIB.define("cpu_grouped_mm(Tensor a, Tensor offsets, Tensor w, Tensor? w_second) -> Tensor")
_LIB.impl("cpu_grouped_mm", _cpu_grouped_mm, "CPU")


@torch.library.register_fake("moe_inductor::cpu_grouped_mm")
def _(a, offsets, w, w_second):
    return a.new_empty(a.shape[0], w.shape[2] * (1 if w_second is None else 2))


cpu_grouped_mm = torch.ops.moe_inductor.cpu_grouped_mm.default


def experts_forward_traced(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``experts_forward`` with its arguments, in aten ops and ``cpu_grouped_mm`` (the same five outputs), for
    Inductor to trace on the CPU."""
    call = from_op_args(args)
    x, w, act, position = call.x, call.weights, call.activation, call.weight_position
    T, H = x.shape
    E, _, I = w.w1.shape
    k = call.routing.topk_ids.shape[1]
    order, sorted_expert, offsets = route_reference(call.routing.topk_ids, E, call.routing.capacity)
    assignment = order.long()
    valid = (sorted_expert < E)[:, None]
    expert = sorted_expert.long().clamp(max=E - 1)
    s = call.routing.topk_weights.reshape(-1)[assignment][:, None]
    token = assignment // k
    gated = w.w1_up is not None
    h = cpu_grouped_mm(x[token], offsets, w.w1, w.w1_up)
    gate, up = (h[:, :I], h[:, I:]) if gated else (h, None)
    if position == "input":
        gate, up = gate * s.to(h.dtype), (up * s.to(h.dtype) if gated else None)
    if w.b1 is not None:
        gate = gate + w.b1[expert]
        up = up + w.b1_up[expert] if gated else None
    a = apply_activation(act.name, gate, up, act.alpha, act.limit)
    if position == "between":
        a = a * s.to(a.dtype)
    o = cpu_grouped_mm(a.to(x.dtype), offsets, w.w2, None)
    if w.b2 is not None:
        o = o + w.b2[expert]
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    o = o.to(acc)
    if position == "output":
        o = o * s.to(acc)
    o = torch.where(valid, o, 0.0)  # a dropped row's bias or scale must not reach y
    # The combine gathers each token's k rows back through the inverse of ``order`` and sums them: a scatter-add
    # (``index_add_``) becomes an atomic add per element in Inductor's C++ kernel, which costs more than the gather.
    slot = torch.empty_like(assignment).scatter_(0, assignment, torch.arange(T * k, device=x.device))
    y = o[slot].view(T, k, H).sum(1).to(x.dtype)
    pre = h if call.save_pre else x.new_empty(0)
    return y, pre, order, sorted_expert, offsets


def _example(node: object) -> Optional[object]:
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _builds_no_backward(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether AOTAutograd builds no backward through ``node``: none of its tensor arguments requires grad (every
    argument node with a recorded example value), or grad mode is off at compile time and the graph never turns it
    on."""
    examples = [_example(a) for a in node.args if isinstance(a, torch.fx.Node)]
    if all(t is not None for t in examples) and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in examples):
        return True
    if torch.is_grad_enabled():
        return False
    return not any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in gm.graph.nodes)


def swap_in_cpu_lowering(gm: torch.fx.GraphModule) -> int:
    """Point every ``experts_forward`` call on plain CPU tensors in an inference graph at
    ``experts_forward_traced``; returns how many were swapped."""
    swapped = 0
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.moe_inductor.experts_forward.default
                and not node.kwargs):
            x = _example(node.args[0])
            if (isinstance(x, torch.Tensor) and x.device.type == "cpu" and not use_triton(x)
                    and _builds_no_backward(gm, node)):
                node.target = experts_forward_traced
                swapped += 1
    if swapped:
        from torch._dynamo.utils import counters

        counters["moe_inductor_cpu_lowering"]["swapped"] += swapped
        gm.recompile()
    return swapped
