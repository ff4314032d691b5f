"""Does a shipped TMA entry that spills registers under the running Triton still pay? Times one shape's whole
experts forward with the table's TMA tiles as shipped against every TMA key of it set to POINTERS (the pointer
launches), in ABBA rounds (a steady drift of the card's clock cancels in the means). The spill itself is read on
the CPU by tests/test_sm90_compile.py. Changes nothing in the table or the user's cache.

    python benchmarks/spill_check.py --shape deepseekv3 --tokens 4096 --rounds 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from moe_inductor.kernels import configs, launch  # noqa: E402

from benchmarks.bench_experts import bench  # noqa: E402
from benchmarks.tune_gemm import forward, shape_cases  # noqa: E402


def _keys_of(case: tuple) -> list[str]:
    """The GEMM keys the case's forward looks up (recorded by running it once under a recording tuner)."""
    seen: list[str] = []
    real = configs.TABLE.lookup

    def lookup(key: str):
        if key.startswith("gemm|") and key not in seen:
            seen.append(key)
        return real(key)

    configs.TABLE.lookup = lookup
    launch._GEMM_DECISIONS.clear()
    try:
        forward(*case)
        torch.cuda.synchronize()
    finally:
        configs.TABLE.lookup = real
        launch._GEMM_DECISIONS.clear()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseekv3")
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096])
    ap.add_argument("--rounds", type=int, default=8, help="an even number: ABBA order")
    args = ap.parse_args()
    import triton

    moe_inductor.config.validate_routing = False
    moe_inductor.config.gemm_engine = "triton"
    moe_inductor.config.gemm_tma_weights = "tuned"
    print(f"torch {torch.__version__}, triton {triton.__version__}, GPU {torch.cuda.get_device_name()}", flush=True)
    for T, case in shape_cases(args.shape, args.tokens, "cuda", torch.bfloat16):
        keys = _keys_of(case)
        tiles = {k: configs.TABLE.lookup(k) for k in keys if k.endswith("|tma")}
        tiles = {k: c for k, c in tiles.items() if c is not None and c != configs.POINTERS}
        print(f"{args.shape} T={T}: keys {keys}", flush=True)
        if not tiles:
            print("  no TMA tile in the table for this case", flush=True)
            continue
        for key, cfg in tiles.items():
            print(f"  TMA entry {key}: {cfg}", flush=True)
        sides = {"pointers": dict.fromkeys(tiles, configs.POINTERS), "tiles": tiles}
        times = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else list(reversed(list(sides)))):
                for key, cfg in sides[side].items():
                    configs.TABLE.store(key, cfg)
                launch._GEMM_DECISIONS.clear()
                times[side].append(bench(lambda: forward(*case), 25, 100))
        mean = {side: sum(v) / len(v) for side, v in times.items()}
        print(f"  forward, mean of {args.rounds} ABBA rounds (do_bench medians): pointers {mean['pointers']:.4f} ms, "
              f"tiles {mean['tiles']:.4f} ms, tiles buy {mean['pointers'] / mean['tiles']:.3f}x", flush=True)
        print(f"  per round: pointers {[round(t, 4) for t in times['pointers']]}, "
              f"tiles {[round(t, 4) for t in times['tiles']]}", flush=True)
        for key, cfg in tiles.items():
            configs.TABLE.store(key, cfg)
        launch._GEMM_DECISIONS.clear()


if __name__ == "__main__":
    main()
