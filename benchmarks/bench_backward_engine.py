"""Forward + backward of the experts op with each pairing of GEMM engines, against sort + torch._grouped_mm.

    python benchmarks/bench_backward_engine.py --shapes qwen3 olmoe gptoss deepseekv3 --tokens 4096 16384
    python benchmarks/bench_backward_engine.py --forward --shapes olmoe qwen2moe --tokens 4096   # inference only

With ``--forward`` it times the forward alone, without gradients (prefill), for "fused" (gemm_engine="triton"),
"gmm" (gemm_engine="grouped_mm") and "auto". Shape "qwen2moe" (Qwen1.5-MoE-A2.7B's routed experts) is known here
beside bench_experts.py's shapes.

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


FORWARD_ENGINES = {"fused": "triton", "gmm": "grouped_mm", "auto": "auto"}
#: shapes this script knows beyond bench_experts.py's: (H, I, E, k)
EXTRA_SHAPES = {"qwen2moe": (2048, 1408, 60, 4)}


def _weights(name: str, dev, dt) -> tuple[torch.Tensor, torch.Tensor]:
    if name not in EXTRA_SHAPES:
        return hf_expert_weights(name, dev, dt)
    H, I, E, _ = EXTRA_SHAPES[name]
    return (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5,
            torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5)


def forward_only(shapes: list[str], tokens: list[int]) -> None:
    """The forward under no_grad with each engine, and sort + torch._grouped_mm's."""
    print("| shape | T | rows/expert | " + " | ".join(FORWARD_ENGINES) + " | sort+_grouped_mm | gmm vs fused |")
    print("|---" * (len(FORWARD_ENGINES) + 5) + "|")
    dev, dt = "cuda", torch.bfloat16
    for name in shapes:
        H, I, E, k = {**SHAPES, **EXTRA_SHAPES}[name]
        gen = torch.Generator().manual_seed(0)
        w1, w2 = _weights(name, dev, dt)
        for T in tokens:
            x = torch.randn(T, H, device=dev, dtype=dt)
            ids, weights = make_routing(T, E, k, False, gen, dev)
            weights = weights.to(dt)
            times = {}
            with torch.no_grad():
                for column, engine in FORWARD_ENGINES.items():
                    moe_inductor.config.gemm_engine = engine
                    times[column] = bench(lambda: moe_inductor.fused_experts(x, ids, weights, w1, w2), 25, 200)
                moe_inductor.config.gemm_engine = "auto"
                ref = bench(lambda: sort_grouped_mm(x, ids, weights, w1.transpose(1, 2), w2.transpose(1, 2)), 25, 200)
            cells = " | ".join(f"{t:.3f}" for t in times.values())
            print(f"| {name} | {T} | {T * k // E} | {cells} | {ref:.3f} | {times['fused'] / times['gmm']:.2f}x |",
                  flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3", "olmoe", "gptoss", "deepseekv3"],
                    choices=[*SHAPES, *EXTRA_SHAPES])
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--forward", action="store_true", help="time the forward alone, without gradients")
    args = ap.parse_args()
    moe_inductor.config.validate_routing = False
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}")
    if args.forward:
        return forward_only(args.shapes, args.tokens)
    print("| shape | T | rows/expert | " + " | ".join(PAIRINGS) + " | sort+_grouped_mm | best ours vs sort+gmm |")
    print("|---" * (len(PAIRINGS) + 5) + "|")
    for name in args.shapes:
        H, I, E, k = {**SHAPES, **EXTRA_SHAPES}[name]
        dev, dt = "cuda", torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        w1, w2 = (w.requires_grad_() for w in _weights(name, dev, dt))
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
