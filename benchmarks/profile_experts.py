"""Where the time of one fused_experts call goes: GPU kernels (torch.profiler) and host overhead.

    python benchmarks/profile_experts.py --shape qwen3 --tokens 16 4096
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import moe_inductor
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_experts import SHAPES, make_routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[16, 4096])
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    moe_inductor.config.validate_routing = False
    H, I, E, k = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5
    gen = torch.Generator().manual_seed(0)
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=args.backward)
        ids, weights = make_routing(T, E, k, False, gen, dev)
        weights = weights.to(dt)

        def call():
            y = moe_inductor.fused_experts(x, ids, weights, w1, w2)
            if args.backward:
                y.backward(torch.ones_like(y))
            return y

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            call()
        host = (time.perf_counter() - t0) / 50
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 50
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        print(f"== {args.shape} T={T}: host launch {host * 1e3:.3f} ms/call, wall {wall * 1e3:.3f} ms/call")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
