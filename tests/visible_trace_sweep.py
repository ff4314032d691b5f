"""Every rewritten corpus case and tiny HF family traced as an H100 compile would trace it, on the CPU: does any
compile of the visible ops fail while AOT autograd traces it (a fallback the GPU would meet)?

    python -m tests.visible_trace_sweep [--tokens 13] [--only NAME ...] [--traced-engine]

Each case is compiled by moe_inductor with Inductor as the inner compiler (so its experts call takes the visible
ops), forward alone and a training step, and stopped at the partitioner once AOT autograd has traced it
(``tests/hf_trace.py``: an sm_90 target stands in for the GPU in torch's mutation analysis). A row says which
rewrite ran, what the visible ops took (``swapped``; ``backward``: the fused visible backward; ``engine_backward``:
the engine's traced one), and any fallback or error. Per-expert weights (the list op) have no visible op: their
rows show no ``swapped``, which is no failure. Exit status 1 where any compile fell back or raised.
"""
from __future__ import annotations

import argparse
import sys

import torch


def _trace(build, make_input, dtype, train: bool, stop) -> tuple[dict, str]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    error = ""
    try:
        model = build().to(dtype)
        x = make_input()
        with torch.set_grad_enabled(train):
            if x.is_floating_point():
                x = x.to(dtype).requires_grad_(train)
            out = torch.compile(model, backend="moe_inductor", dynamic=False)(x)
            out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if train:
                out.float().sum().backward()
    except stop:
        pass
    except Exception as e:  # the row reports it
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    seen = {k.replace("moe_inductor_", "").replace("moe_inductor", "rewrites"): dict(v)
            for k, v in counters.items() if k.startswith("moe_inductor") and v and k != "moe_inductor_left_alone"}
    return seen, error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=13)
    parser.add_argument("--only", nargs="*", help="case or family names")
    parser.add_argument("--traced-engine", action="store_true",
                        help="the engine forced for the backward alone, traced (config.visible_engine_backward)")
    args = parser.parse_args(argv)

    from tests.hf_trace import StopTrace, stand_in_sm90_driver, stopped_at_the_partitioner

    stand_in_sm90_driver()
    from moe_inductor import config
    from tests.corpus.test_corpus import CASES

    config.triton_on_cpu, config.speed_rule = True, False
    if args.traced_engine:
        config.gemm_engine, config.gemm_engine_backward, config.visible_engine_backward = "triton", "grouped_mm", True

    jobs = []
    for case in CASES:
        if case.expected() == ("rewritten",):
            jobs.append((case.name, case.build,
                         lambda c=case: c.make_input(args.tokens, torch.Generator().manual_seed(0)), case.dtype))
    try:
        from tests.hf_models import tiny
    except Exception:  # transformers missing: the corpus alone
        tiny = None
    if tiny is not None:
        for family in ("qwen3_moe", "mixtral", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3"):
            for dtype in (torch.float32, torch.bfloat16):
                jobs.append((f"hf {family} {str(dtype)[6:]}", lambda f=family: tiny(f),
                             lambda: torch.randint(0, 64, (2, args.tokens), generator=torch.Generator().manual_seed(1)),
                             dtype))
    failed = 0
    for name, build, make_input, dtype in jobs:
        if args.only and not any(o in name for o in args.only):
            continue
        for train in (False, True):
            with stopped_at_the_partitioner():
                seen, error = _trace(build, make_input, dtype, train, StopTrace)
            bad = bool(error) or "fallback" in seen
            failed += bad
            print(f"{'FAIL' if bad else 'ok  '} {name:40s} {'train' if train else 'infer':5s} {seen} {error}",
                  flush=True)
    print(f"{failed} failing compile(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
