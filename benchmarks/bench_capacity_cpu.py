"""A fairseq-style padded-capacity layer over a ModuleList of biased nn.Linear experts (top-1 GShard gating, the
(T, E, C) combine, ``mm`` dispatch, one expert per ``chunk`` of the (1, E, C, H) buffer) on the CPU: eager against
``backend="moe_inductor"``, fp32, no_grad, the median of interleaved rounds of wall-clock time, ms per call.

    OMP_NUM_THREADS=1 python benchmarks/bench_capacity_cpu.py --tokens 1 8 64 --rounds 5

The rewrite used to stack every expert's weights in the graph at each call here (the list op took no capacity).
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


class _FFN(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class CapacityMoE(nn.Module):
    """Top-1 gating with capacity 2 * ceil(T / E), fairseq's dispatch and combine."""

    def __init__(self, hidden: int, inner: int, experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_FFN(hidden, inner) for _ in range(experts))

    def forward(self, x):
        T, H = x.shape
        E = len(self.experts)
        C = 2 * ((T + E - 1) // E)
        gates = F.softmax(self.wg(x), 1)
        mask = F.one_hot(gates.argmax(1), E)
        slot = torch.cumsum(mask, 0) - 1
        mask = mask * torch.lt(slot, C)
        gate = (gates * mask).sum(1)
        slots = F.one_hot(torch.sum(slot * mask, 1), C)
        combine = torch.bmm((gate[:, None] * mask.to(gate.dtype)).unsqueeze(-1), slots.to(gate.dtype).unsqueeze(1))
        dispatch = combine.bool().to(x.dtype).permute(1, 2, 0)
        buffer = torch.mm(dispatch.reshape(E * C, T), x).reshape(1, E, -1, H)
        out = torch.cat([e(c) for e, c in zip(self.experts, buffer.chunk(E, 1))], 1).reshape(E, -1, H)
        return combine.view(T, -1).mm(out.view(-1, H))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--widths", nargs=3, type=int, default=[512, 1024, 16], metavar=("H", "I", "E"))
    args = ap.parse_args(argv)
    assert moe_inductor.__name__  # the backend's name is registered on import
    hidden, inner, experts = args.widths
    torch.manual_seed(0)
    model = CapacityMoE(hidden, inner, experts).eval()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, H={hidden} I={inner} E={experts}")
    print("| T | eager ms | moe_inductor ms | eager / moe_inductor | rewrites | max abs err |")
    print("|---|---|---|---|---|---|")
    rows = []
    for T in args.tokens:
        torch._dynamo.reset()
        counters.clear()
        x = torch.randn(T, hidden)
        compiled = torch.compile(model, backend="moe_inductor", dynamic=False)
        with torch.no_grad():
            err = (compiled(x) - model(x)).abs().max().item()
            times = interleaved_ms({"eager": lambda: model(x), "moe_inductor": lambda: compiled(x)}, args.rounds,
                                   args.calls)
        med = {n: statistics.median(v) for n, v in times.items()}
        rewrites = dict(counters["moe_inductor"])
        rows.append(dict(T=T, rewrites=rewrites, **med))
        print(f"| {T} | {med['eager']:.2f} | {med['moe_inductor']:.2f} | {med['eager'] / med['moe_inductor']:.2f}x | "
              f"{rewrites} | {err:.1e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
