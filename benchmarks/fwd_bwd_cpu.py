"""One training step of ``moe_inductor.fused_experts`` on the CPU (the op's plain-torch path), median wall time.

    python benchmarks/fwd_bwd_cpu.py                          # T H I E k = 64 1024 1024 32 2: weight-gradient bound
    python benchmarks/fwd_bwd_cpu.py --shape 512 512 256 8 2

For host-side changes that a CPU can show (what autograd does around the op, say). GPU speed is measured by
bench_experts.py on the device machine, never here.
"""
from __future__ import annotations

import argparse
import time

import torch

import moe_inductor


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=5, type=int, default=[64, 1024, 1024, 32, 2], metavar=("T", "H", "I", "E", "k"))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    T, H, I, E, k = args.shape
    torch.manual_seed(0)
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.randn(T, E).topk(k, -1).indices
    weights = torch.rand(T, k, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H) * H ** -0.5).requires_grad_()  # HF's concatenated gate_up_proj
    w2 = (torch.randn(E, H, I) * I ** -0.5).requires_grad_()

    def step() -> None:
        moe_inductor.fused_experts(x, ids, weights, w1, w2).sum().backward()
        x.grad = weights.grad = w1.grad = w2.grad = None

    for _ in range(2):
        step()
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"fwd+bwd median {times[len(times) // 2] * 1e3:.1f} ms over {args.reps} steps; T H I E k = {args.shape}; "
          f"gate_up weight {w1.numel() * 4 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
