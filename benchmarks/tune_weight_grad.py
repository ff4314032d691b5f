"""Tune the weight-gradient kernel's launch configs on this GPU, and measure what they buy, in one process.

    python benchmarks/tune_weight_grad.py --shapes qwen3 gptoss deepseekv3 --tokens 4096 \\
        --json tuned_wgrad.json --merge
    python benchmarks/tune_weight_grad.py --shapes gptoss_layout --tokens 1024 2048 --merge   # GPT-OSS's own

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
from benchmarks.bench_experts import (SHAPES, bench, bench_backward, gptoss_weights, hf_expert_weights,  # noqa: E402
                                      make_routing)

#: GPT-OSS's experts as the model holds them (interleaved gate_up, biases, the clamped glu), with the weight passed
#: whole as a compiled training step passes it: the weight-gradient keys that step's backward meets
GPTOSS_LAYOUT = "gptoss_layout"

WGRAD = "wgrad|"


def tune_only_weight_grads() -> None:
    """Let the tuner run for weight-gradient keys only; every other kernel keeps its table entry or default."""
    pick = launch._pick

    def pick_weight_grads(key, default, candidates, run, autotune):
        if key.startswith(WGRAD):
            return pick(key, default, candidates, run, autotune=autotune)
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


def tune_gptoss_layout(T: int) -> tuple[float, float]:
    """Forward + backward of GPT-OSS's experts in the model's layout, the gate_up weight passed whole (as a compiled
    step's backward runs it), on the fused kernels; tune the weight-gradient keys it meets. (before, after) in ms."""
    H, _, E, k = SHAPES["gptoss"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = make_routing(T, E, k, False, gen, "cuda")
    leaves = [t.detach().clone().requires_grad_()
              for t in (x, weights.to(torch.bfloat16), *gptoss_weights(gen, "cuda", torch.bfloat16))]
    dy = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)

    def fwd_bwd():
        lx, lw, lgu, ld, lbgu, lbd = leaves
        y = moe_inductor.fused_experts(lx, ids, lw, lgu, ld, b1=lbgu, b2=lbd, gate_up="interleaved",
                                       activation="gptoss_glu", layout="kn")
        torch.autograd.grad(y, leaves, dy)

    moe_inductor.ops._whole_gate_up_eagerly = True
    try:
        moe_inductor.config.autotune = False
        before = bench(fwd_bwd)
        moe_inductor.config.autotune = True
        fwd_bwd()  # the first call tunes
        moe_inductor.config.autotune = False
        return before, bench(fwd_bwd)
    finally:
        moe_inductor.ops._whole_gate_up_eagerly = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qwen3", "gptoss", "deepseekv3"],
                    choices=[*SHAPES, GPTOSS_LAYOUT])
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
        if name == GPTOSS_LAYOUT:
            for T in args.tokens:
                before, after = tune_gptoss_layout(T)
                print(f"| {name} | {T} | {before:.3f} | {after:.3f} | - | {before / after:.2f}x | - |", flush=True)
                save(args.json, args.merge)  # after every size: a run cut short keeps what it tuned
            continue
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
