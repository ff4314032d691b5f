"""A top-k loop over a ModuleList of nn.Linear MLP experts (biased or not) on the CPU: eager against
``backend="moe_inductor"`` (its list op), fp32, the median of interleaved rounds of wall-clock time, ms per call.

    OMP_NUM_THREADS=1 python benchmarks/bench_loop_cpu.py --tokens 1 64 --rounds 5
    OMP_NUM_THREADS=1 python benchmarks/bench_loop_cpu.py --train --tokens 64 256 --rounds 5

``--train`` times a training step instead (forward, then the backward of the output against a fixed random probe,
gradients set to None first), where the list op's backward reads the experts' weights too.

The rewrite used to stack every expert's weights in the graph at each call where the experts had biases (the list
op took none): the biased rows show what that cost, and what reading each expert's own weights gives.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_cpu import interleaved_ms  # noqa: E402


class LoopMoE(nn.Module):
    """``for e in range(E)``: the rows that chose e, its MLP, ``index_add_`` weighted by their routing weight."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int, bias: bool):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.fc1 = nn.ModuleList(nn.Linear(hidden, inner, bias=bias) for _ in range(experts))
        self.fc2 = nn.ModuleList(nn.Linear(inner, hidden, bias=bias) for _ in range(experts))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.fc1)):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.fc2[e](F.gelu(self.fc1[e](x[tok]))) * w[tok, pos, None])
        return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--train", action="store_true", help="time forward + backward instead of the forward")
    ap.add_argument("--biases", nargs="*", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--widths", nargs=4, type=int, default=[1024, 2048, 32, 2], metavar=("H", "I", "E", "K"))
    args = ap.parse_args(argv)
    assert moe_inductor.__name__  # the backend's name is registered on import
    hidden, inner, experts, top_k = args.widths
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, H={hidden} I={inner} E={experts} k={top_k}")
    print(f"mode: {'training step' if args.train else 'forward (no_grad)'}")
    print("| biases | T | eager ms | moe_inductor ms | eager / moe_inductor | rewrites | max abs err |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for bias in (b == "on" for b in args.biases):
        torch.manual_seed(0)
        model = LoopMoE(hidden, inner, experts, top_k, bias).eval()
        for T in args.tokens:
            torch._dynamo.reset()
            counters.clear()
            x = torch.randn(T, hidden)
            compiled = torch.compile(model, backend="moe_inductor")
            if args.train:
                probe = torch.randn(T, hidden)
                xg = x.clone().requires_grad_(True)

                def step(run):
                    for p in model.parameters():
                        p.grad = None
                    xg.grad = None
                    (run(xg) * probe).sum().backward()
                    return xg.grad

                err = (step(compiled) - step(model)).abs().max().item()
                times = interleaved_ms({"eager": lambda: step(model), "moe_inductor": lambda: step(compiled)},
                                       args.rounds, args.calls)
            else:
                with torch.no_grad():
                    err = (compiled(x) - model(x)).abs().max().item()
                    times = interleaved_ms({"eager": lambda: model(x), "moe_inductor": lambda: compiled(x)},
                                           args.rounds, args.calls)
            med = {n: statistics.median(v) for n, v in times.items()}
            rewrites = dict(counters["moe_inductor"])
            rows.append(dict(bias=bias, T=T, rewrites=rewrites, **med))
            print(f"| {bias} | {T} | {med['eager']:.2f} | {med['moe_inductor']:.2f} | "
                  f"{med['eager'] / med['moe_inductor']:.2f}x | {rewrites} | {err:.1e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
