"""Hand-written MoE layers of the FX forms, one per form, against Inductor: the speed rule's values for the routes
``bench_list_train.py`` does not measure (``moe_inductor/speed_rule.py``'s ``fx_route``).

    python benchmarks/bench_fx_forms.py --forms list stacked_loop gathered capacity sorted --widths 4096 14336 8 2

Each layer is written as such code is in public codebases, SwiGLU experts, over stacked (E, out, in) weights but the
first:

- ``list``: bench_list_train.py's ModuleList loop (route "fx_list"), so that one run measures every route;
- ``stacked_loop``: a loop over the experts, ``torch.where`` of each one's rows of a one-hot, ``F.linear`` on the
  expert's slice of each stack, ``index_add_`` (Mixtral's transformers-v4 loop with the weights stacked);
- ``gathered``: every token's chosen experts' weights gathered (``w[ids]``) and applied by einsum (gpt-fast's
  decode path); its gathered weights are (T, k, I, H), so it runs only at decode sizes;
- ``capacity``: GShard's top-2 gating into a (T, E, C) dispatch with capacity factor 1.25, the experts on the padded
  (E, C, H) buffer by einsum, the combine einsum;
- ``sorted``: the assignments sorted by expert and run through ``torch._grouped_mm`` with cumulative offsets
  (torchtitan's grouped experts; bf16 on the GPU);
- ``dense``: every expert on every token by einsum, weighted by a (T, E) matrix zero outside each token's top-k.

Columns: eager, ``torch.compile`` (Inductor) and ``backend="moe_inductor"`` with the speed rule off, so that the
rewrite itself is timed (the rule's own values are what this measures). Modes: ``forward`` (under ``no_grad``; a
token count up to 16 is the rule's "decode", from 512 its "prefill") and ``train`` (forward, then the backward of
the output against a fixed probe). Times are ``triton.testing.do_bench`` medians in ms on CUDA (random bf16 weights
and inputs), or wall-clock medians on the CPU (``--device cpu``, fp32 but ``sorted``'s bf16, for a smoke run). Each row gives the time,
Inductor's time over the column's, the max abs error against eager, the peak memory and the first call's seconds,
and how many layers moe_inductor rewrote (a 0 there means the row times Inductor's path twice; a ``LEFT`` line
then gives explain()'s reasons). The last lines,
``RULE {...}``, are each form's values as the rule's file holds them (route, shape, one value per mode).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_cpu import interleaved_ms  # noqa: E402
from benchmarks.bench_list_train import LoopMoE  # noqa: E402
from benchmarks.hf_profile import Profiler  # noqa: E402
from moe_inductor import config  # noqa: E402
from moe_inductor.speed_rule import backward_traced, filed_modes, visible_backward_on  # noqa: E402

#: the speed rule's route each form's values are for
ROUTES = {"list": "fx_list", "stacked_loop": "fx_loop", "gathered": "fx_gathered", "capacity": "fx_capacity",
          "sorted": "fx_sorted", "dense": "fx_dense"}
#: token counts beyond which a form's eager code cannot run at real widths (gathered weights: (T, k, I, H) each)
MAX_TOKENS = {"gathered": 64}
#: forms whose code takes one dtype whatever the device (torch._grouped_mm traces bf16 only)
BF16_ONLY = {"sorted": torch.bfloat16}


class _Stacked(nn.Module):
    """A router and stacked SwiGLU expert weights in nn.Linear's (out, in) layout."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int):
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, inner, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, inner, hidden) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inner) * inner ** -0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax over the experts, top-k, renormalised: (weights in x's dtype, ids), each (T, k)."""
        probs = self.gate(x).float().softmax(-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids


class StackedLoop(_Stacked):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        hot = F.one_hot(ids, self.experts).permute(2, 1, 0)  # (E, k, T)
        for e in range(self.experts):
            slot, tok = torch.where(hot[e])
            rows = x[tok]
            h = F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e])
            out.index_add_(0, tok, F.linear(h, self.w2[e]) * w[tok, slot, None])
        return out


class Gathered(_Stacked):
    def forward(self, x):
        w, ids = self.route(x)
        up = torch.einsum("th,tkih->tki", x, self.w1[ids])
        gate_up = F.silu(up) * torch.einsum("th,tkih->tki", x, self.w3[ids])
        down = torch.einsum("tki,tkhi->tkh", gate_up, self.w2[ids])
        return torch.einsum("tkh,tk->th", down, w)


class Capacity(_Stacked):
    """GShard's top-2 gating (the second choice the best expert other than the first, queued behind every first
    choice), capacity ``ceil(1.25 * 2T / E)``; the dispatch and combine einsums."""

    def forward(self, x):
        T, E = x.shape[0], self.experts
        C = max(1, -(-5 * 2 * T // (4 * E)))
        gates = self.gate(x).float().softmax(-1)
        first = F.one_hot(gates.argmax(-1), E)
        second = F.one_hot(gates.masked_fill(first.bool(), 0.0).argmax(-1), E)
        place1 = torch.cumsum(first, 0) - 1
        place2 = torch.cumsum(second, 0) - 1 + first.sum(0, keepdim=True)
        first, second = first * (place1 < C), second * (place2 < C)
        g1, g2 = (gates * first).sum(1), (gates * second).sum(1)
        norm = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
        slot1 = F.one_hot((place1 * first).sum(1), C)
        slot2 = F.one_hot((place2 * second).sum(1), C)
        combine = ((g1 / norm)[:, None, None] * first[:, :, None] * slot1[:, None, :]
                   + (g2 / norm)[:, None, None] * second[:, :, None] * slot2[:, None, :]).to(x.dtype)
        dispatch = combine.bool().to(x.dtype)
        rows = torch.einsum("tec,th->ech", dispatch, x)
        h = F.silu(torch.einsum("ech,eih->eci", rows, self.w1)) * torch.einsum("ech,eih->eci", rows, self.w3)
        return torch.einsum("tec,ech->th", combine, torch.einsum("eci,ehi->ech", h, self.w2))


class Dense(_Stacked):
    """Every expert on every token, weighted by a (T, E) matrix that is zero outside each token's top-k (the
    all-experts einsums of small research code and of MoE layers written for export)."""

    def forward(self, x):
        w, ids = self.route(x)
        routing = torch.zeros(x.shape[0], self.experts, device=x.device, dtype=x.dtype).scatter(1, ids, w)
        h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
        return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)


class Sorted(_Stacked):
    def forward(self, x):
        w, ids = self.route(x)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // self.top_k
        offsets = torch.cumsum(torch.bincount(flat, minlength=self.experts), 0).to(torch.int32)
        rows = x[tok]
        h = F.silu(torch._grouped_mm(rows, self.w1.transpose(1, 2), offs=offsets)) * torch._grouped_mm(
            rows, self.w3.transpose(1, 2), offs=offsets)
        down = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offsets) * w.view(-1)[order][:, None]
        return torch.zeros_like(x).index_add_(0, tok, down)


#: "list" is bench_list_train.py's layer (transformers v4's Mixtral loop over a ModuleList), so one run measures every
#: route
FORMS = {"list": LoopMoE, "stacked_loop": StackedLoop, "gathered": Gathered, "capacity": Capacity, "sorted": Sorted,
         "dense": Dense}


def _timer(device: str) -> Callable[[Callable], float]:
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=50, rep=300)

    def median_ms(fn: Callable, rounds: int = 7, calls: int = 3) -> float:
        fn()
        return statistics.median(interleaved_ms({"fn": fn}, rounds, calls)["fn"])

    return median_ms


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=list(FORMS))
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096, 16])
    ap.add_argument("--widths", nargs=4, type=int, default=[4096, 14336, 8, 2], metavar=("H", "I", "E", "K"))
    ap.add_argument("--modes", nargs="*", default=["train", "forward"], choices=["train", "forward"])
    ap.add_argument("--columns", nargs="*", default=["eager", "inductor", "moe_inductor"],
                    choices=["eager", "inductor", "moe_inductor"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                    help="moe_inductor's inner compiler (aot_eager: a light smoke run on the CPU)")
    ap.add_argument("--profile", metavar="PATH", default=None,
                    help="after each timed row, torch.profiler over 3 of its steps: the top kernels and the time "
                         "outside them, printed and appended to PATH (which kernels differ between the columns)")
    args = ap.parse_args(argv)
    assert moe_inductor.__name__  # the backend's name is registered on import
    config.speed_rule = False  # the rewrite itself is what is timed
    hidden, inner, experts, top_k = args.widths
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    bench = _timer(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    visible = visible_backward_on()  # which training values the rows give (speed_rule.filed_modes)
    print(f"torch {torch.__version__}, {name}, H={hidden} I={inner} E={experts} k={top_k}, {dtype}, "
          f"visible backward {'on' if visible else 'off'}")
    print("| form | mode | T | column | ms | inductor / column | max abs err vs eager | peak MiB | first call s | "
          "rewrites |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    from torch._dynamo.utils import counters

    profiler = Profiler(args.profile, rows=16) if args.profile else None

    for form in args.forms:
        torch.manual_seed(0)
        model = FORMS[form](hidden, inner, experts, top_k).to(args.device, BF16_ONLY.get(form, dtype))
        for mode in args.modes:
            for T in args.tokens:
                if T > MAX_TOKENS.get(form, T):
                    continue
                x = torch.randn(T, hidden, device=args.device, dtype=BF16_ONLY.get(form, dtype))
                probe = torch.randn(T, hidden, device=args.device, dtype=x.dtype)
                xg = x.clone().requires_grad_(True)

                def step(run):
                    if mode == "forward":
                        with torch.no_grad():
                            return run(x)
                    for p in model.parameters():
                        p.grad = None
                    xg.grad = None
                    (run(xg).float() * probe).sum().backward()
                    return xg.grad

                ref = step(model).float()
                times: dict[str, float] = {}
                for column in args.columns:
                    torch._dynamo.reset()
                    counters.clear()
                    if column == "eager":
                        run = model
                    elif column == "moe_inductor":
                        run = torch.compile(model, backend="moe_inductor", options={"inner": args.inner})
                    else:
                        run = torch.compile(model, backend=column)
                    t0 = time.perf_counter()
                    got = step(run).float()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    first = time.perf_counter() - t0
                    ms = bench(lambda: step(run))
                    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else float("nan")
                    rewrites = sum(counters["moe_inductor"].values()) if column == "moe_inductor" else 0
                    times[column] = ms
                    err = (got - ref).abs().max().item()
                    ratio = times["inductor"] / ms if "inductor" in times else float("nan")
                    rows.append(dict(form=form, mode=mode, T=T, column=column, ms=ms, err=err, peak_mib=peak,
                                     first_s=first, rewrites=rewrites))
                    print(f"| {form} | {mode} | {T} | {column} | {ms:.3f} | {ratio:.2f} | {err:.2e} | {peak:.0f} | "
                          f"{first:.1f} | {rewrites} |", flush=True)
                    if profiler is not None:
                        profiler(f"{form} {mode} T={T} {column}", lambda: step(run), 3, args.device)
                    if column == "moe_inductor" and not rewrites:
                        print(f"LEFT {form} {mode} T={T}: {why_left(model, xg if mode == 'train' else x, mode)}",
                              flush=True)
        # each form's entry as soon as it is measured: a run cut by its time limit keeps what it finished
        for entry in rule_entries([r for r in rows if r["form"] == form], args.widths, visible):
            print("RULE " + json.dumps(entry), flush=True)
    return rows


def why_left(model: nn.Module, x: torch.Tensor, mode: str) -> str:
    """explain()'s reasons for a layer moe_inductor did not rewrite (a row that times Inductor's path twice)."""
    with torch.set_grad_enabled(mode == "train"):
        report = moe_inductor.explain(model, x, options={"inner": "aot_eager"})
    reasons = "; ".join(f"{left.form}: {left.reason}" for left in report.left_alone)
    return reasons or "explain() found no MoE-looking region"


def floor2(ratio: float) -> float:
    """``ratio`` rounded down to two decimals: a layer 0.996x as fast as Inductor's must not read as a 1.00x tie,
    which the rule takes (the 1e-9 keeps a ratio like 0.29, stored as 0.28999..., from dropping a step)."""
    return math.floor(ratio * 100 + 1e-9) / 100


def rule_entries(rows: list[dict], widths: list[int], visible: bool = False) -> list[dict]:
    """Each form's values as the speed rule's file holds them: Inductor's time over moe_inductor's, the worst over
    the sizes measured in each of the rule's modes, for rows where moe_inductor rewrote the layer; ``visible``:
    the run had the visible backward on, so a training row whose layer and size take it files as such
    (``speed_rule.filed_modes``)."""
    out = []
    for form in dict.fromkeys(r["form"] for r in rows):
        values: dict[str, float] = {}
        for r in rows:
            if r["form"] != form or r["column"] != "moe_inductor" or not r["rewrites"]:
                continue
            base = next((b for b in rows if b["form"] == form and b["mode"] == r["mode"] and b["T"] == r["T"]
                         and b["column"] == "inductor"), None)
            if base is None:
                continue
            value = floor2(base["ms"] / r["ms"])
            # whether this row's own backward was the visible one (the list op has none)
            row_visible = visible and form != "list" and backward_traced(r["T"], widths, False)
            for mode in filed_modes(r["mode"], r["T"], row_visible):
                values[mode] = min(values.get(mode, value), value)
        if values:
            out.append({"name": f"{form} (bench_fx_forms.py)", "route": ROUTES[form], "activation": "silu_glu",
                        "gate_up": "separate", "bias": False, "shape": list(widths), **values})
    return out


if __name__ == "__main__":
    main()
