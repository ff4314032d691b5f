"""The CPU lowering of the experts forward (lowerings/cpu.py): the traced forward against the naive reference and the
opaque op, the matmul op's opcheck, and which graphs the backend swaps it into."""
import pytest
import torch
from torch._dynamo.utils import counters

from moe_inductor.lowerings.cpu import (aten_grouped_mm_serves, cpu_grouped_mm, cpu_grouped_mm_autograd,
                                        experts_forward_traced, experts_forward_traced_aten_matmuls,
                                        swap_in_cpu_lowering)
from moe_inductor.ops import expert_weight_views, moe_reference
from tests.helpers import assert_close, make_problem


def _args(p, position="output", capacity=None, save_pre=True, gate_up="concat"):
    g, u, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation=p.activation, layout=p.layout, gate_up=gate_up)
    return (p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, p.activation, position, 1.702, 7.0, capacity,
            save_pre)


CASES = {  # name: (T, E, k, problem options, call options)
    "T0": (0, 4, 2, {}, {}),
    "T1": (1, 4, 2, {}, {}),
    "E7-bias-between": (9, 7, 2, {"bias": True}, {"position": "between"}),
    "one-hot-expert-input": (10, 6, 2, {"routing": "one_expert"}, {"position": "input"}),
    "empty-experts-plain": (12, 6, 2, {"routing": "skip_odd", "activation": "gelu"}, {}),
    "capacity-bias": (9, 5, 2, {"bias": True}, {"capacity": 2}),
    "separate-gate-up": (8, 5, 2, {"layout": "kn", "gate_up": "interleaved"}, {"gate_up": "interleaved"}),
}


@pytest.mark.parametrize("traced", [experts_forward_traced, experts_forward_traced_aten_matmuls],
                         ids=["cpu_grouped_mm", "aten_grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_traced_forward_matches_the_reference_and_the_opaque_op(case, dtype, traced, nan_empty):
    """Run eagerly, the forward Inductor traces gives the reference's y and the opaque op's metadata and raw up
    projections (``nan_empty``: a row it never writes shows up as NaN), with its matmuls by our op or, as bf16
    inference graphs take them, by ``torch._grouped_mm`` (whose rows past the experts' are undefined: dropped by
    capacity here, they must not reach y or pre)."""
    if traced is experts_forward_traced_aten_matmuls and not aten_grouped_mm_serves(torch.bfloat16):
        pytest.skip("this torch has no torch._grouped_mm on the CPU")
    T, E, k, problem, call = CASES[case]
    p = make_problem(T, 16, 8, E, k, dtype=dtype, requires_grad=False, **problem)
    args = _args(p, **call)
    got = traced(*args)
    ref = moe_reference(*args[:14])
    assert_close(got[0], ref, dtype, "y")
    opaque = torch.ops.moe_inductor.experts_forward(*args)
    for a, b, name in zip(got[1:], opaque[1:], ("pre", "order", "sorted_expert", "offsets")):
        torch.testing.assert_close(a, b, msg=name)


def _per_expert_loop(rows, offsets, w, w_second):
    """cpu_grouped_mm as the definition reads: expert e's rows times w[e] (and w_second[e]), zero past the experts."""
    bounds = offsets.tolist()
    width = w.shape[2] * (1 if w_second is None else 2)
    parts = []
    for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part = rows[lo:hi] @ w[e]
        parts.append(torch.cat([part, rows[lo:hi] @ w_second[e]], 1) if w_second is not None else part)
    parts.append(rows.new_zeros(rows.shape[0] - bounds[-1], width))
    return torch.cat(parts)


@pytest.mark.parametrize("second,capacity,routing,layout", [
    ("combined", None, "random", "nk"),
    ("separate", None, "random", "nk"),    # interleaved columns of a transposed weight: two separate views
    ("separate", 1, "random", "kn"),       # GPT-OSS's (E, H, 2I) interleaved weight: read whole, with drops
    (None, 1, "random", "nk"),             # rows past the experts (capacity drops) are zero, and so their gradient
    ("combined", None, "skip_odd", "nk"),  # empty experts: a zero weight gradient
    (None, None, "one_expert", "nk"),      # every row on experts 0 and 1
], ids=["combined-gate-up", "separate-gate-up", "interleaved-pairs-kn", "plain-dropped-rows", "empty-experts",
        "one-hot"])
def test_cpu_grouped_mm_and_its_gradients_match_a_per_expert_loop(second, capacity, routing, layout):
    """The matmul op, forward and backward (its gradients' op), against the per-expert loop, and opcheck of the
    three ops."""
    from moe_inductor.kernels.weight_views import interleaved_pairs
    from moe_inductor.lowerings.cpu import cpu_grouped_mm_backward
    from moe_inductor.ops.routing import route_reference

    E = 5
    p = make_problem(7, 16, 8, E, 2, requires_grad=False, activation="silu_glu" if second else "gelu",
                     gate_up="interleaved" if second == "separate" else "concat", routing=routing, layout=layout)
    g, u, _, _, _ = expert_weight_views(p.w1, p.w2, None, activation=p.activation, layout=layout,
                                        gate_up="interleaved" if second == "separate" else "concat")
    order, _, offsets = route_reference(p.topk_ids, E, capacity)
    rows = p.x[order.long() // 2]
    torch.library.opcheck(cpu_grouped_mm, (rows, offsets, g, u))
    torch.library.opcheck(cpu_grouped_mm_autograd, (rows, offsets, g, u))
    out = cpu_grouped_mm(rows, offsets, g, u)
    kept = int(offsets[-1])
    assert (out[kept:] == 0).all() and (capacity is None) == (kept == rows.shape[0])
    dout = torch.randn_like(out)
    for need_a, need_w in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(cpu_grouped_mm_backward, (dout, rows, offsets, g, u, need_a, need_w))

    # the gradients reach the weight the user holds (both halves of gate_up, where gated) through its views
    leaves = [rows.clone().requires_grad_(), p.w1.clone().requires_grad_()]
    views = expert_weight_views(leaves[1], p.w2, None, activation=p.activation, layout=layout,
                                gate_up="interleaved" if second == "separate" else "concat")[:2]
    assert (interleaved_pairs(*views) is not None) == (layout == "kn" and second == "separate")
    got = cpu_grouped_mm_autograd(leaves[0], offsets, *views)
    want = _per_expert_loop(leaves[0], offsets, *views)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, b)


def test_cpu_grouped_mm_without_a_backward_refuses_inputs_that_need_a_gradient():
    """The inference graphs' op has no backward: a gradient through it would be silently missing, so it raises."""
    a, w = torch.randn(4, 8), torch.randn(2, 8, 3, requires_grad=True)
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no backward"):
        cpu_grouped_mm(a, offsets, w, None)
    with torch.no_grad():
        torch.testing.assert_close(cpu_grouped_mm(a, offsets, w, None), torch.cat([a[:1] @ w[0], a[1:] @ w[1]]))


def _graph(inputs: tuple) -> torch.fx.GraphModule:
    def moe(x, ids, w, g, u, d):
        return torch.ops.moe_inductor.experts_forward.default(x, ids, w, g, u, d, None, None, None, "silu_glu",
                                                              "output", 1.702, 7.0, None, False)[0]

    gm = torch.fx.symbolic_trace(moe)
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        node.meta["val"] = value
    return gm


@pytest.mark.parametrize("requires_grad,grad_mode", [(False, True), (True, False), (True, True)],
                         ids=["nothing-needs-grad", "no-grad-mode", "training"])
def test_the_swap_takes_inference_and_training_graphs(requires_grad, grad_mode):
    """The matmul op has a backward, so a graph AOTAutograd differentiates takes the lowering too."""
    p = make_problem(7, 16, 8, 5, 2, requires_grad=requires_grad)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    gm = _graph((p.x, p.topk_ids, p.topk_weights, g, u, d))
    counters.clear()
    with torch.set_grad_enabled(grad_mode):
        assert swap_in_cpu_lowering(gm) == 1
    assert counters["moe_inductor_cpu_lowering"]["swapped"] == 1


def _compiled_inference(run, args: tuple, dtype: torch.dtype):
    """``run`` compiled under the Inductor inner compiler and called on ``args`` without grad: its output must be
    eager's and the lowering swapped in once. Returns the compiled function and the generated code."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run, backend="moe_inductor", options={"inner": "inductor"})
    with torch.no_grad():
        got, codes = run_and_get_code(compiled, *args)
        assert_close(got, run(*args), dtype)
    assert counters["moe_inductor_cpu_lowering"]["swapped"] == 1
    return compiled, codes


@pytest.mark.parametrize("options", [{}, {"capacity": 2, "bias": True}], ids=["plain", "capacity-drops-bias"])
def test_compiled_under_inductor_matches_eager_and_takes_the_lowering(options):
    """Inference through the Inductor inner compiler takes the lowering; the model's output is eager's, dropped rows
    and their biases included. The combine in the generated code is a gather, not an atomic scatter-add."""
    import moe_inductor

    capacity, bias = options.get("capacity"), options.get("bias", False)
    p = make_problem(6, 16, 8, 5, 2, bias=bias, requires_grad=False)

    def run(x, ids, w):
        return moe_inductor.fused_experts(x, ids, w, p.w1, p.w2, b1=p.b1, b2=p.b2, capacity=capacity)

    _, codes = _compiled_inference(run, (p.x, p.topk_ids, p.topk_weights), torch.float32)
    assert not any("atomic_add" in code for code in codes)
    assert any("cpu_grouped_mm.default" in code for code in codes)
    assert not any("cpu_grouped_mm_autograd" in code for code in codes)  # no autograd kernel per call


@pytest.mark.parametrize("case", [
    dict(),
    dict(capacity=2, bias=True),  # undefined rows of torch._grouped_mm past the experts' (drops), under biases
    dict(layout="kn", gate_up="interleaved", activation="gptoss_glu", bias=True),  # one call for the pairs
], ids=["plain", "capacity-drops-bias", "gptoss-interleaved"])
def test_bf16_inference_takes_aten_grouped_mm(case):
    """A bf16 inference graph runs its matmuls as ``torch._grouped_mm`` (no op of ours left in the generated code)
    and gives eager's output. A bf16 training graph of the same layer keeps ``cpu_grouped_mm_autograd``: the aten
    op's backward would leave the gradient of dropped rows undefined."""
    import moe_inductor
    from torch._inductor.utils import run_and_get_code

    if not aten_grouped_mm_serves(torch.bfloat16):
        pytest.skip("this torch has no torch._grouped_mm on the CPU")
    case = dict(case)
    capacity = case.pop("capacity", None)
    p = make_problem(9, 16, 8, 5, 2, dtype=torch.bfloat16, requires_grad=False, **case)

    def run(x, w, w1):
        return moe_inductor.fused_experts(x, p.topk_ids, w, w1, p.w2, b1=p.b1, b2=p.b2, activation=p.activation,
                                          layout=p.layout, gate_up=p.gate_up, capacity=capacity)

    compiled, codes = _compiled_inference(run, (p.x, p.topk_weights, p.w1), torch.bfloat16)
    assert any("_grouped_mm" in code for code in codes)
    assert not any("cpu_grouped_mm" in code for code in codes)
    torch._dynamo.reset()
    w1 = p.w1.clone().requires_grad_()
    _, codes = run_and_get_code(lambda: compiled(p.x, p.topk_weights, w1).float().sum().backward())
    assert any("cpu_grouped_mm_autograd" in code for code in codes)


@pytest.mark.parametrize("hidden,dtype", [(12, torch.bfloat16), (16, torch.float32)],
                         ids=["bf16-rows-off-16-bytes", "fp32"])
def test_inference_keeps_cpu_grouped_mm_where_aten_grouped_mm_does_not_serve(hidden, dtype):
    """Rows of 12 bf16 values (24 bytes) are off the 16-byte strides ``torch._grouped_mm`` checks for, and fp32
    measured faster on our op: both keep ``cpu_grouped_mm``, with eager's output."""
    import moe_inductor

    p = make_problem(9, hidden, 8, 5, 2, dtype=dtype, requires_grad=False)

    def run(x, w):
        return moe_inductor.fused_experts(x, p.topk_ids, w, p.w1, p.w2)

    _, codes = _compiled_inference(run, (p.x, p.topk_weights), dtype)
    assert any("cpu_grouped_mm.default" in code for code in codes)
    assert not any("aten._grouped_mm" in code for code in codes)


@pytest.mark.parametrize("case", [
    dict(),
    dict(capacity=2, bias=True, weight_position="between"),  # drops, biases, the scale between the projections
    dict(layout="kn", gate_up="interleaved", activation="gptoss_glu", bias=True),  # GPT-OSS's layout
    dict(weight_position="input", activation="gelu"),  # not gated, the scale on the expert's input
    dict(activation="clamped_silu_glu", limit=0.5),  # Step-3.7's, at a bound that binds on both factors
], ids=["plain", "capacity-bias-between", "gptoss-interleaved", "input-gelu", "step3p7-clamped"])
def test_compiled_training_under_inductor_matches_eager(case):
    """A training step through the Inductor inner compiler takes the lowering; y and every gradient (tokens,
    routing weights, weights, biases) equal eager's. Without biases (whose gradient sums rows per expert) the
    generated forward and backward have no atomic add."""
    import moe_inductor
    from torch._inductor.utils import run_and_get_code

    case = dict(case)
    capacity, position = case.pop("capacity", None), case.pop("weight_position", "output")
    limit = case.pop("limit", 7.0)
    p = make_problem(9, 16, 8, 5, 2, requires_grad=False, **case)
    leaves = [t.clone().requires_grad_() for t in (p.x, p.topk_weights, p.w1, p.w2)]
    leaves += [t.clone().requires_grad_() for t in (p.b1, p.b2) if t is not None]

    def run(x, w, w1, w2, *biases):
        b1, b2 = biases if biases else (None, None)
        return moe_inductor.fused_experts(x, p.topk_ids, w, w1, w2, b1=b1, b2=b2, activation=p.activation,
                                          layout=p.layout, gate_up=p.gate_up, weight_position=position,
                                          capacity=capacity, limit=limit)

    def step(fn):
        y = fn(*leaves)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        return (y,) + torch.autograd.grad(y, leaves, dy)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run, backend="moe_inductor", options={"inner": "inductor"})
    got, codes = run_and_get_code(lambda: step(compiled))
    for a, b, name in zip(got, step(run), ("y", "dx", "dw", "dw1", "dw2", "db1", "db2")):
        assert_close(a, b, torch.float32, name)
    assert counters["moe_inductor_cpu_lowering"]["swapped"] == 1
    assert len(codes) == 2  # the forward and the backward
    if p.b1 is None:
        assert not any("atomic_add" in code for code in codes)
