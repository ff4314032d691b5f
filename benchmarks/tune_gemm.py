"""Tune the forward grouped GEMM's launch configs on this GPU for the named shapes, and measure what they buy.

    python benchmarks/tune_gemm.py --shapes olmoe qwen2moe deepseekv3 qwen3 --tokens 16 512 4096 16384 \\
        --workers 12 --json tuned_gemm.json --merge

For each shape and token count, in one process: the experts forward (no gradients, HF's weight layout, our fused
kernels: gemm_engine="triton") with the configs the table has now ("before"); then every forward-GEMM key that
call meets and the table lacks is tuned (each of ``configs.gemm_candidates`` timed by do_bench medians); then the
forward again ("after") and sort + torch._grouped_mm. Keys the table has already are left as they are. Each GEMM's
tail key (``...|tail``, the smaller tiles for the rows past each expert's whole tiles) is tuned after its GEMM's
key, over ``configs.tail_candidates``, whose first is the GEMM's own config: no split; its "default" column is that.
On a GPU that can read through TMA (Hopper and later), each 16-bit key without interleaved pairs also meets its TMA key
(``...|tma``, ``config.gemm_tma_weights = "tuned"``): ``configs.tma_candidates``, whose first, POINTERS, is the key's
pointer launches as tuned (and its "default"); the others run the persistent launch with descriptors made in the
kernel. The entry is kept whichever wins, so the table also records where pointers did. Each TMA key is then settled
in its case's whole forward (``settle_in_context``: POINTERS against its best tile, the other keys as they stand), and
a case whose forward, timed with its TMA entries and without them in alternating rounds, gains less than
``CONFIRM_GAIN`` has them set back (``confirm_tma``).

Compiling the candidates is most of a tune (about a hundred Triton compiles per kernel variant), and it is CPU
work, so it is done first, in ``--workers`` processes at once: each compiles its share through
``JITFunction.warmup`` into Triton's on-disk cache, and the timing in this process then loads them from there.
--json writes the tuned entries with each key's default and best time; --merge adds the entries to the shipped
table (moe_inductor/kernels/tuned/<GPU>.json).
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

import moe_inductor
from moe_inductor.kernels import configs, launch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_backward_engine import EXTRA_SHAPES, _weights  # noqa: E402
from benchmarks.bench_experts import SHAPES, bench, gptoss_weights, make_routing, sort_grouped_mm  # noqa: E402

GEMM = "gemm|"
#: tune only the keys that end so (``--only``); the others get what they get without the tuner
ONLY = ""


def _skipped(key: str) -> bool:
    return not key.startswith(GEMM) or not key.endswith(ONLY)


def _untuned(key: str, candidates) -> configs.LaunchConfig:
    """What a key the tuner stands aside from gets: its table entry, else its default (a non-GEMM key: its first
    candidate)."""
    return configs.TABLE.lookup(key) or (default_of(key) if key.startswith(GEMM) else candidates()[0])


def _portable(arg):
    """A kernel argument as a worker can rebuild it: a tensor becomes its dtype (Triton's ``MockTensor``)."""
    return arg.dtype if isinstance(arg, torch.Tensor) else arg


def _warm(jobs: list[tuple]) -> int:
    """Compile each job (module, kernel name, grid, args, meta) into Triton's cache; returns how many compiled."""
    done = 0
    for module, name, grid, args, meta in jobs:
        kernel = getattr(importlib.import_module(module), name)
        try:
            kernel.warmup(*args, grid=grid, **meta)
            done += 1
        except Exception:  # a config that does not compile is skipped by the tuner too
            pass
    return done


class Recorder:
    """Stands in for ``configs.tune``: records every candidate's launch (not run) of each key the table lacks."""

    def __init__(self) -> None:
        self.jobs: dict[str, list[tuple]] = {}

    def __call__(self, key, candidates, run, bench=None, **kwargs):
        if _skipped(key):
            return _untuned(key, candidates)
        cands = candidates()
        if key not in self.jobs:
            jobs = self.jobs[key] = []
            real = launch.launch_kernel

            def capture(kernel, grid, args, meta):
                if isinstance(kernel, launch.LazyKernel):
                    kernel = kernel.resolve()
                jobs.append((kernel.fn.__module__, kernel.fn.__name__, tuple(grid),
                             tuple(_portable(a) for a in args), dict(meta)))

            launch.launch_kernel = capture
            try:
                for cfg in cands:
                    run(cfg)
            finally:
                launch.launch_kernel = real
        return cands[0]  # this call's own result is thrown away


class Timings:
    """Wraps ``configs.tune`` to keep every candidate's time, so the default's can be shown beside the best's."""

    def __init__(self) -> None:
        self.real = configs.tune
        self.times: dict[str, dict[configs.LaunchConfig, float]] = {}

    def __call__(self, key, candidates, run, bench=None, **kwargs):
        if _skipped(key):
            return _untuned(key, candidates)
        cands = candidates()
        order = iter(cands)
        times = self.times[key] = {}
        from triton.testing import do_bench

        def timed(fn):
            cfg = next(order)
            ms = do_bench(fn, warmup=5, rep=25, return_mode="median")
            times[cfg] = ms
            return ms

        return self.real(key, lambda: cands, run, bench=timed, **kwargs)


def save(entries: dict[str, dict], json_path: str | None, merge: bool) -> None:
    """Write the tuned entries (with their times) to ``json_path``; with ``merge``, add their configs to the shipped
    table of this GPU."""
    if json_path:
        Path(json_path).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    if merge:
        configs.TABLE.merge_into_shipped({key: _fields(e) for key, e in entries.items()})


def default_of(key: str) -> configs.LaunchConfig:
    """The config a forward-GEMM key gets without a table entry (``launch.launch_grouped_gemm``'s key layout:
    ``gemm|E..|N..|K..|dtype|g..|a..|c..|m..[|il]``). A tail key's (``...|tail``) is its GEMM's own config: no split;
    a TMA key's (``...|tma``) is POINTERS: the pointer launches."""
    if key.endswith("|tma"):
        return configs.POINTERS
    if key.endswith("|tail"):
        base = key[: -len("|tail")]
        return configs.TABLE.lookup(base) or default_of(base)
    parts = key.split("|")
    n, k, dtype, gated = int(parts[2][1:]), int(parts[3][1:]), getattr(torch, parts[4].split(".")[-1]), parts[5] == "g1"
    return configs.default_gemm_config(int(parts[8][1:]), n, k, dtype, gated)


def run_with_tuner(stand_in, cases: list[tuple]) -> None:
    """Run the forward of every case with autotuning on and ``stand_in`` in the place of ``configs.tune``; launch
    decisions made before or during it are forgotten, so that every key meets the tuner and then its table entry."""
    real = configs.tune
    configs.tune, moe_inductor.config.autotune = stand_in, True
    launch._GEMM_DECISIONS.clear()
    try:
        for case in cases:
            forward(*case)
    finally:
        configs.tune, moe_inductor.config.autotune = real, False
        launch._GEMM_DECISIONS.clear()


def forward(x, ids, weights, w1, w2, kw=None):
    with torch.no_grad():
        return moe_inductor.fused_experts(x, ids, weights, w1, w2, **(kw or {}))


def shape_cases(name: str, tokens: list[int], dev, dt) -> list[tuple[int, tuple]]:
    """(T, forward's arguments) for each token count. "gptoss" is GPT-OSS's experts as the model holds them: (E, H,
    2I) gate_up with interleaved columns, biases and the clamped glu, whose GEMMs have keys of their own (``|il``);
    every other shape is HF's concatenated (E, 2I, H) layout with SiLU."""
    H, I, E, k = {**SHAPES, **EXTRA_SHAPES}[name]
    gen = torch.Generator().manual_seed(0)
    if name == "gptoss":
        w1, w2, b1, b2 = gptoss_weights(gen, dev, dt)
        kw = dict(b1=b1, b2=b2, activation="gptoss_glu", layout="kn", gate_up="interleaved")
    else:
        (w1, w2), kw = _weights(name, dev, dt), {}
    out = []
    for T in tokens:
        x = torch.randn(T, H, generator=gen).to(dev, dt)
        ids, weights = make_routing(T, E, k, False, gen, dev)
        out.append((T, (x, ids, weights.to(dt), w1, w2, kw)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["olmoe", "qwen2moe", "deepseekv3", "qwen3"],
                    choices=[*SHAPES, *EXTRA_SHAPES])
    ap.add_argument("--tokens", nargs="*", type=int, default=[16, 512, 4096, 16384])
    ap.add_argument("--workers", type=int, default=8, help="processes compiling candidates at once")
    ap.add_argument("--json", help="write the tuned entries (with default and best times) here")
    ap.add_argument("--merge", action="store_true", help="add them to the shipped table for this GPU")
    ap.add_argument("--only", default="", help="tune only the keys ending so (e.g. '|tma'); others as they are")
    ap.add_argument("--retune", action="store_true",
                    help="forget the table's entries of the keys --only names first, so that they are measured again")
    args = ap.parse_args()
    global ONLY
    ONLY = args.only
    if args.retune:
        if not ONLY:
            ap.error("--retune needs --only")
        configs.TABLE.lookup(GEMM)  # (loads the shipped table and the user's cache)
        for key in [k for k in configs.TABLE._table if k.startswith(GEMM) and k.endswith(ONLY)]:
            del configs.TABLE._table[key]
    moe_inductor.config.validate_routing = False
    moe_inductor.config.gemm_engine = "triton"  # the fused kernels are what is tuned
    print(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}", flush=True)
    dev, dt = "cuda", torch.bfloat16
    cases = [(name, T, case) for name in args.shapes for T, case in shape_cases(name, args.tokens, dev, dt)]

    before = {(n, T): bench(lambda c=c: forward(*c), 25, 100) for n, T, c in cases}

    # 1. record the candidates' launches of every untuned key, 2. compile them in worker processes
    recorder = Recorder()
    run_with_tuner(recorder, [c for _, _, c in cases])
    jobs = [job for key_jobs in recorder.jobs.values() for job in key_jobs]
    unique = list({(j[0], j[1], repr(j[3]), repr(sorted(j[4].items()))): j for j in jobs}.values())
    start = time.perf_counter()
    print(f"compiling {len(unique)} candidate kernels for {len(recorder.jobs)} keys in {args.workers} processes",
          flush=True)
    shares = [unique[i::args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        compiled = sum(pool.map(_warm, shares))
    print(f"compiled {compiled}/{len(unique)} in {time.perf_counter() - start:.0f} s", flush=True)

    # 3. tune (every compile is now a cache load), keeping each candidate's time, and which case met which key
    timings = Timings()
    keys_of = {}
    for name, T, c in cases:
        known = set(timings.times)
        run_with_tuner(timings, [c])
        keys_of[(name, T)] = [key for key in timings.times if key not in known]

    print("| key | default (ms) | best (ms) | best config | default / best |")
    print("|---|---|---|---|---|")
    entries = {}
    for key, times in timings.times.items():
        cfg = configs.TABLE.lookup(key)
        default = default_of(key)
        d_ms, b_ms = times.get(default, float("nan")), times[cfg]
        entries[key] = {**vars(cfg), "_default_ms": round(d_ms, 4), "_best_ms": round(b_ms, 4)}
        print(f"| {key} | {d_ms:.4f} | {b_ms:.4f} | {cfg} | {d_ms / b_ms:.2f}x |", flush=True)

    save(entries, args.json, args.merge)  # before the last timings: a run cut short keeps what it tuned

    # 4. each TMA key once more, in its case's whole forward: POINTERS against its best tile
    for name, T, c in cases:
        for key, choice in settle_in_context(entries, timings.times, keys_of[(name, T)],
                                             lambda c=c: bench(lambda: forward(*c), 25, 100)).items():
            print(f"in the forward of {name} T={T}: {key} -> {choice}", flush=True)
    save(entries, args.json, args.merge)

    # 5. each case's TMA entries together against none, in its whole forward, both sides timed now
    reverted = []
    for name, T, c in cases:
        back, gain = confirm_tma(entries, keys_of[(name, T)], lambda c=c: bench(lambda: forward(*c), 25, 100))
        print(f"{name} T={T}: its forward with its TMA entries against none: {gain:.3f}x", flush=True)
        reverted += back
    if reverted:
        print(f"TMA entries set back to POINTERS (their forward was not {CONFIRM_GAIN}x faster as a whole): "
              f"{reverted}", flush=True)
        save(entries, args.json, args.merge)

    # "before" was timed at the start, on a cooler card: its ratio to "after" is a rough one (see confirm_tma)
    print("| shape | T | before (ms) | after (ms) | sort+_grouped_mm (ms) | engine rule (ms) | before / after "
          "| sort+gmm / after | engine rule / after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, T, c in cases:
        after = bench(lambda: forward(*c), 25, 100)
        x, ids, weights, w1, w2, kw = c
        ref = float("nan") if kw else bench(  # sort + _grouped_mm here takes the plain (nk, concat) layout only
            lambda: sort_grouped_mm(x, ids, weights, w1.transpose(1, 2), w2.transpose(1, 2)), 25, 100)
        moe_inductor.config.gemm_engine = "auto"  # what the op runs by default (torch._grouped_mm where its rule says)
        try:
            rule = bench(lambda: forward(*c), 25, 100)
        finally:
            moe_inductor.config.gemm_engine = "triton"
        b = before[(name, T)]
        print(f"| {name} | {T} | {b:.3f} | {after:.3f} | {ref:.3f} | {rule:.3f} | {b / after:.2f}x | "
              f"{ref / after:.2f}x | {rule / after:.2f}x |", flush=True)


#: in ``settle_in_context``, a TMA tile displaces POINTERS only when the whole forward is this fraction faster with it
FORWARD_MARGIN = 0.01


def _fields(entry: dict) -> configs.LaunchConfig:
    """An entry's config, without the timings stored beside it (fields starting with "_")."""
    return configs.LaunchConfig(**{f: v for f, v in entry.items() if f[0] != "_"})


def settle_in_context(entries: dict[str, dict], times: dict[str, dict], keys: list[str], time_forward,
                      rounds: int = 2) -> dict[str, configs.LaunchConfig]:
    """For each TMA key among ``keys`` (one case's), time the case's whole forward (``time_forward()``, ms) with the
    key's entry POINTERS and with its best tile timed alone (``times[key]``: each candidate's time), the other keys
    as they stand, ``rounds`` times in the order ABBA...; keep the tile only when the forward's mean time with it
    is ``FORWARD_MARGIN`` faster (means over an even ``rounds`` cancel a steady drift of the card's speed). A GEMM
    timed alone can prefer a tile that its forward does not (RESULTS.md, twenty-sixth session). Updates ``entries``
    and the table (the user's cache too); returns each key's choice."""
    chosen = {}
    for key in keys:
        if not key.endswith("|tma") or key not in entries:
            continue
        tiles = {cfg: ms for cfg, ms in times.get(key, {}).items() if cfg != configs.POINTERS and ms < float("inf")}
        if not tiles:
            continue
        tile = min(tiles, key=tiles.get)
        mean = {configs.POINTERS: 0.0, tile: 0.0}
        for r in range(rounds):
            for cfg in (configs.POINTERS, tile) if r % 2 == 0 else (tile, configs.POINTERS):
                configs.TABLE.store(key, cfg)
                launch._GEMM_DECISIONS.clear()
                mean[cfg] += time_forward() / rounds
        pick = tile if mean[tile] < mean[configs.POINTERS] * (1.0 - FORWARD_MARGIN) else configs.POINTERS
        configs.TABLE.store(key, pick, persist=True)
        launch._GEMM_DECISIONS.clear()
        entries[key] = {**entries[key], **vars(pick), "_forward_ms_pointers": round(mean[configs.POINTERS], 4),
                        "_forward_ms_tile": round(mean[tile], 4)}
        chosen[key] = pick
    return chosen


#: a case's TMA entries stay only where its whole forward (routing, both GEMMs, combine) is this much faster with
#: them: each GEMM timed alone can win while the forward loses (Qwen3 at T = 4096, RESULTS.md, twenty-sixth session)
CONFIRM_GAIN = 1.02


def confirm_tma(entries: dict[str, dict], keys: list[str], time_forward, rounds: int = 4) -> tuple[list[str], float]:
    """Time the case's whole forward (``time_forward()``, ms) with its TMA entries among ``keys`` as chosen and with
    all of them POINTERS, ``rounds`` times in the order ABBA..., and set them to POINTERS (in ``entries``, the table
    and the user's cache) when their mean time is not ``CONFIRM_GAIN`` faster. The two sides are timed together
    because a forward timed minutes apart is not comparable: a card warmed by the tuning runs its clock lower (the
    twenty-seventh session saw one forward at 0.765 and 0.813 ms); with an even ``rounds``, the ABBA order's means
    cancel a steady drift. Returns (the keys set back, the gain measured; 1.0 where the case has no TMA tile)."""
    tiles = {key: _fields(entries[key]) for key in keys
             if key.endswith("|tma") and key in entries and _fields(entries[key]) != configs.POINTERS}
    if not tiles:
        return [], 1.0

    def use(table: dict[str, configs.LaunchConfig]) -> None:
        for key, cfg in table.items():
            configs.TABLE.store(key, cfg)
        launch._GEMM_DECISIONS.clear()

    sides = {"pointers": dict.fromkeys(tiles, configs.POINTERS), "tiles": tiles}
    total = dict.fromkeys(sides, 0.0)
    for r in range(rounds):
        for side in sides if r % 2 == 0 else reversed(sides):
            use(sides[side])
            total[side] += time_forward()
    gain = total["pointers"] / total["tiles"]
    for key in tiles:  # (the gain goes into the --json record either way)
        entries[key] = {**entries[key], "_confirm_gain": round(gain, 3)}
    if gain >= CONFIRM_GAIN:
        use(tiles)
        return [], gain
    for key in tiles:
        entries[key] = {**entries[key], **vars(configs.POINTERS)}
        configs.TABLE.store(key, configs.POINTERS, persist=True)  # (the tuner saved the tile in the user's cache)
    launch._GEMM_DECISIONS.clear()
    return list(tiles), gain


if __name__ == "__main__":
    main()
