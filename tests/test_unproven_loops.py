"""Loops no rewrite took, remembered (moe_inductor/unproven_loops.py): after a frame falls back because no rewrite
took a speculated loop's body, the frames Dynamo compiles around the graph break do not unroll that loop again.

The model mirrors transformers' LongCat-Flash experts: a loop over the experts that got rows (``nonzero`` of the
summed one-hot mask), ``.item()`` of each index, and "zero experts" past the routed ones whose output is their
input, here added without their routing weight beside weighted routed experts, which no rewrite takes (LongCat's
own, weighted, are rewritten: tests/test_zero_experts.py). Checked: the same outputs as eager, fewer attempts than without the memory (each
module's loop is unrolled once, not once per frame), and explain() saying why. Look-alikes that must still be
rewritten: the same class without zero experts beside one with them (the memory is per module), and a module whose
loop failed at one token count asked again at another (the memory is per shape).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import unproven_loops
from tests.helpers import rel_err

H, I, E, K = 16, 8, 4, 2


class ZeroExperts(nn.Module):
    """LongCat-Flash's experts loop: ``zero`` identity experts after ``E`` routed ones, added unweighted."""

    def __init__(self, zero: int):
        super().__init__()
        self.routed, self.total = E, E + zero
        self.w1 = nn.Parameter(torch.randn(E, I, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) / I ** 0.5)

    def forward(self, x, ids, weights):
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.total).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e_t in hit:
            e = int(e_t.item())
            pos, tok = torch.where(mask[e].squeeze(0))
            if tok.numel() == 0:
                continue
            rows = x[tok]
            if e >= self.routed:
                h = rows
            else:
                h = F.linear(F.silu(F.linear(rows, self.w1[e])), self.w2[e]) * weights[tok, pos, None]
            out.index_add_(0, tok, h)
        return out


class Block(nn.Module):
    def __init__(self, zero: int):
        super().__init__()
        self.gate = nn.Linear(H, E + zero, bias=False)
        self.experts = ZeroExperts(zero)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        return x + self.experts(x, ids, weights)


class Model(nn.Module):
    def __init__(self, zeros: tuple):
        super().__init__()
        self.layers = nn.ModuleList([Block(z) for z in zeros])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _run(model: nn.Module, xs: list, monkeypatch, remember: bool = True) -> tuple[list, dict, int]:
    """The outputs of ``model`` compiled (light inner compiler) on each input in turn, with the counters, and how
    many ops Dynamo traced in all (each unrolled attempt traces the loop's every body again)."""
    unproven_loops.forget_all()
    if not remember:
        monkeypatch.setattr(unproven_loops, "known_unproven", lambda key: False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
    got = {name: dict(counters[name]) for name in ("moe_inductor", "moe_inductor_fallback")}
    return outs, got, counters["stats"]["calls_captured"]


def _eager(model: nn.Module, xs: list) -> list:
    with torch.no_grad():
        return [model(x) for x in xs]


def _x(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def _with_and_without(zeros: tuple, monkeypatch) -> tuple:
    """A model of layers with these numbers of zero experts, on one input: eager's output, then ``_run`` with the
    memory and without it."""
    torch.manual_seed(0)
    model = Model(zeros).eval()
    xs = [_x(9)]
    return _eager(model, xs)[0], _run(model, xs, monkeypatch), _run(model, xs, monkeypatch, remember=False)


@pytest.mark.slow
def test_a_loop_no_rewrite_took_is_unrolled_once_per_module(monkeypatch):
    want, (outs, got, traced), (outs_before, got_before, traced_before) = _with_and_without((2, 2), monkeypatch)
    assert rel_err(outs[0], want) < 1e-5 and rel_err(outs_before[0], want) < 1e-5
    assert got["moe_inductor"] == {} and got_before["moe_inductor"] == {}
    # remembered, the frames around the break go to plain capture at once instead of failing the same proof again
    assert got["moe_inductor_fallback"]["compile"] < got_before["moe_inductor_fallback"]["compile"], (got, got_before)
    assert traced < traced_before, (traced, traced_before)


@pytest.mark.slow
def test_explain_says_why_a_remembered_loop_was_not_unrolled():
    torch.manual_seed(0)
    model = Model((2,)).eval()
    unproven_loops.forget_all()
    with torch.no_grad():
        report = moe_inductor.explain(model, _x(9), options={"inner": "eager"})
    reasons = " | ".join(f.reason for f in report.fallbacks)
    assert "no rewrite took its body" in reasons, reasons
    # the frame compiled after the fallback traces the loop as plain capture would, and says why in a note
    assert any(unproven_loops.REFUSAL in note for note in report.notes), report.notes
    assert unproven_loops.REFUSAL in str(report), str(report)


@pytest.mark.slow
def test_the_same_class_without_zero_experts_is_still_rewritten(monkeypatch):
    """Look-alike: the first layer's loop fails the proof (zero experts), the second layer is the same class and
    code with none; it is rewritten in its own frame, as without the memory."""
    want, (outs, got, _), (_, got_before, _) = _with_and_without((2, 0), monkeypatch)
    assert rel_err(outs[0], want) < 1e-5
    assert got["moe_inductor"] == got_before["moe_inductor"] == {"unrolled_loop": 1}, (got, got_before)


@pytest.mark.slow
def test_another_token_count_is_tried_afresh(monkeypatch):
    """Look-alike: the memory is per argument shape (the speed rule judges by shape), so a recompile for another
    token count unrolls the loop again rather than reading the first count's failure."""
    torch.manual_seed(0)
    experts = ZeroExperts(2).eval()
    gate = nn.Linear(H, E + 2, bias=False)

    def route(x):
        weights, ids = torch.topk(gate(x).softmax(-1), K, dim=-1)
        return x, ids, weights

    unproven_loops.forget_all()
    torch._dynamo.reset()
    with torch.no_grad():
        first = moe_inductor.explain(experts, *route(_x(9)), options={"inner": "eager"})
        second = moe_inductor.explain(experts, *route(_x(5, 1)), options={"inner": "eager"})
    for report in (first, second):
        reasons = " | ".join(f.reason for f in report.fallbacks)
        assert "no rewrite took its body" in reasons, reasons
        assert not any(unproven_loops.REFUSAL in note for note in report.notes), report.notes


def test_a_module_that_cannot_be_hashed_is_never_remembered(monkeypatch):
    """A module class with ``__eq__`` and no ``__hash__`` keys nothing (and so is tried afresh each time), rather than
    failing the trace."""

    class Unhashable(ZeroExperts):
        def __eq__(self, other):
            return self is other

    assert Unhashable.__hash__ is None
    monkeypatch.setattr(unproven_loops, "_self_module", lambda tx: Unhashable(0))
    monkeypatch.setattr(unproven_loops, "_arguments", lambda tx: ())

    class State:
        forms = frozenset()

    from moe_inductor import capture

    monkeypatch.setattr(capture, "current", lambda: State())

    class Tx:
        f_code = ZeroExperts.forward.__code__

    assert unproven_loops.key_of(Tx(), 0) is None
    assert not unproven_loops.known_unproven(None)
