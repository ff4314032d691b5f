"""What a new user meets in the first hour: import without triton, the HF registry in any import order, explain()'s
claims, the CLI's errors, the packaging metadata. Most of it runs in fresh interpreters, where import order and
blocked modules can be set up exactly."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A meta-path finder that makes ``import triton`` fail, as on a machine without it.
_BLOCK_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _NoTriton())
"""

# A small unrolled-loop MoE, the first form a user writes by hand.
_LOOP_MOE = """
import torch, torch.nn as nn, torch.nn.functional as F
class LoopMoE(nn.Module):
    def __init__(self, E=3, k=2, H=16, I=8):
        super().__init__()
        self.E, self.k = E, k
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, pos = torch.where(ids == e)
            h = F.silu(x[tok] @ self.w1[e].T)
            out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, pos, None])
        return out
"""


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the repository root; fail with its output when it fails."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_import_backend_explain_and_cpu_op_without_triton():
    """macOS, Windows and CPU-only installs have no triton: everything but the GPU kernels must still work."""
    # such installs have no CUDA either: a CUDA build of torch without triton cannot start CUDA, so Dynamo's own
    # frame set-up fails there under any backend
    out = run_python(_BLOCK_TRITON + _LOOP_MOE + """
import moe_inductor
from torch._dynamo.utils import counters
assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
torch.manual_seed(0)
model, x = LoopMoE(), torch.randn(6, 16)
ref = model(x)
compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
torch.testing.assert_close(compiled(x), ref)
assert sum(counters["moe_inductor"].values()) == 1, dict(counters["moe_inductor"])
report = moe_inductor.explain(model, x)
assert len(report.rewrites) == 1, str(report)
E, I, H = 3, 8, 16
w1, w2 = torch.randn(E, I, H), torch.randn(E, H, I)
ids, w = torch.randint(0, E, (6, 2)), torch.rand(6, 2)
y = moe_inductor.fused_experts(x, ids, w, w1, w2, activation="silu")
assert y.shape == x.shape
assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
print("ok")
""", env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.stdout.strip().endswith("ok")


_TINY_QWEN3 = """
import torch
def tiny_qwen3_config():
    return transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                       moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2)
"""


@pytest.mark.parametrize("first", ["moe_inductor", pytest.param("transformers", marks=pytest.mark.slow)],
                         ids=["ours-first", "transformers-first"])
def test_hf_registry_whatever_the_import_order(first):
    """The README imports moe_inductor before transformers; the registry entry must exist either way, for every
    path HF offers to pick it."""
    pytest.importorskip("transformers")
    imports = "import moe_inductor, transformers" if first == "moe_inductor" else "import transformers, moe_inductor"
    run_python(imports + _TINY_QWEN3 + """
import tempfile
import moe_inductor.hf
calls = []
plain = moe_inductor.hf.fused_experts
moe_inductor.hf.fused_experts = lambda *a, **kw: calls.append(1) or plain(*a, **kw)
cls = transformers.Qwen3MoeForCausalLM
torch.manual_seed(0)
ref = cls._from_config(tiny_qwen3_config()).eval()
x = torch.randint(0, 64, (2, 7))
with torch.no_grad():
    expected = ref(x).logits
    # _from_config
    model = cls._from_config(tiny_qwen3_config(), experts_implementation="moe_inductor").eval()
    model.load_state_dict(ref.state_dict())
    torch.testing.assert_close(model(x).logits, expected)
    assert len(calls) == 2, calls
    # set_experts_implementation
    ref.set_experts_implementation("moe_inductor")
    torch.testing.assert_close(ref(x).logits, expected)
    assert len(calls) == 4, calls
    # from_pretrained
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        loaded = cls.from_pretrained(d, experts_implementation="moe_inductor").eval()
    torch.testing.assert_close(loaded(x).logits, expected)
    assert len(calls) == 6, calls
""")


@pytest.mark.slow
def test_cli_checks_a_model_already_on_the_registry(tmp_path):
    """The CLI imports moe_inductor before the target imports transformers; a model whose experts already run the op
    counts as rewritten, so ``--check`` passes it, and the report names each layer."""
    pytest.importorskip("transformers")
    target = tmp_path / "target.py"
    target.write_text("import transformers\n" + _TINY_QWEN3 + textwrap.dedent("""
    def make():
        model = transformers.Qwen3MoeForCausalLM._from_config(tiny_qwen3_config(),
                                                              experts_implementation="moe_inductor").eval()
        return model, (torch.randint(0, 64, (1, 8)),)
    """))
    out = run_python("from moe_inductor.__main__ import main; main()", "inspect", f"{target}:make", "--summary",
                     "--check").stdout
    assert "2 MoE rewrite(s)" in out, out
    assert "model.layers.0.mlp.experts" in out and "model.layers.1.mlp.experts" in out, out


def _readme_setup_install() -> str:
    """The install part of the README's first set-up command (before the test run)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Set-up", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    first = block.splitlines()[0]
    return first.split(" && python -m pytest", 1)[0]


def test_ci_installs_exactly_what_the_readme_says():
    install = _readme_setup_install()
    assert install.startswith("pip install ")
    assert install in (ROOT / ".ci" / "run").read_text()


def test_readme_pins_and_pyproject_ranges_hold_the_tested_versions():
    """Every ``==`` pin of the README's set-up line is the installed version, and pyproject's ranges contain what
    the suite runs with, each with a ceiling (an unbounded range resolves to a release nobody tested)."""
    import re
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement
    import torch
    from packaging.version import Version

    for name, pinned in re.findall(r'"([a-z_-]+)==([\w.]+)"', _readme_setup_install()):
        if name == "torch" and torch.version.cuda is not None:
            continue  # the README pins the CPU wheel its set-up installs; a CUDA machine brings its own torch
        assert Version(version(name)).base_version == pinned, (name, pinned, version(name))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    checked = set()
    for req in reqs:
        if req.name not in ("torch", "triton", "transformers"):
            continue
        if req.name != "triton" or sys.platform == "linux":
            installed = Version(Version(version(req.name)).base_version)
            assert req.specifier.contains(installed, prereleases=True), (str(req), str(installed))
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req} has no ceiling"
        checked.add(req.name)
    assert checked == {"torch", "triton", "transformers"}
    assert project["license"] and (ROOT / "LICENSE").exists()
    from packaging.specifiers import SpecifierSet
    import platform
    assert SpecifierSet(project["requires-python"]).contains(platform.python_version())
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in project["classifiers"])


# --- explain() tells the truth -------------------------------------------------------------------------------------


def _loop_moe():
    namespace: dict = {}
    exec(_LOOP_MOE, namespace)
    return namespace["LoopMoE"]


def test_explain_leaves_the_users_compiled_model_warm():
    import torch
    from torch._dynamo.utils import counters

    import moe_inductor

    torch.manual_seed(0)
    model, x = _loop_moe()(), torch.randn(6, 16)
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    compiled(x)
    report = moe_inductor.explain(model, x)
    assert len(report.rewrites) == 1
    graphs = counters["stats"]["unique_graphs"]
    compiled(x)  # no recompile: explain reset nothing, and its own graphs do not stand in for the user's
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(moe_inductor.explain(compiled, x).rewrites) == 1  # a compiled wrapper is looked through
    compiled(x)
    assert counters["stats"]["unique_graphs"] == graphs + 2


def test_explain_counts_graph_breaks_as_dynamo_does_with_file_and_line():
    import torch

    import moe_inductor

    LoopMoE = _loop_moe()

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = LoopMoE(), LoopMoE()

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x).sin()

    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(6, 16)
    report = moe_inductor.explain(model, x)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        dynamo = torch._dynamo.explain(model)(x)
    assert report.graph_break_count == dynamo.graph_break_count == 1, (report.graph_breaks, dynamo)
    assert len(report.graph_breaks) == len(dynamo.break_reasons) == 1
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "torch._dynamo.graph_break()" in text and "line" not in text)
    assert f"{__file__}:{line}" in report.graph_breaks[0], report.graph_breaks
    assert len(report.rewrites) == 2


@pytest.mark.slow
def test_explain_pairs_graphs_before_and_after_by_source():
    """HF's eager experts loop breaks the graph where it is not rewritten: the one graph after pairs with every
    graph of the same source before, not with whatever came first."""
    pytest.importorskip("transformers")
    import torch

    import moe_inductor
    from tests.hf_models import tiny

    model = tiny("qwen3_moe", "eager").eval()
    report = moe_inductor.explain(model, torch.randint(0, 64, (1, 8)))
    assert len(report.graphs) == 1 and len(report.before) > 1
    paired = report.before_of(report.graphs[0])
    assert len(paired) > 1 and all(b.sources & report.graphs[0].sources for b in paired)
    text = str(report)
    assert all(b.code.strip() in text for b in paired)


def test_explain_names_what_runs_here_in_one_short_line():
    import torch

    import moe_inductor

    report = moe_inductor.explain(_loop_moe()(), torch.randn(6, 16))
    gemms = [line for line in report.summary().splitlines() if "GEMMs:" in line]
    assert gemms == ["  GEMMs: on cpu: plain torch (the Triton kernels run on CUDA GPUs)"]


# --- one-call paths: apply(), compile_generate(), with_options() / options= ---------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3"])
def test_apply_runs_every_hf_experts_module_on_the_op_without_compiling(family, monkeypatch):
    pytest.importorskip("transformers")
    import torch

    import moe_inductor
    import moe_inductor.hf
    from tests.helpers import assert_close
    from tests.hf_models import tiny

    calls = []
    plain = moe_inductor.hf.fused_experts
    monkeypatch.setattr(moe_inductor.hf, "fused_experts", lambda *a, **kw: calls.append(1) or plain(*a, **kw))
    model, x = tiny(family).eval(), torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(x).logits
        names = moe_inductor.apply(model)
        got = model(x).logits
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert len(calls) == 2
    assert_close(got, expected, torch.float32)


def test_apply_refuses_a_model_without_hf_experts():
    import torch

    import moe_inductor

    with pytest.raises(ValueError, match="no HF experts module"):
        moe_inductor.apply(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_compile_generate_compiles_every_step_on_cpu():
    """``torch.compile(model).generate()`` compiles nothing; compile_generate compiles the forward generate calls."""
    pytest.importorskip("transformers")
    import torch
    from torch._dynamo.utils import counters

    import moe_inductor
    from tests.hf_models import tiny

    torch._dynamo.reset()
    counters.clear()
    model, prompt = tiny("qwen3_moe").eval(), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
        assert model is moe_inductor.compile_generate(model, inner="eager")
        got = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
    assert counters["moe_inductor"]["hf_grouped_mm"] >= 2


def test_inductor_options_pass_through_and_mode_works_with_them(monkeypatch):
    import torch
    from torch._dynamo.utils import counters

    import moe_inductor
    from tests.test_backend_modes import _patches_seen

    seen = _patches_seen(monkeypatch)  # our post-grad pass taken out of each record, and checked apart
    model, x = _loop_moe()(), torch.randn(6, 16)
    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="moe_inductor", options={"max_autotune": True, "epilogue_fusion": False})(x)
    assert seen == [{"max_autotune": True, "epilogue_fusion": False}]
    # torch.compile refuses mode= with options=; a backend carrying its options takes a mode
    torch._dynamo.reset()
    torch.compile(model, backend=moe_inductor.with_options(coordinate_descent_tuning=True), mode="max-autotune")(x)
    assert seen[-1] == {"triton.cudagraphs": True, "max_autotune": True, "coordinate_descent_tuning": True}
    assert counters["moe_inductor"]["unrolled_loop"] == 2  # the capture knows both compiles as ours
    assert seen.ours == [True, True]  # ours rides along (unshared_buffers)
    with pytest.raises(ValueError, match="unknown moe_inductor options"):
        moe_inductor.with_options(max_autotune_typo=True)


# --- the CLI's mistakes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target,expected", [
    ("{dir}/nope.py:make", "no such file"),
    ("{dir}/target.py", "names no callable"),
    ("{dir}/target.py:missing", "defines no callable 'missing' (it defines make_model, ok)"),
    ("{dir}/target.py:make_model", "make_model() returned Linear, not a pair; make_model() must return (model_or_fn, args)"),
], ids=["bad-path", "no-name", "missing-name", "returns-only-the-model"])
def test_cli_mistakes_give_one_line_with_the_fix(tmp_path, target, expected):
    from moe_inductor.__main__ import main

    (tmp_path / "target.py").write_text(textwrap.dedent("""
        import torch
        def make_model():
            return torch.nn.Linear(2, 2)
        def ok():
            return torch.nn.Linear(2, 2), (torch.randn(1, 2),)
    """))
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", target.format(dir=tmp_path), "--summary"])
    message = str(exit_info.value.code)
    assert message.startswith("moe_inductor inspect: ") and "\n" not in message
    assert expected in message, message


# --- tuned configs persist, and a GPU without a tuned table is named ------------------------------------------------


def test_autotune_saves_to_the_user_cache_reads_it_back_and_reports_progress(tmp_path, monkeypatch, capsys):
    from moe_inductor.kernels import configs

    monkeypatch.setenv("MOE_INDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs.ConfigTable, "device_tag", staticmethod(lambda: "Fake_GPU_9000"))
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(configs, "TABLE", configs.ConfigTable())
    fast, slow = configs.LaunchConfig(64, 64, 32, 4, 3), configs.LaunchConfig(128, 128, 64, 8, 3)
    ran = []
    speed = {fast: 1.0, slow: 2.0}
    with pytest.warns(UserWarning, match=r"no tuned kernel configs ship for this GPU \(Fake GPU 9000"):
        assert configs.TABLE.lookup("gemm-key") is None
    best = configs.tune("gemm-key", lambda: [slow, fast, slow], ran.append, bench=lambda fn: fn() or speed[ran[-1]])
    assert best == fast
    err = capsys.readouterr().err
    assert "1/3 configs" in err and "2/3 configs" in err and "s left" in err and "autotuned gemm-key" in err
    saved = tmp_path / "tuned" / "Fake_GPU_9000.json"
    assert saved.exists()
    fresh = configs.ConfigTable()  # the next run
    with pytest.warns(UserWarning, match="Fake GPU 9000"):
        assert fresh.lookup("gemm-key") == fast


def test_explain_reports_a_rewrites_off_pass_that_fails_and_still_explains(monkeypatch):
    """The graphs before come from a compile the user never runs (every rewrite off). Where it fails (torch 2.11's
    Dynamo built a broken graph there for ArcticTraining's MoE) explain still reports the configured compile, and
    says why the graphs before are missing; where the configured compile fails too, explain raises its error."""
    import torch

    import moe_inductor

    explain_module = sys.modules["moe_inductor.explain"]  # the package's ``explain`` is the function
    namespace = {}
    exec(textwrap.dedent(_LOOP_MOE), namespace)
    model, x = namespace["LoopMoE"](), torch.randn(6, 16)
    plain = explain_module._compile_and_run

    def rewrites_off_fails(fn, args, kwargs, options, report):
        if options.get("forms") == ():
            raise RuntimeError("a broken graph")
        return plain(fn, args, kwargs, options, report)

    monkeypatch.setattr(explain_module, "_compile_and_run", rewrites_off_fails)
    report = moe_inductor.explain(model, x)
    assert len(report.rewrites) == 1 and not report.before, str(report)
    assert any("could not be shown" in n and "RuntimeError: a broken graph" in n for n in report.notes), report.notes
    assert "could not be shown" in str(report)

    def both_fail(fn, args, kwargs, options, report):
        raise ValueError("the user's own error")

    monkeypatch.setattr(explain_module, "_compile_and_run", both_fail)
    with pytest.raises(ValueError, match="the user's own error"):
        moe_inductor.explain(model, x)
