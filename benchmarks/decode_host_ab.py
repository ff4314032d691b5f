"""Whether a host-bound decode is slower under moe_inductor because of something of ours, or because of the process.

Each call times one variant of GPT-OSS's (or another bench_hf family's) greedy decode in this process: a static
cache under ``reduce-overhead``, 64 new tokens, the median of 7 generates after two warm-up ones. Run it in one
process per variant, in an order that alternates over rounds, so that a variant is not judged by its place in the
sequence. The variants take away the pieces of moe_inductor's path one at a time:

    ind         backend="inductor"
    ind_imp     backend="inductor" in a process that imported moe_inductor (its Dynamo hooks are installed)
    custom      a plain backend that hands the graph to compile_fx with CUDA graphs on (nothing of ours)
    moe         backend="moe_inductor"
    moe_nowrap  backend="moe_inductor" without the first-call fallback wrapper around the compiled graph

    python benchmarks/decode_host_ab.py moe --family gpt_oss --batch 1   # prints one JSON line
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_hf  # noqa: E402

VARIANTS = ("ind", "ind_imp", "custom", "moe", "moe_nowrap")


def plain_backend(gm: torch.fx.GraphModule, example_inputs: list, mode: Optional[str] = None,
                  options: Optional[dict] = None) -> Callable:
    """compile_fx with CUDA graphs on, as ``mode="reduce-overhead"`` patches it: a custom backend with none of ours."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True})


def backend_of(variant: str) -> Any:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    if variant in ("ind_imp", "moe", "moe_nowrap"):
        import moe_inductor  # noqa: F401
    if variant == "moe_nowrap":
        from moe_inductor import backend

        backend._first_call_guarded = lambda compiled, *args, **kwargs: compiled
    return {"ind": "inductor", "ind_imp": "inductor", "custom": plain_backend}.get(variant, "moe_inductor")


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--family", default="gpt_oss", choices=sorted(bench_hf.FAMILIES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_host_ab.py times CUDA graph replays: it needs a GPU")
    from transformers.generation.configuration_utils import CompileConfig

    model, cfg = bench_hf.build(args.family, args.layers, False, "cuda", torch.bfloat16)
    config = CompileConfig(backend=backend_of(args.variant), mode="reduce-overhead", fullgraph=True)
    prompt = bench_hf.tokens(cfg, (args.batch, 32), "cuda")
    gen = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, cache_implementation="static",
               compile_config=config)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(prompt, **gen)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        model.generate(prompt, **gen)
        times = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, **gen)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(times)
    print(json.dumps(dict(variant=args.variant, fam=args.family, B=args.batch, first_s=round(first_s, 1),
                          ms=[round(t, 1) for t in times], median_ms=round(median, 1),
                          tok_s=round(64 * args.batch / median * 1e3))))


if __name__ == "__main__":
    main()
