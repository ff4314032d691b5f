"""Per-expert loops that skip an expert with no tokens (moe_inductor/speculation.py): traced as the loop that runs
every body, kept only where the unrolled_loop rewrite takes every body, else the frame falls back.

Genuine: DeepSeek-V3's ``counts = bincount(ids.flatten(), minlength=E).tolist(); if counts[i] == 0: continue`` and
DBRX's ``if tok.shape[0] == 0: continue`` on the body's own selection (also the tokens that chose the expert at
all, ``(ids == i).any(-1).nonzero()``), over stacked (E, ., .) weights, rewritten and
equal to eager (forward and gradients) at token counts that leave experts empty; over one nn.Linear set per expert,
rewritten with gradients too, a skipped expert's weights left without a gradient (None) as eager leaves them
(grad_gate.py). Look-alikes, each still equal to eager and not rewritten: a skip of experts with fewer than 2 tokens,
a skip on another router's counts, a skip on the next expert's tokens, a body that also counts its expert in a buffer, and a body that counts the experts
it ran in a local read after the loop.
"""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import report
from tests.corpus.harness import Case, check_rewritten, check_unchanged, run_case
from tests.helpers import rel_err

H, I, E, K = 16, 8, 8, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SkippingMoE(nn.Module):
    """A top-2 MoE whose expert loop skips, as ``skip`` says, before running expert i on its rows."""

    def __init__(self, skip: str, per_expert: bool = False):
        super().__init__()
        self.skip = skip
        self.gate = nn.Linear(H, E, bias=False)
        self.other_gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)]) if per_expert else None
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, I, H) * H ** -0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.register_buffer("hits", torch.zeros(E))

    def expert(self, i, xe):
        if self.experts is not None:
            return self.experts[i](xe)
        return F.linear(F.silu(F.linear(xe, self.w1[i])) * F.linear(xe, self.w3[i]), self.w2[i])

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        counted = torch.topk(self.other_gate(x), K, dim=-1)[1] if self.skip == "other_counts" else ids
        counts = torch.bincount(counted.flatten(), minlength=E).tolist()
        y = torch.zeros_like(x)
        for i in range(E):
            if self.skip in ("any_rows", "any_other_expert"):
                # the tokens that chose i at all, each row's weight summed over its slots (Mixtral-style forks)
                tok = (ids == i).any(-1).nonzero().squeeze(-1)
                guarded = tok if self.skip == "any_rows" else (ids == (i + 1) % E).any(-1).nonzero()
                if guarded.numel() == 0:
                    continue
                y[tok] += self.expert(i, x[tok]) * (weights * (ids == i)).sum(-1)[tok, None]
                continue
            if self.skip == "own_rows":
                tok, pos = torch.where(ids == i)
                if tok.shape[0] == 0:
                    continue
            else:
                if self.skip == "fewer_than_2":
                    if counts[i] < 2:
                        continue
                elif counts[i] == 0:
                    continue
                tok, pos = torch.where(ids == i)
            if self.skip == "buffer":
                self.hits[i] += 1
            y[tok] += self.expert(i, x[tok]) * weights[tok, pos, None]
        return y


class CountingMoE(SkippingMoE):
    """The bincount skip, with a count of the experts run kept in a local and read after the loop."""

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        y = torch.zeros_like(x)
        ran = 0
        for i in range(E):
            if counts[i] == 0:
                continue
            tok, pos = torch.where(ids == i)
            ran += 1
            y[tok] += self.expert(i, x[tok]) * weights[tok, pos, None]
        return y * ran / E


class SteppingMoE(SkippingMoE):
    """The bincount skip, the experts run counted by stepping an iterator made before the loop: Dynamo logs no side
    effect for a range iterator's step, so only the speculation's iterator hook sees it."""

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        y = torch.zeros_like(x)
        ticks = iter(range(E + 1))
        for i in range(E):
            if counts[i] == 0:
                continue
            tok, pos = torch.where(ids == i)
            next(ticks)
            y[tok] += self.expert(i, x[tok]) * weights[tok, pos, None]
        return y * next(ticks) / E


def _build(skip: str) -> nn.Module:
    if skip == "per_expert":
        return SkippingMoE("bincount", per_expert=True)
    return {"local": CountingMoE, "ticks": SteppingMoE}.get(skip, SkippingMoE)(skip)


def _case(skip: str, expect: tuple) -> Case:
    return Case(f"skip-{skip}", "tests/test_data_dependent_loops.py", lambda: _build(skip),
                lambda T, g: torch.randn(T, H, generator=g), form="unrolled_loop", expect=expect, token_counts=(3, 9))


@pytest.mark.slow  # each case compiles a model
@pytest.mark.parametrize("skip", ["bincount", "own_rows", "per_expert", "any_rows"])
def test_skip_of_an_empty_expert_is_rewritten_and_equal_to_eager(skip):
    case = _case(skip, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    check_rewritten(case, outcome)
    # 3 tokens with 2 choices each reach at most 6 of the 8 experts: the skipped side was taken in eager
    assert outcome.rewrites == {"unrolled_loop": outcome.graphs}


@pytest.mark.slow
@pytest.mark.parametrize("skip, said", [
    ("fewer_than_2", "is not a test of 'this expert got no tokens'"),
    ("other_counts", "the count is of expert"),
    ("buffer", "no rewrite took its body"),
    ("local", "the skipped body sets ran, read after it"),
    ("ticks", "the skipped body changes Python state"),
    ("any_other_expert", "the count is of expert"),
], ids=["counts-below-2", "another-routers-counts", "buffer-write-in-body", "local-counter", "stepped-iterator",
        "any-selection-of-the-next-expert"])
def test_a_skip_that_is_not_no_tokens_is_kept_and_equal_to_eager(skip, said):
    case = _case(skip, ("fell_back",))
    with report.collecting(report.Report()) as seen:  # what explain() would print of the fallback
        outcome = run_case(case)
    assert outcome.fallbacks and outcome.kind != "crash", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_unchanged(case, outcome)
    for got, ref in outcome.steps:
        assert got.grads.keys() == ref.grads.keys()
        for name in ref.grads:
            assert rel_err(got.grads[name], ref.grads[name]) < 1e-5, name
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


def _two_accumulating_steps(device: str, options: dict, tol: float = 1e-5) -> None:
    """Per-expert nn.Linear weights in training: after two steps that accumulate (no zero_grad), each expert's
    weights hold what eager's hold: None where neither step reached it, one step's gradient where one did."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _build("per_expert").to(device)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe_inductor", options=options)
    gen = torch.Generator().manual_seed(3)
    for T in (2, 3):  # 4 and 6 choices over 8 experts: some expert is skipped by both steps
        x = torch.randn(T, H, generator=gen).to(device)
        compiled(x).square().sum().backward()
        eager(x).square().sum().backward()
    got, ref = dict(model.named_parameters()), dict(eager.named_parameters())
    missing = [n for n, p in ref.items() if p.grad is None]
    assert missing, "the token counts must leave an expert without tokens in both steps"
    for name, p in ref.items():
        assert (got[name].grad is None) == (p.grad is None), name
        if p.grad is not None:
            assert rel_err(got[name].grad, p.grad) < tol, name
    assert counters["moe_inductor"]["unrolled_loop"] >= 1, dict(counters["moe_inductor"])


@pytest.mark.slow
def test_a_skipped_experts_own_weights_keep_their_gradient_as_in_eager():
    _two_accumulating_steps("cpu", {"inner": "eager"})


@pytest.mark.gpu
def test_a_skipped_experts_own_weights_keep_their_gradient_under_inductor_on_the_gpu(monkeypatch):
    # the rewrite's gradients are what is tested: the speed rule keeps such ModuleList layers on Inductor's path in
    # training where this GPU's data measured them slower (the H100's), which would leave nothing to test
    monkeypatch.setattr(moe_inductor.config, "speed_rule", False)
    _two_accumulating_steps("cuda", {}, tol=1e-4)


@pytest.mark.slow
def test_per_expert_weights_without_gradients_are_rewritten():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _build("per_expert")
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        for T in (3, 9):
            x = torch.randn(T, H)
            assert rel_err(compiled(x), model(x)) < 1e-5
        report = moe_inductor.explain(model, torch.randn(3, H))
    assert [r.form for r in report.rewrites] == ["unrolled_loop"] and not report.fallbacks, report.summary()


def test_the_hooks_do_nothing_under_the_inductor_backend():
    """backend="eager" (plain Dynamo): the skip stays a data-dependent branch, as without moe_inductor."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SkippingMoE("bincount")
    x = torch.randn(3, H)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count >= 1
    assert torch.allclose(torch.compile(model, backend="eager")(x), model(x))


def test_hooking_a_dispatch_table_skips_opcodes_it_does_not_hold():
    """Python 3.12's ``dis.opmap`` names pseudo-instructions with opcodes of 256 and up, past the end of Dynamo's
    dispatch tables: hooking must skip them (indexing them raised IndexError when the backend was first loaded)."""
    from moe_inductor import speculation

    def jump(tx, inst):
        return "jumped"

    table = [None] * 8
    table[3] = jump
    speculation.hook_table(table, {"POP_JUMP_IF_TRUE": 3, "NOP": 5, "JUMP": 256, "LOAD_METHOD": 300})
    assert len(table) == 8 and table[3] is not jump and table[5] is None


class AddPerExpertRun(nn.Module):
    """Not an MoE: a loop that skips experts with no tokens and adds 1 to the output for each expert it runs."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)

    def forward(self, x):
        ids = torch.topk(self.gate(x), K, dim=-1)[1]
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        y = x.clone()
        for i in range(E):
            if counts[i] == 0:
                continue
            y.add_(1.0)
        return y


def test_a_wrapper_that_looks_like_ours_but_compiles_elsewhere_falls_back():
    """capture.py takes a function naming "moe_inductor" for a wrapper of ours. If it hands the graph to another
    compiler, the skips assumed while tracing are never proven (that is the backend's work): the frame falls back,
    and the loop runs as eager runs it."""

    def lookalike(gm, example_inputs):
        gm.meta["wanted"] = "moe_inductor"  # named, never called
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AddPerExpertRun()
    x = torch.randn(2, H)  # 4 choices over 8 experts: at least 4 skipped
    got = torch.compile(model, backend=lookalike)(x)
    assert torch.equal(got, model(x))
    assert counters["moe_inductor_fallback"], "the frame must fall back"


class TrainingOnlyIdleMoE(SkippingMoE):
    """The no-tokens side tests ``self.training`` (``elif self.training:``), touching the idle expert's weights in
    training only, as a DDP workaround does: in eval it goes straight to the next expert."""

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        y = torch.zeros_like(x)
        for i in range(E):
            if counts[i] > 0:
                tok, pos = torch.where(ids == i)
                y[tok] += self.expert(i, x[tok]) * weights[tok, pos, None]
            elif self.training:
                y = y + 0.0 * self.w2[i].sum()
        return y


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_no_tokens_side_that_tests_self_training(training):
    """In eval the ``elif self.training:`` side is a straight skip: rewritten, equal to eager. In training it runs
    code of its own: the skip is not assumed away, and the frame falls back, equal to eager."""
    expect = ("fell_back",) if training else ("rewritten",)  # (training's pieces: see below)
    case = Case(f"training-only-idle-{training}", "tests/test_data_dependent_loops.py",
                lambda: TrainingOnlyIdleMoE("bincount").train(training), lambda T, g: torch.randn(T, H, generator=g),
                form="unrolled_loop", expect=expect, token_counts=(3, 9))
    outcome = run_case(case)
    if training:  # the frame falls back; its resumed pieces are compiled as they come, none rewritten
        assert outcome.fallbacks and not outcome.rewrites, (outcome.declared(), outcome.rewrites)
        check_unchanged(case, outcome)
    else:
        assert outcome.declared() == expect, (outcome.declared(), outcome.fallbacks, outcome.left_alone)
        check_rewritten(case, outcome)
