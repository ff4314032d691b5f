"""Whole-model benchmark: the HF MoE families users run, at their real widths (a few layers, random bf16 weights, a 32k
vocabulary, no downloads), in the modes users run them, against what they would otherwise use.

    python benchmarks/bench_hf.py --json hf.json                          # every family, mode and column (GPU)
    python benchmarks/bench_hf.py --cells qwen3_moe:prefill:4096 gpt_oss:train:4096 qwen3_moe:decode:1
    python benchmarks/bench_hf.py --cells qwen3_moe:prefill:4096:max-autotune-no-cudagraphs+moe_inductor
    python benchmarks/bench_hf.py --tiny --device cpu --families qwen3_moe --tokens 8   # a smoke run of the script

Modes (a cell is family:mode:size[:column+column...]):
- prefill T: one forward over (1, T) tokens with ``logits_to_keep=1`` under no_grad; milliseconds.
- decode B: greedy ``generate`` with a static cache at batch B, the compiled columns under "reduce-overhead" (HF compiles
  its decode step itself, through its CompileConfig); new tokens per second.
- train T: ``zero_grad(set_to_none=True)``, forward with ``labels=``, ``loss.backward()``; milliseconds.

Columns: eager, inductor (``torch.compile`` default), max-autotune-no-cudagraphs, moe_inductor (``backend="moe_inductor"``),
moe_inductor_rule_off (the same with its speed rule off) and moe_inductor_experts_kept (no MoE form rewritten). The
last two side by side give the speed rule's value for a cell (a second table), the measurement that
``kernels/tuned/whole_model/`` ships.
Each (cell, column) compiles afresh with static shapes, so that every size gets the code a user's first call would get.
Times are ``triton.testing.do_bench`` medians (prefill, train) or the median of three ``generate`` calls (decode), after
a warm-up: the first forwards after a compile run slower than later ones. Beside each time: the first call's wall time
(compile included), the error against eager (relative L2 of the last logits or the loss; for decode, the share of tokens
equal to eager's) and the peak memory of the timed calls.

Several families run one process each, in sequence, each under a time budget (``--budget-s``, ``--deadline-s``): a
compile's memory and caches stay out of the next family's numbers, and a family that overruns costs only its own cells.
Each column of a decode cell runs in a process of its own (``--decode-process``): decode is host-bound, and a process
that has compiled and run another column first runs the host's side of the next one slower.
``--profile`` adds a torch.profiler trace of the timed cells' compiled columns (top kernels by device time, and the step's
time outside kernels), written beside the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
import hf_rounds  # noqa: E402

MODES = ("prefill", "decode", "train")
#: backend="moe_inductor" with its speed rule off (every proven layer rewritten), and with no MoE form rewritten (the
#: experts left to Inductor; attention and masks still moe_inductor's). Their ratio is what rewriting the experts
#: buys with everything else in the model compiled alike: the speed rule's value (``rule_values``)
RULE_OFF, EXPERTS_KEPT = "moe_inductor_rule_off", "moe_inductor_experts_kept"
MOE_COLUMNS = ("moe_inductor", RULE_OFF, EXPERTS_KEPT)
COLUMNS = ("eager", "inductor", "max-autotune-no-cudagraphs", *MOE_COLUMNS)
DEFAULT_COLUMNS = ("eager", "inductor", "moe_inductor")

# (transformers class name, real widths, default layers, tiny widths). The real widths are the named checkpoints';
# the layer counts keep one family's compiles and timings inside a few minutes of the H200.
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", "Qwen3-30B-A3B", 4, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("Mixtral", "Mixtral-8x7B", 2, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128), dict(
        hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)),
    "gpt_oss": ("GptOss", "GPT-OSS-20B", 2, dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128), dict(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "olmoe": ("Olmoe", "OLMoE-1B-7B", 2, dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
        num_key_value_heads=16), dict(
        hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=4)),
    "qwen2_moe": ("Qwen2Moe", "Qwen1.5-MoE-A2.7B", 2, dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4)),
    "deepseek_v3": ("DeepseekV3", "DeepSeek-V3", 1, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=0,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=2.5)),
}


def build(family: str, layers: int, tiny: bool, device: str, dtype: torch.dtype):
    """A randomly initialised model of ``family``, built on ``device`` (so that a 20 GB layer never passes through the
    host). Every matrix and bias is drawn afresh from N(0, 0.02): HF leaves some at zeros, and zeros time faster."""
    import transformers

    prefix, _, _, real, small = FAMILIES[family]
    widths = dict(small if tiny else real, vocab_size=128 if tiny else 32768, num_hidden_layers=layers,
                  max_position_embeddings=4096 if tiny else 32768, eos_token_id=None)  # decode runs its full length
    if family == "gpt_oss":
        widths["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = getattr(transformers, f"{prefix}Config")(**widths)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.to(dtype).eval(), cfg


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device: str) -> float:
    """The do_bench median on the GPU, after a second of warm-up; the mean of 3 calls (after one) on the CPU."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3
    from triton.testing import do_bench

    t0, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - t0 < 1.0:
        fn()
        calls += 1
    _sync(device)
    each_ms = (time.perf_counter() - t0) * 1e3 / calls
    return do_bench(fn, warmup=25, rep=max(200, 15 * each_ms), return_mode="median")  # >= 15 timed calls


def compiled(model, column: str, mode_name: str, reset: bool = True):
    """The forward a column runs. Decode's compiled columns go through generate's CompileConfig instead. ``reset``:
    drop every earlier compile first (each column compiles afresh); without it, the columns' compiles live side by
    side (Dynamo keeps one cache entry per backend), as the interleaved rounds need."""
    if reset:
        torch._dynamo.reset()
    if column == "eager":
        return model.forward
    kwargs = {"dynamic": False}
    if column in MOE_COLUMNS:
        kwargs["backend"] = moe_backend(column)
    elif column == "max-autotune-no-cudagraphs":
        kwargs["mode"] = column
    return torch.compile(model.forward, **kwargs)


def host_syncs(step, device: str) -> dict:
    """How many times one call of ``step`` makes the host wait on the GPU (CUDA's sync debug mode), and where the
    first wait comes from: a compiled step should have none (the backend promises no host sync on its path)."""
    if device != "cuda":
        return {}
    import traceback
    import warnings

    _sync(device)
    with warnings.catch_warnings(record=True) as caught, _sync_debug_mode("warn"):
        warnings.simplefilter("always")
        step()
    count = sum("synchronizing" in str(w.message) for w in caught)
    out = {"host_syncs": count}
    if count:
        _sync(device)
        try:
            with _sync_debug_mode("error"):
                step()
        except RuntimeError:
            frames = traceback.extract_tb(sys.exc_info()[2])[-4:]
            out["first_sync"] = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
        _sync(device)
    return out


@contextlib.contextmanager
def _sync_debug_mode(mode: str):
    """CUDA's sync debug mode ``mode`` ("warn" or "error") for the block, back to "default" after it."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


class Profiler:
    """torch.profiler over a few steps of a compiled column: its top kernels by device time, and the step's wall time
    outside them (launch gaps, host work the GPU waits on)."""

    def __init__(self, path, rows: int = 12, host: bool = False):
        self.path, self.rows, self.host = path, rows, host

    def __call__(self, title: str, step, steps: int, device: str, per: str = "step") -> None:
        self._kernels(title, step, steps, device, per)
        if self.host:
            self._host(title, step, steps, device, per)

    def _emit(self, lines) -> None:
        text = "\n".join(lines)
        print(text, flush=True)
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(text + "\n")

    def _host(self, title: str, step, steps: int, device: str, per: str) -> None:
        """cProfile over the same steps: the host's own time by where it is spent (self time per package, then the
        top functions), which says whether a host-bound cell waits on the model's code, generate's loop, Dynamo's
        guards or the CUDA-graph replay."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        _sync(device)
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            step()
        _sync(device)
        prof.disable()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        stats = pstats.Stats(prof).stats
        buckets: dict = {}
        funcs = []
        for (filename, line, name), (_, calls, self_s, cum_s, _) in stats.items():
            where = host_bucket(filename, name)
            buckets[where] = buckets.get(where, 0.0) + self_s
            funcs.append((self_s, cum_s, calls, f"{where}: {Path(filename).name}:{line}({name})"))
        total = sum(buckets.values())
        lines = [f"== host {title}: per {per}: wall {wall_ms:.3f} ms under cProfile, self time {total * 1e3 / steps:.3f}"
                 f" ms"]
        lines += [f"  {s * 1e3 / steps:9.3f} ms  {where}"
                  for where, s in sorted(buckets.items(), key=lambda kv: -kv[1])[:self.rows]]
        lines.append("  top functions by self time (ms per step, cumulative ms, calls per step):")
        lines += [f"  {s * 1e3 / steps:9.3f} {c * 1e3 / steps:9.3f} x{n // steps:<6} {name[:110]}"
                  for s, c, n, name in sorted(funcs, reverse=True)[:self.rows]]
        self._emit(lines)

    def _kernels(self, title: str, step, steps: int, device: str, per: str) -> None:
        acts = [torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU]
        step()
        _sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(device)
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        events = []
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", None)
            if us is None or device != "cuda":
                us = getattr(evt, "self_cuda_time_total", 0) if device == "cuda" else evt.self_cpu_time_total
            if us > 0:  # kernels, copies and sets (the runtime calls that launch them take no device time)
                events.append((us / 1e3 / steps, evt.count // steps, evt.key))
        events.sort(reverse=True)
        busy = sum(ms for ms, _, _ in events) if device == "cuda" else float("nan")
        lines = [f"== {title}: per {per}: wall {wall_ms:.3f} ms, kernels {busy:.3f} ms, outside kernels "
                 f"{wall_ms - busy:.3f} ms, {sum(n for _, n, _ in events)} launches"]
        lines += [f"  {ms:9.3f} ms  x{n:<5} {name[:110]}" for ms, n, name in events[:self.rows]]
        self._emit(lines)


_HOST_BUCKETS = (("torchinductor_", "compiled graphs (Inductor's generated code)"),
                 ("/transformers/generation/", "transformers generate"), ("/transformers/", "transformers model code"),
                 ("/torch/_dynamo/", "torch._dynamo (frame entry, guards' Python)"),
                 ("/torch/_inductor/cudagraph", "cudagraph trees"), ("/torch/_inductor/", "torch._inductor (other)"),
                 ("/torch/_functorch/", "aot_autograd runtime"), ("/moe_inductor/", "moe_inductor"),
                 ("/torch/", "torch (other Python)"))


def host_bucket(filename: str, name: str) -> str:
    """The package a profiled function belongs to, for ``Profiler``'s host split: C functions by their name."""
    if filename == "~":
        return "C: " + re.sub(r"^<(built-in method|method) (\S+).*", r"\2", name).strip("'>")
    path = filename.replace("\\", "/")
    return next((label for part, label in _HOST_BUCKETS if part in path), "other Python")


def tokens(cfg, shape: tuple, device: str) -> torch.Tensor:
    """Random token ids, the same for every column of a cell (the error against eager compares like with like)."""
    g = torch.Generator(device="cpu").manual_seed(shape[0] * 100003 + shape[1])
    return torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)


def _against(reference: dict, key, column: str, got, eager, compare=rel_err):
    """The error of ``got`` against eager's output for ``key`` (computed once per cell: eager's own column, or an
    untimed eager call); with ``compare=None``, eager's output itself."""
    if key not in reference:
        reference[key] = got if column == "eager" else eager()
    return reference[key] if compare is None else compare(got, reference[key])


def make_step(model, cfg, mode: str, size: int, column: str, device: str, reset: bool = True):
    """One prefill (the last logits) or training step (zero_grad, forward with ``labels=``, backward; the loss) of
    ``column``; the caller sets no_grad for prefill and ``model.train()`` for a training step."""
    ids = tokens(cfg, (1, size), device)
    fwd = compiled(model, column, mode, reset)
    if mode == "prefill":
        return lambda: fwd(input_ids=ids, logits_to_keep=1).logits

    def train_step():
        model.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return train_step


def run_prefill(model, cfg, T, column, device, reference, profile, graph_time: bool = False):
    ids = tokens(cfg, (1, T), device)
    step = make_step(model, cfg, "prefill", T, column, device)

    with torch.no_grad():
        t0 = time.perf_counter()
        logits = step()
        _sync(device)
        first_s = time.perf_counter() - t0
        err = _against(reference, ("prefill", T), column, logits.float().cpu(),
                       lambda: model(input_ids=ids, logits_to_keep=1).logits.float().cpu())
        _reset_peak(device)
        ms = timed_ms(step, device)
        peak = _peak_mib(device)
        if profile:
            profile(f"prefill T={T} {column}", step, 3, device)
        syncs = host_syncs(step, device) if column != "eager" else {}
        replay = graph_replay_ms(step, device) if column != "eager" and graph_time else {}
    return dict(value=ms, unit="ms", first_call_s=first_s, err=err, peak_mib=peak, **syncs, **replay)


def graph_replay_ms(step, device: str) -> dict:
    """The step's time replayed from one CUDA graph (``do_bench_cudagraph``): its GPU work without the host's
    launches, so that ``value - graph_ms`` is what the host costs the step (idle gaps, waits)."""
    if device != "cuda":
        return {}
    from triton.testing import do_bench_cudagraph

    try:
        return {"graph_ms": do_bench_cudagraph(step, rep=200, return_mode="median")}
    except Exception as e:  # a step that cannot be captured says why instead of failing the cell
        torch.cuda.synchronize()
        return {"graph_error": f"{type(e).__name__}: {str(e)[:200]}"}


def run_train(model, cfg, T, column, device, reference, profile):
    ids = tokens(cfg, (1, T), device)
    model.train()
    step = make_step(model, cfg, "train", T, column, device)

    try:
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        first_s = time.perf_counter() - t0

        def eager_loss():
            with torch.no_grad():
                return model(input_ids=ids, labels=ids).loss.float().cpu()

        err = _against(reference, ("train", T), column, loss.detach().float().cpu(), eager_loss)
        _reset_peak(device)
        ms = timed_ms(step, device)
        peak = _peak_mib(device)
        if profile:
            profile(f"train T={T} {column}", step, 3, device)
        syncs = host_syncs(step, device) if column != "eager" else {}
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return dict(value=ms, unit="ms", first_call_s=first_s, err=err, peak_mib=peak, **syncs)


def run_decode(model, cfg, B, column, device, reference, profile, new_tokens: int = 64):
    from transformers.generation.configuration_utils import CompileConfig

    torch._dynamo.reset()
    if column == "eager":
        extra = {"disable_compile": True}
    else:
        backend = moe_backend(column) if column in MOE_COLUMNS else "inductor"
        if column == "max-autotune-no-cudagraphs":
            raise ValueError("decode runs its compiled columns under reduce-overhead; max-autotune is a prefill column")
        extra = {"compile_config": CompileConfig(backend=backend, mode="reduce-overhead" if device == "cuda" else None,
                                                 fullgraph=True)}
        if device != "cuda":
            extra["compile_config"]._compile_all_devices = True
    prompt = tokens(cfg, (B, 32), device)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
               **extra)

    def step():
        return model.generate(prompt, **gen)

    with torch.no_grad():
        t0 = time.perf_counter()
        out = step()  # compile, warm up, capture
        _sync(device)
        first_s = time.perf_counter() - t0
        eager_gen = {k: v for k, v in gen.items() if k != "compile_config"} | {"disable_compile": True}
        ref = _against(reference, ("decode", B), column, out.cpu(), lambda: model.generate(prompt, **eager_gen).cpu(),
                       compare=None)
        same = float((out.cpu() == ref).float().mean()) if out.shape == ref.shape else float("nan")
        _reset_peak(device)
        times = []
        with GcClock() as gc_clock:
            for _ in range(3):
                _sync(device)
                t0 = time.perf_counter()
                out = step()
                _sync(device)
                times.append(time.perf_counter() - t0)
        peak = _peak_mib(device)
        made = out.shape[1] - prompt.shape[1]
        if profile:
            profile(f"decode B={B} {column} ({made} new tokens)", step, 1, device, per="generate")
    return dict(value=B * made / statistics.median(times), unit="new tok/s", first_call_s=first_s, err=1.0 - same,
                peak_mib=peak, gc_ms=gc_clock.ms / 3, gc_objects=len(gc.get_objects()))


class GcClock:
    """The time Python's cyclic garbage collector runs inside the block (``ms``): a host-bound decode pays it per
    step, and a process that compiled an earlier column has more objects for it to walk."""

    def __enter__(self):
        self.ms, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._tick)
        return self

    def _tick(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._tick)


RUNNERS = {"prefill": run_prefill, "train": run_train, "decode": run_decode}


def _reset_peak(device: str) -> None:
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: str):
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def parse_cell(text: str, columns) -> tuple:
    """'family:mode:size[:col+col]' -> (family, mode, size, columns)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in FAMILIES or parts[1] not in MODES:
        raise argparse.ArgumentTypeError(f"bad cell {text!r}: family:mode:size[:column+column]")
    cols = tuple(parts[3].split("+")) if len(parts) == 4 else tuple(columns)
    if not set(cols) <= set(COLUMNS):
        raise argparse.ArgumentTypeError(f"bad columns in {text!r}: choose from {COLUMNS}")
    return parts[0], parts[1], int(parts[2]), cols


def cell_text(cell) -> str:
    return ":".join([cell[0], cell[1], str(cell[2]), "+".join(cell[3])])


def versions(device: str) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton_version, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def run_family(cells, args) -> list:
    """Every cell (all of one family) in this process, results written to ``args.json`` after each one."""
    family = cells[0][0]
    layers = args.layers.get(family, FAMILIES[family][2])
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    start = time.perf_counter()
    model, cfg = build(family, layers, args.tiny, args.device, dtype)
    profile = Profiler(args.profile_path, rows=args.profile_rows, host=args.host_profile) if args.profile else None
    reference, rows = {}, []
    for _, mode, size, cols in cells:
        for column in cols:
            row = dict(family=family, checkpoint=FAMILIES[family][1], layers=layers, mode=mode, size=size,
                       column=column)
            if time.perf_counter() - start > args.budget_s:
                row["skipped"] = "time budget"
            else:
                try:
                    counters["stats"].clear()
                    extra = {"graph_time": True} if mode == "prefill" and args.graph_time else {}
                    with speed_rule_off(column == RULE_OFF):
                        row |= RUNNERS[mode](model, cfg, size, column, args.device, reference,
                                             profile if column != "eager" else None, **extra)
                    row["graphs"] = counters["stats"]["unique_graphs"]  # > 1 per compile: breaks or recompiles
                except Exception as e:  # one broken column must not cost the family's other cells
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    if args.strict:
                        raise
            rows.append(row)
            _show(row)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            if args.json:
                write(args.json, dict(meta=versions(args.device), rows=rows))
        if args.interleave > 1 and mode != "decode" and time.perf_counter() - start <= args.budget_s:
            interleave_cell(model, cfg, rows[-len(cols):], args)
            if args.json:
                write(args.json, dict(meta=versions(args.device), rows=rows))
    return rows


def _show(row: dict, label: str = "") -> None:
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
             if k not in ("family", "checkpoint", "layers", "mode", "size", "column")}
    print(f"{row['family']} {row['mode']} {row['size']} {row['column']}{label}: {shown}", flush=True)


def interleave_cell(model, cfg, cell_rows: list, args) -> None:
    """The cell's measured columns timed again in ``args.interleave`` rounds, their order reversed every other round
    (``hf_rounds``); each row's ``value`` becomes the median of its rounds, the one-after-another time kept as
    ``value_alone``. The columns compile again side by side first (from the caches their first compiles filled)."""
    rows = [r for r in cell_rows if "value" in r]
    if len(rows) < 2:
        return
    mode, size = rows[0]["mode"], rows[0]["size"]
    torch._dynamo.reset()
    model.train(mode == "train")
    try:
        with torch.set_grad_enabled(mode == "train"):
            steps = {}
            for r in rows:
                with speed_rule_off(r["column"] == RULE_OFF):
                    steps[r["column"]] = make_step(model, cfg, mode, size, r["column"], args.device, reset=False)
                    for _ in range(2):  # its compile, then one call: the first forwards after a compile run slower
                        steps[r["column"]]()
            graphs = counters["stats"]["unique_graphs"]
            got = hf_rounds.interleaved(steps, args.interleave, lambda step: timed_ms(step, args.device),
                                        lambda column: speed_rule_off(column == RULE_OFF), args.device,
                                        clocks=args.clocks)
            recompiled = counters["stats"]["unique_graphs"] - graphs  # a guard that failed between columns: say so
    except Exception as e:  # the cell keeps its one-after-another values, and says why it has no rounds
        for r in rows:
            r["interleave_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if args.strict:
                raise
        return
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        torch._dynamo.reset()
    for r in rows:
        r["value_alone"] = r["value"]
        r.update(got[r["column"]])
        if recompiled:
            r["interleave_recompiled"] = recompiled
        _show(r, f" ({args.interleave} interleaved rounds)")


def moe_backend(column: str):
    """The backend a moe_inductor column compiles with: by name, or with no MoE form rewritten (``EXPERTS_KEPT``)."""
    if column != EXPERTS_KEPT:
        return "moe_inductor"
    import moe_inductor

    return moe_inductor.with_options(forms=())


@contextlib.contextmanager
def speed_rule_off(off: bool):
    """``moe_inductor.config.speed_rule = False`` inside the block where ``off`` (the rule is read while tracing, so
    the whole column runs inside it: a recompile reads it again)."""
    if not off:
        yield
        return
    from moe_inductor import config

    before, config.speed_rule = config.speed_rule, False
    try:
        yield
    finally:
        config.speed_rule = before


def rule_values(rows) -> list[dict]:
    """Per (family, mode, size) with both ``EXPERTS_KEPT`` and ``RULE_OFF``: the speed rule's value, the model's time
    with the experts left to Inductor over its time with every proven layer rewritten (> 1: rewriting is faster),
    everything else compiled alike."""
    cells: dict = {}
    for r in rows:
        if "value" in r:
            cells.setdefault((r["family"], r["layers"], r["mode"], r["size"]), {})[r["column"]] = r
    out = []
    for (family, layers, mode, size), c in cells.items():
        kept, rewritten = c.get(EXPERTS_KEPT), c.get(RULE_OFF)
        if kept is None or rewritten is None:
            continue
        ratio = kept["value"] / rewritten["value"]
        value = ratio if kept["unit"] == "ms" else 1.0 / ratio
        out.append(dict(family=family, layers=layers, mode=mode, size=size, unit=kept["unit"], kept=kept["value"],
                        rewritten=rewritten["value"], value=value))
    return out


def rule_markdown(rows) -> str:
    """The speed rule's values (``rule_values``) as a table; empty where no cell ran both moe_inductor columns."""
    values = rule_values(rows)
    if not values:
        return ""
    lines = ["| family (layers) | mode | unit | experts kept | every proven layer rewritten | rewriting buys |",
             "|---|---|---|---|---|---|"]
    for v in values:
        fmt = "{:.0f}" if v["unit"] != "ms" else "{:.2f}"
        lines.append(f"| {FAMILIES[v['family']][1]} ({v['layers']}) | {v['mode']} {v['size']} | {v['unit']} | "
                     f"{fmt.format(v['kept'])} | {fmt.format(v['rewritten'])} | {v['value']:.2f} |")
    return "\n".join(lines)


def write(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def markdown(rows) -> str:
    """One line per (family, mode, size): each column's value, then moe_inductor against inductor and against eager
    (> 1 is faster), the first call's seconds, the error against eager and the peak memory."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["family"], r["layers"], r["mode"], r["size"]), {})[r["column"]] = r
    head = ("| family (layers) | mode | unit | eager | inductor | max-autotune-no-cg | moe_inductor | vs inductor | "
            "vs eager | first call s (ind / moe) | err vs eager (ind / moe) | peak MiB (ind / moe) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def val(r):
        if r is None:
            return "–"
        if "value" not in r:
            return "skipped" if "skipped" in r else "error"
        fmt = "{:.0f}" if r["unit"] != "ms" else "{:.2f}"
        several = r.get("values") or r.get("rounds")
        spread = f" ({fmt.format(min(several))}-{fmt.format(max(several))})" if several else ""
        return fmt.format(r["value"]) + spread  # a median over processes or rounds shows their range

    def pair(c, key, fmt):
        out = []
        for name in ("inductor", "moe_inductor"):
            v = c.get(name, {}).get(key)
            out.append(fmt.format(v) if v is not None else "–")
        return " / ".join(out)

    for (family, layers, mode, size), c in cells.items():
        unit = next((r["unit"] for r in c.values() if "unit" in r), "")
        moe = c.get("moe_inductor", {}).get("value")

        def ratio(name):
            other = c.get(name, {}).get("value")
            if moe is None or other is None:
                return "–"
            return f"{(moe / other if unit != 'ms' else other / moe):.2f}"

        label = {"prefill": f"prefill T={size}", "train": f"train T={size}", "decode": f"decode B={size}"}[mode]
        lines.append(f"| {FAMILIES[family][1]} ({layers}) | {label} | {unit} | {val(c.get('eager'))} | "
                     f"{val(c.get('inductor'))} | {val(c.get('max-autotune-no-cudagraphs'))} | "
                     f"{val(c.get('moe_inductor'))} | {ratio('inductor')} | {ratio('eager')} | "
                     f"{pair(c, 'first_call_s', '{:.0f}')} | {pair(c, 'err', '{:.1e}')} | "
                     f"{pair(c, 'peak_mib', '{:.0f}')} |")
    rounds = {len(r["rounds"]) for r in rows if r.get("rounds")}
    if rounds:
        lines.append(f"\nTimes with a range are the median of {'/'.join(map(str, sorted(rounds)))} interleaved rounds "
                     "(the columns' order reversed every other round) and their range.")
    return "\n".join(lines)


def lanes_of(groups, gpus: int) -> list:
    """The groups' indices per GPU: each family keeps to one GPU (all its cells' columns are compared on the same
    device), families go round-robin over ``gpus``, and a GPU runs its groups one after another."""
    lane_of: dict = {}
    lanes: list = [[] for _ in range(max(1, gpus))]
    for i, cells in enumerate(groups):
        lane = lane_of.setdefault(cells[0][0], len(lane_of) % len(lanes))
        lanes[lane].append(i)
    return [lane for lane in lanes if lane]


def drive(groups, args, argv) -> list:
    """One child process per group of cells (a family, or one decode column), each under its time budget; with
    ``--gpus N`` the families run side by side, one GPU each (``lanes_of``), so that one run of every cell fits a
    machine's call limit. Rows come back in the groups' order."""
    import concurrent.futures

    deadline = time.perf_counter() + args.deadline_s
    out_dir = Path(args.json).resolve().parent if args.json else Path(".")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(max(1, args.gpus))]
    results: dict = {}

    def run_group(i: int, device: Optional[str]) -> None:
        cells = groups[i]
        family = cells[0][0]
        left = deadline - time.perf_counter()
        part = out_dir / f".bench_hf_part{i}_{family}.json"
        if left < 30:
            results[i] = [dict(family=family, checkpoint=FAMILIES[family][1],
                               layers=args.layers.get(family, FAMILIES[family][2]), mode=m, size=s, column=c,
                               skipped="deadline") for _, m, s, cols in cells for c in cols]
            return
        budget = min(args.budget.get(family, args.budget_s), left - 20)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--json", str(part), "--budget-s",
               str(budget), "--cells", *map(cell_text, cells)] + argv
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device) if device is not None else None
        where = f" on GPU {device}" if device is not None else ""
        print(f"### {family}: {len(cells)} cells, budget {budget:.0f} s{where}", flush=True)
        try:
            subprocess.run(cmd, timeout=budget + 60, check=False, env=env)
        except subprocess.TimeoutExpired:
            print(f"### {family}: killed at its time limit", flush=True)
        results[i] = json.loads(part.read_text())["rows"] if part.exists() else []
        part.unlink(missing_ok=True)

    lanes = lanes_of(groups, args.gpus)
    if len(lanes) == 1:
        for i in lanes[0]:
            run_group(i, None)
    else:
        def run_lane(lane_index: int) -> None:
            for i in lanes[lane_index]:
                run_group(i, devices[lane_index % len(devices)])

        with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
            list(pool.map(run_lane, range(len(lanes))))
    return [row for i in range(len(groups)) for row in results.get(i, [])]


def passthrough(args) -> list:
    """The options a child process inherits from the driver."""
    out = ["--device", args.device]
    out += ["--tiny"] if args.tiny else []
    out += ["--strict"] if args.strict else []
    out += ["--profile"] if args.profile else []
    out += ["--host-profile"] if args.host_profile else []
    out += ["--profile-rows", str(args.profile_rows)]
    out += ["--graph-time"] if args.graph_time else []
    out += ["--interleave", str(args.interleave)] + (["--clocks"] if args.clocks else [])
    out += ["--profile-path", args.profile_path] if args.profile_path else []
    out += ["--layers", *(f"{k}={v}" for k, v in args.layers.items())] if args.layers else []
    return out


def process_groups(cells, alone: bool, repeats: int = 1) -> list:
    """The cells each child process runs: consecutive cells of one family share a process, except that with ``alone``
    every column of a decode cell gets a process of its own. Decode is host-bound, and a process that compiled and
    ran another column first slows the host for the next one: with the columns of one cell in a shared process,
    whichever ran second lost (Qwen3 B=1 on the H200: 0.86x second, 1.06x first; not the garbage collector, which
    took 0.03 ms a generate; RESULTS.md). With ``repeats`` R > 1 each decode column runs in R processes, the
    columns' order reversed every other round (A B, B A, ...): one process's host speed varies from the next's by
    more than the columns differ (GPT-OSS, same kernels in both columns: 0.97x at B=1, 1.11x at B=16)."""
    groups: list = []
    for cell in cells:
        family, mode, size, cols = cell
        if alone and mode == "decode":
            for r in range(max(1, repeats)):
                groups += [[(family, mode, size, (c,))] for c in (cols if r % 2 == 0 else cols[::-1])]
            groups.append([])  # the family's next cells start a process of their own
        elif groups and groups[-1] and groups[-1][0][0] == family:
            groups[-1].append(cell)
        else:
            groups.append([cell])
    return [g for g in groups if g]


def merge_repeats(rows) -> list:
    """One row per (family, mode, size, column): where a column ran in several processes (``--decode-repeats``), its
    value is the median of theirs, which are kept in ``values``; the other fields are the first process's."""
    merged: dict = {}
    for row in rows:
        key = (row["family"], row["mode"], row["size"], row["column"])
        if key not in merged:
            merged[key] = dict(row)
            continue
        first = merged[key]
        if "value" in row:
            first.setdefault("values", [first["value"]] if "value" in first else []).append(row["value"])
    for row in merged.values():
        if "values" in row:
            row["value"] = statistics.median(row["values"])
    return list(merged.values())


def cpu_list(text: str) -> set:
    """The cores of a list like ``0-3,8,10-11``."""
    out: set = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def _pairs(items, kind):
    out = {}
    for item in items or ():
        key, _, value = item.partition("=")
        if key not in FAMILIES or not value:
            raise SystemExit(f"expected FAMILY=NUMBER, got {item!r}")
        out[key] = kind(value)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: checks the script, measures nothing useful")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--tokens", nargs="*", type=int, default=[512, 4096, 16384], help="prefill T")
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 16], help="decode B")
    ap.add_argument("--train-tokens", nargs="*", type=int, default=[4096], help="train step T")
    ap.add_argument("--columns", nargs="*", default=list(DEFAULT_COLUMNS), choices=COLUMNS)
    ap.add_argument("--cells", nargs="*", default=None,
                    help="family:mode:size[:column+column] cells, instead of families x modes x sizes")
    ap.add_argument("--layers", nargs="*", default=None, help="FAMILY=N, overriding a family's default layer count")
    ap.add_argument("--budget-s", type=float, default=150, help="seconds one family's process may start cells in")
    ap.add_argument("--budget", nargs="*", default=None, help="FAMILY=SECONDS, overriding --budget-s")
    ap.add_argument("--deadline-s", type=float, default=570, help="seconds the whole driver run may take")
    ap.add_argument("--gpus", type=int, default=1,
                    help="run the families side by side, one GPU each (one family's cells all on one GPU)")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler trace of every timed compiled cell")
    ap.add_argument("--profile-rows", type=int, default=12, help="kernels (and host rows) listed per profiled cell")
    ap.add_argument("--host-profile", action="store_true",
                    help="with --profile: also a cProfile of the same steps, the host's time by package")
    ap.add_argument("--graph-time", action="store_true",
                    help="prefill: also the step's time replayed from a CUDA graph (its GPU work alone)")
    ap.add_argument("--decode-process", choices=("column", "family"), default="column",
                    help="decode cells: each column in a process of its own (default), or in its family's process")
    ap.add_argument("--decode-repeats", type=int, default=1,
                    help="with column processes: each decode column in this many processes, alternating the columns' "
                         "order; the median is reported")
    ap.add_argument("--cpus", default=None,
                    help="CPU cores every process runs on, e.g. 0-7 or 0,2,4: a host-bound decode column's speed "
                         "then does not depend on where the scheduler put its process")
    ap.add_argument("--interleave", type=int, default=1, metavar="R",
                    help="prefill and train cells: after each column ran, time the cell's columns again in R rounds, "
                         "the order reversed every other round, and report each column's median (hf_rounds.py)")
    ap.add_argument("--clocks", action="store_true",
                    help="with --interleave: the GPU's SM clock, temperature and power while each column is timed")
    ap.add_argument("--profile-path", default=None, help="where the traces go (default: beside --json)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--strict", action="store_true", help="raise on a failing cell instead of recording it")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.layers, args.budget = _pairs(args.layers, int), _pairs(args.budget, float)
    if args.cpus:
        os.sched_setaffinity(0, cpu_list(args.cpus))  # children inherit it
    if args.profile and not args.profile_path and args.json:
        args.profile_path = str(Path(args.json).with_suffix(".profile.txt"))
    if args.cells:
        cells = [parse_cell(c, args.columns) for c in args.cells]
    else:
        sizes = {"prefill": args.tokens, "decode": args.batches, "train": args.train_tokens}
        cells = [(f, m, s, tuple(args.columns)) for f in args.families for m in args.modes for s in sizes[m]]
    groups = process_groups(cells, alone=args.decode_process == "column" and not args.child,
                            repeats=args.decode_repeats)
    meta = versions(args.device)
    if args.child or len(groups) == 1:
        if not args.child:
            print(meta, flush=True)
            meta["command"] = " ".join(["python benchmarks/bench_hf.py", *(argv if argv is not None else sys.argv[1:])])
        rows = run_family(groups[0], args)
        if args.child:
            return
    else:
        print(meta, flush=True)
        meta["command"] = " ".join(["python benchmarks/bench_hf.py", *(argv if argv is not None else sys.argv[1:])])
        rows = merge_repeats(drive(groups, args, passthrough(args)))
    if args.json:
        write(args.json, dict(meta=meta, rows=rows))
    table = markdown(rows)
    if rule_markdown(rows):
        table += "\n\nThe speed rule's values (kernels/tuned/whole_model/):\n\n" + rule_markdown(rows)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
