"""DeepSeek-V2's remote-code MoE layer (``bench_moe_infer.py``'s) on the CPU: eager, ``torch.compile``'s default and
``backend="moe_inductor"``, fp32, the median of interleaved rounds of wall-clock time, ms per call.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_infer_cpu.py --tokens 1 16 128 --rounds 5

``--tiny`` builds the layer at small widths (a smoke run). The list op's CPU path computes with each expert's own
weights (ops/expert_lists.PerExpert); at DeepSeek-V2-Lite's widths a stack of them per call cost 1979 ms at T=1.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_cpu import interleaved_ms  # noqa: E402
from benchmarks.bench_moe_infer import E, H, I, K, SHARED, _example  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 16, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls per round")
    ap.add_argument("--tiny", action="store_true", help="small widths (a smoke run)")
    args = ap.parse_args(argv)
    assert moe_inductor.__name__  # the backend's name is registered on import
    hidden, inner, experts = (32, 16, 8) if args.tiny else (H, I, E)
    torch.manual_seed(0)
    layer = _example().RemoteCodeMoE(hidden=hidden, inner=inner, experts=experts, top_k=min(K, experts),
                                     shared=SHARED).eval()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, H={hidden} I={inner} E={experts}")
    print("| T | eager ms | inductor ms | moe_inductor ms | eager / moe_inductor | inductor / moe_inductor | "
          "max abs err vs eager (inductor, moe_inductor) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for T in args.tokens:
        torch._dynamo.reset()
        x = torch.randn(1, T, hidden)
        runs = {"eager": layer, "inductor": torch.compile(layer),
                "moe_inductor": torch.compile(layer, backend="moe_inductor")}
        with torch.no_grad():
            ref = layer(x)
            err = {n: (f(x) - ref).abs().max().item() for n, f in runs.items() if n != "eager"}
            times = interleaved_ms({n: (lambda f=f: f(x)) for n, f in runs.items()}, args.rounds, args.calls)
        med = {n: statistics.median(v) for n, v in times.items()}
        rows.append(dict(T=T, **med))
        print(f"| {T} | {med['eager']:.2f} | {med['inductor']:.2f} | {med['moe_inductor']:.2f} | "
              f"{med['eager'] / med['moe_inductor']:.2f}x | {med['inductor'] / med['moe_inductor']:.2f}x | "
              f"{err['inductor']:.1e}, {err['moe_inductor']:.1e} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
