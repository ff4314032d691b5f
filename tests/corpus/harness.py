"""The checks every corpus module gets: one MoE layer written in the style of a public codebase, compiled with
moe_inductor (light inner compiler), against the same module run eagerly.

A module in ``tests/corpus/`` defines ``CASES``, a list of ``Case``. For each case ``run_case`` compiles the module
once and calls it at several token counts, forward and backward, and reports what happened as an ``Outcome``:

- ``rewritten``: the expected form was counted, and ``check_rewritten`` then asserts everything the corpus promises
  (eager-equal forward and gradients, 0 graph breaks, one rewrite per compiled graph, the moe_inductor op called on
  every step, at most 2 compiles over the token counts);
- ``left_alone``: nothing was rewritten and a pass said why (``counters["moe_inductor_left_alone"]``; the reason is
  the one ``moe_inductor.explain`` reports);
- ``fell_back``: nothing was rewritten, no pass said a word, and a frame failed under moe_inductor's capture
  settings and was compiled as plain capture would (``counters["moe_inductor_fallback"]``, the do-no-harm rule);
- ``graph_break``: nothing was rewritten, no pass said a word, and Dynamo broke the graph (explain() shows the
  break, with its line; the MoE code was split over graphs no pass sees whole);
- ``unexplained``: nothing was rewritten and no pass said a word;
- ``partly_rewritten``: the form was rewritten in some of the module's compiled graphs, not all (a recompile
  traced it differently); every step must still equal eager;
- ``crash``: the compile or a compiled call raised (before the per-frame fallback of the do-no-harm issue lands,
  a model's own ``.tolist()`` or ``if count == 0`` turns into a hard error under moe_inductor's capture flags).

test_corpus.py compares each case's outcome with what it declares, exactly, so a fix forces an update.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from moe_inductor.backend import moe_inductor_backend
from moe_inductor.capture import BACKEND_MARKER
from tests.helpers import rel_err

#: relative L2 error bound of the corpus (the issue's bar); bf16 cases (torch._grouped_mm takes nothing else) use
#: the bf16 bound of tests/helpers.py
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@dataclass
class Case:
    """One MoE layer in one codebase's style.

    ``build()`` returns the module with seeded random weights; ``make_input(T, generator)`` its input for T tokens
    (the tokens may be spread over a batch dimension, as the source does). ``form`` is the rewrite expected when
    the module is recognised. ``expect`` is what happens today: "rewritten", or a miss declared as
    ``("left_alone", form, reason substring)``, ``("unexplained",)`` or ``("crash", exception type name)``.
    """

    name: str
    source: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int, torch.Generator], torch.Tensor]
    form: str
    expect: tuple = ("rewritten",)
    dtype: torch.dtype = torch.float32
    token_counts: tuple = (4, 7, 10, 13)
    #: what happens under torch < 2.13 where that differs (Dynamo 2.11 traces some modules differently; README's
    #: known limits), else None: ``expect`` on every torch
    before_2_13: Optional[tuple] = None

    def expected(self) -> tuple:
        """The declared outcome on the running torch."""
        if self.before_2_13 is not None and tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
            return self.before_2_13
        return self.expect

    def __str__(self) -> str:
        return self.name


@dataclass
class Step:
    out: torch.Tensor
    grads: dict
    moe_ops: int


@dataclass
class Outcome:
    kind: str  # "rewritten", "left_alone", "fell_back", "graph_break", "unexplained", "crash"
    detail: tuple = ()
    steps: list = field(default_factory=list)  # (compiled Step, eager Step) per token count
    graph_breaks: int = 0
    graphs: int = 0
    rewrites: dict = field(default_factory=dict)
    left_alone: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)
    buffers: list = field(default_factory=list)  # (name, compiled model's, eager model's) after every step

    def declared(self) -> tuple:
        """The outcome in the form a Case declares it (``Case.expect``)."""
        return (self.kind, *self.detail)


def _moe_op_calls(prof) -> int:
    """The ``moe_inductor::`` ops the profiler saw run (a dispatch mode would not do: Dynamo does not compile a
    frame under an active TorchDispatchMode)."""
    return sum(1 for e in prof.events() if e.name.startswith("moe_inductor::"))


def _step(module: nn.Module, x: torch.Tensor, seed: int) -> Step:
    """Forward and backward of a fixed random projection of the output; the gradients of x and of the params."""
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = module(x)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        (out.float() * probe.to(out.device)).sum().backward()
    grads = {"x": x.grad}
    grads.update({n.removeprefix("_orig_mod."): p.grad for n, p in module.named_parameters() if p.grad is not None})
    return Step(out.detach(), grads, _moe_op_calls(prof))


def run_case(case: Case, inner: str = "eager", device: str = "cpu") -> Outcome:
    """Compile ``case``'s module once and run it at each token count, forward and backward, next to eager. The
    inner compiler is "eager": the rewritten graph runs as is, so the op's own autograd makes the gradients, and
    the corpus stays fast enough for CI. On ``device="cuda"`` the ops run their Triton kernels."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = case.build().to(device, case.dtype)
    eager_model = copy.deepcopy(model)  # its own buffers: a compiled step must update the module's state as eager's
    breaks, graphs = [], []

    def backend(gm, example_inputs, **kwargs):
        # the reason Dynamo ended each graph, as torch._dynamo.explain and moe_inductor.explain count graph breaks
        # (counters["graph_break"] misses some, such as a loop over a tensor)
        reason = getattr(gm, "compile_subgraph_reason", None)
        graphs.append(gm)
        if reason is not None and getattr(reason, "graph_break", False):
            breaks.append(reason)
        return moe_inductor_backend(gm, example_inputs, options={"inner": inner})

    setattr(backend, BACKEND_MARKER, True)  # a wrapper of ours: the capture stays on (as for explain's backend)
    compiled = torch.compile(model, backend=backend)
    outcome = Outcome("rewritten")
    gen = torch.Generator().manual_seed(1)
    for i, T in enumerate(case.token_counts):
        x = case.make_input(T, gen).to(device, case.dtype)
        try:
            got = _step(compiled, x, seed=i)
        except Exception as exc:  # noqa: BLE001  (the outcome records which error; the test declares it)
            outcome.kind, outcome.detail = "crash", (type(exc).__name__,)
            break
        outcome.steps.append((got, _step(eager_model, x, seed=i)))
    outcome.buffers = [(name, b, dict(eager_model.named_buffers())[name]) for name, b in model.named_buffers()]
    outcome.graph_breaks = max(len(breaks), sum(counters["graph_break"].values()))
    outcome.graphs = len(graphs)
    outcome.rewrites = dict(counters["moe_inductor"])
    outcome.left_alone = dict(counters["moe_inductor_left_alone"])
    outcome.fallbacks = dict(counters["moe_inductor_fallback"])
    if outcome.kind == "crash":
        return outcome
    if outcome.rewrites.get(case.form):
        if outcome.rewrites[case.form] < outcome.graphs:  # some compiled graph of the module kept its code
            outcome.kind, outcome.detail = "partly_rewritten", (f"{outcome.rewrites[case.form]} of {outcome.graphs}",)
        return outcome
    if not outcome.left_alone:
        outcome.kind = ("fell_back" if outcome.fallbacks else "graph_break" if outcome.graph_breaks
                        else "unexplained")
        return outcome
    outcome.kind = "left_alone"
    outcome.detail = _left_alone_reason(case)
    return outcome


def _left_alone_reason(case: Case) -> tuple:
    """(form, reason) of the first region ``moe_inductor.explain`` reports as left alone."""
    import moe_inductor

    torch.manual_seed(0)
    model = case.build().to(case.dtype)
    x = case.make_input(case.token_counts[0], torch.Generator().manual_seed(1)).to(case.dtype)
    report = moe_inductor.explain(model, x)
    if not report.left_alone:
        return ("<explain() reports nothing>", "")
    first = report.left_alone[0]
    return first.form, first.reason


def matches_declared(outcome: Outcome, expect: tuple) -> bool:
    """A left-alone declaration names the form and a substring of the reason; the others match exactly."""
    got = outcome.declared()
    if expect[0] == "left_alone" and got[0] == "left_alone":
        return len(expect) == 3 and got[1] == expect[1] and expect[2] in got[2]
    return got == tuple(expect)


def check_rewritten(case: Case, outcome: Outcome) -> None:
    """Everything a recognised corpus module must give (the issue's bar)."""
    tol = TOL[case.dtype]
    assert outcome.graph_breaks == 0, f"{outcome.graph_breaks} graph break(s)"
    assert 1 <= outcome.graphs <= 2, f"{outcome.graphs} compiles over {len(case.token_counts)} token counts"
    assert outcome.rewrites == {case.form: outcome.graphs}, (
        f"rewrites {outcome.rewrites}, expected one {case.form!r} per compiled graph ({outcome.graphs})")
    assert len(outcome.steps) == len(case.token_counts)
    for T, (got, ref) in zip(case.token_counts, outcome.steps):
        assert got.moe_ops >= 1, f"T={T}: no moe_inductor op was called"
        assert ref.moe_ops == 0
        err = rel_err(got.out, ref.out)
        assert err < tol, f"T={T}: forward relative error {err:.2e}"
        assert got.grads.keys() == ref.grads.keys(), f"T={T}: gradients of {sorted(got.grads)} vs {sorted(ref.grads)}"
        for name in ref.grads:
            err = rel_err(got.grads[name], ref.grads[name])
            assert err < tol, f"T={T}: gradient of {name}: relative error {err:.2e}"
    for name, got_buf, ref_buf in outcome.buffers:  # the module's own in-place state updates survive the rewrite
        assert torch.equal(got_buf, ref_buf), f"buffer {name} differs from eager's after the steps"


def check_unchanged(case: Case, outcome: Outcome) -> None:
    """A module left alone must still compute what eager does (nothing was rewritten behind its back)."""
    tol = TOL[case.dtype]
    assert not outcome.rewrites, f"a miss must rewrite nothing, got {outcome.rewrites}"
    for T, (got, ref) in zip(case.token_counts, outcome.steps):
        assert got.moe_ops == 0
        assert rel_err(got.out, ref.out) < tol, f"T={T}: forward differs from eager"


def check_equal_to_eager(case: Case, outcome: Outcome) -> None:
    """A module rewritten in some of its compiled graphs only: every step's output and gradients are still eager's."""
    tol = TOL[case.dtype]
    assert len(outcome.steps) == len(case.token_counts)
    for T, (got, ref) in zip(case.token_counts, outcome.steps):
        assert rel_err(got.out, ref.out) < tol, f"T={T}: forward differs from eager"
        assert got.grads.keys() == ref.grads.keys(), f"T={T}: gradients of {sorted(got.grads)} vs {sorted(ref.grads)}"
        for name in ref.grads:
            assert rel_err(got.grads[name], ref.grads[name]) < tol, f"T={T}: gradient of {name} differs from eager"


