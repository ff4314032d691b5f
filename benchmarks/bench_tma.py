"""The experts forward with TMA loads against pointer loads (our fused kernels only, config.gemm_tma_weights "on"
against "off"), per family shape and token count, in interleaved rounds. Two TMA variants: descriptors made on the
host (the weights only) and made in the kernel (the weights, and the down projection's sorted token rows);
config.gemm_tma_descriptors.

    python benchmarks/bench_tma.py --shapes qwen2moe qwen3 olmoe deepseekv3 --tokens 512 4096 16384 --rounds 3

Each round times every variant (do_bench medians, the order reversed every other round); the table gives the
rounds' medians, each TMA variant's speed against pointers, and the largest difference between a variant's output
and the pointers' (the same products, so it should be 0). HF's weight layout ((E, 2I, H) and (E, H, I)), bf16,
random routing as bench_experts.py's.
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
from moe_inductor.kernels import launch

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
    saved = config.gemm_tma_weights, config.gemm_tma_descriptors, launch._PERSISTENT_PROGRAMS_PER_SM
    config.validate_routing = False
    config.gemm_engine = "triton"
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}", flush=True)
    # (TMA mode, descriptor kind, persistent programs per SM)
    variants = {"pointers": ("off", "device", 1), "host": ("on", "host", 1), "device": ("on", "device", 1),
                "device2": ("on", "device", 2)}
    print("| shape | T | pointers ms | host descriptors ms | in-kernel, 1 program/SM ms | 2 programs/SM ms | "
          "pointers / host | pointers / in-kernel (1; 2) | max diff (host, in-kernel) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.shapes:
        H, I, E, k = {**SHAPES, **EXTRA_SHAPES}[name]
        w1, w2 = _weights(name, dev, dt)
        gen = torch.Generator().manual_seed(0)
        for T in args.tokens:
            x = torch.randn(T, H, generator=gen).to(dev, dt)
            ids, weights = make_routing(T, E, k, False, gen, dev)
            weights = weights.to(dt)

            def run(variant: str):
                config.gemm_tma_weights, config.gemm_tma_descriptors, launch._PERSISTENT_PROGRAMS_PER_SM = \
                    variants[variant]
                with torch.no_grad():
                    return moe_inductor.fused_experts(x, ids, weights, w1, w2)

            outs = {v: run(v) for v in variants}
            diffs = {v: (outs["pointers"].float() - outs[v].float()).abs().max().item() for v in variants}
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                    times[v].append(bench(lambda: run(v), 10, 50))
            med = {v: statistics.median(t) for v, t in times.items()}
            rows.append(dict(shape=name, T=T, **{f"{v}_ms": med[v] for v in variants},
                             **{f"rounds_{v}": times[v] for v in variants},
                             max_diff_host=diffs["host"], max_diff_device=diffs["device"]))
            print(f"| {name} | {T} | {med['pointers']:.3f} | {med['host']:.3f} | {med['device']:.3f} | "
                  f"{med['device2']:.3f} | {med['pointers'] / med['host']:.2f}x | "
                  f"{med['pointers'] / med['device']:.2f}x; {med['pointers'] / med['device2']:.2f}x | "
                  f"{diffs['host']:.1e}, {diffs['device']:.1e} |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))
    config.gemm_tma_weights, config.gemm_tma_descriptors, launch._PERSISTENT_PROGRAMS_PER_SM = saved


if __name__ == "__main__":
    main()
