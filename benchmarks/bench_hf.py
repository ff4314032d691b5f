"""Whole-model HF benchmark: a Qwen3-MoE-shaped model (real widths, random bf16 weights, no download), prefill and
decode, eager vs torch.compile (Inductor, HF's default grouped_mm experts) vs backend="moe_inductor".

    python benchmarks/bench_hf.py --json hf.json                        # on the GPU
    python benchmarks/bench_hf.py --tiny --device cpu                   # a smoke run of the script itself
    python benchmarks/bench_hf.py --skip-decode --prefill-mode reduce-overhead   # prefill under CUDA graphs, both

Prefill: one forward over (1, T) tokens, two ways: the do_bench median on the GPU (the latency of one forward, L2
flushed before each), and back to back (the wall time of 30 forwards enqueued one after the other, divided by 30: a
prefill loop's throughput, where host time can overlap the previous forward's GPU work). Decode: greedy ``generate`` with a static cache,
new tokens per second, at batch 1 and 16 (compiled forward; "reduce-overhead" for both compiled columns).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from typing import Optional

import torch
from torch._dynamo.utils import counters


def build(tiny: bool, layers: int, device: str, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if tiny:
        cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    else:  # Qwen3-30B-A3B widths; a 32k vocabulary keeps the LM head from dominating
        cfg = Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             num_experts=128, num_experts_per_tok=8, max_position_embeddings=32768)
    return Qwen3MoeForCausalLM(cfg).to(device, dtype).eval(), cfg


def back_to_back_ms(fn, device: str, calls: int = 30) -> float:
    """Wall time per call of ``calls`` calls enqueued back to back (synced before and after)."""
    sync = _synchronizer(device)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e3


def _synchronizer(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def warm_up(fn, device: str, seconds: float = 1.0, min_calls: int = 3) -> None:
    """Call ``fn`` for about ``seconds`` (at least ``min_calls`` times). On the H200 the first ~30 forwards after a
    compile ran up to 1.7x slower than later ones (debug_gpu.py prefill_host, repeat 0 against 1 and 2), and a
    do_bench window of 30 ms holds only ~10 forwards at T = 512: without this the rows measured the transient."""
    sync = _synchronizer(device)
    t0 = time.perf_counter()
    calls = 0
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    sync()


def timed_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


VARIANTS = ("eager", "inductor", "moe_inductor")
# moe_inductor_opaque: moe_inductor with config.visible_kernels off (the op called through the dispatcher, as before
# it was on), measured in the same process as the others, since host-bound rows move between processes
ALL_VARIANTS = VARIANTS + ("moe_inductor_opaque",)


@contextlib.contextmanager
def variant_config(name: str):
    """The moe_inductor config a variant runs (and compiles) under."""
    import moe_inductor

    old = moe_inductor.config.visible_kernels
    moe_inductor.config.visible_kernels = old and name != "moe_inductor_opaque"
    try:
        yield
    finally:
        moe_inductor.config.visible_kernels = old


def variants(model, names=VARIANTS, mode=None):
    """(name, forward); Dynamo's caches are reset between variants so each gets its own recompile budget. ``mode``
    (e.g. "reduce-overhead") applies to every compiled variant alike."""
    plain = model.forward
    for name in names:
        torch._dynamo.reset()
        backend = "moe_inductor" if name.startswith("moe_inductor") else name
        kwargs = ({"backend": backend} if name != "inductor" else {}) | ({"mode": mode} if mode else {})
        yield name, (plain if name == "eager" else torch.compile(plain, **kwargs))


def prefill(model, cfg, tokens, device, names=VARIANTS, mode=None, back_to_back: Optional[dict] = None) -> dict:
    """{T: {variant: do_bench ms}}; ``back_to_back``, when given, is filled with the back-to-back ms alike."""
    rows = {}
    for name, fwd in variants(model, names, mode):
        for T in tokens:
            ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
            with torch.no_grad(), variant_config(name):
                fwd(input_ids=ids)  # compile
                warm_up(lambda: fwd(input_ids=ids), device, seconds=1.0 if device == "cuda" else 0.0)
                gc.collect()  # the compile's garbage: its collection pauses would land in the host-bound rows
                ms = timed_ms(lambda: fwd(input_ids=ids), device)
                steady = back_to_back_ms(lambda: fwd(input_ids=ids), device) if back_to_back is not None else None
            rows.setdefault(T, {})[name] = ms
            line = f"prefill T={T:<6} {name:<13} {ms:9.3f} ms  {T / ms * 1e3:10.0f} tokens/s"
            if steady is not None:
                back_to_back.setdefault(T, {})[name] = steady
                line += f"   back to back {steady:9.3f} ms  {T / steady * 1e3:10.0f} tokens/s"
            print(line, flush=True)
    return rows


def decode(model, cfg, batches, new_tokens, device, names=VARIANTS) -> dict:
    """Greedy decode with a static cache. The compiled columns use HF's own compiled decode step (generate compiles the
    forward itself when the cache is static), with the backend chosen through its CompileConfig."""
    from transformers.generation.configuration_utils import CompileConfig

    rows = {}
    for name in names:
        torch._dynamo.reset()
        counters["inductor"].clear()
        if name == "eager":
            extra = {"disable_compile": True}
        else:
            backend = "inductor" if name == "inductor" else "moe_inductor"
            mode = "reduce-overhead" if device == "cuda" else None
            extra = {"compile_config": CompileConfig(backend=backend, mode=mode, fullgraph=True)}
            if device != "cuda":
                extra["compile_config"]._compile_all_devices = True
        for B in batches:
            prompt = torch.randint(0, cfg.vocab_size, (B, 32), device=device)
            gen = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static", **extra)
            with torch.no_grad(), variant_config(name):
                model.generate(prompt, **gen)  # compile / warm up / capture
                gc.collect()
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(prompt, **gen)
                if device == "cuda":
                    torch.cuda.synchronize()
            tps = B * new_tokens / (time.perf_counter() - t0)
            rows.setdefault(B, {})[name] = tps
            skips = counters["inductor"]["cudagraph_skips"]
            rows[B][f"{name}_cudagraph_skips"] = skips
            print(f"decode  B={B:<6} {name:<13} {tps:10.1f} new tokens/s  cudagraph skips so far: {skips}", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the script, measures nothing useful")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", nargs="*", type=int, default=None)
    ap.add_argument("--batches", nargs="*", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=ALL_VARIANTS)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--prefill-mode", default=None, choices=[None, "reduce-overhead"],
                    help="torch.compile mode of both compiled prefill columns (default: the default mode)")
    args = ap.parse_args(argv)
    tokens = args.tokens or ([16, 64] if args.tiny else [512, 4096, 16384])
    batches = args.batches or ([1, 2] if args.tiny else [1, 16])
    new_tokens = args.new_tokens or (4 if args.tiny else 64)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, cfg = build(args.tiny, args.layers, args.device, dtype)
    import transformers

    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": __import__("triton").__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "command": " ".join(sys.argv)}
    print(meta, flush=True)
    steady: dict = {}
    result = {"meta": meta, "prefill_ms": prefill(model, cfg, tokens, args.device, args.variants,
                                                      args.prefill_mode, steady)}
    result["prefill_back_to_back_ms"] = steady
    if not args.skip_decode:
        result["decode_tokens_per_s"] = decode(model, cfg, batches, new_tokens, args.device,
                                               args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    for label, table in (("do_bench", result["prefill_ms"]), ("back to back", steady)):
        for T, r in table.items():
            if "moe_inductor" in r:
                print(f"prefill T={T} ({label}): moe_inductor " + ", ".join(
                    f"vs {n} {r[n] / r['moe_inductor']:.2f}x" for n in r if n != "moe_inductor"))


if __name__ == "__main__":
    main()
