"""The fused experts op on the CPU path against the independent naive reference: forward and backward."""
import pytest
import torch

import moe_inductor
from moe_inductor.ops import expert_weight_views, experts_backward, experts_forward, moe_reference, route
from tests.helpers import assert_close, graph_keeping_backend, make_problem

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_both(p, weight_position="output", capacity=None, alpha=1.702, limit=7.0):
    """(ours, reference) outputs and gradients of every leaf for one upstream gradient."""
    y = moe_inductor.fused_experts(
        p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2, activation=p.activation, layout=p.layout,
        gate_up=p.gate_up, weight_position=weight_position, capacity=capacity, alpha=alpha, limit=limit,
    )
    g, u, d, bg, bu = p.views()
    ref = moe_reference(p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, p.activation, weight_position,
                        alpha, limit, capacity)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    leaves = p.leaves()
    if y.numel() == 0:
        return y, ref, [], []
    ours = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    theirs = torch.autograd.grad(ref, leaves, dy, allow_unused=True)
    return y, ref, ours, theirs


def check(p, dtype, **kw):
    y, ref, ours, theirs = run_both(p, **kw)
    assert_close(y, ref, dtype, "y")
    names = ["x", "topk_weights", "w1", "w2", "b1", "b2"]
    for name, a, b in zip(names, ours, theirs):
        if b is None:
            b = torch.zeros_like(a)
        assert_close(a, b, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize(
    "T,E,k",
    [
        pytest.param(0, 4, 2, id="T0"),
        pytest.param(1, 4, 2, id="T1"),
        pytest.param(5, 7, 2, id="E7-prime"),
        pytest.param(33, 6, 1, id="k1"),
        pytest.param(9, 3, 3, id="k-eq-E"),
    ],
)
def test_edge_shapes(T, E, k, dtype, nan_empty):
    check(make_problem(T, 16, 12, E, k, dtype=dtype), dtype)


@pytest.mark.parametrize("routing", ["one_expert", "skip_odd"], ids=["all-on-one-expert", "empty-experts"])
def test_skewed_routing(routing, nan_empty):
    check(make_problem(20, 16, 8, 6, 2, routing=routing), torch.float32)


@pytest.mark.parametrize("activation", ["silu_glu", "gelu_glu", "gelu_tanh_glu", "gptoss_glu", "clamped_silu_glu",
                                        "gelu", "relu", "silu"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_activations(activation, bias):
    p = make_problem(11, 16, 8, 5, 2, activation=activation, bias=bias, seed=3)
    clamped = activation in ("gptoss_glu", "clamped_silu_glu")
    if clamped:  # push values past the clamp so both sides of it are exercised
        with torch.no_grad():
            p.w1.mul_(8)
    check(p, torch.float32, limit=2.0 if clamped else 7.0)


@pytest.mark.parametrize("layout,gate_up", [("nk", "concat"), ("kn", "concat"), ("kn", "interleaved"),
                                            ("nk", "interleaved")])
def test_weight_layouts(layout, gate_up):
    check(make_problem(13, 16, 8, 4, 2, layout=layout, gate_up=gate_up, bias=True), torch.float32)


@pytest.mark.parametrize("weight_position", ["output", "between", "input"])
def test_weight_positions(weight_position):
    check(make_problem(13, 16, 8, 4, 2, bias=True), torch.float32, weight_position=weight_position)


@pytest.mark.parametrize("k,capacity", [(1, 2), (2, 3), (2, 100)], ids=["top1-C2", "top2-C3", "no-drops"])
def test_capacity_drops(k, capacity, nan_empty):
    check(make_problem(17, 16, 8, 3, k, bias=True), torch.float32, capacity=capacity)


def test_separate_gate_up_tensors():
    p = make_problem(9, 16, 8, 4, 2)
    gate, up = p.w1.detach()[:, :8].clone().requires_grad_(), p.w1.detach()[:, 8:].clone().requires_grad_()
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, (gate, up), p.w2)
    ref = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    assert_close(y, ref, torch.float32, "y")


def test_non_contiguous_inputs():
    p = make_problem(10, 16, 8, 4, 2, requires_grad=False)
    x_wide = torch.randn(10, 32)
    x_wide[:, ::2] = p.x
    x = x_wide[:, ::2]
    ids = p.topk_ids.t().contiguous().t()
    weights = p.topk_weights.t().contiguous().t()
    y = moe_inductor.fused_experts(x, ids, weights, p.w1, p.w2)
    g, u, d, _, _ = p.views()
    assert_close(y, moe_reference(p.x, p.topk_ids, p.topk_weights, g, u, d), torch.float32, "y")


def test_leading_dims_are_kept():
    p = make_problem(12, 16, 8, 4, 2, requires_grad=False)
    y = moe_inductor.fused_experts(p.x.view(3, 4, 16), p.topk_ids.view(3, 4, 2), p.topk_weights.view(3, 4, 2),
                                   p.w1, p.w2)
    assert y.shape == (3, 4, 16)


def test_no_grad_does_not_keep_pre_activation():
    p = make_problem(6, 16, 8, 4, 2, requires_grad=False)
    g, u, d, _, _ = p.views()
    y, pre, *_ = experts_forward(p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None, "silu_glu", "output",
                                 1.702, 7.0, None, False)
    assert pre.numel() == 0


@pytest.mark.parametrize(
    "bad,match",
    [
        ("id_high", r"routing ids must lie in \[0, 4\).*got values in"),
        ("id_negative", r"routing ids must lie in \[0, 4\).*got values in"),
        ("w2_shape", "w2 must be"),
        ("w1_dtype", "w1 has dtype"),
        ("weights_shape", "topk_weights must match"),
        ("activation", "activation='swish' is not supported"),
        ("position", "weight_position="),
        ("float_ids", "topk_ids must be an integer tensor"),
    ],
)
def test_bad_input_names_the_argument(bad, match):
    p = make_problem(6, 16, 8, 4, 2, requires_grad=False)
    kw = dict(activation="silu_glu", weight_position="output")
    ids, weights, w1, w2 = p.topk_ids.clone(), p.topk_weights, p.w1, p.w2
    if bad == "id_high":
        ids[2, 1] = 4
    elif bad == "id_negative":
        ids[0, 0] = -1
    elif bad == "w2_shape":
        w2 = w2[:, :, :-1]
    elif bad == "w1_dtype":
        w1 = w1.double()
    elif bad == "weights_shape":
        weights = weights[:, :1]
    elif bad == "activation":
        kw["activation"] = "swish"
    elif bad == "position":
        kw["weight_position"] = "before"
    elif bad == "float_ids":
        ids = ids.float()
    with pytest.raises((ValueError, TypeError), match=match):
        moe_inductor.fused_experts(p.x, ids, weights, w1, w2, **kw)


def _opcheck_args(T=7, gated=True, bias=True, capacity=None, dtype=torch.float32):
    p = make_problem(T, 16, 8, 5, 2, bias=bias, dtype=dtype, activation="silu_glu" if gated else "gelu")
    g, u, d, bg, bu = p.views()
    return (p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, p.activation, "output", 1.702, 7.0, capacity, True)


@pytest.mark.parametrize("gated,bias,capacity", [(True, True, None), (False, False, None), (True, False, 3)],
                         ids=["gated-bias", "plain", "capacity"])
def test_opcheck_experts_forward(gated, bias, capacity):
    torch.library.opcheck(experts_forward, _opcheck_args(gated=gated, bias=bias, capacity=capacity))


def _whole_gate_up_args(T=7):
    """``_opcheck_args`` with the gate/up pair passed whole in w1 (op_call's ``gate_up``), no w1_up."""
    p = make_problem(T, 16, 8, 5, 2, bias=True, activation="silu_glu")
    whole = p.w1.transpose(1, 2)  # (E, H, 2I), [gate | up], the transpose of HF's (E, 2I, H) parameter
    _, _, d, bg, bu = p.views()
    return p, (p.x, p.topk_ids, p.topk_weights, whole, None, d, bg, bu, p.b2, p.activation, "output", 1.702, 7.0,
               None, True)


def test_opcheck_experts_forward_with_the_gate_up_weight_whole():
    torch.library.opcheck(experts_forward, _whole_gate_up_args()[1])


def test_a_whole_gate_up_weight_gets_one_gradient_equal_to_the_halves():
    """The op given the [gate | up] weight whole computes what it computes from the two halves, and its backward
    returns the whole weight's gradient: exactly the two halves' gradients side by side."""
    p, args = _whole_gate_up_args()
    whole = args[3].detach().requires_grad_()
    I = whole.shape[2] // 2
    halves = [whole.detach()[:, :, :I].clone().requires_grad_(), whole.detach()[:, :, I:].clone().requires_grad_()]
    y_whole = experts_forward(*args[:3], whole, None, *args[5:])[0]
    y_halves = experts_forward(*args[:3], *halves, *args[5:])[0]
    torch.testing.assert_close(y_whole, y_halves)  # (one GEMM of width 2I against two: rounding may differ)
    dy = torch.randn_like(y_whole)
    (g_whole,) = torch.autograd.grad(y_whole, whole, dy)
    g_halves = torch.autograd.grad(y_halves, halves, dy)
    assert g_whole.shape == whole.shape
    torch.testing.assert_close(g_whole, torch.cat(g_halves, 2))


def test_traced_training_passes_the_gate_up_weight_whole():
    """Traced with a gradient to make, fused_experts hands the op HF's gate_up parameter whole, so the backward
    graph holds one gradient for it: no ``slice_backward`` stitching two halves' gradients into it (a further read
    and write of the whole gradient per layer and step). Gradients equal eager's."""
    graphs = {}
    p = make_problem(9, 16, 8, 5, 2, activation="silu_glu")
    gate_up = torch.nn.Parameter(p.w1.detach().clone())
    down = torch.nn.Parameter(p.w2.detach().clone())

    def run(x, ids, tw):
        return moe_inductor.fused_experts(x, ids, tw, gate_up, down, activation="silu_glu", layout="nk")

    torch._dynamo.reset()
    compiled = torch.compile(run, backend=graph_keeping_backend(graphs))
    compiled(p.x, p.topk_ids, p.topk_weights).square().sum().backward()
    got = gate_up.grad.clone(), down.grad.clone()
    gate_up.grad = down.grad = None
    run(p.x, p.topk_ids, p.topk_weights).square().sum().backward()
    torch.testing.assert_close(got[0], gate_up.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], down.grad, rtol=1e-5, atol=1e-6)
    ops = [n for n in graphs["fw"].graph.nodes if n.target is torch.ops.moe_inductor.experts_forward.default]
    assert len(ops) == 1 and ops[0].args[4] is None and ops[0].args[3].meta["val"].shape == (5, 16, 16)
    bw_targets = {n.target for n in graphs["bw"].graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.slice_backward.default not in bw_targets, graphs["bw"].code
    # the backward is two ops, and the forward's saved ``pre`` is read by the first alone, so that the compiled
    # backward frees it before dW1 and dx are made (ops/backward.py)
    bw = graphs["bw"].graph
    middles = [n for n in bw.nodes if n.target is torch.ops.moe_inductor.experts_backward_middle.default]
    ups = [n for n in bw.nodes if n.target is torch.ops.moe_inductor.experts_backward_up.default]
    assert len(middles) == 1 and len(ups) == 1, graphs["bw"].code
    assert torch.ops.moe_inductor.experts_backward.default not in bw_targets
    pre, reader = middles[0].args[10], middles[0]
    while pre.op == "call_function" and pre.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        assert set(pre.users) == {reader}, [u.format_node() for u in pre.users]  # AOTAutograd's aliases, read once
        pre, reader = pre.args[0], pre
    assert pre.op == "placeholder" and pre.meta["val"].shape == (18, 16)  # (T*k, 2I), saved by the forward
    assert set(pre.users) == {reader}, [u.format_node() for u in pre.users]
    nodes = list(bw.nodes)
    assert nodes.index(middles[0]) < nodes.index(ups[0])


def _backward_args(combined_gate_up: bool):
    args = _opcheck_args()
    with torch.no_grad():
        y, pre, order, sorted_expert, offsets = experts_forward(*args)
    x, ids, tw, g, u, d, bg, bu, b2 = args[:9]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return (dy, x.detach(), ids, tw.detach(), g.detach(), u.detach(), d.detach(), bg.detach(),
            bu.detach(), b2.detach(), pre, order, sorted_expert, offsets, "silu_glu", "output", 1.702, 7.0, False,
            [True] * 8 + [combined_gate_up])


@pytest.mark.parametrize("combined_gate_up", [False, True], ids=["separate", "combined-gate-up"])
def test_opcheck_experts_backward(combined_gate_up):
    torch.library.opcheck(experts_backward, _backward_args(combined_gate_up))


@pytest.mark.parametrize("on_triton", [False, True], ids=["torch", "triton"])
def test_combined_gate_up_gradient_is_the_two_halves(on_triton, monkeypatch):
    """The ninth ``needs`` flag: dw1 comes back as one (E, H, 2I) tensor, laid out as the (E, 2I, H) parameter is,
    holding exactly the separate gate and up gradients."""
    # the Triton kernels take CPU tensors under the interpreter only; with a GPU they run on its copies
    device = "cuda" if on_triton and torch.cuda.is_available() else "cpu"
    on = lambda args: tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)  # noqa: E731
    separate_args, combined_args = on(_backward_args(False)), on(_backward_args(True))
    monkeypatch.setattr(moe_inductor.config, "triton_on_cpu", on_triton)
    separate = experts_backward(*separate_args)
    combined = experts_backward(*combined_args)
    I = separate[2].shape[2]
    assert combined[2].shape[2] == 2 * I and combined[3].numel() == 0
    assert combined[2].stride(1) == 1  # the transpose of a dense (E, 2I, H), like the nn.Linear-style parameter
    torch.testing.assert_close(combined[2][:, :, :I], separate[2])
    torch.testing.assert_close(combined[2][:, :, I:], separate[3])
    for a, b in zip(combined[4:] + combined[:2], separate[4:] + separate[:2]):
        torch.testing.assert_close(a, b)


def test_split_gate_up_hands_one_gradient_to_the_parameter_without_a_copy():
    from moe_inductor.ops import _SplitGateUp

    w = torch.randn(3, 8, 4).transpose(1, 2).requires_grad_()  # (E, H, 2I) as an (E, 2I, H) parameter's transpose
    gate, up = _SplitGateUp.apply(w, False)
    torch.testing.assert_close(torch.cat([gate, up], 2), w)
    one = torch.randn(3, 8, 4).transpose(1, 2)
    grad, _ = _SplitGateUp.backward(_Ctx(w, False), one[:, :, :4], one[:, :, 4:])
    assert grad.data_ptr() == one.data_ptr() and torch.equal(grad, one)
    # separate gradients are stitched; a missing one counts as zeros
    a, b = torch.randn(3, 4, 4), torch.randn(3, 4, 4)
    torch.testing.assert_close(_SplitGateUp.backward(_Ctx(w, False), a, b)[0], torch.cat([a, b], 2))
    torch.testing.assert_close(_SplitGateUp.backward(_Ctx(w, False), None, b)[0],
                               torch.cat([torch.zeros_like(a), b], 2))
    # through autograd, end to end
    (gate * 2 + 0).sum().backward()
    torch.testing.assert_close(w.grad, torch.cat([torch.full((3, 4, 4), 2.0), torch.zeros(3, 4, 4)], 2))


def test_split_gate_up_interleaved():
    from moe_inductor.ops import _SplitGateUp

    w = torch.randn(3, 4, 8, requires_grad=True)
    gate, up = _SplitGateUp.apply(w, True)
    assert torch.equal(gate, w[:, :, 0::2]) and torch.equal(up, w[:, :, 1::2])
    (gate * 2 + up * 3).sum().backward()
    want = torch.empty(3, 4, 8)
    want[:, :, 0::2], want[:, :, 1::2] = 2.0, 3.0
    torch.testing.assert_close(w.grad, want)


class _Ctx:
    def __init__(self, w, interleaved):
        self.w_shape, self.interleaved = w.shape, interleaved


def test_fused_experts_asks_for_one_gate_up_gradient(monkeypatch):
    """Eager training through fused_experts with HF's concatenated gate_up weight: the op is asked for the combined
    gradient, and the parameter's gradient matches the reference's."""
    from moe_inductor.ops import experts as experts_module

    seen = []
    real = experts_module.experts_backward_up

    def spy(*args):
        seen.append(list(args[-1]))
        return real(*args)

    monkeypatch.setattr(experts_module, "experts_backward_up", spy)
    p = make_problem(6, 16, 8, 5, 2)
    moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2).sum().backward()
    assert seen and seen[0][8] is True
    w1 = p.w1.detach().clone().requires_grad_()
    g, u, d, _, _ = expert_weight_views(w1, p.w2.detach(), None, activation="silu_glu", layout="nk", gate_up="concat")
    moe_reference(p.x.detach(), p.topk_ids, p.topk_weights.detach(), g, u, d, None, None, None, "silu_glu", "output",
                  1.702, 7.0, None).sum().backward()
    torch.testing.assert_close(p.w1.grad, w1.grad, rtol=1e-4, atol=1e-5)


def test_opcheck_route():
    ids = torch.randint(0, 5, (9, 2))
    torch.library.opcheck(route, (ids, 5, None))
    torch.library.opcheck(route, (ids, 5, 2))


def test_expert_list_op_matches_reference_and_stacks_the_weights_as_they_are():
    from moe_inductor.ops import expert_lists

    torch.manual_seed(0)
    T, H, I, E, k = 9, 16, 8, 4, 2
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.randn(T, E).topk(k).indices
    w = torch.rand(T, k, requires_grad=True)
    w1, w3, w2 = ([(torch.randn(*shape) * 0.3).requires_grad_() for _ in range(E)] for shape in ((I, H), (I, H), (H, I)))
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, "output", "nk", None)
    ref = moe_reference(x, ids, w, *(torch.stack(ws).transpose(1, 2) for ws in (w1, w3, w2)))
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    leaves = [x, w] + w1 + w3 + w2
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        assert_close(a, b, torch.float32, "grad")
    w1[0].data.add_(1.0)  # a write through .data bumps no version counter: the stack must still see it
    assert torch.equal(expert_lists.stacked(w1)[0], w1[0].detach())


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_expert_list_op_with_a_plain_activation_matches_the_reference(layout):
    """No up weights (``w1_up`` empty, as HF Switch's experts and plain-MLP loops give it): forward and backward."""
    from moe_inductor.ops import expert_lists

    torch.manual_seed(2)
    T, H, I, E, k = 7, 16, 8, 3, 1
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.randint(0, E, (T, k))
    w = torch.rand(T, k, requires_grad=True)
    shapes = ((I, H), (H, I)) if layout == "nk" else ((H, I), (I, H))
    w1, w2 = ([(torch.randn(*shape) * 0.3).requires_grad_() for _ in range(E)] for shape in shapes)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, [], w2, [], [], [], "relu", True, "output", layout, None)
    stacks = [torch.stack(ws).transpose(1, 2) if layout == "nk" else torch.stack(ws) for ws in (w1, w2)]
    ref = moe_reference(x, ids, w, stacks[0], None, stacks[1], activation="relu")
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    leaves = [x, w] + w1 + w2
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        assert_close(a, b, torch.float32, "grad")


@pytest.mark.parametrize("position,layout", [("output", "nk"), ("input", "nk"), ("between", "nk"), ("output", "kn")])
def test_opcheck_expert_list_op(position, layout):
    from moe_inductor.ops import expert_lists

    p = make_problem(7, 16, 8, 3, 2, layout=layout)
    gate, up = (p.w1[:, :8], p.w1[:, 8:]) if layout == "nk" else (p.w1[..., :8], p.w1[..., 8:])
    w1 = [t.detach().contiguous().requires_grad_() for t in gate.unbind(0)]
    w3 = [t.detach().contiguous().requires_grad_() for t in up.unbind(0)]
    w2 = [t.detach().requires_grad_() for t in p.w2.unbind(0)]
    args = (p.x, p.topk_ids, p.topk_weights, w1, w3, w2, [], [], [], "silu_glu", True, position, layout, None)
    torch.library.opcheck(expert_lists.experts_forward_list, args)


@pytest.mark.parametrize("position,layout", [("input", "nk"), ("between", "nk"), ("output", "kn"), ("input", "kn")])
def test_expert_list_op_takes_every_weight_position_and_layout(position, layout):
    """Forward and every gradient against the reference, which applies the weight at the same place; "kn" weights are
    (in, out), as experts written ``x @ w`` hold them."""
    from moe_inductor.ops import expert_lists

    torch.manual_seed(1)
    T, H, I, E, k = 8, 16, 8, 5, 2  # E not a power of two
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.randn(T, E).topk(k).indices
    w = torch.rand(T, k, requires_grad=True)
    shapes = ((I, H), (I, H), (H, I)) if layout == "nk" else ((H, I), (H, I), (I, H))
    w1, w3, w2 = ([(torch.randn(*shape) * 0.3).requires_grad_() for _ in range(E)] for shape in shapes)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, position, layout,
                                              None)
    stacks = [torch.stack(ws).transpose(1, 2) if layout == "nk" else torch.stack(ws) for ws in (w1, w3, w2)]
    ref = moe_reference(x, ids, w, *stacks, activation="silu_glu", weight_position=position)
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    leaves = [x, w] + w1 + w3 + w2
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        assert_close(a, b, torch.float32, "grad")
    with pytest.raises(ValueError, match="weight_position='before'; choose one of"):
        expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, "before", layout, None)
    with pytest.raises(ValueError, match="layout='nn'; choose 'nk'"):
        expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, position, "nn", None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gate_up_gradient_reaches_autograd_in_the_parameters_layout(compiled):
    """A (E, 2I, H) gate_up parameter (HF's nn.Linear-style layout) gets its gradient in its own strides, so that
    AccumulateGrad keeps it instead of copying it into the parameter's layout (a transposing pass over the whole
    gradient, per layer and step)."""
    torch.manual_seed(0)
    T, H, I, E, k = 9, 16, 8, 4, 2
    x = torch.randn(T, H)
    ids = torch.randn(T, E).topk(k).indices
    weights = torch.rand(T, k)
    gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.3)
    down = torch.nn.Parameter(torch.randn(E, H, I) * 0.3)
    seen = {}
    for name, p in (("gate_up", gate_up), ("down", down)):
        p.register_hook(lambda g, name=name: seen.__setitem__(name, g.stride()))

    def run(x, ids, weights):
        return moe_inductor.fused_experts(x, ids, weights, gate_up, down, activation="silu_glu", layout="nk")

    fn = torch.compile(run, backend="moe_inductor", options={"inner": "aot_eager"}) if compiled else run
    torch._dynamo.reset()
    fn(x, ids, weights).square().sum().backward()
    assert seen["gate_up"] == gate_up.stride() and seen["down"] == down.stride()


# On the GPU: the Triton kernels at realistic sizes against a float64 reference, and the op under CUDA graphs.


def _reference64(p, **kw):
    g, u, d, bg, bu = expert_weight_views(
        p.w1.double(), p.w2.double(), p.b1.double() if p.b1 is not None else None, activation=p.activation,
        layout=p.layout, gate_up=p.gate_up,
    )
    return moe_reference(p.x.double(), p.topk_ids, p.topk_weights.double(), g, u, d, bg, bu,
                         p.b2.double() if p.b2 is not None else None, p.activation, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "T,E,k,routing",
    [(1, 8, 2, "random"), (300, 7, 2, "random"), (1000, 60, 8, "random"), (256, 16, 4, "one_expert"),
     (128, 12, 2, "skip_odd"), (200, 6, 1, "random")],
    ids=["T1", "E7", "E60-k8", "all-on-one", "empty-experts", "k1"],  # k1: y and dx written without a combine
)
def test_gpu_forward_backward_matches_fp64(T, E, k, routing, dtype):
    p = make_problem(T, 256, 128, E, k, dtype=dtype, device="cuda", routing=routing, bias=True)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2)
    ref = _reference64(p)
    assert_close(y, ref, dtype, "y")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    leaves64 = [t.detach().double().requires_grad_() for t in p.leaves()]
    x, tw, w1, w2, b1, b2 = leaves64
    g, u, d, bg, bu = expert_weight_views(w1, w2, b1, activation=p.activation, layout=p.layout, gate_up=p.gate_up)
    ref_grads = torch.autograd.grad(moe_reference(x, p.topk_ids, tw, g, u, d, bg, bu, b2), leaves64, dy.double())
    for name, a, b in zip(["x", "topk_weights", "w1", "w2", "b1", "b2"], grads, ref_grads):
        assert_close(a, b, dtype, f"d{name}")


@pytest.mark.gpu
def test_gpu_gptoss_interleaved_kn_layout_bf16():
    p = make_problem(200, 256, 128, 8, 4, dtype=torch.bfloat16, device="cuda", activation="gptoss_glu", layout="kn",
                     gate_up="interleaved", bias=True)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2,
                                   activation="gptoss_glu", layout="kn", gate_up="interleaved")
    assert_close(y, _reference64(p), torch.bfloat16, "y")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_of_route_and_experts():
    """Capture routing + experts in one CUDA graph: it only works if nothing syncs with the host."""
    E, k, T, H = 8, 2, 64, 128
    p = make_problem(T, H, 64, E, k, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    router = torch.randn(H, E, device="cuda", dtype=torch.bfloat16)
    static_x = p.x.clone()

    def step():
        weights, ids = torch.softmax(static_x.float() @ router.float(), -1).topk(k)
        return moe_inductor.fused_experts(static_x, ids, weights.to(static_x.dtype), p.w1, p.w2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for seed in range(3):  # new data through the same graph: the routing changes, the graph does not
        static_x.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_y, step(), torch.bfloat16, "replay")


@pytest.mark.gpu
def test_gpu_bad_ids_raise_in_eager_without_illegal_access():
    p = make_problem(16, 64, 32, 4, 2, device="cuda", requires_grad=False)
    ids = p.topk_ids.clone()
    ids[3, 0] = 17
    with pytest.raises(ValueError, match=r"routing ids must lie in \[0, 4\).*got values in"):
        moe_inductor.fused_experts(p.x, ids, p.topk_weights, p.w1, p.w2)
    # the op itself (compiled graphs skip the eager check) drops the bad assignment instead of reading past E
    g, u, d, _, _ = p.views()
    y, *_ = torch.ops.moe_inductor.experts_forward(p.x, ids, p.topk_weights, g, u, d, None, None, None, "silu_glu",
                                                    "output", 1.702, 7.0, None, False)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
