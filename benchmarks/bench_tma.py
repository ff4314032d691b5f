"""The experts forward with the weights read through TMA descriptors against pointer loads (our fused kernels only,
config.gemm_tma_weights), per family shape and token count, in interleaved rounds.

    python benchmarks/bench_tma.py --shapes qwen2moe qwen3 olmoe deepseekv3 --tokens 512 4096 16384 --rounds 3

Each round times both settings (do_bench medians, the order reversed every other round); the table gives the
rounds' medians, their ratio, and the largest difference between the two outputs (the same products, so it should
be 0). HF's weight layout ((E, 2I, H) and (E, H, I)), bf16, random routing as bench_experts.py's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import moe_inductor
from moe_inductor import config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_backward_engine import EXTRA_SHAPES, _weights  # noqa: E402
from benchmarks.bench_experts import SHAPES, bench, make_routing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen2moe", "qwen3", "olmoe", "deepseekv3"],
                    choices=[*SHAPES, *EXTRA_SHAPES])
    ap.add_argument("--tokens", nargs="*", type=int, default=[512, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config.validate_routing = False
    config.gemm_engine = "triton"
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}", flush=True)
    print("| shape | T | pointers ms | TMA ms | pointers / TMA | rounds (ptr; tma) | max diff |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in args.shapes:
        H, I, E, k = {**SHAPES, **EXTRA_SHAPES}[name]
        w1, w2 = _weights(name, dev, dt)
        gen = torch.Generator().manual_seed(0)
        for T in args.tokens:
            x = torch.randn(T, H, generator=gen).to(dev, dt)
            ids, weights = make_routing(T, E, k, False, gen, dev)
            weights = weights.to(dt)

            def run(tma: bool):
                config.gemm_tma_weights = "on" if tma else "off"
                with torch.no_grad():
                    return moe_inductor.fused_experts(x, ids, weights, w1, w2)

            outs = {tma: run(tma) for tma in (False, True)}
            diff = (outs[False].float() - outs[True].float()).abs().max().item()
            times = {False: [], True: []}
            for r in range(args.rounds):
                for tma in ((False, True) if r % 2 == 0 else (True, False)):
                    times[tma].append(bench(lambda: run(tma), 10, 50))
            ptr, tma = statistics.median(times[False]), statistics.median(times[True])
            rows.append(dict(shape=name, T=T, pointers_ms=ptr, tma_ms=tma, rounds_pointers=times[False],
                             rounds_tma=times[True], max_diff=diff))
            print(f"| {name} | {T} | {ptr:.3f} | {tma:.3f} | {ptr / tma:.2f}x | "
                  f"{', '.join(f'{t:.3f}' for t in times[False])}; {', '.join(f'{t:.3f}' for t in times[True])} | "
                  f"{diff:.1e} |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))
    config.gemm_tma_weights = "off"


if __name__ == "__main__":
    main()
