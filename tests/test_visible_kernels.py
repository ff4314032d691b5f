"""The Inductor-visible experts forward (lowerings/visible.py, ``config.visible_kernels``, on by default).

On the CPU only its eager behaviour and the graph swap are testable: tracing into it needs compiled Triton kernels
(under TRITON_INTERPRET=1 ``wrap_triton`` hands back the interpreted kernel, which cannot take fake tensors). The
compiled path is tested on the GPU (the `gpu` tests at the end of this file).
"""
import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import config
from moe_inductor.ops import expert_weight_views
from tests.helpers import make_problem, run_without_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels only without a GPU


def _wrap_triton_takes_our_kernels() -> bool:
    """Whether ``torch.library.wrap_triton`` accepts a kernel as this process builds them: a compiled one on a GPU,
    and under TRITON_INTERPRET=1 Triton's interpreted one, which torch before 2.13 refuses ("wrap_triton only works
    on functions annotated with triton.jit")."""
    if torch.cuda.is_available():
        return True
    from torch.library import wrap_triton

    from moe_inductor.kernels.combine import combine_kernel as kernel
    try:
        wrap_triton(kernel)
    except RuntimeError:
        return False
    return True


needs_wrap_triton = pytest.mark.skipif(not _wrap_triton_takes_our_kernels(), reason=(
    "this torch's wrap_triton refuses Triton's interpreted kernels (torch < 2.13 under TRITON_INTERPRET=1); the "
    "file's gpu tests run the visible op there"))


@needs_wrap_triton
@pytest.mark.parametrize("T,k,capacity,routing", [
    (3, 2, None, "random"), (11, 3, None, "random"), (9, 2, 4, "random"), (0, 2, None, "random"),
    (1, 1, None, "random"), (10, 2, None, "one_expert"), (10, 2, None, "skip_odd"),
], ids=["one-chunk", "chunks", "capacity", "T0", "T1", "all-on-one-expert", "empty-experts"])
def test_visible_op_equals_the_opaque_op(T, k, capacity, routing, triton_kernels):
    """Eagerly (a known token count), the visible op runs the same kernels as the opaque op. (The routing path that
    a symbolic token count takes is tested in tests/test_routing.py, count-then-place.)"""
    import moe_inductor.lowerings.visible  # noqa: F401  (registers the op)

    p = make_problem(T, 16, 8, 5, k, routing=routing, device=DEVICE, requires_grad=False)  # E = 5: not a power of 2
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    args = (p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None, "silu_glu", "output", 1.702, 7.0, capacity,
            True)
    got = torch.ops.moe_inductor.experts_forward_visible(*args)
    ref = torch.ops.moe_inductor.experts_forward(*args)
    for a, b, name in zip(got, ref, ("y", "pre", "order", "sorted_expert", "offsets")):
        torch.testing.assert_close(a, b, msg=name)


def _opaque_moe(x, ids, w, g, u, d):
    return torch.ops.moe_inductor.experts_forward.default(x, ids, w, g, u, d, None, None, None, "silu_glu", "output",
                                                          1.702, 7.0, None, False)[0]


def _graph_of_the_opaque_op(inputs: tuple) -> torch.fx.GraphModule:
    """``_opaque_moe`` as an FX graph whose placeholders carry ``inputs`` as example values, as Dynamo's do."""
    gm = torch.fx.symbolic_trace(_opaque_moe)
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        node.meta["val"] = value
    return gm


@needs_wrap_triton
def test_the_swap_only_touches_triton_run_tensors(monkeypatch):
    from moe_inductor.lowerings.visible import swap_in_visible_ops

    for on_triton in (False, True):  # CPU tensors without Triton: left alone; Triton-run tensors: swapped
        monkeypatch.setattr(config, "triton_on_cpu", on_triton)
        p = make_problem(7, 16, 8, 5, 2, device=DEVICE if on_triton else "cpu", requires_grad=False)
        g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
        inputs = (p.x, p.topk_ids, p.topk_weights, g, u, d)
        gm = _graph_of_the_opaque_op(inputs)
        counters.clear()
        assert swap_in_visible_ops(gm) == int(on_triton)
        assert counters["moe_inductor_visible"]["swapped"] == int(on_triton)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        visible = torch.ops.moe_inductor.experts_forward_visible.default
        assert (visible in targets) == on_triton
        torch.testing.assert_close(gm(*inputs), _opaque_moe(*inputs))  # eagerly the same function either way


@pytest.mark.parametrize("engine,swapped,swapped_below_rule", [("auto", 0, 1), ("grouped_mm", 0, 0), ("triton", 1, 1)])
def test_experts_the_grouped_mm_engine_may_take_stay_opaque(engine, swapped, swapped_below_rule, monkeypatch):
    """The engine decides per call from the token count, which a traced graph cannot: experts at or above its size
    rule (lowered here to this problem's H * I) keep the opaque op unless the engine is off ("triton"); a forced
    engine ("grouped_mm") keeps every size opaque."""
    from moe_inductor.lowerings.visible import swap_in_visible_ops

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "gemm_engine", engine)
    monkeypatch.setattr(config, "grouped_mm_min_expert_weights", 16 * 8)
    p = make_problem(7, 16, 8, 5, 2, device=DEVICE, requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    inputs = (p.x, p.topk_ids, p.topk_weights, g, u, d)
    assert swap_in_visible_ops(_graph_of_the_opaque_op(inputs)) == swapped
    monkeypatch.setattr(config, "grouped_mm_min_expert_weights", 16 * 8 + 1)  # one weight short of the rule
    assert swap_in_visible_ops(_graph_of_the_opaque_op(inputs)) == swapped_below_rule


class _StackedLoop(torch.nn.Module):
    """A loop over stacked (E, out, in) expert weights: the rewrite hands the op transposed views of them."""

    def __init__(self, E=4, H=16, I=8):
        super().__init__()
        self.E = E
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(E, I, H) * H ** -0.5) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = torch.where(ids == e)
            rows = x[tok]
            h = torch.nn.functional.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())
            out.index_add_(0, tok, (h @ self.w2[e].t()) * w[tok, slot, None])
        return out


@pytest.mark.parametrize("engine,swapped", [("auto", 0), ("triton", 1)])
def test_rewritten_stacked_weights_the_engine_may_take_stay_opaque(engine, swapped, monkeypatch):
    """The views the rewrite makes of stacked nn.Linear-layout weights carry their traced shapes, so the engine's
    size rule can read the down weight: experts it may take stay on the opaque op (a view without one was swapped
    to the visible op, which never runs the engine: Mixtral-sized sort + grouped_mm layers ran our fused GEMMs
    where torch._grouped_mm is faster)."""
    from moe_inductor import backend

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "visible_kernels", True)
    monkeypatch.setattr(config, "gemm_engine", engine)
    monkeypatch.setattr(config, "grouped_mm_min_expert_weights", 16 * 8)
    monkeypatch.setattr(backend, "_inner_compile", lambda name, gm, inputs, mode, inductor_options=None: gm.forward)
    torch.manual_seed(0)
    model = _StackedLoop().to(DEVICE)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "inductor"})
    x = torch.randn(6, 16, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert counters["moe_inductor"]["unrolled_loop"] == 1, dict(counters["moe_inductor"])
    assert counters["moe_inductor_visible"]["swapped"] == swapped


@needs_wrap_triton
def test_visible_op_has_the_opaque_ops_gradients(triton_kernels):
    import moe_inductor.lowerings.visible  # noqa: F401  (registers the op)

    p = make_problem(7, 16, 8, 5, 2, device=DEVICE)
    leaves = p.leaves()
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    args = (p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None, "silu_glu", "output", 1.702, 7.0, None, True)
    dy = torch.randn(7, 16, device=DEVICE)
    got = torch.autograd.grad(torch.ops.moe_inductor.experts_forward_visible(*args)[0], leaves, dy)
    ref = torch.autograd.grad(torch.ops.moe_inductor.experts_forward(*args)[0], leaves, dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def _trace_the_visible_op_in_a_subprocess(call: str):
    """``call`` (a tracing function of tests/helpers.py) run in a process without the interpreter; its answer."""
    import json

    out = run_without_interpreter(f"import json; print(json.dumps({call}))", timeout=300)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("spelling,whole", [("whole", True), ("views", True), ("two_weights", False)])
def test_the_traced_visible_op_reads_an_interleaved_weight_whole(spelling, whole):
    """Traced by Dynamo (fake tensors) and AOT autograd (functional tensors), whose views keep no ``_base``, the
    gate/up GEMM still proves that its two stride-2 views are one interleaved weight and reads it whole
    (``INTERLEAVED``). It once read the pairs form as two strided views in every compiled GPT-OSS training step,
    about 9x slower at T = 1024. Views of two different tensors are never read as one."""
    from tests.helpers import visible_interleaved_launches

    seen = visible_interleaved_launches(spelling)
    assert {kind for kind, _ in seen} == {"FakeTensor", "FunctionalTensor"}, seen
    assert all(flag == whole for _, flag in seen), seen


def test_every_dimension_symbolic_specialises_only_the_weight_dims():
    """With every dimension symbolic (opcheck's test_aot_dispatch_dynamic; it once failed on the H200 with
    "unhashable type: SymInt"), the launchers specialise k, E, H and I, which pick constexprs and configs, and
    never the token count. (T = 17, k = 2, E = 5, H = 16, I = 8 in tests/helpers.py.)"""
    traced = _trace_the_visible_op_in_a_subprocess("visible_every_dim_guards()")
    specialised = sorted(int(g.split(", ")[1].rstrip(")")) for g in traced["guards"])
    assert specialised == [2, 5, 8, 16], traced["guards"]
    assert not any(traced["tokens"] in g.replace("(", " ").replace(",", " ").split() for g in traced["guards"])


@pytest.mark.slow
def test_a_static_graph_routes_in_one_launch_and_a_dynamic_one_in_two():
    """A known token count makes the opaque op's choice (6 rows fit one routing chunk: one launch); a symbolic one
    takes count-then-place, which is right for every count and adds no guard."""
    gemms = ["grouped_gemm_kernel", "grouped_gemm_kernel", "combine_kernel"]
    assert _trace_the_visible_op_in_a_subprocess("visible_launches(False)") == ["route_place_kernel", *gemms]
    assert _trace_the_visible_op_in_a_subprocess("visible_launches(True)") == ["route_count_kernel", "route_place_kernel",
                                                                        *gemms]


@pytest.mark.slow
def test_tracing_into_the_visible_op_adds_no_token_count_guard():
    """Traced with a dynamic token count (in a process without the interpreter, see tests/helpers.py), the
    op adds no shape guard: a guard on T would recompile the model at each new range of sequence lengths. (The
    routing buffer once gave `num_chunks == 1`, i.e. T <= 512.)"""
    guards = _trace_the_visible_op_in_a_subprocess("visible_dynamic_token_guards()")
    assert [g for g in guards if "2147483647" not in g] == []  # int32-range checks of kernel arguments are fine


@pytest.mark.parametrize("inner,mode,swapped", [
    ("inductor", None, True), ("inductor", "default", True), ("inductor", "reduce-overhead", False),
    ("inductor", "max-autotune", False), ("aot_eager", None, False), ("eager", None, False),
])
def test_the_backend_swaps_only_for_inductor_without_cuda_graphs(inner, mode, swapped, monkeypatch):
    """The visible kernels cut host time per call; CUDA graph replay removes that anyway, and only Inductor launches
    them from its wrapper. So the backend swaps for Inductor in modes without CUDA graphs, and nowhere else."""
    from moe_inductor import backend
    from moe_inductor.lowerings import visible

    from moe_inductor.report import Report, collecting

    calls = []
    monkeypatch.setattr(visible, "swap_in_visible_ops", lambda gm: calls.append(gm) or 3)  # "swapped three ops"
    monkeypatch.setattr(backend, "_inner_compile", lambda name, gm, inputs, mode, inductor_options=None: gm.forward)
    monkeypatch.setattr(config, "visible_kernels", True)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with collecting(Report()) as report:
        backend.moe_inductor_backend(gm, [torch.ones(2)], options={"inner": inner}, mode=mode)
    assert bool(calls) == swapped
    assert report.graphs[0].visible_ops == (3 if swapped else 0)  # explain() says how many Inductor launches
    assert ("3 launched from Inductor's wrapper" in str(report)) == swapped
    monkeypatch.setattr(config, "visible_kernels", False)
    backend.moe_inductor_backend(gm, [torch.ones(2)], options={"inner": inner}, mode=mode)
    assert len(calls) == int(swapped)  # off: never


# On the GPU: Inductor traces into the op and launches our kernels from its own generated code.


def _compiled_with_visible_kernels(monkeypatch):
    """A gathered-weights MoE on the GPU and its moe_inductor compile with config.visible_kernels, fresh counters."""
    from tests.test_pass_gathered_weights import GatheredMoE

    monkeypatch.setattr(config, "visible_kernels", True)
    torch.manual_seed(0)
    model = GatheredMoE("gptfast").cuda()
    torch._dynamo.reset()
    counters.clear()
    return model, torch.compile(model, backend="moe_inductor")


@pytest.mark.gpu
def test_gpu_visible_kernels_run_from_inductors_wrapper(monkeypatch):
    """config.visible_kernels (on by default): Inductor traces into the experts forward and launches our Triton
    kernels from its generated code; the results and the gradients stay as with the opaque op."""
    from torch._inductor.utils import run_and_get_code

    from moe_inductor.lowerings import visible

    model, compiled = _compiled_with_visible_kernels(monkeypatch)
    codes = []
    for T in (5, 17, 33, 64):
        x = torch.randn(T, 16, device="cuda", requires_grad=True)
        out, code = run_and_get_code(compiled, x)
        codes += code
        ref = model(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0],
                                   rtol=1e-4, atol=1e-4)
    text = "\n".join(codes)
    assert "grouped_gemm_kernel" in text and "torch.ops.moe_inductor.experts_forward" not in text  # no op call left
    p = make_problem(9, 64, 32, 5, 2, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    torch.library.opcheck(visible.experts_forward_visible, (p.x, p.topk_ids, p.topk_weights, g, u, d, None, None,
                                                            None, "silu_glu", "output", 1.702, 7.0, None, False))


@pytest.mark.gpu
def test_gpu_visible_kernels_compile_at_most_twice(monkeypatch):
    """Over four token counts: one static compile, then one dynamic. (Not checked with run_and_get_code above: it
    resets Dynamo before every call, which is what once read as four compiles.)"""
    _, compiled = _compiled_with_visible_kernels(monkeypatch)
    for T in (5, 17, 33, 64):
        compiled(torch.randn(T, 16, device="cuda", requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.gpu
def test_gpu_a_compiled_training_step_reads_the_interleaved_weight_whole(monkeypatch):
    """GPT-OSS's layer (interleaved gate/up with biases, gptoss_glu) in a compiled training step: the visible op's
    gate/up GEMM is traced with ``INTERLEAVED`` (the whole weight read as (gate, up) pairs), and the output and
    every gradient equal eager's."""
    import moe_inductor
    from moe_inductor.kernels import launch

    monkeypatch.setattr(config, "visible_kernels", True)
    traced = []
    real = launch.launch_kernel

    def spy(kernel, grid, args, meta):
        if meta.get("GATED") and kernel.name == "grouped_gemm_kernel" and type(args[1]) is not torch.Tensor:
            traced.append(bool(meta["INTERLEAVED"]))
        return real(kernel, grid, args, meta)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    act = "gptoss_glu"
    p = make_problem(40, 64, 32, 6, 2, dtype=torch.bfloat16, device="cuda", activation=act, layout="kn",
                     gate_up="interleaved", bias=True, requires_grad=False)
    params = [torch.nn.Parameter(t.detach().clone()) for t in (p.w1, p.b1, p.w2, p.b2)]
    x = p.x.detach().clone().requires_grad_()

    def run(x):
        return moe_inductor.fused_experts(x, p.topk_ids, p.topk_weights, params[0], params[2], b1=params[1],
                                          b2=params[3], activation=act, layout="kn", gate_up="interleaved")

    torch._dynamo.reset()
    dy = torch.randn_like(p.x)
    out = torch.compile(run, backend="moe_inductor")(x)
    got = torch.autograd.grad(out, [x, *params], dy)
    ref_out = run(x)
    ref = torch.autograd.grad(ref_out, [x, *params], dy)
    assert traced and all(traced), traced
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_every_launch_passes_every_kernel_parameter(tma, triton_kernels, monkeypatch):
    """torch 2.11's ``wrap_triton`` rejects a launch that leaves any kernel parameter to its default ("Incorrect
    number of arguments passed to kernel"; torch 2.13 accepts it), and the visible op's trace then fails. So every
    launch of ours names every parameter of its kernel: forward and backward, and the TMA paths (descriptors made in
    the kernel, persistent)."""
    from moe_inductor.kernels import launch

    launches = []
    real = launch.launch_kernel

    def spy(kernel, grid, args, meta):
        launches.append((kernel, len(args), set(meta)))
        return real(kernel, grid, args, meta)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    monkeypatch.setattr(launch, "_GEMM_DECISIONS", {})
    monkeypatch.setattr(config, "gemm_engine", "triton")  # every GEMM ours, the weight gradients' too
    if tma:
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("a GPU without TMA")
        monkeypatch.setattr(config, "gemm_tma_weights", "on")  # (the rule forced below; "tuned" asks the table)
        monkeypatch.setattr(launch, "tma_weights_apply", lambda *args, **kwargs: True)
    p = make_problem(9, 32, 16, 3, 2, dtype=torch.bfloat16, device=DEVICE)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)
    torch.autograd.grad(y.float().sum(), p.leaves())
    assert len({kernel.name for kernel, _, _ in launches}) >= 4, "routing, GEMMs, combine and backward launches seen"
    for kernel, num_args, meta in launches:
        names = kernel.resolve().arg_names
        passed = set(names[:num_args]) | (meta - {"num_warps", "num_stages"})
        assert passed == set(names), (kernel.name, set(names) - passed)


def test_traceable_launches_in_one_thread_leave_another_threads_launches_as_they_are():
    """The visible op's body sets ``traceable_launches`` in the thread tracing it; an opaque op running meanwhile in
    another thread must keep its own launches and decisions (its engine, its autotuning)."""
    from moe_inductor.kernels.launch import traceable_launches, tracing_launches
    from tests.helpers import read_beside

    assert read_beside(traceable_launches(), tracing_launches) == (True, False)
    assert not tracing_launches()
