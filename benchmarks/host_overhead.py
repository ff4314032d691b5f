"""Host-side cost of one fused_experts call: cProfile of repeated calls (sorted by own time).

    python benchmarks/host_overhead.py --shape qwen3 --tokens 4096
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
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
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    moe_inductor.config.validate_routing = False
    H, I, E, k = SHAPES[args.shape]
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    ids, weights = make_routing(args.tokens, E, k, False, torch.Generator().manual_seed(0), "cuda")
    weights = weights.to(torch.bfloat16)
    for _ in range(3):
        moe_inductor.fused_experts(x, ids, weights, w1, w2)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(20):
        moe_inductor.fused_experts(x, ids, weights, w1, w2)
    prof.disable()
    host = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    print(f"host {host * 1e3:.3f} ms/call (under cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
