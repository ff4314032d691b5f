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
from hf_columns import column_options, moe_backend, speed_rule_off  # noqa: E402,F401 (mem_peak.py etc. use them here)
from hf_families import (COLUMNS, DEFAULT_COLUMNS, EXPERTS_KEPT, FAMILIES, MODES, MOE_COLUMNS,  # noqa: E402,F401
                         RULE_OFF, TAIL_OFF, TMA_AUTO, TMA_OFF, FUSED, ENGINE, BW_FUSED)
from hf_processes import cpu_list, lanes_of, merge_repeats, process_groups  # noqa: E402
from hf_profile import GcClock, Profiler, sync  # noqa: E402
from hf_tables import markdown, rule_markdown, variants_markdown  # noqa: E402


def build(family: str, layers: int, tiny: bool, device: str, dtype: torch.dtype):
    """A randomly initialised model of ``family``, built on ``device`` (so that a 20 GB layer never passes through the
    host). Every matrix and bias is drawn afresh from N(0, 0.02): HF leaves some at zeros, and zeros time faster."""
    import transformers

    prefix, _, _, real, small = FAMILIES[family]
    widths = dict(small if tiny else real, vocab_size=128 if tiny else 32768, num_hidden_layers=layers,
                  max_position_embeddings=4096 if tiny else 32768, eos_token_id=None)  # decode runs its full length
    if family in ("gpt_oss", "gpt_oss_v4"):
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
    if family == "gpt_oss_v4":
        from hf_v4_code import use_v4_moe_code

        use_v4_moe_code(model)
    return model.to(dtype).eval(), cfg


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
    sync(device)
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
    first wait comes from: a compiled step should have none (the backend promises no host sync on its path). The
    count is the second of two calls': a process's first counted call waits once more, whichever column it is
    (RESULTS.md, twenty-first session); that first count is kept as ``host_syncs_first_call`` where it differs."""
    if device != "cuda":
        return {}
    import traceback
    import warnings

    counts = []
    for _ in range(2):
        sync(device)
        with warnings.catch_warnings(record=True) as caught, _sync_debug_mode("warn"):
            warnings.simplefilter("always")
            step()
        counts.append(sum("synchronizing" in str(w.message) for w in caught))
    count = counts[-1]
    out = {"host_syncs": count} | ({"host_syncs_first_call": counts[0]} if counts[0] != count else {})
    if count:
        sync(device)
        try:
            with _sync_debug_mode("error"):
                step()
        except RuntimeError:
            frames = traceback.extract_tb(sys.exc_info()[2])[-4:]
            out["first_sync"] = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
        sync(device)
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


def make_step(model, ids: torch.Tensor, mode: str, column: str, reset: bool = True):
    """One prefill (the last logits) or training step (zero_grad, forward with ``labels=``, backward; the loss) of
    ``column`` over the token ids ``ids``; the caller sets no_grad for prefill and ``model.train()`` for a training
    step."""
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
    step = make_step(model, ids, "prefill", column)

    with torch.no_grad():
        t0 = time.perf_counter()
        logits = step()
        sync(device)
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
    step = make_step(model, ids, "train", column)

    try:
        t0 = time.perf_counter()
        loss = step()
        sync(device)
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
        sync(device)
        first_s = time.perf_counter() - t0
        eager_gen = {k: v for k, v in gen.items() if k != "compile_config"} | {"disable_compile": True}
        ref = _against(reference, ("decode", B), column, out.cpu(), lambda: model.generate(prompt, **eager_gen).cpu(),
                       compare=None)
        same = float((out.cpu() == ref).float().mean()) if out.shape == ref.shape else float("nan")
        _reset_peak(device)
        times = []
        with GcClock() as gc_clock:
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                out = step()
                sync(device)
                times.append(time.perf_counter() - t0)
        peak = _peak_mib(device)
        made = out.shape[1] - prompt.shape[1]
        if profile:
            profile(f"decode B={B} {column} ({made} new tokens)", step, 1, device, per="generate")
    return dict(value=B * made / statistics.median(times), unit="new tok/s", first_call_s=first_s, err=1.0 - same,
                peak_mib=peak, gc_ms=gc_clock.ms / 3, gc_objects=len(gc.get_objects()))


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

    from moe_inductor import config
    from moe_inductor.speed_rule import visible_backward_on

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton_version, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            # which training values rule_file.py files from the rows
            "visible_backward": visible_backward_on(), "visible_engine_backward": config.visible_engine_backward}


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
                    counters["moe_inductor_visible"].clear()
                    extra = {"graph_time": True} if mode == "prefill" and args.graph_time else {}
                    with column_options(column):
                        row |= RUNNERS[mode](model, cfg, size, column, args.device, reference,
                                             profile if column != "eager" else None, **extra)
                    row["graphs"] = counters["stats"]["unique_graphs"]  # > 1 per compile: breaks or recompiles
                    if counters["moe_inductor_visible"]:  # which path ran: calls swapped in, backwards traced
                        row["visible"] = dict(counters["moe_inductor_visible"])
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
            steps, ids = {}, tokens(cfg, (1, size), args.device)
            for r in rows:
                with column_options(r["column"]):
                    steps[r["column"]] = make_step(model, ids, mode, r["column"], reset=False)
                    for _ in range(2):  # its compile, then one call: the first forwards after a compile run slower
                        steps[r["column"]]()
            graphs = counters["stats"]["unique_graphs"]
            got = hf_rounds.interleaved(steps, args.interleave, lambda step: timed_ms(step, args.device),
                                        column_options, args.device,
                                        clocks=args.clocks)
            recompiled = counters["stats"]["unique_graphs"] - graphs  # a guard that failed between columns: say so
    except Exception as e:  # the cell keeps its one-after-another values, and says why it has no rounds
        if args.strict:
            raise
        for r in rows:
            r["interleave_error"] = f"{type(e).__name__}: {str(e)[:200]}"
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


def write(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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
    rules, variants = rule_markdown(rows), variants_markdown(rows)
    if rules:
        table += "\n\nThe speed rule's values (kernels/tuned/whole_model/):\n\n" + rules
    if variants:
        table += "\n\nThe moe_inductor columns with a setting changed, against the default one:\n\n" + variants
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
