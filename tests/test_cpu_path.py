"""The CPU lowering of the experts forward (lowerings/cpu.py): the traced forward against the naive reference and the
opaque op, the matmul op's opcheck, and which graphs the backend swaps it into."""
import pytest
import torch
from torch._dynamo.utils import counters

from moe_inductor.lowerings.cpu import cpu_grouped_mm, experts_forward_traced, swap_in_cpu_lowering
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_traced_forward_matches_the_reference_and_the_opaque_op(case, dtype, nan_empty):
    """Run eagerly, the forward Inductor traces gives the reference's y and the opaque op's metadata and raw up
    projections (``nan_empty``: a row it never writes shows up as NaN)."""
    T, E, k, problem, call = CASES[case]
    p = make_problem(T, 16, 8, E, k, dtype=dtype, requires_grad=False, **problem)
    args = _args(p, **call)
    got = experts_forward_traced(*args)
    ref = moe_reference(*args[:14])
    assert_close(got[0], ref, dtype, "y")
    opaque = torch.ops.moe_inductor.experts_forward(*args)
    for a, b, name in zip(got[1:], opaque[1:], ("pre", "order", "sorted_expert", "offsets")):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("second,capacity", [("combined", None), ("separate", None), (None, 1)],
                         ids=["combined-gate-up", "separate-gate-up", "plain-dropped-rows"])
def test_opcheck_cpu_grouped_mm(second, capacity):
    from moe_inductor.ops.routing import route_reference

    p = make_problem(7, 16, 8, 5, 2, requires_grad=False, activation="silu_glu" if second else "gelu",
                     gate_up="interleaved" if second == "separate" else "concat")
    g, u, _, _, _ = expert_weight_views(p.w1, p.w2, None, activation=p.activation, layout="nk",
                                        gate_up="interleaved" if second == "separate" else "concat")
    order, _, offsets = route_reference(p.topk_ids, 5, capacity)
    rows = p.x[order.long() // 2]
    torch.library.opcheck(cpu_grouped_mm, (rows, offsets, g, u))
    out = cpu_grouped_mm(rows, offsets, g, u)
    kept = int(offsets[-1])
    assert (out[kept:] == 0).all() and (capacity is None) == (kept == rows.shape[0])


def test_cpu_grouped_mm_refuses_inputs_that_need_a_gradient():
    """It has no backward: a gradient through it would be silently missing, so it raises instead."""
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


@pytest.mark.parametrize("requires_grad,grad_mode,swapped", [(False, True, 1), (True, False, 1), (True, True, 0)],
                         ids=["nothing-needs-grad", "no-grad-mode", "training"])
def test_the_swap_takes_inference_graphs_only(requires_grad, grad_mode, swapped):
    """The matmul op has no autograd: a graph AOTAutograd differentiates keeps the opaque op."""
    p = make_problem(7, 16, 8, 5, 2, requires_grad=requires_grad)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    gm = _graph((p.x, p.topk_ids, p.topk_weights, g, u, d))
    counters.clear()
    with torch.set_grad_enabled(grad_mode):
        assert swap_in_cpu_lowering(gm) == swapped
    assert counters["moe_inductor_cpu_lowering"]["swapped"] == swapped


@pytest.mark.parametrize("options", [{}, {"capacity": 2, "bias": True}], ids=["plain", "capacity-drops-bias"])
def test_compiled_under_inductor_matches_eager_and_takes_the_lowering(options):
    """Inference through the Inductor inner compiler takes the lowering; the model's output is eager's, dropped rows
    and their biases included. The combine in the generated code is a gather, not an atomic scatter-add."""
    import moe_inductor
    from torch._inductor.utils import run_and_get_code

    capacity, bias = options.get("capacity"), options.get("bias", False)
    p = make_problem(6, 16, 8, 5, 2, bias=bias, requires_grad=False)

    def run(x, ids, w):
        return moe_inductor.fused_experts(x, ids, w, p.w1, p.w2, b1=p.b1, b2=p.b2, capacity=capacity)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run, backend="moe_inductor", options={"inner": "inductor"})
    with torch.no_grad():
        got, codes = run_and_get_code(compiled, p.x, p.topk_ids, p.topk_weights)
        assert_close(got, run(p.x, p.topk_ids, p.topk_weights), torch.float32)
    assert counters["moe_inductor_cpu_lowering"]["swapped"] == 1
    assert not any("atomic_add" in code for code in codes)
