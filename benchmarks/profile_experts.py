"""Where the time of one fused_experts call goes: GPU kernels (torch.profiler) and host overhead.

    python benchmarks/profile_experts.py --shape qwen3 --tokens 16 4096
    python benchmarks/profile_experts.py --shape qwen3 --tokens 4096 --backward --reference
    python benchmarks/profile_experts.py --shape gptoss_layout --tokens 1024 --backward --whole

--backward times forward + backward with gradients for x, the routing weights and both weights (what training
asks); --reference profiles sort + torch._grouped_mm (bench_experts.py's reference column) the same way.
``gptoss_layout`` is GPT-OSS's experts as the model holds them (interleaved (E, H, 2I) gate_up, biases, the clamped
glu); --whole passes that weight to the op whole, as a compiled training step does.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

import moe_inductor
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_experts import (SHAPES, gptoss_weights, hf_expert_weights, make_routing,  # noqa: E402
                                     sort_grouped_mm)


def host_profile(call, calls: int = 50, rows: int = 14) -> None:
    """cProfile over ``calls`` calls: the host functions by self time (microseconds per call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = sorted(((tt, ct, n, f"{Path(f).name}:{line}({name})")
                    for (f, line, name), (_, n, tt, ct, _) in pstats.Stats(prof).stats.items()), reverse=True)
    print(f"   host self time {sum(s[0] for s in stats) / calls * 1e6:.1f} us/call; top functions "
          "(self us/call, cumulative us/call, calls/call):")
    for tt, ct, n, name in stats[:rows]:
        print(f"   {tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f} x{n / calls:<5.1f} {name[:100]}")


HOST = False  # --host: also the cProfile breakdown of each call's host time


def profile(label: str, call) -> None:
    """Host launch time, wall time, do_bench median and the top GPU kernels of ``call``."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        call()
    host = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20
    median = do_bench(call, warmup=10, rep=100)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    print(f"== {label}: host launch {host * 1e3:.3f} ms/call, wall {wall * 1e3:.3f} ms/call, "
          f"do_bench median {median:.3f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))
    if HOST:
        host_profile(call)


def profile_gptoss_layout(tokens, backward: bool, whole: bool) -> None:
    """GPT-OSS's experts in the model's layout, profiled as ``profile`` does; ``whole``: the gate_up weight reaches
    the op whole (ops._whole_gate_up_eagerly), so the backward is the one a compiled training step runs."""
    H, _, E, k = SHAPES["gptoss"]
    gen = torch.Generator().manual_seed(0)
    gate_up, down, b_gate_up, b_down = gptoss_weights(gen, "cuda", torch.bfloat16)
    moe_inductor.ops._whole_gate_up_eagerly = whole
    for T in tokens:
        x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
        ids, weights = make_routing(T, E, k, False, gen, "cuda")
        leaves = [t.detach().clone().requires_grad_(backward)
                  for t in (x, weights.to(torch.bfloat16), gate_up, down, b_gate_up, b_down)]
        dy = torch.randn_like(x)

        def run():
            lx, lw, lgu, ld, lbgu, lbd = leaves
            y = moe_inductor.fused_experts(lx, ids, lw, lgu, ld, b1=lbgu, gate_up="interleaved",
                                           activation="gptoss_glu", layout="kn", b2=lbd)
            if backward:
                torch.autograd.grad(y, leaves, dy)
            return y

        what = ("fwd+bwd" if backward else "fwd") + (", gate_up whole" if whole else "")
        profile(f"gptoss_layout T={T} {what} moe_inductor", run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3", choices=[*SHAPES, "gptoss_layout"])
    ap.add_argument("--whole", action="store_true", help="gptoss_layout: the gate_up weight to the op whole")
    ap.add_argument("--tokens", nargs="*", type=int, default=[16, 4096])
    ap.add_argument("--backward", action="store_true", help="forward + backward, gradients for every input")
    ap.add_argument("--reference", action="store_true", help="also profile sort + torch._grouped_mm")
    ap.add_argument("--host", action="store_true", help="also the cProfile breakdown of each call's host time")
    args = ap.parse_args()
    global HOST
    HOST = args.host
    moe_inductor.config.validate_routing = False
    if args.shape == "gptoss_layout":
        profile_gptoss_layout(args.tokens, args.backward, args.whole)
        return
    H, I, E, k = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    w1, w2 = hf_expert_weights(args.shape, dev, dt)
    gen = torch.Generator().manual_seed(0)
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=dt)
        ids, weights = make_routing(T, E, k, False, gen, dev)
        weights = weights.to(dt)
        dy = torch.randn_like(x)
        leaves = [t.detach().requires_grad_(args.backward) for t in (x, weights, w1, w2)]

        def run(experts):
            y = experts(*leaves)
            if args.backward:
                torch.autograd.grad(y, leaves, dy)
            return y

        def ours(xg, wg, w1g, w2g):
            return moe_inductor.fused_experts(xg, ids, wg, w1g, w2g)

        def reference(xg, wg, w1g, w2g):
            return sort_grouped_mm(xg, ids, wg, w1g.transpose(1, 2), w2g.transpose(1, 2))

        what = "fwd+bwd" if args.backward else "fwd"
        profile(f"{args.shape} T={T} {what} moe_inductor", lambda: run(ours))
        if args.reference:
            profile(f"{args.shape} T={T} {what} sort+_grouped_mm", lambda: run(reference))


if __name__ == "__main__":
    main()
