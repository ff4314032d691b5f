"""The passes' one driver (moe_inductor/passes/driver.py): a form is an anchor and a proof, and the driver does the
rest. A toy form, registered with the driver, shows that the mutation check, the left-alone note, the emit, the
dead-code removal, the counters and the report are the driver's; and no form file does any of it itself."""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import backend, report
from moe_inductor.passes import driver
from moe_inductor.passes.fx_utils import canonicalize_operators, einsum_parts, is_call
from moe_inductor.spec import MoESpec

E, H, I, K = 4, 8, 6, 2  # experts, hidden, intermediate, choices per token


class ToyMoE(torch.nn.Module):
    """Every expert on every token, mixed by a (T, E) matrix: the one-hot routing (the toy form's mark), or a soft
    mixture (a look-alike the toy proof explains)."""

    def __init__(self, style: str = "routed"):
        super().__init__()
        self.style = style
        self.w1 = torch.nn.Parameter(torch.randn(E, I, H) / H**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) / I**0.5)

    def forward(self, x, ids, weights):
        if self.style == "ids_changed":  # in place after the user's code read them (to the same values here, so
            mix = (F.one_hot(ids, E).to(x.dtype) * weights[..., None]).sum(1)  # that repeated calls stay valid)
            ids.mul_(1)
        elif self.style == "soft":
            mix = torch.softmax(x[:, :E], -1)
        else:
            mix = (F.one_hot(ids, E).to(x.dtype) * weights[..., None]).sum(1)
        out = torch.einsum("tei,ehi->teh", F.relu(torch.einsum("th,eih->tei", x, self.w1)), self.w2)
        return torch.einsum("teh,te->th", out, mix)


def toy_proof(y):
    """Only the proof of the form: ``einsum("teh,te->th", experts(x), mix)`` with mix the one-hot routing."""
    parsed = einsum_parts(y)
    if parsed is None or parsed[0] != ["teh", "te"]:
        return None
    out, mix = parsed[2]
    if not is_call(mix, "call_method", "sum"):
        return "the toy's mixing matrix is not a one-hot routing"
    hot, scaled = mix.args[0].args
    ids, weights = hot.args[0].args[0], scaled.args[0]
    h, w2 = einsum_parts(out)[2]
    x, w1 = einsum_parts(h.args[0])[2]
    return driver.Match(MoESpec(x, ids, weights, w1, None, w2, "nk", "relu"), y, note="a toy")


TOY = driver.Form("toy", (driver.Anchor(lambda n: is_call(n, "call_function", torch.functional.einsum,
                                                          torch.einsum), toy_proof),))


def _inputs(T: int = 5):
    torch.manual_seed(0)
    return torch.randn(T, H), torch.stack([torch.randperm(E)[:K] for _ in range(T)]), torch.rand(T, K)


def _graph_of(model, *args) -> tuple[torch.fx.GraphModule, list]:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*args)
    ((gm, example_inputs),) = graphs
    canonicalize_operators(gm.graph)  # as run_pass does first
    return gm, example_inputs


def test_the_driver_emits_erases_dead_code_and_records():
    model = ToyMoE()
    x, ids, weights = _inputs()
    gm, example_inputs = _graph_of(model, x, ids, weights)
    with report.recording() as records:
        done = TOY(gm)
    assert [r.form for r in done] == ["toy"] and done[0].note == "a toy" and (done[0].num_experts, done[0].top_k) == (E, K)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.moe_inductor.experts_forward.default in targets
    assert F.one_hot not in targets and not any("einsum" in str(t) for t in targets)  # the region is gone
    assert not records.left_alone
    (out,) = gm(*example_inputs)  # recompiled: it runs the op, and computes what the user's code does
    ref = model(x, ids, weights)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_the_driver_counts_logs_and_reports_through_the_backend(monkeypatch, caplog):
    monkeypatch.setattr(backend, "FX_PASSES", {"gathered_weights": TOY})
    model = ToyMoE()
    x, ids, weights = _inputs(7)
    torch._dynamo.reset()
    counters.clear()
    with caplog.at_level("INFO", logger="moe_inductor"):
        out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(x, ids, weights)
    assert ((out - model(x, ids, weights)).norm() / out.norm()).item() < 1e-5
    assert counters["moe_inductor"] == {"toy": 1}
    assert "moe_inductor rewrote" in caplog.text and "(toy, E=4, k=2, relu)" in caplog.text
    got = moe_inductor.explain(model, x, ids, weights)
    assert [r.form for r in got.rewrites] == ["toy"]


@pytest.mark.parametrize("style,reason", [
    ("ids_changed", driver.CHANGED_IN_PLACE),  # the driver's mutation check: the proof never looks
    ("soft", "the toy's mixing matrix is not a one-hot routing"),  # the proof's reason, noted by the driver
])
def test_the_driver_notes_what_it_leaves_alone(monkeypatch, style, reason):
    monkeypatch.setattr(backend, "FX_PASSES", {"gathered_weights": TOY})
    model = ToyMoE(style)
    x, ids, weights = _inputs()
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(x, ids.clone(), weights)
    assert torch.allclose(out, model(x, ids.clone(), weights), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"] and counters["moe_inductor_left_alone"] == {"toy": 1}
    (left,) = moe_inductor.explain(model, x, ids.clone(), weights).left_alone
    assert left.form == "toy" and left.reason == reason and "test_passes_driver.py" in left.where


def test_a_failing_attempt_records_nothing():
    """Records made inside a recording block stay there: a pass that fails drops its own block."""
    with report.recording() as outer:
        with report.recording() as inner:
            report.record_left_alone("toy", "here", "why")
        report.record_rewrite("toy", "there", E, K, "relu", ())
    assert [m.reason for m in inner.left_alone] == ["why"] and not outer.left_alone
    assert [r.where for r in outer.rewrites] == ["there"]
    report.record_rewrite("toy", "nowhere", E, K, "relu", ())  # outside every block (not our compile): dropped


_DRIVER_STEPS = {"eliminate_dead_code", "recompile", "replace_all_uses_with", "erase_node", "emit_experts",
                 "record_left_alone", "record_rewrite", "inputs_unchanged", "note_unmatched"}
_PASSES = Path(moe_inductor.__file__).parent / "passes"
_NOT_FORMS = {"__init__.py", "aliases.py", "counts.py", "driver.py", "emit.py", "expert_projections.py", "fx_utils.py",
              "gated_reads.py", "kept_errors.py", "leading_ones.py", "scatter_sums.py", "score_tables.py",
              "grad_modes.py", "private_writes.py", "slice_runs.py", "zero_weights.py",
              "stale_reads.py"}  # (shared helpers and canonical respellings, not forms)


@pytest.mark.parametrize("path", sorted(p.name for p in _PASSES.glob("*.py") if p.name not in _NOT_FORMS))
def test_a_form_file_holds_only_its_proof(path):
    """No form keeps its own rewrite loop: emitting, replacing uses, erasing, dead-code removal, recompiling and
    recording are the driver's; and each form's docstring shows the user code it matches."""
    tree = ast.parse((_PASSES / path).read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not called & _DRIVER_STEPS, f"{path} does the driver's work itself: {sorted(called & _DRIVER_STEPS)}"
    assert "The user code this" in (ast.get_docstring(tree) or "")


def test_identity_casts_are_dropped_and_real_conversions_kept():
    """``drop_identity_casts`` (run_pass's canonical form): ``.to`` of a device or dtype the tensor already has is the
    tensor itself in eager, and goes; a cast to another dtype, ``copy=True`` and a memory format stay."""
    from moe_inductor.passes.fx_utils import drop_identity_casts

    def f(x, w):
        same = w.to(x.device) * x
        same = same + w.to(x.dtype)
        wider = w.to(torch.float64)
        copied = w.to(x.dtype, copy=True)
        laid = w.to(memory_format=torch.contiguous_format)
        return same, wider, copied, laid

    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    x, w = torch.randn(3, 4), torch.randn(3, 4)
    torch.compile(f, backend=capture)(x, w)
    ((gm, example_inputs),) = graphs
    assert drop_identity_casts(gm.graph) == 2
    gm.recompile()
    kept = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(kept) == 3  # float64, copy=True, memory_format
    assert any(torch.float64 in n.args for n in kept)
    for got, ref in zip(gm(*example_inputs), f(x, w)):  # the graph's inputs in Dynamo's order
        assert torch.equal(got, ref)
