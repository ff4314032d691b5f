"""The experts backward visible to Inductor (lowerings/visible_backward.py, ``config.visible_backward``).

On the CPU: the choice of ops (static row counts the engine cannot take), the ops' eager results under the
interpreter against the opaque ops', and a fake-tensor trace of a training step (which ops the backward calls). AOT
autograd's trace into the ops needs Triton's GPU driver to read which arguments each kernel writes (without it every
argument counts as written, the saved inputs included), so the compiled step is tested on the GPU.
"""
import pytest
import torch
from torch._dynamo.utils import counters

from moe_inductor import config
from moe_inductor.lowerings import visible_backward
from moe_inductor.ops import grouped_mm_engine
from moe_inductor.ops.backward import experts_backward_middle, experts_backward_up
from tests.helpers import make_problem, run_without_interpreter
from tests.test_backward_split import _args

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fake(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("engine,dtype,rows_per_expert,biased,traced", [
    ("auto", torch.bfloat16, 64, False, True),  # Qwen3-MoE at 1024 tokens: below the backward's 128 rows
    ("auto", torch.bfloat16, 128, False, False),  # the engine's backward rule: the opaque ops keep it
    ("auto", torch.float32, 4096, False, True),  # the engine takes bf16 only
    ("auto", torch.bfloat16, 128, True, True),  # biased experts this small (H * I < 4M): never the engine
    ("triton", torch.bfloat16, 4096, False, True),
    ("grouped_mm", torch.float32, 1, False, False),  # forced: wherever the layout allows, so never traced
])
def test_the_backward_is_traced_only_where_the_engine_cannot_take_it(engine, dtype, rows_per_expert, biased,
                                                                     traced, monkeypatch):
    monkeypatch.setattr(config, "gemm_engine", engine)
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    E, H, I = 8, 64, 32
    x, w2 = _fake((16, H), dtype), _fake((E, I, H), dtype)
    rows = rows_per_expert * E
    assert grouped_mm_engine.may_take_backward_of(x, w2, biased, rows) is not traced
    assert visible_backward.backward_traceable(x, w2, biased, rows) is traced
    monkeypatch.setattr(config, "gemm_tma_descriptors", "host")  # a traced launch cannot take those
    assert visible_backward.backward_traceable(x, w2, biased, rows) is False


def test_a_symbolic_row_count_keeps_the_opaque_ops():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    rows = ShapeEnv().create_unbacked_symint()
    assert not visible_backward.backward_traceable(_fake((4, 64), torch.float32), _fake((8, 32, 64), torch.float32),
                                                   False, rows)


def test_the_rule_agrees_with_the_engines_own_decision(monkeypatch):
    """Wherever ``may_take_backward_of`` says no, ``grouped_mm_weights(backward=True)`` (which reads real tensors)
    says no as well: a traced backward never loses a call the engine would have taken."""
    monkeypatch.setattr(config, "gemm_engine", "auto")
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    for dtype in (torch.float32, torch.bfloat16):
        for T, E in ((3, 4), (64, 4), (300, 4), (2048, 8)):
            p = make_problem(T, 16, 8, E, 2, dtype=dtype, requires_grad=False)
            w1 = p.w1.transpose(1, 2)[:, :, :8] if p.layout == "nk" else p.w1[:, :, :8]
            w2 = p.w2.transpose(1, 2) if p.layout == "nk" else p.w2
            rows = T * 2
            if not grouped_mm_engine.may_take_backward_of(p.x, w2, False, rows):
                assert grouped_mm_engine.grouped_mm_weights(p.x, w1, None, w2, None, None, "output", False, rows,
                                                            backward=True) is None


def _visible_ops_take_triton():
    from tests.test_visible_kernels import _wrap_triton_takes_our_kernels

    return _wrap_triton_takes_our_kernels()


@pytest.mark.skipif(not _visible_ops_take_triton(), reason="this torch's wrap_triton refuses interpreted kernels")
@pytest.mark.parametrize("activation,bias,gate_up,whole", [
    ("silu_glu", False, "concat", (False, False)), ("silu_glu", True, "concat", (False, False)),
    ("silu_glu", False, "concat", (True, False)),  # one gate/up gradient: one weight-gradient launch when traced
    ("gptoss_glu", True, "interleaved", (False, False)), ("gptoss_glu", True, "interleaved", (True, True)),
    ("clamped_silu_glu", False, "concat", (True, False))])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_the_visible_ops_give_the_opaque_ops_gradients(activation, bias, gate_up, whole, T, triton_kernels):
    gated = True
    needs = [True, True, True, gated, True, bias, bias and gated, bias, *whole]
    # the interpreter's, or the GPU's; a bound that binds (the projections are about N(0, 1))
    args = _args(activation, bias, gate_up, T=T, needs=needs, device=DEVICE, limit=0.5)
    dy, *shared, pre, order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs = args
    options = (order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs)
    middle = torch.ops.moe_inductor.experts_backward_middle_visible(dy, *shared, pre, *options)
    ref_middle = experts_backward_middle(dy, *shared, pre, *options)
    for a, b in zip(middle, ref_middle):
        torch.testing.assert_close(a, b)
    up = torch.ops.moe_inductor.experts_backward_up_visible(middle[0], middle[1], *shared, *options)
    ref_up = experts_backward_up(ref_middle[0], ref_middle[1], *shared, *options)
    for a, b in zip(up, ref_up):
        torch.testing.assert_close(a, b)


def test_a_traced_training_step_calls_the_visible_backward_ops_where_static():
    """make_fx (fake tensors, so nothing launches; in a process without the interpreter): with a static token count
    the visible forward's backward calls the visible ops, with a symbolic one the opaque ops."""
    import json

    out = run_without_interpreter("import json; print(json.dumps([visible_backward_trace(False), "
                                  "visible_backward_trace(True)]))", timeout=400)
    static, dynamic = json.loads(out.strip().splitlines()[-1])
    assert static["ops"] == ["experts_forward_visible", "experts_backward_middle_visible",
                             "experts_backward_up_visible"], static
    assert dynamic["ops"] == ["experts_forward_visible", "experts_backward_middle", "experts_backward_up"], dynamic


def test_off_the_visible_forward_keeps_the_opaque_backward(monkeypatch):
    monkeypatch.setattr(config, "visible_backward", False)
    x, w2 = _fake((4, 64), torch.float32), _fake((8, 32, 64), torch.float32)
    order = _fake((8,), torch.int32)
    assert visible_backward.pick_backward_ops(x, w2, False, order) == (experts_backward_middle, experts_backward_up)
    monkeypatch.setattr(config, "visible_backward", True)
    counters.clear()
    assert visible_backward.pick_backward_ops(x, w2, False, order)[0] is (
        torch.ops.moe_inductor.experts_backward_middle_visible)
    assert counters["moe_inductor_visible"]["backward"] == 1


# On the GPU: Inductor traces the backward's kernels into its compiled backward graph.


def _compiled_step(model, x):
    out = model(x)
    out.float().pow(2).sum().backward()
    return out


def _compiled_copy_step(ref_model, x):
    """A copy of the gathered-weights ``ref_model`` compiled with backend="moe_inductor" (static shapes, after a
    Dynamo reset and a clear of the counters), one training step on ``x``: (model, output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    from tests.test_pass_gathered_weights import GatheredMoE

    model = GatheredMoE("gptfast").to(x.device, x.dtype)
    model.load_state_dict(ref_model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", dynamic=False)
    out, codes = run_and_get_code(_compiled_step, compiled, x.clone().requires_grad_())
    return model, out, codes


def _errors(model, ref_model, out, ref):
    """Max abs error of the output and of every parameter's gradient against the reference model's."""
    errs = {"out": (out.float() - ref.float()).abs().max().item()}
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert a.grad is not None and b.grad is not None, name
        errs[name] = (a.grad.float() - b.grad.float()).abs().max().item()
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_gpu_a_compiled_training_step_launches_the_backward_from_inductors_wrapper(dtype, T, monkeypatch):
    """A gathered-weights MoE's training step with a static token count: the compiled backward launches our
    kernels itself (no opaque backward op left in its code), and the output and every gradient are as close to
    eager's as the opaque ops' compiled step is (``_compiled_on_against_off``)."""
    monkeypatch.setattr(config, "visible_kernels", True)
    texts = _compiled_on_against_off(monkeypatch, dtype, T, "visible_backward", "backward")
    assert "backward_middle_kernel" in texts[True] and "grouped_weight_grad_kernel" in texts[True]
    assert "moe_inductor.experts_backward" not in texts[True]  # neither opaque half is called
    assert "moe_inductor.experts_backward_middle.default" in texts[False]  # the control did take the opaque ops


def _traced_afresh(monkeypatch) -> None:
    """Compiles that AOT autograd traces every time: a graph served from the compile caches (an earlier run on the
    machine, with the same settings and source) is never traced, so the choices counted while tracing read 0."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)


def _compiled_on_against_off(monkeypatch, dtype, T: int, setting: str, counter: str) -> dict:
    """A gathered-weights MoE's compiled training step over T tokens with ``config.<setting>`` on and off: each
    compile counts ``counter`` (moe_inductor_visible) once when on and never when off, and the output and every
    gradient of the step with it on are as close to eager's as the step with it off (the opaque ops) is. The
    model's unscaled weights make gradients of 1e4 to 1e5, where one bf16 ulp is 64 to 512, so the opaque ops' own
    error is the measure. Returns each step's generated code, by the setting's value."""
    from tests.test_pass_gathered_weights import GatheredMoE

    _traced_afresh(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(T, 16, device="cuda", dtype=dtype)
    ref_model = GatheredMoE("gptfast").to("cuda", dtype)
    ref = _compiled_step(ref_model, x.clone().requires_grad_())
    errors, texts = {}, {}
    for on in (True, False):
        monkeypatch.setattr(config, setting, on)
        model, out, codes = _compiled_copy_step(ref_model, x)
        texts[on] = "\n".join(codes)
        errors[on] = _errors(model, ref_model, out, ref)
        assert counters["moe_inductor_visible"][counter] == (1 if on else 0)
    ulp = torch.finfo(dtype).eps
    for name, err in errors[True].items():
        scale = ref.abs().max().item() if name == "out" else ref_model.get_parameter(name).grad.abs().max().item()
        assert err <= 2 * errors[False][name] + 4 * ulp * scale, (name, err, errors[False][name], scale)
    return texts


@pytest.mark.gpu
@pytest.mark.parametrize("activation,bias,gate_up", [("silu_glu", False, "concat"), ("gptoss_glu", True,
                                                                                       "interleaved")])
def test_gpu_opcheck_the_visible_backward_ops(activation, bias, gate_up):
    args = _args(activation, bias, gate_up, dtype=torch.bfloat16)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    dy, *shared, pre, order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs = args
    options = (order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs)
    torch.library.opcheck(visible_backward.experts_backward_middle_visible, (dy, *shared, pre, *options))
    d_pre, d_scale, *_ = visible_backward.experts_backward_middle_visible(dy, *shared, pre, *options)
    torch.library.opcheck(visible_backward.experts_backward_up_visible, (d_pre, d_scale, *shared, *options))


# The engine's backward traced (``config.visible_engine_backward``): its GEMMs as aten._grouped_mm nodes.


@pytest.mark.parametrize("flag,engine,dtype,rows_per_expert,traced", [
    (True, "auto", torch.bfloat16, 128, True),  # the engine's backward rule holds: traced with its GEMMs
    (True, "auto", torch.bfloat16, 64, False),  # below it the fused kernels' visible ops take it
    (True, "auto", torch.float32, 4096, False),  # the engine takes bf16 only
    (False, "auto", torch.bfloat16, 128, False),  # off: the opaque ops keep the engine's calls
])
def test_the_engines_backward_is_traced_only_under_its_setting(flag, engine, dtype, rows_per_expert, traced,
                                                               monkeypatch):
    monkeypatch.setattr(config, "visible_engine_backward", flag)
    monkeypatch.setattr(config, "gemm_engine", engine)
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    E, H, I = 8, 64, 32
    x, w2 = _fake((16, H), dtype), _fake((E, I, H), dtype)
    rows = rows_per_expert * E
    assert visible_backward.engine_backward_traceable(x, w2, False, rows) is traced
    # never both: the fused visible ops are for calls the engine cannot take
    assert not (traced and visible_backward.backward_traceable(x, w2, False, rows))
    counters.clear()
    middle, _ = visible_backward.pick_backward_ops(x, w2, False, _fake((rows,), torch.int32))
    if traced:
        assert middle is torch.ops.moe_inductor.experts_backward_middle_visible
        assert counters["moe_inductor_visible"]["engine_backward"] == 1
    else:
        assert counters["moe_inductor_visible"]["engine_backward"] == 0
    monkeypatch.setattr(config, "gemm_tma_descriptors", "host")  # a traced launch cannot take those
    assert not visible_backward.engine_backward_traceable(x, w2, False, rows)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert not visible_backward.engine_backward_traceable(x, w2, False, ShapeEnv().create_unbacked_symint())
    # biased layers (GPT-OSS's kind) follow the engine's biased rule: traced wherever it may take them
    monkeypatch.setattr(config, "gemm_tma_descriptors", "device")
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    big_w2 = _fake((E, 2880, 2880), dtype)
    per = config.grouped_mm_biased_backward_min_rows_per_expert
    if dtype == torch.bfloat16:
        assert visible_backward.engine_backward_traceable(x, big_w2, True, per * E) is flag
    assert not visible_backward.engine_backward_traceable(x, big_w2, True, per * E // 2)
    assert not visible_backward.engine_backward_traceable(x, w2, True, rows)  # experts too small for the biased rule


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing")
@pytest.mark.skipif(not _visible_ops_take_triton(), reason="this torch's wrap_triton refuses interpreted kernels")
@pytest.mark.parametrize("activation,bias,gate_up,whole", [
    ("silu_glu", False, "concat", (False, False)), ("silu_glu", False, "concat", (True, False)),
    ("silu_glu", True, "concat", (False, False)), ("silu", False, "concat", (False, False)),
    ("gptoss_glu", True, "interleaved", (False, False))])
@pytest.mark.parametrize("T", [1, 7])
def test_the_visible_ops_run_the_engine_where_it_is_traced(activation, bias, gate_up, whole, T, triton_kernels,
                                                          monkeypatch):
    """bf16 with the engine forced for the backward: the visible ops' bodies (what Inductor traces) run the
    engine's two halves and give the opaque ops' gradients (which run the engine too)."""
    monkeypatch.setattr(config, "visible_engine_backward", True)
    monkeypatch.setattr(config, "gemm_engine", "triton")
    monkeypatch.setattr(config, "gemm_engine_backward", "grouped_mm")
    calls = []
    for name in ("middle_grads", "up_grads"):
        real = getattr(grouped_mm_engine, name)
        monkeypatch.setattr(grouped_mm_engine, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    gated = activation != "silu"
    needs = [True, True, True, gated, True, bias, bias and gated, bias, *whole]
    # GPT-OSS's weight as it lies: (E, H, 2I), the pairs interleaved along its columns, read in place by the engine
    layout = "kn" if gate_up == "interleaved" else "nk"
    args = _args(activation, bias, gate_up, T=T, needs=needs, dtype=torch.bfloat16, device=DEVICE, layout=layout)
    dy, *shared, pre, order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs = args
    options = (order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs)
    middle = torch.ops.moe_inductor.experts_backward_middle_visible(dy, *shared, pre, *options)
    up = torch.ops.moe_inductor.experts_backward_up_visible(middle[0], middle[1], *shared, *options)
    assert calls == ["middle_grads", "up_grads"], calls
    ref_middle = experts_backward_middle(dy, *shared, pre, *options)
    ref_up = experts_backward_up(ref_middle[0], ref_middle[1], *shared, *options)
    for a, b in zip((*middle, *up), (*ref_middle, *ref_up)):
        torch.testing.assert_close(a, b)


def test_the_engines_traced_backward_puts_its_gemms_in_the_graph():
    """AOT autograd's joint graph (fake tensors, read at the partitioner; in a process without the interpreter):
    with the setting on, the backward the engine takes holds aten._grouped_mm nodes and our kernels, and no opaque
    backward op; off, the opaque ops and no aten._grouped_mm."""
    import json

    out = run_without_interpreter("import json; print(json.dumps([visible_engine_backward_joint(True), "
                                  "visible_engine_backward_joint(False)]))", timeout=400)
    traced, opaque = json.loads(out.strip().splitlines()[-1])
    assert traced["ops"] == [] and traced["grouped_mm"] >= 4, traced
    assert "backward_middle_kernel" in traced["kernels"], traced
    # the weight gradients' operands gathered by our kernel: Inductor's own gather, read through a transpose, was
    # laid out with the grouped dimension contiguous, which torch._grouped_mm refused on the H100
    assert traced["kernels"].count("gather_rows_kernel") >= 2, traced
    assert opaque["ops"] == ["experts_backward_middle", "experts_backward_up"] and opaque["grouped_mm"] == 0, opaque


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 300])
def test_gpu_a_compiled_step_traces_the_engines_backward(T, monkeypatch):
    """bf16, the engine forced for the backward: with the setting on, the compiled backward calls no opaque op
    (aten._grouped_mm sits in Inductor's code), and the output and gradients are as close to eager's as the
    opaque ops' compiled step is."""
    monkeypatch.setattr(config, "visible_kernels", True)
    monkeypatch.setattr(config, "gemm_engine", "triton")
    monkeypatch.setattr(config, "gemm_engine_backward", "grouped_mm")
    texts = _compiled_on_against_off(monkeypatch, torch.bfloat16, T, "visible_engine_backward", "engine_backward")
    assert "moe_inductor.experts_backward" not in texts[True] and "_grouped_mm" in texts[True]
    assert "moe_inductor.experts_backward_middle.default" in texts[False]


@pytest.mark.gpu
def test_gpu_gptoss_traced_engine_backward_takes_groups_of_any_size(monkeypatch):
    """A tiny HF GPT-OSS (biases, its (E, H, 2I) interleaved gate/up weight read transposed for dW1), bf16, the
    engine forced, compiled with the engine's backward traced: groups of sizes that are not multiples of 8 run (the
    gathers' layout is ours), no opaque backward op is called, and every experts gradient is as
    close to eager's as the opaque ops' compiled step is."""
    from torch._inductor.utils import run_and_get_code

    from tests.hf_models import tiny

    monkeypatch.setattr(config, "speed_rule", False)
    monkeypatch.setattr(config, "gemm_engine", "triton")  # the forward swapped in: its backward ops are picked
    monkeypatch.setattr(config, "gemm_engine_backward", "grouped_mm")
    _traced_afresh(monkeypatch)
    model = tiny("gpt_oss").to("cuda", torch.bfloat16)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1)).to("cuda")
    ref = model(ids, labels=ids).loss
    ref.backward()
    want = {n: p.grad.float().clone() for n, p in model.named_parameters() if "experts" in n}
    errors, texts = {}, {}
    for on in (True, False):
        monkeypatch.setattr(config, "visible_engine_backward", on)
        model.zero_grad()
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="moe_inductor", dynamic=False)
        _, codes = run_and_get_code(lambda: compiled(ids, labels=ids).loss.backward())
        texts[on] = "\n".join(codes)
        assert counters["moe_inductor_visible"]["engine_backward"] == (2 if on else 0)
        errors[on] = {n: (p.grad.float() - want[n]).abs().max().item()
                      for n, p in model.named_parameters() if "experts" in n}
    assert len(errors[True]) == 8  # gate_up_proj, its bias, down_proj, its bias, in each of 2 layers
    assert "moe_inductor.experts_backward" not in texts[True] and "_grouped_mm" in texts[True]
    ulp = torch.finfo(torch.bfloat16).eps
    for name, err in errors[True].items():
        assert err <= 2 * errors[False][name] + 4 * ulp * want[name].abs().max().item(), (name, err, errors[False])


_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3")


def _hf_joints() -> dict:
    """Every family's tiny HF training step traced to its joint graph with the engine's backward traced and, for
    Qwen3-MoE and GPT-OSS, opaque (``tests/hf_trace.py``: an sm_90 target stands in for the GPU), in one process
    without the interpreter."""
    import json

    calls = [f"hf_training_joint({f!r}, True)" for f in _FAMILIES]
    calls += [f"hf_training_joint({f!r}, False)" for f in ("qwen3_moe", "gpt_oss")]
    code = ("import json; from tests.hf_trace import hf_training_joint; "
            f"print(json.dumps([{', '.join(calls)}]))")
    out = json.loads(run_without_interpreter(code, timeout=900).strip().splitlines()[-1])
    return {"traced": dict(zip(_FAMILIES, out[:len(_FAMILIES)])),
            "opaque": dict(zip(("qwen3_moe", "gpt_oss"), out[len(_FAMILIES):]))}


def _traced_problems(joint: dict) -> list[str]:
    """What is wrong with a family's joint graph under the traced engine backward: both layers swapped for the
    visible op and their backward picked for the traced engine, no fallback, no opaque moe_inductor op, the
    engine's GEMMs (4 per layer: dW2, dh, dW1, dx) and our gather kernel."""
    c = joint["counters"]
    checks = [(c["moe_inductor_visible"] == {"swapped": 2, "engine_backward": 2}, f"counters {c}"),
              (not c.get("moe_inductor_fallback"), f"fallback {c.get('moe_inductor_fallback')}"),
              (joint["ops"] == [], f"opaque ops {joint['ops']}"),
              (joint["grouped_mm"] == 8, f"{joint['grouped_mm']} grouped_mm"),
              ({"gather_rows_kernel", "backward_middle_kernel", "grouped_gemm_kernel"} <= set(joint["kernels"]),
               f"kernels {joint['kernels']}")]
    return [what for ok, what in checks if not ok]


@pytest.mark.slow
def test_every_familys_training_step_traces_the_engines_backward():
    """transformers' experts of each family (GPT-OSS's biased, interleaved (E, H, 2I) weight; Qwen1.5-MoE's and
    DeepSeek-V3's shared experts beside them) in a whole compiled training step take the traced engine backward
    (``_traced_problems``). The control: with ``config.visible_engine_backward`` off, Qwen3-MoE's and GPT-OSS's
    steps call the opaque backward halves (each layer's middle and up) and hold no ``aten._grouped_mm``. One test,
    so that the one traced process serves every check (a fixture would run once per xdist worker)."""
    pytest.importorskip("transformers")
    joints = _hf_joints()
    problems = {f: _traced_problems(joints["traced"][f]) for f in _FAMILIES}
    for family, joint in joints["opaque"].items():
        if joint["counters"]["moe_inductor_visible"] != {"swapped": 2}:
            problems[family].append(f"off: counters {joint['counters']}")
        if joint["ops"] != ["experts_backward_middle", "experts_backward_up"] * 2 or joint["grouped_mm"] != 0:
            problems[family].append(f"off: ops {joint['ops']}, {joint['grouped_mm']} grouped_mm")
    assert not any(problems.values()), {f: p for f, p in problems.items() if p}
