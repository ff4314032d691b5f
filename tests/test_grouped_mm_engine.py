"""The compute-bound engine (ops/grouped_mm_engine.py): the experts op with ``torch._grouped_mm`` as its GEMMs.

On the CPU it runs with ``config.gemm_engine = "grouped_mm"`` and our kernels under the interpreter (torch's CPU
``_grouped_mm``); on the GPU the same tests run CUTLASS and the compiled kernels. Every case checks that the engine
really ran, so a silent fallback to the fused kernels cannot pass for it.
"""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_inductor
from moe_inductor import config
from moe_inductor.ops import expert_weight_views, grouped_mm_engine, moe_reference
from tests.helpers import assert_close, assert_matches_reference, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing")
if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
    needs_grouped_mm = pytest.mark.skip(reason="torch._grouped_mm runs on Hopper only")


@pytest.fixture
def engine_calls(monkeypatch, triton_kernels):
    """Force the engine and count its forward and backward calls (a backward's by its first half, which every
    backward runs once)."""
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    calls = {"forward": 0, "backward": 0}
    for name, attr in (("forward", "forward"), ("backward", "middle_grads")):
        real = getattr(grouped_mm_engine, attr)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(grouped_mm_engine, attr, spy)
    return calls


@needs_grouped_mm
@pytest.mark.parametrize("T,E,k,activation,layout,routing,weights_dtype", [
    pytest.param(6, 3, 2, "silu_glu", "nk", "random", torch.bfloat16, id="glu-nk"),
    pytest.param(5, 5, 2, "gelu_glu", "kn", "random", torch.bfloat16, id="glu-kn-E5"),
    pytest.param(4, 3, 1, "silu", "nk", "random", torch.bfloat16, id="unary-k1"),
    pytest.param(1, 3, 2, "silu_glu", "nk", "random", torch.bfloat16, id="T1"),
    pytest.param(5, 3, 2, "silu_glu", "nk", "one_expert", torch.bfloat16, id="all-on-one-expert"),
    pytest.param(6, 4, 2, "gptoss_glu", "nk", "skip_odd", torch.bfloat16, id="empty-experts"),
    # routers often keep their weights in fp32 while x is bf16
    pytest.param(6, 3, 2, "silu_glu", "nk", "random", torch.float32, id="fp32-routing-weights"),
])
def test_grouped_mm_engine_matches_the_reference(T, E, k, activation, layout, routing, weights_dtype, engine_calls,
                                                  nan_empty):
    """bf16, forward and every gradient against the float64 reference on the same inputs."""
    p = make_problem(T, 32, 16, E, k, dtype=torch.bfloat16, device=DEVICE, activation=activation, layout=layout,
                     routing=routing)
    p.topk_weights = p.topk_weights.detach().to(weights_dtype).requires_grad_()
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, activation=activation,
                                   layout=layout)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    assert engine_calls == {"forward": 1, "backward": 1}
    assert_matches_reference(p, y, grads, dy, torch.bfloat16, activation=activation, layout=layout)


@needs_grouped_mm
def test_grouped_mm_engine_passes_opcheck(engine_calls):
    """A unary activation: opcheck copies its arguments, which would split a gate/up pair into two tensors."""
    p = make_problem(5, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE, activation="gelu", requires_grad=False)
    g, _, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="gelu", layout="nk", gate_up="concat")
    args = (p.x, p.topk_ids, p.topk_weights, g, None, d, None, None, None, "gelu", "output", 1.702, 7.0, None, True)
    torch.library.opcheck(torch.ops.moe_inductor.experts_forward.default, args)
    assert engine_calls["forward"] > 0


@needs_grouped_mm
def test_grouped_mm_engine_with_biases_passes_opcheck(engine_calls):
    """Up and down biases through the engine (a unary activation, so that opcheck's copies keep the engine)."""
    p = make_problem(5, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE, activation="gelu", bias=True,
                     requires_grad=False)
    g, _, d, b1, _ = expert_weight_views(p.w1, p.w2, p.b1, activation="gelu", layout="nk", gate_up="concat")
    args = (p.x, p.topk_ids, p.topk_weights, g, None, d, b1, None, p.b2, "gelu", "output", 1.702, 7.0, None, True)
    torch.library.opcheck(torch.ops.moe_inductor.experts_forward.default, args)
    assert engine_calls["forward"] > 0


def _weights(activation="silu_glu", layout="nk", gate_up="concat", dtype=torch.bfloat16, bias=False):
    p = make_problem(4, 32, 16, 3, 2, dtype=dtype, device=DEVICE, activation=activation, layout=layout,
                     gate_up=gate_up, bias=bias, requires_grad=False)
    return p, expert_weight_views(p.w1, p.w2, p.b1, activation=activation, layout=layout, gate_up=gate_up)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_combined_up_weights_is_a_view_of_gate_up(layout):
    """HF's concatenated gate_up_proj, either layout, becomes one (E, H, 2I) operand without a copy."""
    p, (g, u, _, _, _) = _weights(layout=layout)
    both = grouped_mm_engine.combined_up_weights(g, u)
    assert both is not None and both.data_ptr() == g.data_ptr()
    torch.testing.assert_close(both, torch.cat([g, u], 2), rtol=0, atol=0)


def test_combined_up_weights_refuses_what_is_not_one_tensor():
    _, (g, u, _, _, _) = _weights(gate_up="interleaved")
    assert grouped_mm_engine.combined_up_weights(g, u) is None
    _, (g, u, _, _, _) = _weights()
    assert grouped_mm_engine.combined_up_weights(g, u.clone()) is None  # two separate tensors
    assert grouped_mm_engine.combined_up_weights(u, g) is None  # the halves the wrong way round


@pytest.mark.parametrize("case", ["capacity", "input", "between", "fp32", "triton", "auto-cpu"])
def test_grouped_mm_engine_is_not_chosen_where_it_does_not_apply(case, monkeypatch, triton_kernels):
    """Negative cases: whatever the engine cannot run exactly as the fused op does stays on the fused kernels."""
    monkeypatch.setattr(config, "gemm_engine", {"triton": "triton", "auto-cpu": "auto"}.get(case, "grouped_mm"))
    p, (g, u, d, b1, _) = _weights(dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    position = case if case in ("input", "between") else "output"
    got = grouped_mm_engine.grouped_mm_weights(p.x, g, u, d, b1, p.b2, position, case == "capacity", 8)
    if case == "auto-cpu" and torch.cuda.is_available():
        pytest.skip("the CPU case of auto")
    assert got is None
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    _, (g, u, d, _, _) = _weights()
    assert grouped_mm_engine.grouped_mm_weights(p.x.bfloat16(), g, u, d, None, None, "output", False, 8) is not None


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_biases_and_interleaved_pairs_take_the_engine(gate_up, monkeypatch, triton_kernels):
    """Biases, and GPT-OSS's interleaved pairs read as one (E, H, 2I) weight, run through the engine, forward and
    backward; interleaved pairs in the nk layout (no dense whole weight) stay fused."""
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    interleaved = gate_up == "interleaved"
    p, (g, u, d, b1, _) = _weights(activation="gptoss_glu", layout="kn", gate_up=gate_up, bias=True)
    for backward in (False, True):
        w = grouped_mm_engine.grouped_mm_weights(p.x, g, u, d, b1, p.b2, "output", False, 8, backward=backward)
        assert w is not None and w.shape == (3, 32, 32) and w.data_ptr() == g.data_ptr()
        assert grouped_mm_engine.is_interleaved(w, g) == interleaved
    if interleaved:
        p, (g, u, d, _, _) = _weights(activation="gptoss_glu", layout="nk", gate_up=gate_up)
        assert grouped_mm_engine.grouped_mm_weights(p.x, g, u, d, None, None, "output", False, 8) is None


@pytest.mark.gpu
def test_auto_engine_takes_grouped_mm_only_for_large_experts_with_many_rows(monkeypatch):
    """"auto" on the H200: Mixtral-sized experts at 1024 rows each go to torch._grouped_mm; the same rows with small
    experts, or few rows with large ones, stay fused."""
    monkeypatch.setattr(config, "gemm_engine", "auto")
    E, k = 2, 2

    def chosen(T, H, I, backward=False):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return grouped_mm_engine.grouped_mm_weights(x, w1[..., :I], w1[..., I:], w2, None, None, "output", False,
                                                    T * k, backward=backward) is not None

    assert chosen(1024, 4096, 8192)
    assert not chosen(1024, 2048, 768)
    assert not chosen(256, 4096, 8192)
    # the backward's own rule: 128 rows per expert, any expert size
    assert chosen(128, 2048, 768, backward=True)
    assert chosen(256, 4096, 8192, backward=True)
    assert not chosen(64, 2048, 768, backward=True)
    monkeypatch.setattr(config, "gemm_engine_backward", "triton")
    assert not chosen(1024, 4096, 8192, backward=True)


@pytest.mark.gpu
def test_auto_engine_runs_inside_an_inductor_graph(engine_calls, monkeypatch):
    """Compiled, the op receives gate and up as views of the one gate_up parameter (Inductor keeps them views), so
    "auto" still finds the engine's regime there; forward and backward match the eager op."""
    monkeypatch.setattr(config, "gemm_engine", "auto")
    torch.manual_seed(0)
    E, H, I, k, T = 2, 4096, 8192, 2, 1024
    w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5).requires_grad_()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, E, (T, k), device="cuda")
    weights = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)

    def moe(x):
        return moe_inductor.fused_experts(x, ids, weights, w1, w2)

    torch._dynamo.reset()
    got = torch.compile(moe)(x)
    got_grads = torch.autograd.grad(got.float().square().sum(), (x, w1, w2))
    assert engine_calls == {"forward": 1, "backward": 1}
    want = moe(x)
    want_grads = torch.autograd.grad(want.float().square().sum(), (x, w1, w2))
    assert_close(got, want, torch.bfloat16, "y")
    for name, a, b in zip(("dx", "dw1", "dw2"), got_grads, want_grads):
        assert_close(a, b, torch.bfloat16, name)


@needs_grouped_mm
def test_engine_runs_inside_a_traced_graph(engine_calls):
    """Under AOT autograd (functionalised views), gate and up still reach the op as views of one weight tensor; the
    engine runs forward and backward there, with the eager results."""
    p = make_problem(6, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE)

    def moe(x, w1, w2):
        return moe_inductor.fused_experts(x, p.topk_ids, p.topk_weights, w1, w2)

    torch._dynamo.reset()
    got = torch.compile(moe, backend="aot_eager", fullgraph=True)(p.x, p.w1, p.w2)
    got_grads = torch.autograd.grad(got.float().sum(), (p.x, p.w1, p.w2))
    assert engine_calls == {"forward": 1, "backward": 1}
    want = moe(p.x, p.w1, p.w2)
    want_grads = torch.autograd.grad(want.float().sum(), (p.x, p.w1, p.w2))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


@needs_grouped_mm
def test_engine_skips_out_of_range_ids(engine_calls, nan_empty):
    """A masked choice (id -1, as expert parallelism leaves them) adds nothing to y and gets a zero routing-weight
    gradient, even though its sorted row is never computed (fresh buffers hold NaN here)."""
    p = make_problem(6, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE)
    ids = p.topk_ids.clone()
    ids[1, 0] = -1
    ids[4, 1] = -1
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    args = (p.x, ids, p.topk_weights, g, u, d, None, None, None, "silu_glu", "output", 1.702, 7.0, None, True)
    y = torch.ops.moe_inductor.experts_forward(*args)[0]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, (p.x, p.topk_weights, p.w1, p.w2), dy)
    assert engine_calls == {"forward": 1, "backward": 1}
    leaves64 = [t.detach().double().requires_grad_() for t in (p.x, p.topk_weights, p.w1, p.w2)]
    views = expert_weight_views(leaves64[2], leaves64[3], None, activation="silu_glu", layout="nk", gate_up="concat")
    ref = moe_reference(leaves64[0], ids, leaves64[1], *views, None, "silu_glu", "output", 1.702, 7.0, None)
    assert_close(y, ref, torch.bfloat16, "y")
    ref_grads = torch.autograd.grad(ref, leaves64, dy.double())
    for name, got, want in zip(("dx", "dtopk_weights", "dw1", "dw2"), grads, ref_grads):
        assert_close(got, want.to(got.dtype), torch.bfloat16, name)
    assert grads[1][1, 0] == 0 and grads[1][4, 1] == 0


@needs_grouped_mm
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("combined", [False, True], ids=["separate-grads", "one-grad"])
def test_engine_gradient_layouts_match_the_fake_kernel(layout, combined, engine_calls):
    """Inductor checks every output of the op against the fake kernel's strides. Compiled, gate and up arrive as two
    graph inputs, so the combined flag is off while they are still halves of one tensor; the engine once returned
    their gradients transposed there while the fake kernel said dense (found on the H200 by
    test_auto_engine_runs_inside_an_inductor_graph)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = make_problem(6, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE, layout=layout, requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout=layout, gate_up="concat")
    fwd = torch.ops.moe_inductor.experts_forward(p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None,
                                                 "silu_glu", "output", 1.702, 7.0, None, True)
    args = (torch.randn_like(fwd[0]), p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None, *fwd[1:],
            "silu_glu", "output", 1.702, 7.0, False, [True, True, True, True, True, False, False, False, combined])
    real = torch.ops.moe_inductor.experts_backward(*args)
    assert engine_calls == {"forward": 1, "backward": 1}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.moe_inductor.experts_backward(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    for name, r, f in zip(("dx", "dtw", "dw1", "dw1_up", "dw2"), real, fake):
        assert (r.shape, r.stride()) == (f.shape, f.stride()), name


@needs_grouped_mm
@pytest.mark.parametrize("forward_engine,backward_engine,expected", [
    pytest.param("triton", "grouped_mm", {"forward": 0, "backward": 1}, id="fused-fwd-gmm-bwd"),
    pytest.param("grouped_mm", "triton", {"forward": 1, "backward": 0}, id="gmm-fwd-fused-bwd"),
])
def test_backward_engine_can_differ_from_the_forwards(forward_engine, backward_engine, expected, engine_calls,
                                                       monkeypatch, nan_empty):
    """``config.gemm_engine_backward``: the forward saves the raw up projection in one sorted layout whoever ran it,
    so either engine's backward can follow either forward; every gradient still matches the float64 reference."""
    monkeypatch.setattr(config, "gemm_engine", forward_engine)
    monkeypatch.setattr(config, "gemm_engine_backward", backward_engine)
    p = make_problem(7, 32, 16, 5, 2, dtype=torch.bfloat16, device=DEVICE, routing="skip_odd")
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    assert engine_calls == expected
    assert_matches_reference(p, y, grads, dy, torch.bfloat16)


def test_an_unknown_engine_name_is_an_error(monkeypatch):
    monkeypatch.setattr(config, "gemm_engine_backward", "cutlass")
    p, (g, u, d, _, _) = _weights()
    with pytest.raises(ValueError, match="gemm engine must be"):
        grouped_mm_engine.grouped_mm_weights(p.x, g, u, d, None, None, "output", False, 8, backward=True)


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors that torch ops allocate while the mode is on (what the op's own code holds at
    once; the Triton interpreter's numpy copies are not torch tensors and do not count). A storage counts from the op
    that creates it until the last tensor viewing it is collected."""

    def __init__(self):
        super().__init__()
        self.live, self.views, self.now, self.peak = {}, {}, 0, 0

    def _drop(self, ptr):
        self.views[ptr] -= 1
        if self.views[ptr] == 0:
            self.now -= self.live.pop(ptr)
            del self.views[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ret.alias_info is None and ptr not in self.live:  # a fresh allocation
                self.live[ptr] = t.untyped_storage().nbytes()
                self.views[ptr] = 0
                self.now += self.live[ptr]
                self.peak = max(self.peak, self.now)
            if ptr in self.live:
                self.views[ptr] += 1
                weakref.finalize(t, self._drop, ptr)
        return out


@needs_grouped_mm
@pytest.mark.slow
def test_engine_backward_holds_one_sorted_copy_of_the_rows_at_a_time(engine_calls, monkeypatch):
    """The backward gathers x in expert order (M x H) only for dW1, in its second half, after the sorted dy (also
    M x H) of its first half is freed. Holding both at once, as it used to, peaks near 2 M H bytes on top of the
    gradients; each half stays near M H."""
    peaks = []
    for half in ("middle_grads", "up_grads"):
        real = getattr(grouped_mm_engine, half)

        def measured(*args, _real=real, **kwargs):
            with LiveTensorBytes() as mode:
                grads = _real(*args, **kwargs)
            peaks.append(mode.peak)
            return grads

        monkeypatch.setattr(grouped_mm_engine, half, measured)
    T, H, I, E, k = 512, 256, 16, 4, 2
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device=DEVICE)
    y = moe_inductor.fused_experts(p.x.detach(), p.topk_ids, p.topk_weights, p.w1, p.w2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    grads = torch.autograd.grad(y, [p.topk_weights, p.w1, p.w2], dy)
    assert engine_calls["backward"] == 1 and len(peaks) == 2
    sorted_rows = T * k * H * 2  # M x H in bf16
    gradients = sum(g.numel() * g.element_size() for g in grads)
    assert max(peaks) < 1.5 * sorted_rows + gradients, (peaks, sorted_rows, gradients)


@needs_grouped_mm
@pytest.mark.parametrize("T,E,k,activation,gate_up,routing", [
    pytest.param(6, 4, 2, "gptoss_glu", "interleaved", "random", id="gptoss-interleaved"),
    pytest.param(5, 5, 2, "gptoss_glu", "interleaved", "random", id="interleaved-E5"),
    pytest.param(1, 3, 2, "gptoss_glu", "interleaved", "random", id="interleaved-T1"),
    pytest.param(5, 3, 2, "gptoss_glu", "interleaved", "one_expert", id="interleaved-one-hot-expert"),
    pytest.param(6, 4, 2, "gptoss_glu", "interleaved", "skip_odd", id="interleaved-empty-experts"),
    pytest.param(6, 3, 2, "silu_glu", "concat", "random", id="concat-biases"),
    pytest.param(4, 3, 1, "silu", "concat", "random", id="unary-biases-k1"),
])
def test_engine_with_biases_matches_the_reference(T, E, k, activation, gate_up, routing, engine_calls, nan_empty):
    """Layers with biases (GPT-OSS: (E, H, 2I) gate_up_proj with interleaved pairs, clamped glu) through the engine,
    the biases in the activation pass and the combine, their gradients as per-expert row sums: forward and every
    gradient against the float64 reference."""
    p = make_problem(T, 32, 16, E, k, dtype=torch.bfloat16, device=DEVICE, activation=activation, layout="kn",
                     gate_up=gate_up, bias=True, routing=routing)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2,
                                   activation=activation, layout="kn", gate_up=gate_up)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    leaves = p.leaves()
    grads = torch.autograd.grad(y, leaves, dy)
    assert engine_calls == {"forward": 1, "backward": 1}
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, w64, w1_64, w2_64, b1_64, b2_64 = leaves64
    views = expert_weight_views(w1_64, w2_64, b1_64, activation=activation, layout="kn", gate_up=gate_up)
    ref = moe_reference(x64, p.topk_ids, w64, *views, b2_64, activation, "output", 1.702, 7.0, None)
    assert_close(y, ref, torch.bfloat16, "y")
    names = ["x", "topk_weights", "w1", "w2", "b1", "b2"]
    for name, got, want in zip(names, grads, torch.autograd.grad(ref, leaves64, dy.double())):
        assert_close(got, want.to(got.dtype), torch.bfloat16, f"d{name}")


@needs_grouped_mm
def test_engine_forward_keeps_pre_in_the_fused_forwards_layout(engine_calls, monkeypatch):
    """The raw up projection the engine keeps for interleaved pairs is the fused forward's: [gate | up] halves,
    before the biases (either backward reads it so)."""
    p = make_problem(6, 32, 16, 4, 2, dtype=torch.bfloat16, device=DEVICE, activation="gptoss_glu", layout="kn",
                     gate_up="interleaved", bias=True, requires_grad=False)
    g, u, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation="gptoss_glu", layout="kn",
                                          gate_up="interleaved")
    args = (p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, "gptoss_glu", "output", 1.702, 7.0, None, True)
    y_engine, pre_engine = torch.ops.moe_inductor.experts_forward.default(*args)[:2]
    assert engine_calls["forward"] == 1
    monkeypatch.setattr(config, "gemm_engine", "triton")
    y_fused, pre_fused = torch.ops.moe_inductor.experts_forward.default(*args)[:2]
    assert engine_calls["forward"] == 1
    assert pre_engine.shape == pre_fused.shape == (12, 32)
    # the same products, rounded once in each: only the GEMMs' summation order differs
    torch.testing.assert_close(pre_engine.float(), pre_fused.float(), rtol=2e-2, atol=2e-2)
    assert_close(y_engine, y_fused.double(), torch.bfloat16, "y")


def test_combine_adds_each_assignments_expert_bias_before_its_scale(triton_kernels):
    """combine(bias=b): y[t] = sum_j scale_j * (row_j + b[e_j]); an out-of-range id adds nothing."""
    from moe_inductor.ops.grouped import combine

    gen = torch.Generator().manual_seed(3)
    T, k, H, E = 3, 2, 8, 4
    rows = torch.randn(T * k, H, generator=gen)
    ids = torch.tensor([[0, 3], [2, 2], [1, 4]])  # 4 is out of range: that assignment is skipped
    scale = torch.rand(T * k, generator=gen)
    bias = torch.randn(E, H, generator=gen)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < E:
                want[t] += scale[t * k + j] * (rows[t * k + j] + bias[e])
    on = [t.to(DEVICE) for t in (rows, ids, scale, bias)]  # the kernel (the interpreter on the CPU)
    torch.testing.assert_close(combine(on[0], on[1], E, scale=on[2], bias=on[3]).cpu(), want)
    config.triton_on_cpu = False  # the plain-torch path too (monkeypatch restores the flag)
    torch.testing.assert_close(combine(rows, ids, E, scale=scale, bias=bias), want)


def test_biased_layers_stay_visible_where_their_rows_are_too_few(monkeypatch):
    """"auto": a layer with biases may take the engine at an unknown row count or from its rows-per-expert rule;
    at a static decode-sized count it keeps the visible launches. Layers without biases keep the size rule."""
    monkeypatch.setattr(config, "gemm_engine", "auto")
    E, I, H = 32, 2880, 2880
    w2 = torch.empty(E, I, H, device="meta")
    per = config.grouped_mm_biased_min_rows_per_expert
    assert grouped_mm_engine.may_take_experts_of(w2, biased=True, num_rows=None)
    assert grouped_mm_engine.may_take_experts_of(w2, biased=True, num_rows=per * E)
    assert not grouped_mm_engine.may_take_experts_of(w2, biased=True, num_rows=16 * 4)
    assert not grouped_mm_engine.may_take_experts_of(w2, biased=False, num_rows=None)  # 8.3M weights: small
    small = torch.empty(E, 1024, 2048, device="meta")  # 2M weights per projection: below the biased size rule
    assert not grouped_mm_engine.may_take_experts_of(small, biased=True, num_rows=None)
    monkeypatch.setattr(config, "gemm_engine", "triton")
    assert not grouped_mm_engine.may_take_experts_of(w2, biased=True, num_rows=None)


@pytest.mark.gpu
def test_auto_engine_takes_biased_interleaved_layers_from_their_row_rule(monkeypatch):
    """"auto" on the H200: GPT-OSS's layer (biases, interleaved pairs) goes to torch._grouped_mm, forward and
    backward, from the rule's rows per expert, and stays fused below it."""
    monkeypatch.setattr(config, "gemm_engine", "auto")
    E, H, I, k = 4, 2880, 2880, 4
    per = config.grouped_mm_biased_min_rows_per_expert
    gate_up = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16)
    w1, w1_up = gate_up[..., 0::2], gate_up[..., 1::2]
    w2 = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16)
    b1 = torch.randn(E, I, device="cuda", dtype=torch.bfloat16)
    b2 = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)

    def chosen(rows: int, backward: bool = False) -> bool:
        x = torch.randn(rows // k, H, device="cuda", dtype=torch.bfloat16)
        w = grouped_mm_engine.grouped_mm_weights(x, w1, w1_up, w2, b1, b2, "output", False, rows, backward=backward)
        return w is not None and w.data_ptr() == gate_up.data_ptr() and grouped_mm_engine.is_interleaved(w, w1)

    assert chosen(per * E) and not chosen(per * E // 2)
    monkeypatch.setattr(config, "grouped_mm_biased_min_expert_weights", H * I + 1)  # the size rule
    assert not chosen(per * E) and not chosen(per * E, backward=True)
    monkeypatch.setattr(config, "grouped_mm_biased_min_expert_weights", H * I)
    per_backward = config.grouped_mm_biased_backward_min_rows_per_expert
    assert chosen(per_backward * E, backward=True) and not chosen(per_backward * E // 2, backward=True)


@needs_grouped_mm
def test_engine_runs_gptoss_inside_a_compiled_training_step(engine_calls, monkeypatch):
    """A whole (tiny) GPT-OSS compiled by moe_inductor, its experts forced onto the engine: loss and every experts
    gradient (biases included) as eager's, bf16. The speed rule would keep Inductor's path for GPT-OSS training on
    the H200, so it is off here: this checks the path, not the choice."""
    from torch._dynamo.utils import counters

    from tests.hf_models import tiny

    monkeypatch.setattr(config, "speed_rule", False)
    model = tiny("gpt_oss").to(DEVICE, torch.bfloat16)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch._dynamo.reset()
    counters.clear()
    inner = "inductor" if DEVICE == "cuda" else "eager"
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner})
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    got = {n: p.grad.float().clone() for n, p in model.named_parameters() if "experts" in n}
    model.zero_grad()
    ref = model(ids, labels=ids).loss
    ref.backward()
    assert counters["moe_inductor"]["hf_grouped_mm"] == 2, dict(counters["moe_inductor"])
    assert engine_calls["forward"] >= 2 and engine_calls["backward"] >= 2
    assert abs(loss.item() - ref.item()) < 2e-2 * abs(ref.item())
    assert len(got) == 8  # gate_up_proj, its bias, down_proj, its bias, in each of 2 layers
    for name, p in model.named_parameters():
        if "experts" in name:
            assert_close(got[name], p.grad.double(), torch.bfloat16, f"d{name}")


@needs_grouped_mm
def test_engine_backward_remakes_an_unkept_pre_of_interleaved_pairs(engine_calls):
    """Where the forward kept no raw up projection, the engine's backward makes it again from the interleaved weight,
    in the [gate | up] layout: the same gradients as from the kept one."""
    p = make_problem(6, 32, 16, 4, 2, dtype=torch.bfloat16, device=DEVICE, activation="gptoss_glu", layout="kn",
                     gate_up="interleaved", bias=True, requires_grad=False)
    g, u, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation="gptoss_glu", layout="kn",
                                          gate_up="interleaved")
    args = (p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, "gptoss_glu", "output", 1.702, 7.0, None, True)
    _, pre, order, sorted_expert, offsets = torch.ops.moe_inductor.experts_forward.default(*args)
    dy = torch.randn(p.x.shape, generator=torch.Generator().manual_seed(2)).to(p.x)
    needs = [True] * 8 + [False]

    def grads(kept):
        return torch.ops.moe_inductor.experts_backward.default(
            dy, p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, kept, order, sorted_expert, offsets,
            "gptoss_glu", "output", 1.702, 7.0, False, needs)

    from_kept, remade = grads(pre), grads(p.x.new_empty(0))
    assert engine_calls == {"forward": 1, "backward": 2}
    for name, a, b in zip(["dx", "dtopk_weights", "dw1", "dw1_up", "dw2", "db1", "db1_up", "db2"], from_kept, remade):
        assert a.numel() > 0, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _two_tensor_layer(T: int, E: int, layout: str, bias: bool, routing: str, seed: int = 0):
    """A layer whose gate and up weights are two tensors (torchtitan's w1 and w3), as leaves in the layout they are
    held (nk: (E, I, H) read transposed; kn: (E, H, I)), with the op's (E, H, I) views of them."""
    p = make_problem(T, 32, 16, E, 2, dtype=torch.bfloat16, device=DEVICE, layout=layout, bias=bias, routing=routing,
                     requires_grad=False, seed=seed)
    g, u, d, b1, b1_up = expert_weight_views(p.w1, p.w2, p.b1, activation="silu_glu", layout=layout,
                                             gate_up="concat")
    held = [t.transpose(1, 2) if layout == "nk" else t for t in (g, u, d)]
    leaves = [p.x, p.topk_weights, *(t.contiguous() for t in held)]
    if bias:
        leaves += [b1.contiguous(), b1_up.contiguous(), p.b2]
    leaves = [t.detach().clone().requires_grad_() for t in leaves]

    def views(ls):
        x, w, gh, uh, dh, *biases = ls
        gv, uv, dv = (t.transpose(1, 2) if layout == "nk" else t for t in (gh, uh, dh))
        return (x, p.topk_ids, w, gv, uv, dv, *(biases or (None, None, None)))

    return leaves, views


@needs_grouped_mm
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("T,E,routing,bias,seed", [
    pytest.param(6, 5, "random", False, 0, id="E5"),
    # seed 1: seed 0's one token has, in kn, a routing-weight gradient of 0.22 summed from terms near 1, which
    # bf16 rounding of dh (CUTLASS writes it in bf16) moves by 6%, the one-tensor engine path alike
    pytest.param(1, 3, "random", False, 1, id="T1"),
    pytest.param(0, 3, "random", False, 0, id="T0"),
    pytest.param(7, 4, "skip_odd", True, 0, id="empty-experts-biases"),
    pytest.param(5, 3, "one_expert", False, 0, id="one-hot-expert"),
])
def test_engine_runs_gate_and_up_held_as_two_tensors(layout, T, E, routing, bias, seed, engine_calls, nan_empty):
    """Gate and up weights that are two tensors take the engine as two GEMMs (they used to fall back to the fused
    kernels at every size): forward, the inference forward (nothing kept) and every gradient against the float64
    reference."""
    leaves, views = _two_tensor_layer(T, E, layout, bias, routing, seed)
    tail = ("silu_glu", "output", 1.702, 7.0, None)
    y = torch.ops.moe_inductor.experts_forward(*views(leaves), *tail, True)[0]
    with torch.no_grad():
        y_inference = torch.ops.moe_inductor.experts_forward(*views(leaves), *tail, False)[0]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    if T == 0:  # nothing to run: no GEMM, and every gradient zero
        assert engine_calls == {"forward": 0, "backward": 0} and y.shape == (0, 32)
        assert all(g is None or not g.any() for g in grads)
        return
    assert engine_calls == {"forward": 2, "backward": 1}
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = moe_reference(*views(leaves64), *tail)
    assert_close(y, ref, torch.bfloat16, "y")
    assert_close(y_inference, ref, torch.bfloat16, "y (inference)")
    want = torch.autograd.grad(ref, leaves64, dy.double(), allow_unused=True)
    for i, (got, w) in enumerate(zip(grads, want)):
        if w is None:
            continue
        assert_close(got, w.to(got.dtype), torch.bfloat16, f"grad {i}")
        assert got.stride() == leaves[i].stride(), f"grad {i} is not in its leaf's layout"


@needs_grouped_mm
def test_engine_with_two_tensors_passes_opcheck(engine_calls):
    """A gated layer whose gate and up are two tensors (opcheck's own copies are two tensors too)."""
    leaves, views = _two_tensor_layer(5, 3, "nk", False, "random")
    args = (*views([t.detach() for t in leaves]), "silu_glu", "output", 1.702, 7.0, None, True)
    torch.library.opcheck(torch.ops.moe_inductor.experts_forward.default, args)
    assert engine_calls["forward"] > 0


def test_two_tensors_that_differ_stay_on_the_fused_kernels(monkeypatch, triton_kernels):
    """Two gate and up tensors of other shapes or dtypes than each other are not the engine's."""
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    p, (g, u, d, _, _) = _weights()
    x = p.x.bfloat16()
    pair = grouped_mm_engine.grouped_mm_weights(x, g, u.clone(), d, None, None, "output", False, 8)
    assert isinstance(pair, tuple) and not grouped_mm_engine.is_interleaved(pair, g)
    assert grouped_mm_engine.grouped_mm_weights(x, g, u.float(), d, None, None, "output", False, 8) is None
    assert grouped_mm_engine.grouped_mm_weights(x, g, u[:, :16].clone(), d, None, None, "output", False, 8) is None
