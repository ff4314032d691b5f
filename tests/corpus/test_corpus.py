"""The corpus: MoE layers written in the styles of public codebases (one module per source, beside this file),
each compiled with moe_inductor and checked against eager (harness.py says what is checked).

Every case declares its outcome today (``Case.expect``): rewritten, or a miss with its reason. The test asserts the
declared outcome exactly, so a matcher that starts to recognise a module (or stops) forces an update here.
"""
import copy
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.corpus.harness import check_equal_to_eager, check_rewritten, check_unchanged, matches_declared, run_case
from tests.helpers import assert_bf16_logits_match

_HERE = Path(__file__).parent
_NOT_CORPUS = {"harness", "test_corpus", "conftest"}
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(_HERE)]) if m.name not in _NOT_CORPUS)
CASES = [c for name in MODULES for c in importlib.import_module(f"tests.corpus.{name}").CASES]


def test_corpus_is_large_enough():
    assert len(MODULES) >= 12, MODULES
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


@pytest.mark.slow  # every case compiles a model: the full suite (.ci/run) runs the corpus
@pytest.mark.parametrize("case", CASES, ids=str)
def test_corpus_module(case):
    outcome = run_case(case)
    expect = case.expected()
    assert matches_declared(outcome, expect), (
        f"{case.name} ({case.source}): declared {expect}, got {outcome.declared()}; "
        f"rewrites {outcome.rewrites}, left alone {outcome.left_alone}, {outcome.graph_breaks} graph break(s)")
    if outcome.kind == "rewritten":
        check_rewritten(case, outcome)
    elif outcome.kind == "partly_rewritten":
        check_equal_to_eager(case, outcome)
    elif outcome.kind != "crash":
        check_unchanged(case, outcome)


def _one_rewritten_case_per_form() -> list:
    chosen = {}
    for case in CASES:
        if case.expected() == ("rewritten",) and case.form not in chosen:
            chosen[case.form] = case
    return list(chosen.values())


def _first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", _one_rewritten_case_per_form(), ids=lambda c: f"{c.form}-{c.name}")
def test_gpu_one_module_per_form_runs_the_kernels_bf16(case, monkeypatch):
    """A public-codebase MoE layer of each form, compiled with the default inner compiler on the GPU in bf16. The
    kernels are under test, so the speed rule (which keeps ModuleList layers nearest Mixtral's measured widths on
    Inductor's path, test_speed_rule.py) is off."""
    from moe_inductor import config

    monkeypatch.setattr(config, "speed_rule", False)
    torch.manual_seed(0)
    model32 = case.build().to("cuda", torch.float32)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor")
    gen = torch.Generator().manual_seed(1)
    for T in (5, 64):
        x = case.make_input(T, gen).to("cuda")
        with torch.no_grad():
            out, ref = _first(compiled(x.to(torch.bfloat16))), _first(model(x.to(torch.bfloat16)))
            ref32 = _first(model32(x))
        assert_bf16_logits_match(out, ref, ref32, f"{case.name} T={T}")
    assert counters["moe_inductor"][case.form] >= 1, dict(counters["moe_inductor"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.expected() == ("rewritten",)], ids=str)
def test_gpu_every_rewritten_module_forward_and_backward(case):
    """Every rewritten public-codebase layer on the GPU, forward and backward, in its corpus dtype: the Triton
    kernels (per-expert tables, biases, capacities, masks) against eager's cuBLAS at the corpus bound. The fp32
    kernels use IEEE dots, as eager's matmuls do. AOTAutograd traces the rewritten graph again, as Inductor does."""
    outcome = run_case(case, inner="aot_eager", device="cuda")
    assert outcome.kind == "rewritten", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_rewritten(case, outcome)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.expected() == ("rewritten",)], ids=str)
def test_rewritten_module_survives_aot_tracing(case):
    """Every rewritten layer with AOTAutograd as the inner compiler, forward and backward against eager. The graph
    a pass hands on is traced again there (fake tensors, symbolic sizes, the op's own autograd formula), as under
    Inductor: an argument that runs in the graph as Python but not as traced (a 0-d capacity tensor given as the
    op's int capacity read as garbage there) shows up here, where the default corpus run (inner "eager") misses it."""
    outcome = run_case(case, inner="aot_eager")
    assert outcome.kind == "rewritten", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_rewritten(case, outcome)


@pytest.mark.slow
@pytest.mark.parametrize("case", _one_rewritten_case_per_form(), ids=lambda c: f"{c.form}-{c.name}")
def test_one_module_per_form_under_inductor_on_the_cpu(case):
    """A rewritten layer of each form with the default inner compiler, Inductor, on the CPU: the CPU lowering of the
    op (lowerings/cpu.py), Inductor's own partitioner and decompositions, forward and backward against eager. The
    whole corpus passes the same way (RESULTS.md, thirty-fourth session); one per form keeps CI's time."""
    outcome = run_case(case, inner="inductor")
    assert outcome.kind == "rewritten", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    assert not outcome.fallbacks, outcome.fallbacks  # a graph Inductor cannot compile loses its rewrite silently
    check_rewritten(case, outcome)
