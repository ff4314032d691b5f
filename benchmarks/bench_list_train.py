"""A transformers-v4-style Mixtral layer (a ModuleList of SwiGLU experts, three bias-free nn.Linear each, a loop over
the experts with ``index_add_``) on the GPU: eager, ``torch.compile`` (Inductor) and ``backend="moe_inductor"`` (the
list op, which reads the experts' weights where they lie in the forward and stacks them in its backward), in a
forward and in a training step (forward, then the backward of the output against a fixed random probe).

    python benchmarks/bench_list_train.py --tokens 4096 --widths 4096 14336 8 2 --modes train forward

Times are ``triton.testing.do_bench`` medians in ms on random bf16 weights and inputs; the table gives each column's
time, the ratio of Inductor's time over moe_inductor's, the output's error against eager and the peak memory.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """The router's top-k, renormalised; per expert the rows that chose it, its MLP weighted, ``index_add_``."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inner) for _ in range(experts))

    def forward(self, x):
        probs = self.gate(x).float().softmax(-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 1, 0)  # (E, k, T)
        for e, expert in enumerate(self.experts):
            pos, tok = torch.where(mask[e])
            out.index_add_(0, tok, expert(x[tok]) * w[tok, pos, None])
        return out


def main(argv=None) -> list[dict]:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096])
    ap.add_argument("--widths", nargs=4, type=int, default=[4096, 14336, 8, 2], metavar=("H", "I", "E", "K"))
    ap.add_argument("--modes", nargs="*", default=["train", "forward"], choices=["train", "forward"])
    ap.add_argument("--columns", nargs="*", default=["eager", "inductor", "moe_inductor"],
                    choices=["eager", "inductor", "moe_inductor"])
    args = ap.parse_args(argv)
    assert moe_inductor.__name__  # the backend's name is registered on import
    moe_inductor.config.speed_rule = False  # the rewrite itself is timed: the rule's values are what this measures
    hidden, inner, experts, top_k = args.widths
    torch.manual_seed(0)
    model = LoopMoE(hidden, inner, experts, top_k).to("cuda", torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, H={hidden} I={inner} E={experts} k={top_k}, bf16")
    print("| mode | T | column | ms | inductor / column | max abs err vs eager | peak MiB | first call s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in args.modes:
        for T in args.tokens:
            x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
            probe = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
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
            times = {}
            for column in args.columns:
                torch._dynamo.reset()
                run = model if column == "eager" else torch.compile(model, backend=column)
                t0 = time.perf_counter()
                got = step(run).float()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                torch.cuda.reset_peak_memory_stats()
                ms = do_bench(lambda: step(run), warmup=50, rep=300)
                peak = torch.cuda.max_memory_allocated() / 2**20
                times[column] = ms
                err = (got - ref).abs().max().item()
                ratio = times["inductor"] / ms if "inductor" in times else float("nan")
                rows.append(dict(mode=mode, T=T, column=column, ms=ms, err=err, peak_mib=peak, first_s=first))
                print(f"| {mode} | {T} | {column} | {ms:.3f} | {ratio:.2f} | {err:.2e} | {peak:.0f} | {first:.1f} |",
                      flush=True)
    return rows


if __name__ == "__main__":
    main()
