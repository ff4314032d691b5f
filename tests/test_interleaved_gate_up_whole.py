"""An interleaved gate/up weight (GPT-OSS's gate_up_proj: the gate in its even columns, the up in its odd ones)
handed to the experts op whole, as its (E, H, I, 2) ``pairs_view`` (``ops.call.op_call``'s ``gate_up``).

The op reads it as the two stride-2 views it always read, and its backward returns one (E, H, I, 2) gradient made
by one weight-gradient GEMM over the paired d_pre, which the backward middle writes in that layout. Passed as two
slices, autograd stitched their two gradients into the parameter's (Inductor's ``slice_backward`` and an add, a
read and a write of the whole gradient per layer and step). Each test compares the whole weight's gradient with
the two halves' on the same path: the plain-torch path, our Triton kernels (the interpreter on the CPU), and the
``torch._grouped_mm`` engine.
"""
import pytest
import torch

import moe_inductor
from moe_inductor import config
from moe_inductor.ops import (expert_weight_views, experts_backward, experts_forward, grouped_mm_engine, moe_reference,
                              to_kn)
from moe_inductor.ops.call import from_op_args, gate_up_pairs, gate_up_whole, pairs_view
from tests.helpers import assert_close, graph_keeping_backend, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = "gptoss_glu"
PATHS = ["torch", "fused", "engine"]


@pytest.fixture
def path(request, monkeypatch):
    """Pick the op's path; the engine's calls are counted so that a silent fallback cannot pass for it."""
    name = request.param
    if name == "torch" and DEVICE == "cuda":
        pytest.skip("the plain-torch path is the CPU's")
    if name == "engine" and (not hasattr(torch, "_grouped_mm")
                             or (DEVICE == "cuda" and torch.cuda.get_device_capability() != (9, 0))):
        pytest.skip("the engine needs torch._grouped_mm (on Hopper where there is a GPU)")
    monkeypatch.setattr(config, "triton_on_cpu", name != "torch")
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm" if name == "engine" else "triton")
    calls = {"backward": 0}
    real = grouped_mm_engine.middle_grads  # the first half of every engine backward

    def spy(*args, **kwargs):
        calls["backward"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_mm_engine, "middle_grads", spy)
    return name, calls


def _dtype(path_name: str) -> torch.dtype:
    return torch.bfloat16 if path_name == "engine" else torch.float32  # the engine takes bf16 only


def _problem(layout: str, dtype: torch.dtype, T: int = 6, E: int = 5, routing: str = "random"):
    return make_problem(T, 32, 16, E, 2, dtype=dtype, device=DEVICE, activation=ACT, layout=layout,
                        gate_up="interleaved", bias=True, routing=routing, requires_grad=False)


def _args(p, w1, w1_up):
    _, _, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation=ACT, layout=p.layout, gate_up="interleaved")
    return (p.x, p.topk_ids, p.topk_weights, w1, w1_up, d, bg, bu, p.b2, ACT, "output", 1.702, 7.0, None, True)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_from_op_args_reads_pairs_as_the_two_stride_2_views(layout):
    p = _problem(layout, torch.float32)
    whole = pairs_view(to_kn(p.w1, layout))
    assert whole.shape == (5, 32, 16, 2) and whole.data_ptr() == p.w1.data_ptr()  # a view, no copy
    assert gate_up_pairs(whole, None, ACT) and not gate_up_whole(whole, None, ACT)
    call = from_op_args(_args(p, whole, None))
    gate, up = to_kn(p.w1, layout)[..., 0::2], to_kn(p.w1, layout)[..., 1::2]
    for got, want in ((call.weights.w1, gate), (call.weights.w1_up, up)):
        assert got.shape == want.shape and got.stride() == want.stride() and got.data_ptr() == want.data_ptr()
    # what is not a pair stays what it was: a last dim other than 2, an ungated activation, a separate up weight
    assert not gate_up_pairs(whole.new_empty(5, 32, 8, 4), None, ACT)
    assert not gate_up_pairs(whole, None, "gelu")
    assert not gate_up_pairs(whole, whole, ACT)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("layout,T,E,routing", [
    pytest.param("kn", 6, 5, "random", id="kn-E5"),
    pytest.param("nk", 6, 4, "random", id="nk"),
    pytest.param("kn", 1, 3, "random", id="T1"),
    pytest.param("kn", 5, 4, "one_expert", id="one-hot-expert"),
    pytest.param("kn", 6, 4, "skip_odd", id="empty-experts"),
])
def test_the_whole_pairs_gradient_is_the_two_halves_gradients(path, layout, T, E, routing):
    """Forward equal to the halves' (the same views are read), and the parameter's gradient through the pairs view
    equal to the one autograd stitches from the two halves' gradients; every other gradient too."""
    name, calls = path
    dtype = _dtype(name)
    p = _problem(layout, dtype, T=T, E=E, routing=routing)
    leaves = {n: getattr(p, n).detach().clone().requires_grad_() for n in ("x", "topk_weights", "w1", "w2", "b1",
                                                                           "b2")}

    def run(pairs: bool):
        ws = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
        kn = to_kn(ws["w1"], layout)
        w1, w1_up = (pairs_view(kn), None) if pairs else (kn[..., 0::2], kn[..., 1::2])
        _, _, d, bg, bu = expert_weight_views(ws["w1"], ws["w2"], ws["b1"], activation=ACT, layout=layout,
                                              gate_up="interleaved")
        y = experts_forward(ws["x"], p.topk_ids, ws["topk_weights"], w1, w1_up, d, bg, bu, ws["b2"], ACT, "output",
                            1.702, 7.0, None, True)[0]
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
        grads = torch.autograd.grad(y, list(ws.values()), dy)
        return y, dict(zip(ws, grads))

    y_pairs, g_pairs = run(True)
    y_halves, g_halves = run(False)
    torch.testing.assert_close(y_pairs, y_halves, rtol=0, atol=0)
    # and both against the float64 reference: a fault the two runs shared would pass the comparison above
    l64 = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    views = expert_weight_views(l64["w1"], l64["w2"], l64["b1"], activation=ACT, layout=layout, gate_up="interleaved")
    ref = moe_reference(l64["x"], p.topk_ids, l64["topk_weights"], *views, l64["b2"], ACT, "output", 1.702, 7.0, None)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3)).to(y_pairs).double()
    want = dict(zip(l64, torch.autograd.grad(ref, list(l64.values()), dy)))
    for n in leaves:
        assert g_pairs[n].shape == leaves[n].shape, n
        assert_close(g_pairs[n], g_halves[n].double(), dtype, f"d{n}")
        assert_close(g_pairs[n], want[n], dtype, f"d{n} against float64")
    assert g_pairs["w1"].abs().sum() > 0
    # an (E, 2I, H) parameter's pairs are not dense columns: the engine leaves it to the fused kernels
    assert calls["backward"] == (2 if name == "engine" and layout == "kn" else 0)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_the_pairs_gradient_is_laid_out_as_the_fake_kernel_says(path, layout):
    """Inductor trusts the fake kernel's strides for every output: the real (E, H, I, 2) gradient must have them,
    and they must be those of the parameter's own pairs view (so that autograd hands it over without a copy)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, _ = path
    p = _problem(layout, _dtype(name))
    gate, up, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation=ACT, layout=layout, gate_up="interleaved")
    fwd = experts_forward(*_args(p, gate, up))
    args = (torch.randn_like(fwd[0]), p.x, p.topk_ids, p.topk_weights, gate, up, d, bg, bu, p.b2, *fwd[1:], ACT,
            "output", 1.702, 7.0, False, [True] * 8 + [True, True])
    real = experts_backward(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = experts_backward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    whole = pairs_view(to_kn(p.w1, layout))
    assert (real[2].shape, real[2].stride()) == (whole.shape, whole.stride())
    assert real[3].numel() == 0
    for n, r, f in zip(("dx", "dtw", "dw1", "dw1_up", "dw2", "db1", "db1_up", "db2"), real, fake):
        assert (r.shape, r.stride()) == (f.shape, f.stride()), n


def test_opcheck_experts_forward_and_backward_with_pairs():
    p = _problem("kn", torch.float32)
    args = _args(p, pairs_view(to_kn(p.w1, "kn")), None)
    torch.library.opcheck(experts_forward, args)
    gate, up, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation=ACT, layout="kn", gate_up="interleaved")
    fwd = experts_forward(*_args(p, gate, up))
    dy = torch.randn(fwd[0].shape, generator=torch.Generator().manual_seed(1)).to(p.x)
    torch.library.opcheck(experts_backward, (dy, p.x, p.topk_ids, p.topk_weights, gate, up, d, bg, bu, p.b2,
                                             *fwd[1:], ACT, "output", 1.702, 7.0, False, [True] * 8 + [True, True]))


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_traced_training_passes_the_interleaved_weight_whole(layout):
    """Traced with a gradient to make, fused_experts hands the op the interleaved parameter as its pairs view: the
    backward graph has no ``slice_backward`` stitching two stride-2 halves' gradients into the weight's, and every
    gradient equals eager's. Inference still passes the two views."""
    graphs = {}
    p = make_problem(9, 16, 8, 5, 2, activation=ACT, layout=layout, gate_up="interleaved", bias=True)
    params = [torch.nn.Parameter(t.detach().clone()) for t in (p.w1, p.b1, p.w2, p.b2)]

    def run(x, ids, tw):
        return moe_inductor.fused_experts(x, ids, tw, params[0], params[2], b1=params[1], b2=params[3],
                                          activation=ACT, layout=layout, gate_up="interleaved")

    torch._dynamo.reset()
    compiled = torch.compile(run, backend=graph_keeping_backend(graphs))
    compiled(p.x, p.topk_ids, p.topk_weights).square().sum().backward()
    got = [q.grad.clone() for q in params]
    for q in params:
        q.grad = None
    run(p.x, p.topk_ids, p.topk_weights).square().sum().backward()
    for q, g in zip(params, got):
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6)
    ops = [n for n in graphs["fw"].graph.nodes if n.target is torch.ops.moe_inductor.experts_forward.default]
    assert len(ops) == 1 and ops[0].args[4] is None and ops[0].args[3].meta["val"].shape == (5, 16, 8, 2)
    bw_nodes = [n for n in graphs["bw"].graph.nodes if n.op == "call_function"]
    # the (E, 2I) bias still comes as its two stride-2 halves (a gradient of E x 2I elements, not E x H x 2I)
    stitched = [n.args[1] for n in bw_nodes if n.target is torch.ops.aten.slice_backward.default]
    assert all(len(size) == 2 for size in stitched), graphs["bw"].code
    assert torch.ops.moe_inductor.experts_backward_up.default in {n.target for n in bw_nodes}
    torch._dynamo.reset()
    graphs.clear()
    with torch.no_grad():
        compiled = torch.compile(run, backend=graph_keeping_backend(graphs))
        compiled(p.x, p.topk_ids, p.topk_weights)
    ops = [n for n in graphs["fw"].graph.nodes if n.target is torch.ops.moe_inductor.experts_forward.default]
    assert len(ops) == 1 and ops[0].args[4] is not None  # inference: gate and up as two views


@pytest.mark.parametrize("path", ["fused"], indirect=True)
def test_the_benchmarks_eager_whole_weight_switch_takes_the_pairs_backward(path, monkeypatch):
    """``ops._whole_gate_up_eagerly`` (what the op benchmarks set to time a compiled step's backward alone) hands an
    eager call the whole weight: the op's backward then writes the pairs layout, and every gradient equals the
    halves' (the switch off)."""
    import moe_inductor.ops as ops
    import moe_inductor.ops.grouped as grouped

    p = _problem("kn", torch.float32)

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (p.x, p.topk_weights, p.w1, p.w2, p.b1, p.b2)]
        y = moe_inductor.fused_experts(leaves[0], p.topk_ids, leaves[1], leaves[2], leaves[3], b1=leaves[4],
                                       b2=leaves[5], activation=ACT, layout="kn", gate_up="interleaved")
        return torch.autograd.grad(y, leaves, torch.ones_like(y))

    layouts = []
    real = grouped.launch_backward_middle

    def spy(pre, g, routing, biases, outs, act, scale_h=False, whole=None):
        layouts.append(whole)
        return real(pre, g, routing, biases, outs, act, scale_h, whole=whole)

    monkeypatch.setattr(grouped, "launch_backward_middle", spy)
    halves = grads()
    monkeypatch.setattr(ops, "_whole_gate_up_eagerly", True)
    whole = grads()
    assert layouts == ["halves", "pairs"]  # d_pre whole: halves, then the (gate, up) pairs of the whole weight
    for name, a, b in zip(("dx", "dtw", "dw1", "dw2", "db1", "db2"), halves, whole):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_same_storage_proves_views_of_one_tensor_real_fake_or_functional():
    """``same_storage`` is what lets a traced launch read two stride-2 views as one weight: it must say yes for
    views of one tensor and no for two tensors, whether they are real, fake (every fake data pointer is 0) or
    functional (AOT autograd's, whose views keep no ``_base``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_inductor.kernels.weight_views import interleaved_pairs, same_storage

    answers = {}

    def probe(w, other):
        answers["views"] = same_storage(w[..., 0::2], w[..., 1::2])
        answers["two"] = same_storage(w[..., 0::2], other[..., 1::2])
        answers["pairs"] = interleaved_pairs(w[..., 0::2], w[..., 1::2]) is not None
        answers["two_pairs"] = interleaved_pairs(w[..., 0::2], other[..., 1::2]) is not None
        return w + other

    w, other = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    want = {"views": True, "two": False, "pairs": True, "two_pairs": False}
    probe(w, other)
    assert answers == want, "real"
    with FakeTensorMode() as mode:
        probe(mode.from_tensor(w), mode.from_tensor(other))
    assert answers == want, "fake"
    make_fx(torch.func.functionalize(probe), tracing_mode="fake")(w, other)
    assert answers == want, "functional"
