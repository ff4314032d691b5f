"""Build a recipe's module, compile it with moe_inductor (light inner compiler), run forward and backward next to
eager (a forward in inference only, for the recipes checked that way: ``Recipe.inference``), and say what happened:
rewritten, missed, a wrong rewrite, or a crash."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.generator.loops import ExpertChoiceMoE, LoopMoE, SplitMoE
from tests.generator.parts import H
from tests.generator.recipe import Recipe, counter_of
from tests.generator.stacked import CapacityMoE, DenseMoE, GatheredMoE, MemorySlotsMoE, SortedMoE
from tests.generator.walks_lists import CumsumWalkMoE, ListRowsMoE
from tests.helpers import rel_err

MODULES = {"loop": LoopMoE, "split": SplitMoE, "expert_choice": ExpertChoiceMoE, "sorted": SortedMoE,
           "gathered": GatheredMoE, "dense": DenseMoE, "capacity": CapacityMoE, "memory_slots": MemorySlotsMoE,
           "cumsum_walk": CumsumWalkMoE, "list_rows": ListRowsMoE}

#: the issue's bar (fp32); torch._grouped_mm takes bf16 only, and bf16 gets its own bound (tests/helpers.py)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def dtype_of(r: Recipe) -> torch.dtype:
    return torch.bfloat16 if r.form == "sorted" else torch.float32


def build(r: Recipe) -> nn.Module:
    torch.manual_seed(r.seed)
    return MODULES[r.form](r).to(dtype_of(r))


@dataclass
class Outcome:
    recipe: Recipe
    rewrites: dict = field(default_factory=dict)
    left_alone: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # "out" and each gradient: relative error against eager
    crash: Optional[str] = None
    autocast: bool = False  # both runs under CPU bf16 autocast (``run``'s ``autocast``)
    eager_crash: Optional[str] = None  # where the compiled run raised: what eager raised, if it did
    same_error: bool = False  # the compiled run's exception is of the type of eager's (Dynamo's wrap of it too)

    @property
    def rewritten(self) -> bool:
        return sum(self.rewrites.values()) > 0

    @property
    def equal(self) -> bool:
        tol = TOL[torch.bfloat16 if self.autocast else dtype_of(self.recipe)]
        return self.crash is None and all(err < tol for err in self.errors.values())

    @property
    def verdict(self) -> str:
        """"rewritten" (a genuine variant rewritten as its form, equal to eager), "kept" (a look-alike left as
        it was, equal to eager), "missed" (a genuine variant not rewritten), "wrong" (a look-alike rewritten, a
        variant rewritten as another form, or a result that differs from eager), "crash", "same error" (the compiled
        run raised where eager raises too) or "eager error" (eager raised where the compiled run did not: code
        that does not run eagerly, such as a dtype clash of the user's under autocast)."""
        if self.crash is not None:
            return "same error" if self.same_error else "crash"
        if self.eager_crash is not None:
            return "eager error"
        if not self.equal:
            return "wrong"
        if not self.recipe.genuine:
            return "wrong" if self.rewritten else "kept"
        if not self.rewritten:
            return "missed"
        return "rewritten" if set(self.rewrites) == {counter_of(self.recipe.form)} else "wrong"

    def describe(self) -> str:
        errs = ", ".join(f"{n} {e:.1e}" for n, e in self.errors.items() if e >= 1e-6)
        why = "; ".join(f"{f}: {n}" for f, n in self.left_alone.items())
        return (f"{self.verdict}: {self.recipe} | rewrites {self.rewrites} | left alone {why or '-'}"
                f" | errors {errs or '-'}" + (f" | crash {self.crash}" if self.crash else "")
                + (f" | eager raised {self.eager_crash}" if self.eager_crash else ""))


def _step(module: nn.Module, x: torch.Tensor, autocast: bool = False) -> tuple[torch.Tensor, dict]:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)  # a dropout in training draws the same masks in each run
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * probe).sum().backward()
    grads = {"x": x.grad}
    grads.update({n.removeprefix("_orig_mod."): p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out.detach(), grads


def _forward(module: nn.Module, x: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """The module's output in inference (eval mode, no gradient), for the recipes checked that way only."""
    module.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return module(x.detach().clone())


def _errors(out, grads, ref, ref_grads, zero: tuple = ()) -> dict:
    """Relative L2 error of the output and of each gradient against a reference run; a gradient under 1% of the
    largest one is measured against 1% of the largest. The gradients named in ``zero`` are zero by construction
    (the router's, under top-1 with renormalised weights: every weight is w / w), so both runs hold rounding noise:
    each must be under 1% of the largest gradient (the error is its size against that bound, times the tolerance)."""
    errors = {"out": rel_err(out.float(), ref.float())}
    floor = 1e-2 * max((g.float().norm().item() for g in ref_grads.values()), default=0.0)
    for name, g in ref_grads.items():
        mine = grads.get(name)
        if mine is None:
            errors[f"grad {name}"] = float("inf")
            continue
        assert not torch.isnan(mine).any(), f"NaN in the gradient of {name}"
        if name in zero:
            size = max(mine.double().norm().item(), g.double().norm().item())
            errors[f"grad {name}"] = size / max(floor, 1e-30) * TOL[torch.float32]
            continue
        diff = (mine.double() - g.double()).norm().item()
        errors[f"grad {name}"] = diff / max(g.double().norm().item(), floor, 1e-30)
    return errors


def run(r: Recipe, inner: str = "eager", autocast: bool = False) -> Outcome:
    """Compile the recipe's module once at its T, one forward and backward, against an eager copy. ``inner`` is
    the compiler the rewritten graph goes to: "aot_eager" traces it again as Inductor does (fake tensors, the ops'
    autograd formulas), which the light default does not. ``autocast``: both run under CPU bf16 autocast (mixed
    precision over the recipe's weights), held to the bf16 bound."""
    torch._dynamo.reset()
    counters.clear()
    model = build(r)
    eager = copy.deepcopy(model)
    x = torch.randn(r.T, H, generator=torch.Generator().manual_seed(r.seed)).to(dtype_of(r))
    outcome = Outcome(r, autocast=autocast)
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner})
    if r.inference:
        return _run_inference(outcome, compiled, eager, x)
    try:
        got, got_grads = _step(compiled, x, autocast)
    except Exception as exc:  # noqa: BLE001  (the outcome records it; the caller decides)
        outcome.crash = _said(exc)
        try:  # the promise is eager's error where eager fails too (a dtype clash of the user's under autocast)
            _step(eager, x, autocast)
        except Exception as eager_exc:  # noqa: BLE001
            outcome.eager_crash, outcome.same_error = _said(eager_exc), isinstance(exc, type(eager_exc))
        return outcome
    outcome.rewrites = {f: n for f, n in counters["moe_inductor"].items() if n}
    outcome.left_alone = {f: n for f, n in counters["moe_inductor_left_alone"].items() if n}
    reference = eager
    if inner == "inductor" and draws_random_numbers(r):
        # Inductor's dropout draws its own masks (philox), never eager's: the promise for such a layer is the
        # result plain backend="inductor" gives, so that is the reference (the fp32 rule below still copies the
        # plain module, not a compiled wrapper)
        torch._dynamo.reset()
        reference = torch.compile(eager, backend="inductor")
    try:
        ref, ref_grads = _step(reference, x, autocast)
    except Exception as exc:  # noqa: BLE001  (eager fails where the compiled run did not: a dtype clash of the
        outcome.eager_crash = _said(exc)  # user's under autocast that Dynamo's fake tensors let through)
        return outcome
    # top-1 renormalised weights are all 1 (a soft look-alike mixes by the full probabilities instead)
    zero = ("router.gate.weight",) if r.k == 1 and r.renorm and r.flaw != "soft" and r.form not in (
        "capacity", "memory_slots", "expert_choice") else ()
    outcome.errors = _errors(got, got_grads, ref, ref_grads, zero)
    if (dtype_of(r) != torch.float32 or autocast) and not outcome.equal:
        # bf16 eager can itself be far from the same module in fp32 (here: torch._grouped_mm's bf16 backward on
        # CPU); then the bound is torch._dynamo's accuracy rule against an fp32 run of the same weights: no
        # further from it than twice eager's bf16 distance plus 2e-3
        ref32, ref32_grads = _step(copy.deepcopy(eager).float(), x.float())
        ours = _errors(got, got_grads, ref32, ref32_grads, zero)
        eagers = _errors(ref, ref_grads, ref32, ref32_grads, zero)
        outcome.errors = against_fp32(outcome.errors, ours, eagers, TOL[torch.bfloat16])
    return outcome


def _said(exc: Exception) -> str:
    """An exception's type and first line, as an outcome records it."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _run_inference(outcome: Outcome, compiled: nn.Module, eager: nn.Module, x: torch.Tensor) -> Outcome:
    """``run`` for a recipe checked in inference only (``Recipe.inference``): one forward of each, no backward."""
    try:
        got = _forward(compiled, x, outcome.autocast)
    except Exception as exc:  # noqa: BLE001  (the outcome records it; the caller decides)
        outcome.crash = _said(exc)
        try:
            _forward(eager, x, outcome.autocast)
        except Exception as eager_exc:  # noqa: BLE001
            outcome.eager_crash, outcome.same_error = _said(eager_exc), isinstance(exc, type(eager_exc))
        return outcome
    outcome.rewrites = {f: n for f, n in counters["moe_inductor"].items() if n}
    outcome.left_alone = {f: n for f, n in counters["moe_inductor_left_alone"].items() if n}
    outcome.errors = {"out": rel_err(got.float(), _forward(eager, x, outcome.autocast).float())}
    return outcome


def draws_random_numbers(r: Recipe) -> bool:
    """Whether the recipe's module draws random numbers in its training step (a dropout of p > 0)."""
    return r.idioms.get("dropout") == "train_p"


def against_fp32(errors: dict, ours: dict, eagers: dict, tol: float) -> dict:
    """The bf16 errors with torch._dynamo's accuracy rule applied: an error at or over ``tol`` against eager's bf16
    run stands unless ours, against an fp32 run of the same weights, is no further than twice eager's distance
    from it plus 2e-3; then its size against that bound, times ``tol``, replaces it (under ``tol`` exactly when
    the rule holds). ``ours`` and ``eagers``: each result's error against the fp32 run."""
    out = dict(errors)
    for name, err in errors.items():
        bound = 2 * eagers[name] + 2e-3
        if err >= tol and ours[name] <= bound:
            out[name] = ours[name] / bound * tol
    return out
