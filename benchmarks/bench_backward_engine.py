"""Forward + backward of the experts op with each pairing of GEMM engines, against sort + torch._grouped_mm.

    python benchmarks/bench_backward_engine.py --shapes qwen3 olmoe gptoss deepseekv3 --tokens 4096 16384

Columns (do_bench medians, ms, one process): "fused" = our Triton kernels forward and backward
(gemm_engine="triton"); "fused fwd, gmm bwd" = our fused forward, the backward's GEMMs through torch._grouped_mm
(gemm_engine_backward="grouped_mm"); "gmm both" = gemm_engine="grouped_mm"; "auto" = the defaults; the reference is
bench_experts.py's sort + torch._grouped_mm. Gradients for x, the routing weights and both weights.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import moe_inductor
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_experts import SHAPES, bench, hf_expert_weights, make_routing, sort_grouped_mm  # noqa: E402

PAIRINGS = {  # column: (gemm_engine, gemm_engine_backward)
    "fused": ("triton", None),
    "fused fwd, gmm bwd": ("triton", "grouped_mm"),
    "gmm both": ("grouped_mm", None),
    "auto": ("auto", None),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3", "olmoe", "gptoss", "deepseekv3"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096, 16384])
    args = ap.parse_args()
    moe_inductor.config.validate_routing = False
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}")
    print("| shape | T | rows/expert | " + " | ".join(PAIRINGS) + " | sort+_grouped_mm | best ours vs sort+gmm |")
    print("|---" * (len(PAIRINGS) + 5) + "|")
    for name in args.shapes:
        H, I, E, k = SHAPES[name]
        dev, dt = "cuda", torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        w1, w2 = (w.requires_grad_() for w in hf_expert_weights(name, dev, dt))
        for T in args.tokens:
            x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
            ids, weights = make_routing(T, E, k, False, gen, dev)
            weights = weights.to(dt).requires_grad_()
            dy = torch.randn_like(x)
            leaves = (x, weights, w1, w2)

            def ours():
                y = moe_inductor.fused_experts(x, ids, weights, w1, w2)
                torch.autograd.grad(y, leaves, dy)

            def reference():
                y = sort_grouped_mm(x, ids, weights, w1.transpose(1, 2), w2.transpose(1, 2))
                torch.autograd.grad(y, leaves, dy)

            times = {}
            for column, (forward_engine, backward_engine) in PAIRINGS.items():
                moe_inductor.config.gemm_engine = forward_engine
                moe_inductor.config.gemm_engine_backward = backward_engine
                times[column] = bench(ours, 10, 200)
            moe_inductor.config.gemm_engine, moe_inductor.config.gemm_engine_backward = "auto", None
            ref = bench(reference, 10, 200)
            cells = " | ".join(f"{t:.3f}" for t in times.values())
            print(f"| {name} | {T} | {T * k // E} | {cells} | {ref:.3f} | {ref / min(times.values()):.2f}x |",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
