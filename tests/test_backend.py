"""torch.compile(model, backend="moe_inductor") on tiny HF MoE models: rewrites, equality with eager, scoping."""
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor.report import gemm_engine_summary
from tests.helpers import assert_bf16_logits_match, rule_off_where_unmeasured
from tests.hf_models import tiny

QUICK = {("eager", "qwen3_moe")}  # grouped_mm: test_explain_report and tests/test_first_hour.py take it quickly
LIGHT = {"inner": "eager"}  # the rewrite happens before the inner compiler; Inductor adds nothing to these checks
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "olmoe", "deepseek_v3", "granitemoe", "phimoe"]
TRAINED = ["qwen3_moe", "mixtral", "gpt_oss"]
IMPLEMENTATIONS = {"grouped_mm": "hf_grouped_mm", "eager": "hf_eager_loop", "batched_mm": "hf_batched_mm"}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compile_and_compare(model, lengths, options=LIGHT):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options=options)
    worst = 0.0
    for T in lengths:
        ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            worst = max(worst, rel(compiled(ids).logits, model(ids).logits))
    return worst


def test_backend_is_found_by_name_without_import():
    code = "import torch; print('moe_inductor' in torch._dynamo.list_backends())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("implementation,family", [  # the quick suite keeps Qwen3-MoE's eager loop
    pytest.param(i, f, marks=() if (i, f) in QUICK else pytest.mark.slow) for i in IMPLEMENTATIONS for f in FAMILIES])
def test_hf_model_is_rewritten_and_equal(family, implementation):
    model = tiny(family, implementation)
    err = compile_and_compare(model, lengths=(5, 9, 12, 17))
    assert err < 1e-4
    assert sum(counters["graph_break"].values()) == 0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, "at most 2 compiles over 4 sequence lengths"
    assert counters["moe_inductor"][IMPLEMENTATIONS[implementation]] == 2 * graphs  # 2 MoE layers per graph
    assert set(counters["moe_inductor"]) == {IMPLEMENTATIONS[implementation]}
    assert not counters["moe_inductor_left_alone"]  # no MoE-looking code was left behind


@pytest.mark.slow
def test_twenty_sequence_lengths_compile_at_most_twice():
    """Issue 4's bound on a whole causal LM: 20 sequence lengths, at most 2 compiles, every one rewritten."""
    model = tiny("qwen3_moe")
    err = compile_and_compare(model, lengths=range(3, 43, 2))
    assert err < 1e-4
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2
    assert counters["moe_inductor"]["hf_grouped_mm"] == 2 * graphs
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("family,top_k,form", [("llama4", 1, "hf_llama4_dense"), ("llama4", 2, "hf_llama4_dense"),
                                               ("dbrx", None, "hf_dbrx")], ids=["llama4-top1", "llama4-top2", "dbrx"])
def test_wrapped_hf_block_is_rewritten_and_equal(family, top_k, form):
    """The MoE blocks moe_inductor wraps by class (Llama4's dense block, DBRX's flat-weight experts), whole models."""
    model = tiny(family)
    if top_k is not None:
        for layer in model.model.layers:
            layer.feed_forward.top_k = layer.feed_forward.router.top_k = top_k
    err = compile_and_compare(model, lengths=(5, 9, 12))
    assert err < 1e-4
    assert sum(counters["graph_break"].values()) == 0
    assert counters["moe_inductor"][form] == 2 * counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_switch_capacity_model_is_rewritten_and_equal():
    """Switch's capacity drops (made per sequence by its router) must come out exactly the same."""
    model = tiny("switch")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options=LIGHT)
    for T in (5, 9, 16):  # capacity 3 of 4 experts: longer sequences drop tokens
        ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            out = compiled(ids, decoder_input_ids=ids).logits
            ref = model(ids, decoder_input_ids=ids).logits
        assert rel(out, ref) < 1e-5
    assert counters["moe_inductor"]["hf_switch"] >= 2


@pytest.mark.slow
def test_llama4_wrapper_is_inert_outside_moe_inductor():
    """The wrapped Llama4 forward gives other backends the very same graphs as the original."""
    model = tiny("llama4")
    ids = torch.randint(0, 64, (2, 7))

    def graphs_under_eager_backend():
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            out = torch.compile(model, backend="eager")(ids).logits
        return counters["stats"]["unique_graphs"], out

    from moe_inductor import hf

    hf.install_class_wrappers()
    wrapped = type(model.model.layers[0].feed_forward).forward
    graphs_wrapped, out_wrapped = graphs_under_eager_backend()
    type(model.model.layers[0].feed_forward).forward = wrapped._moe_inductor_original
    try:
        graphs_plain, out_plain = graphs_under_eager_backend()
    finally:
        type(model.model.layers[0].feed_forward).forward = wrapped
    assert graphs_wrapped == graphs_plain and torch.equal(out_wrapped, out_plain)
    assert not counters["moe_inductor"]


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAINED)
def test_training_gradients_match_eager(family):
    model = tiny(family, "grouped_mm").train()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "aot_eager"})
    loss = compiled(ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    ref_loss = model(ids, labels=ids).loss
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), allow_unused=True)
    assert counters["moe_inductor"]["hf_grouped_mm"] == 2
    assert rel(loss, ref_loss) < 1e-5
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:
            continue
        assert rel(g, r) < 1e-4, name


@pytest.mark.slow
def test_full_inductor_compile_qwen3():
    model = tiny("qwen3_moe", "grouped_mm")
    err = compile_and_compare(model, lengths=(6, 10), options=None)
    assert err < 1e-4
    assert counters["moe_inductor"]["hf_grouped_mm"] >= 2
    assert sum(counters["graph_break"].values()) == 0


def test_forms_option_turns_rewrites_off():
    model = tiny("qwen3_moe", "grouped_mm")
    assert compile_and_compare(model, lengths=(6,), options={"inner": "eager", "forms": ()}) < 1e-6
    assert not counters["moe_inductor"]


def test_unknown_option_is_an_error():
    model = tiny("qwen3_moe", "grouped_mm")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_inductor", options={"innr": "eager"})
    with pytest.raises(Exception, match="unknown moe_inductor options"):
        compiled(torch.randint(0, 64, (1, 4)))


def test_unsupported_variant_is_left_alone():
    """A custom gate we cannot read must not be rewritten: a wrong rewrite is the worst bug."""
    model = tiny("qwen3_moe", "grouped_mm")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.__class__ = type("CustomGateExperts", (type(experts),),
                                 {"_apply_gate": lambda self, gu: torch.sigmoid(gu[..., ::2]) * gu[..., 1::2]})
    assert compile_and_compare(model, lengths=(6,)) < 1e-6
    assert not counters["moe_inductor"]
    assert counters["moe_inductor_left_alone"]["hf_grouped_mm"] == len(model.model.layers)


@pytest.mark.parametrize("change,reason", [
    ("gate", "CustomGateExperts has its own _apply_gate"),
    ("activation", "activation Tanh is not one the op knows"),
])
@pytest.mark.slow
def test_explain_says_why_hf_experts_were_left_alone(change, reason):
    model = tiny("qwen3_moe", "grouped_mm")
    for layer in model.model.layers:
        experts = layer.mlp.experts
        if change == "gate":
            experts.__class__ = type("CustomGateExperts", (type(experts),),
                                     {"_apply_gate": lambda self, gu: torch.sigmoid(gu[..., ::2]) * gu[..., 1::2]})
        else:
            experts.act_fn = torch.nn.Tanh()
    report = moe_inductor.explain(model, torch.randint(0, 64, (1, 5)))
    assert not report.rewrites
    assert len(report.left_alone) == len(model.model.layers)
    assert all(m.form == "hf_grouped_mm" and reason in m.reason for m in report.left_alone), report.left_alone
    assert "left alone: hf_grouped_mm" in report.summary()


def test_non_moe_model_is_left_alone():
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(5, 16)
    out = torch.compile(mlp, backend="moe_inductor", options=LIGHT)(x)
    assert torch.equal(out, mlp(x))
    assert not counters["moe_inductor"]


def _graphs_with(backend, code_prefix=""):
    script = textwrap.dedent(f"""
        {code_prefix}
        import torch
        from torch._dynamo.utils import counters
        from tests.hf_models import tiny
        model = tiny("qwen3_moe", "eager")
        compiled = torch.compile(model, backend="{backend}")
        with torch.no_grad():
            compiled(torch.randint(0, 64, (1, 7)))
        print(counters["stats"]["unique_graphs"], dict(counters["moe_inductor"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_other_backends_behave_exactly_as_before():
    """The data-dependent loop stays uncaptured under backend="eager" whether or not moe_inductor is loaded."""
    without = _graphs_with("eager")
    with_loaded = _graphs_with("eager", "import moe_inductor; import moe_inductor.backend")
    assert without == with_loaded
    assert int(without.split()[0]) > 2 and without.endswith("{}")


def test_explain_report():
    model = tiny("mixtral", "grouped_mm")
    report = moe_inductor.explain(model, torch.randint(0, 64, (1, 7)))
    text = str(report)
    assert len(report.rewrites) == 2 and not report.graph_breaks
    assert "hf_grouped_mm" in text and "MixtralExperts" in text and "E=3 k=2 act=silu_glu" in text
    assert "experts_forward" in report.graphs[0].code and "experts_forward" not in report.graph_before[0]
    assert report.summary() in text and "def forward" not in report.summary()
    gemms = next(line for line in report.summary().splitlines() if "GEMMs:" in line)
    assert gemms == "  GEMMs: on cpu: plain torch (the Triton kernels run on CUDA GPUs)"  # what runs here, in a line


@pytest.mark.parametrize("forward,backward,expected", [
    ("triton", None, "forward: our fused Triton kernels; backward: our fused Triton kernels (gemm_engine='triton')"),
    ("triton", "grouped_mm", "backward: torch._grouped_mm wherever the layout allows, our kernels around it "
                             "(gemm_engine='triton', gemm_engine_backward='grouped_mm')"),
    ("auto", "triton", "backward: our fused Triton kernels (gemm_engine='auto', gemm_engine_backward='triton')"),
    ("auto", None, "or biases, H*I >= 4Mi and >= 512 rows each; backward: torch._grouped_mm for bf16 on Hopper at "
                   ">= 128 rows per expert (layers with biases: H*I >= 4Mi and >= 128)"),
])
def test_explain_names_each_directions_gemm_engine(forward, backward, expected, monkeypatch):
    monkeypatch.setattr(moe_inductor.config, "gemm_engine", forward)
    monkeypatch.setattr(moe_inductor.config, "gemm_engine_backward", backward)
    assert expected in gemm_engine_summary()


@pytest.mark.parametrize("tma,gpu,expected", [
    ("tuned", "NVIDIA_H200", "(TMA weight loads on the {n} GEMM shapes this GPU's tuned table gives a tile, "
                             "pointers elsewhere)"),
    ("tuned", "NVIDIA_A_GPU_WITHOUT_A_TABLE", "(pointer loads: this GPU's tuned table has no TMA tile)"),
    ("off", "NVIDIA_H200", "our Triton kernels; torch._grouped_mm for large bf16 experts and biased ones with many "
                           "rows; backward"),
    ("on", "NVIDIA_H200", "(TMA weight loads where the call allows: gemm_tma_weights='on')"),
])
def test_explain_says_where_the_forward_gemm_reads_through_tma(tma, gpu, expected, monkeypatch, tmp_path):
    """On a Hopper GPU the GEMM line says how the forward GEMM reads its weights: under "tuned", on how many GEMM
    shapes this GPU's table gives a TMA tile (the shipped H200 table's count), or that it has none."""
    import json

    from moe_inductor import report
    from moe_inductor.kernels import configs

    monkeypatch.setenv("MOE_INDUCTOR_CACHE_DIR", str(tmp_path))  # (no user cache: the shipped table alone)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu.replace("_", " "))
    monkeypatch.setattr(configs.ConfigTable, "device_tag", staticmethod(lambda: gpu))
    monkeypatch.setattr(configs, "TABLE", configs.ConfigTable())
    monkeypatch.setattr(moe_inductor.config, "gemm_tma_weights", tma)
    monkeypatch.setattr(moe_inductor.config, "gemm_engine", "auto")
    monkeypatch.setattr(moe_inductor.config, "gemm_engine_backward", None)
    shipped = json.loads((configs._TUNED_DIR / "NVIDIA_H200.json").read_text())
    n = sum(1 for k, v in shipped.items() if k.endswith("|tma") and v["BLOCK_M"] > 0)
    with warnings.catch_warnings():  # (a GPU without a shipped table is warned about, outside the interpreter)
        warnings.simplefilter("ignore")
        line = report.gemm_engine_line(torch.device("cuda", 0))
    assert line.startswith(f"on cuda:0 ({gpu.replace('_', ' ')}): forward our Triton kernels")
    assert expected.format(n=n) in line, line
    if tma == "off":
        assert "TMA" not in line and "pointer loads" not in line


@pytest.mark.slow
def test_cli_inspect(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""
        import torch
        from tests.hf_models import tiny

        def make():
            return tiny("qwen3_moe", "eager"), (torch.randint(0, 64, (1, 5)),)
    """))
    out = subprocess.run([sys.executable, "-m", "moe_inductor", "inspect", f"{target}:make"], capture_output=True,
                         text=True, check=True)
    assert "2 MoE rewrite(s)" in out.stdout and "hf_eager_loop" in out.stdout


@pytest.mark.slow
def test_cli_check_fails_on_a_region_left_alone(tmp_path):
    """``inspect --check`` passes a fully rewritten model and fails (status 1, with the reason) on a look-alike."""
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""
        import torch
        from tests.test_pass_unrolled_loop import LoopMoE

        def rewritten():
            return LoopMoE("where_matmul", 4, 2), (torch.randn(5, 16),)

        def look_alike():
            return LoopMoE("partial", 4, 2), (torch.randn(5, 16),)
    """))
    cli = [sys.executable, "-m", "moe_inductor", "inspect", "--summary", "--check"]
    ok = subprocess.run(cli + [f"{target}:rewritten"], capture_output=True, text=True)
    assert ok.returncode == 0 and "1 MoE rewrite(s)" in ok.stdout and "--- graph" not in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run(cli + [f"{target}:look_alike"], capture_output=True, text=True)
    assert bad.returncode == 1 and "1 MoE-looking region(s) left alone" in bad.stderr
    assert "not each of range(E) once" in bad.stdout


def test_hf_registry_runs_our_op_in_eager_mode():
    from moe_inductor import hf

    assert hf.register_experts_interface()
    ref = tiny("gpt_oss", "grouped_mm")
    ours = tiny("gpt_oss", "grouped_mm")
    ours.set_experts_implementation("moe_inductor")
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert rel(ours(ids).logits, ref(ids).logits) < 1e-4


@pytest.mark.parametrize("setting", ["+moe_inductor"] + [pytest.param(s, marks=pytest.mark.slow)
                                                         for s in ("moe_inductor.rewrites", "moe_inductor", "none")])
def test_torch_logs_reports_rewrites(setting):
    script = textwrap.dedent("""
        import torch
        from tests.test_pass_gathered_weights import GatheredMoE
        torch.compile(GatheredMoE("gptfast"), backend="moe_inductor", options={"inner": "eager"})(torch.randn(4, 16))
    """)
    env = dict(__import__("os").environ)
    env.pop("TORCH_LOGS", None)
    if setting != "none":
        env["TORCH_LOGS"] = setting
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    if setting == "none":
        assert "moe_inductor rewrote" not in out.stderr
        return
    assert "moe_inductor rewrote" in out.stderr and "gathered_weights" in out.stderr
    if setting == "moe_inductor":  # one line per rewrite, no code
        assert "torch.ops.moe_inductor" not in out.stderr
        return
    assert "torch.ops.moe_inductor.experts_forward" in out.stderr  # the rewritten region
    assert "def forward" not in out.stderr  # not the whole graph


def test_a_failing_pass_leaves_the_graph_unchanged(monkeypatch, caplog):
    from moe_inductor import config, passes
    from tests.test_pass_gathered_weights import GatheredMoE

    def broken(gm):
        for node in list(gm.graph.nodes):  # mutate, then fail: the user's graph must not see the half-done edit
            if node.op == "call_function":
                node.replace_all_uses_with(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
                break
        raise RuntimeError("matcher bug")

    monkeypatch.setattr(config, "strict_passes", False)
    monkeypatch.setitem(passes.FX_PASSES, "gathered_weights", broken)
    model = GatheredMoE("gptfast")
    x = torch.randn(5, 16)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level("WARNING", logger="moe_inductor"):
        out = torch.compile(model, backend="moe_inductor", options=LIGHT)(x)
    assert torch.allclose(out, model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    assert "the gathered_weights pass failed" in caplog.text


@pytest.mark.slow
def test_torch_logs_names_what_was_left_alone():
    """TORCH_LOGS="moe_inductor" (INFO) gives one line per MoE-looking region left alone, with its reason."""
    script = textwrap.dedent("""
        import torch
        from tests.test_pass_unrolled_loop import LoopMoE
        torch.compile(LoopMoE("partial", 4, 2), backend="moe_inductor", options={"inner": "eager"})(torch.randn(5, 16))
    """)
    env = dict(__import__("os").environ, TORCH_LOGS="moe_inductor")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert "moe_inductor left alone" in out.stderr and "not each of range(E) once" in out.stderr, out.stderr[-2000:]


# On the GPU: the Triton kernels inside whole models in bf16, and the op under CUDA graphs.


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_gpu_hf_models_rewritten_bf16(family, implementation, monkeypatch):
    """Every HF family in every experts implementation runs the Triton kernels on the GPU and matches eager in bf16."""
    rule_off_where_unmeasured(monkeypatch)
    model = tiny(family, implementation).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    inner = "inductor" if (family, implementation) == ("qwen3_moe", "grouped_mm") else "eager"
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner})
    for T in (5, 33):
        ids = torch.randint(0, 64, (2, T), device="cuda")
        with torch.no_grad():
            out, ref = compiled(ids).logits.float(), model(ids).logits.float()
        assert rel(out, ref) < 2e-2
    assert sum(counters["moe_inductor"].values()) >= 2
    assert sum(counters["graph_break"].values()) == 0
    if inner == "inductor":  # the default: Inductor launches every rewritten layer's kernels itself
        assert counters["moe_inductor_visible"]["swapped"] == sum(counters["moe_inductor"].values())


@pytest.mark.gpu
def test_gpu_static_cache_decode_reduce_overhead_has_no_cudagraph_skips(monkeypatch):
    """HF's own compiled decode (static cache, CompileConfig(backend="moe_inductor", mode="reduce-overhead")):
    the same tokens as eager, the MoE layers rewritten, and 0 cudagraph skips."""
    rule_off_where_unmeasured(monkeypatch)
    from transformers.generation.configuration_utils import CompileConfig

    model = tiny("qwen3_moe").to("cuda")
    prompt = torch.randint(0, 64, (2, 7), device="cuda")
    gen = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        expected = model.generate(prompt, disable_compile=True, **gen)
        config = CompileConfig(backend="moe_inductor", mode="reduce-overhead", fullgraph=True)
        got = model.generate(prompt, compile_config=config, **gen)
        got_again = model.generate(prompt, compile_config=config, **gen)  # replays the recorded graphs
    assert torch.equal(got, expected) and torch.equal(got_again, expected)
    # transformers picks the experts implementation per step (5.17 decodes small batches with batched_mm)
    assert sum(counters["moe_inductor"].values()) >= 2, dict(counters["moe_inductor"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["moe_inductor_visible"]["swapped"] == 0  # under CUDA graphs the op stays opaque (backend.py)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama4", "switch", "dbrx"])
def test_gpu_wrapped_hf_blocks(family, dtype, monkeypatch):
    """The class-wrapped HF MoE blocks. fp32 as well: if fp32 holds and bf16 does not, look at bf16 router near-ties
    before the op."""
    from moe_inductor.ops import experts as experts_module

    model = tiny(family).to("cuda", dtype)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    ids = torch.randint(0, 64, (2, 12), device="cuda")
    kwargs = {"decoder_input_ids": ids} if family == "switch" else {}
    gpu_runs = []  # every MoE layer the compiled model runs through our GPU kernels
    forward_gemms = experts_module._forward_gemms
    monkeypatch.setattr(experts_module, "_forward_gemms", lambda *a, **kw: gpu_runs.append(1) or forward_gemms(*a, **kw))
    with torch.no_grad():
        # eager first: Switch's router casts its classifier to fp32 on its first call (a module .to() that Dynamo
        # breaks the graph on, with any backend)
        ref = model(ids, **kwargs).logits.float()
        assert not gpu_runs
        out = compiled(ids, **kwargs).logits.float()
        ref_fp32 = tiny(family).to("cuda")(ids, **kwargs).logits.float()
    if dtype == torch.float32:
        assert rel(out, ref) < 1e-4
    else:
        assert_bf16_logits_match(out, ref, ref_fp32, family)
    rewrites, breaks = sum(counters["moe_inductor"].values()), dict(counters["graph_break"])
    assert len(gpu_runs) >= 2 and rewrites >= 1  # after a graph break, layers can share one compiled (rewritten) frame
    if breaks and family == "switch" and torch.__version__ < "2.13":
        # HF's Switch router runs self.classifier.to(dtype) in forward; Dynamo before 2.13 breaks on the
        # nn.Parameter it builds there (pytorch#161207), under every backend. Ours must add no break of its own
        # (backend="eager" also breaks on the experts loop's nonzero, which our capture makes traceable).
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.compile(model, backend="eager")(ids, **kwargs)
        plain = dict(counters["graph_break"])
        assert all(n <= plain.get(reason, 0) for reason, n in breaks.items()), (breaks, plain)
    else:
        assert not breaks, breaks
