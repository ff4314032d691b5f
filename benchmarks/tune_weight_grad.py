"""Tune the weight-gradient kernel's launch configs on this GPU, and measure what they buy, in one process.

    python benchmarks/tune_weight_grad.py --shapes qwen3 gptoss deepseekv3 --tokens 4096 \\
        --json tuned_wgrad.json --merge

For each shape and token count: forward + backward (gradients for x, the routing weights and both weights) with the
configs the table has now ("before"), then tune every weight-gradient key that backward meets (each candidate timed
by do_bench medians, one progress line per key), then forward + backward again ("after") and sort +
torch._grouped_mm, all in this process. --json writes the tuned entries; --merge adds them to the shipped table
(moe_inductor/kernels/tuned/<GPU>.json). The other kernels keep their current configs throughout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import moe_inductor
from moe_inductor.kernels import configs, launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_experts import SHAPES, bench_backward, hf_expert_weights, make_routing  # noqa: E402

WGRAD = "wgrad|"


def tune_only_weight_grads() -> None:
    """Let the tuner run for weight-gradient keys only; every other kernel keeps its table entry or default."""
    pick = launch._pick

    def pick_weight_grads(key, default, candidates, run):
        if key.startswith(WGRAD):
            return pick(key, default, candidates, run)
        return configs.TABLE.lookup(key) or default

    launch._pick = pick_weight_grads


def tuned_entries() -> dict[str, configs.LaunchConfig]:
    return {key: cfg for key, cfg in configs.TABLE._table.items() if key.startswith(WGRAD)}


def save(json_path: str | None, merge: bool) -> None:
    """Write the weight-gradient entries tuned so far to ``json_path`` and/or into the shipped table."""
    tuned = {key: vars(cfg) for key, cfg in sorted(tuned_entries().items())}
    if json_path:
        Path(json_path).write_text(json.dumps(tuned, indent=1) + "\n")
    if merge:
        configs.TABLE.merge_into_shipped(tuned_entries())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3", "gptoss", "deepseekv3"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[4096])
    ap.add_argument("--json", help="write the tuned weight-gradient entries here")
    ap.add_argument("--merge", action="store_true", help="add them to the shipped table for this GPU")
    args = ap.parse_args()
    moe_inductor.config.validate_routing = False
    moe_inductor.config.gemm_engine = "triton"  # the weight-gradient kernel is what is measured
    tune_only_weight_grads()
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}")
    print("| shape | T | fwd+bwd before (ms) | after (ms) | sort+_grouped_mm (ms) | after vs before | after vs sort+gmm |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        H, I, E, k = SHAPES[name]
        dev, dt = "cuda", torch.bfloat16
        gen = torch.Generator().manual_seed(0)
        w1, w2 = hf_expert_weights(name, dev, dt)
        for T in args.tokens:
            x = torch.randn(T, H, device=dev, dtype=dt)
            ids, weights = make_routing(T, E, k, False, gen, dev)
            weights = weights.to(dt)
            common = (x, ids, weights, w1, w2, w1.transpose(1, 2), w2.transpose(1, 2))
            moe_inductor.config.autotune = False
            before = bench_backward(*common, ours_only=True)["fwdbwd_ours"]
            moe_inductor.config.autotune = True
            bench_backward(*common, ours_only=True)  # the first call tunes
            moe_inductor.config.autotune = False
            after = bench_backward(*common)
            ours, ref = after["fwdbwd_ours"], after["fwdbwd_sort_gmm"]
            print(f"| {name} | {T} | {before:.3f} | {ours:.3f} | {ref:.3f} | {before / ours:.2f}x | {ref / ours:.2f}x |",
                  flush=True)
        del w1, w2
        torch.cuda.empty_cache()
        save(args.json, args.merge)  # after every shape: a run cut short keeps what it tuned
    for key, cfg in sorted(tuned_entries().items()):
        print(f"{key}: {cfg}")


if __name__ == "__main__":
    main()
