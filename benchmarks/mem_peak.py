"""What is alive at the peak of one compiled step on the GPU, by the line that allocated it: where one backend's step
needs more memory than another's, the difference shows as lines of one column that the other lacks.

    python benchmarks/mem_peak.py --family qwen3_moe --mode train --tokens 4096
    python benchmarks/mem_peak.py --family mixtral --layers 2 --columns inductor moe_inductor --top 25

Each column compiles the model as ``bench_hf.py`` does, runs two steps (compile and warm-up), then records the CUDA
caching allocator's history over a third (``torch.cuda.memory._record_memory_history``) and replays it: the peak of
the bytes allocated during the step (above what was allocated before it: weights, their gradients' storage where
kept), and, at that peak, the live allocations summed by the frame that made them. The frame is the innermost one in
Inductor's generated code (its line names the buffer), moe_inductor or transformers, else the innermost Python frame
outside torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_hf  # noqa: E402

#: the code an allocation is charged to (a substring of the frame's file name): its innermost frame in any of them
_OWNERS = ("torchinductor_", "/moe_inductor/", "/transformers/")


def site(frames: list[dict]) -> str:
    """The frame an allocation is charged to (see the module's docstring), as ``file:line function``."""
    def text(f):
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    python = [f for f in frames if f.get("filename", "").endswith(".py")]  # innermost first
    hit = next((f for f in python if any(o in f["filename"].replace("\\", "/") for o in _OWNERS)), None)
    if hit is not None:
        return text(hit)
    outside = next((f for f in python if "/torch/" not in f["filename"].replace("\\", "/")), None)
    return text(outside) if outside is not None else (text(python[0]) if python else "?")


def peak_live(events: Iterable[dict]) -> tuple[int, dict[str, int]]:
    """Replays an allocator trace (``device_traces[i]`` of a snapshot): the peak of the bytes live at once among
    the trace's own allocations, and those live at the first time it was reached, summed by ``site``. A block counts
    as freed at ``free_completed`` where the trace has those (the memory is reusable then), else at
    ``free_requested``."""
    events = list(events)
    freed_at = "free_completed" if any(e["action"] == "free_completed" for e in events) else "free_requested"
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])))
            now += e["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif e["action"] == freed_at and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    sites: dict[str, int] = {}
    for size, where in at_peak.values():
        sites[where] = sites.get(where, 0) + size
    return peak, sites


def measure(model, cfg, mode: str, tokens: int, column: str) -> tuple[int, int, dict[str, int]]:
    """(bytes allocated before the step, the step's own peak, its live bytes at the peak by site) for one column."""
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"), bench_hf.speed_rule_off(column == bench_hf.RULE_OFF):
        step = bench_hf.make_step(model, bench_hf.tokens(cfg, (1, tokens), "cuda"), mode, column)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=1_000_000)
        try:
            step()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    model.zero_grad(set_to_none=True)
    model.eval()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, sites = peak_live(trace)
    return before, peak, sites


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(bench_hf.FAMILIES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mode", default="train", choices=("train", "prefill"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--columns", nargs="+", default=["inductor", "moe_inductor"],
                    choices=[c for c in bench_hf.COLUMNS if c != "eager"] + ["eager"])
    ap.add_argument("--top", type=int, default=20, help="sites listed per column")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mem_peak.py reads the CUDA caching allocator's history: it needs a GPU")
    model, cfg = bench_hf.build(args.family, args.layers, False, "cuda", torch.bfloat16)
    mib = 2 ** 20
    for column in args.columns:
        before, peak, sites = measure(model, cfg, args.mode, args.tokens, column)
        print(f"== {args.family} ({args.layers}) {args.mode} T={args.tokens} {column}: {before / mib:.0f} MiB "
              f"before the step, its own peak {peak / mib:.0f} MiB ({(before + peak) / mib:.0f} MiB in all)",
              flush=True)
        for where, size in sorted(sites.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {size / mib:9.1f} MiB  {where[:150]}", flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
