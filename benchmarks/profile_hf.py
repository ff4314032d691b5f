"""Where the time goes in one compiled prefill of bench_hf's model: the top CUDA kernels under torch.profiler.

    python benchmarks/profile_hf.py --tokens 512 --backends inductor moe_inductor
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_hf import build  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backends", nargs="*", default=["inductor", "moe_inductor"])
    ap.add_argument("--rows", type=int, default=14)
    args = ap.parse_args(argv)
    model, cfg = build(False, args.layers, "cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")
    for backend in args.backends:
        torch._dynamo.reset()
        counters.clear()
        fwd = torch.compile(model.forward, backend=backend)
        with torch.no_grad():
            for _ in range(3):
                fwd(input_ids=ids)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fwd(input_ids=ids)
                torch.cuda.synchronize()
        print(f"== {backend}: rewrites {dict(counters['moe_inductor'])}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
