"""Launch configurations: heuristics, an optional on-device tuner, and tuned H200 tables shipped as JSON.

The key never holds the raw token count: it holds (kernel, E, N, K, dtype, flags, bucket of rows per expert), so a new
T reuses a config and never recompiles or re-tunes.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

_TUNED_DIR = Path(__file__).with_name("tuned")


@dataclass(frozen=True)
class LaunchConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8


def rows_bucket(rows_per_expert: float) -> int:
    """Power-of-two bucket of the mean rows per expert, clamped to [1, 4096]."""
    b = 1
    while b < rows_per_expert and b < 4096:
        b *= 2
    return b


@functools.lru_cache(maxsize=None)
def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter. Triton reads TRITON_INTERPRET when a kernel is decorated, at
    import, so the answer cannot change afterwards; cached because launches ask it several times a call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_gemm_config(bucket: int, n: int, k: int, dtype: torch.dtype, gated: bool = False) -> LaunchConfig:
    """A sound config without tuning; small blocks under the interpreter, where every program costs milliseconds."""
    if interpreting():
        return LaunchConfig(16, 32, 32, 1, 1)
    # picked from the tuned H200 table (kernels/tuned/NVIDIA_H200.json) for shapes it does not cover
    wide = dtype == torch.float32
    if bucket <= 8:
        return LaunchConfig(16, 128, 64 if wide else 128, 4, 3)
    if bucket <= 64:
        return LaunchConfig(64, 128 if not wide else 64, 64 if not wide else 32, 4, 4)
    if gated and bucket >= 1024 and not wide:
        # two accumulators (gate and up) per tile: at 1024 rows per expert the tuner picked 128x64 over 128x128
        # (Mixtral's up projection, the table's only gated entry that large)
        return LaunchConfig(128, 64, 64, 8, 3)
    return LaunchConfig(128, 128, 64 if not wide else 32, 8, 3)


def default_weight_grad_config(k: int, n: int, dtype: torch.dtype) -> LaunchConfig:
    """The weight-gradient config for a key the tuned table lacks."""
    if interpreting():
        return LaunchConfig(16, 32, 32, 1, 1)
    if dtype == torch.float32:
        return LaunchConfig(32, 64, 64, 4, 3)
    # a 128x128 output tile (BLOCK_K x BLOCK_N) over 64-row steps: twice the work per load of the former 64x128,
    # the usual Hopper tile. Not tuned yet: the shipped table has no weight-gradient entries
    return LaunchConfig(64, 128, 128, 8, 3)


def gemm_candidates(dtype: torch.dtype) -> list[LaunchConfig]:
    """The search space of the tuner, kept small so a first call tunes in seconds."""
    out = []
    for bm in (16, 32, 64, 128):
        for bn in (64, 128, 256):
            for bk in (64, 128):
                if dtype == torch.float32 and bk * max(bm, bn) > 128 * 64:
                    continue
                if bm >= 128 and bn == 256 and bk > 64:  # 128x256 only with 64-deep K steps (shared memory)
                    continue
                for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                    if bm * bn >= 128 * 128 and warps == 4:
                        continue
                    out.append(LaunchConfig(bm, bn, bk, warps, stages))
    return out


def tail_candidates(full: LaunchConfig, dtype: torch.dtype, gated: bool) -> list[LaunchConfig]:
    """The tail tuner's search space (``launch_grouped_gemm``): ``full`` itself first, which stands for no split,
    then tiles of fewer rows than ``full``'s for the rows past each expert's whole tiles."""
    out = [full]
    for bm in (16, 32, 64):
        if bm >= full.BLOCK_M:
            continue
        for bn in (64, 128) if gated else (64, 128, 256):
            for bk in (64, 128):
                if dtype == torch.float32 and bk * max(bm, bn) > 128 * 64:
                    continue
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    if warps == 8 and bm * bn < 64 * 128:
                        continue
                    out.append(LaunchConfig(bm, bn, bk, warps, stages))
    return out


#: A "|tma" table entry that says the pointer launches of its key were measured faster than every TMA candidate
#: (a config no launch can take: zero-sized blocks).
POINTERS = LaunchConfig(0, 0, 0, 0, 0, 0)


def tma_candidates(full: LaunchConfig, dtype: torch.dtype, gated: bool) -> list[LaunchConfig]:
    """The TMA tuner's search space (``launch_grouped_gemm`` under ``config.gemm_tma_weights = "tuned"``): POINTERS
    first, which stands for the key's pointer launches as they are (``full``, and its tail split if any), then
    ``full`` and a few Hopper tiles for the persistent launch whose weights (and sorted rows) come through
    descriptors made in the kernel. 16-bit only, as TMA is; a gated tile holds two weight tiles a stage, so its
    widest tiles would overflow shared memory and are left out."""
    tiles = [full, LaunchConfig(128, 128, 64, 8, 3), LaunchConfig(128, 128, 64, 8, 4), LaunchConfig(128, 64, 64, 8, 3),
             LaunchConfig(64, 128, 64, 4, 3), LaunchConfig(64, 128, 128, 4, 3), LaunchConfig(128, 128, 128, 8, 3)]
    if not gated:
        tiles += [LaunchConfig(128, 256, 64, 8, 3), LaunchConfig(64, 256, 64, 8, 3)]
    out = [POINTERS]
    for cfg in tiles:
        if cfg not in out and dtype.itemsize == 2:
            out.append(cfg)
    return out


def weight_grad_candidates(dtype: torch.dtype) -> list[LaunchConfig]:
    """The weight-gradient tuner's search space. Two pipeline stages are in it because a few hundred rows per expert
    make the reduction loop only a few steps long: less shared memory per program then buys more programs per SM."""
    out = []
    for bm in (32, 64, 128):
        for bk, bn in ((64, 64), (128, 64), (64, 128), (128, 128)):
            if dtype == torch.float32 and bk * bn > 64 * 64:
                continue
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4)):
                if warps == 4 and bk * bn >= 128 * 128:  # 128 fp32 accumulator registers per thread, before operands
                    continue
                if stages * bm * (bk + bn) * dtype.itemsize > 200 * 1024:  # over the H200's shared memory
                    continue
                out.append(LaunchConfig(bm, bn, bk, warps, stages))
    return out


def cache_dir() -> Path:
    """Where tuned configs persist between runs: ``$MOE_INDUCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/moe_inductor``,
    else ``~/.cache/moe_inductor``."""
    explicit = os.environ.get("MOE_INDUCTOR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "moe_inductor"


class ConfigTable:
    """A process-wide table from tuning key to config: the shipped JSON table of this GPU, then the user's cache of
    configs tuned here before (``cache_dir()/tuned/<GPU>.json``), which every new tune is added to."""

    def __init__(self) -> None:
        self._table: dict[str, LaunchConfig] = {}
        self._loaded_devices: set[str] = set()
        self._warned_write = False

    @staticmethod
    def device_tag() -> str:
        if not torch.cuda.is_available():
            return "cpu"
        return torch.cuda.get_device_name().replace(" ", "_")

    def user_path(self) -> Path:
        """This GPU's file in the user's cache."""
        return cache_dir() / "tuned" / f"{self.device_tag()}.json"

    def _load(self) -> None:
        if self._loaded_devices:
            return
        tag = self.device_tag()
        self._loaded_devices.add(tag)
        shipped = _TUNED_DIR / f"{tag}.json"
        for path in (shipped, self.user_path()):
            try:
                entries = json.loads(path.read_text()) if path.exists() else {}
                self._table.update({key: LaunchConfig(**cfg) for key, cfg in entries.items()})
            except (OSError, ValueError, TypeError) as exc:  # a damaged cache must not stop a run: tune again
                warnings.warn(f"moe_inductor: ignoring the tuned configs in {path} ({exc})", stacklevel=3)
        if tag != "cpu" and not shipped.exists() and not interpreting():
            shipped_for = ", ".join(sorted(p.stem for p in _TUNED_DIR.glob("*.json"))) or "none"
            warnings.warn(
                f"moe_inductor: no tuned kernel configs ship for this GPU ({tag.replace('_', ' ')}; tuned: "
                f"{shipped_for}), so the kernels use heuristic configs. moe_inductor.config.autotune = True "
                f"(or MOE_INDUCTOR_AUTOTUNE=1) tunes each new shape once and keeps the result in {self.user_path()}",
                stacklevel=3)

    def lookup(self, key: str) -> LaunchConfig | None:
        self._load()
        return self._table.get(key)

    def tma_tiles(self) -> int:
        """How many forward-GEMM keys this GPU's table (shipped and the user's) gives a TMA tile: the keys that take
        the persistent descriptor launch under ``config.gemm_tma_weights = "tuned"``."""
        self._load()
        return sum(1 for key, cfg in self._table.items() if key.endswith("|tma") and cfg != POINTERS)

    def store(self, key: str, cfg: LaunchConfig, persist: bool = False) -> None:
        """Keep ``cfg`` for ``key`` in this process; with ``persist``, also in the user's cache for the next run."""
        self._table[key] = cfg
        if persist:
            self._persist(key, cfg)

    def _persist(self, key: str, cfg: LaunchConfig) -> None:
        path = self.user_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = json.loads(path.read_text()) if path.exists() else {}
            entries[key] = asdict(cfg)
            # written whole to a temporary file, then renamed: a reader (another process) never sees half a file
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dict(sorted(entries.items())), indent=1))
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(f"moe_inductor: cannot save tuned configs to {path} ({exc}); they last this run only "
                              "(MOE_INDUCTOR_CACHE_DIR picks another directory)", stacklevel=3)

    def merge_into_shipped(self, entries: dict[str, LaunchConfig]) -> Path:
        """Add ``entries`` to the table shipped for this GPU (``kernels/tuned/<GPU>.json``), as the tuning scripts in
        benchmarks/ do; returns its path."""
        path = _TUNED_DIR / f"{self.device_tag()}.json"
        table = json.loads(path.read_text()) if path.exists() else {}
        table.update({key: asdict(cfg) for key, cfg in entries.items()})
        path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return path

    def dump(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({k: asdict(v) for k, v in sorted(self._table.items())}, indent=1))


TABLE = ConfigTable()


def tune(key: str, candidates: Callable[[], list[LaunchConfig]], run: Callable[[LaunchConfig], None],
         bench: Callable[[Callable[[], None]], float] | None = None, first_margin: float = 0.0) -> LaunchConfig:
    """Time each candidate (``bench``: a function's median milliseconds; Triton's do_bench by default), keep the
    fastest, and save it in the user's cache. ``first_margin``: another candidate displaces the first only when
    faster by more than this fraction of its time (the first being what runs without the tuner's choice). Prints
    progress (done/total and an estimate of the time left) every few seconds, and the result."""
    if bench is None:
        from triton.testing import do_bench

        def bench(fn: Callable[[], None]) -> float:
            return do_bench(fn, warmup=5, rep=20, return_mode="median")

    best, best_ms, best_score = None, float("inf"), float("inf")
    candidates = candidates()
    total = len(candidates)
    print(f"[moe_inductor] autotuning {key} over {total} configs ...", file=sys.stderr, flush=True)
    start = last_print = time.perf_counter()
    for done, cfg in enumerate(candidates, 1):
        try:
            ms = bench(lambda: run(cfg))
        except Exception:  # a config that does not fit (shared memory, registers) is skipped
            ms = float("inf")
        score = ms * (1.0 - first_margin) if done == 1 else ms  # (the first competes with its time less the margin)
        if score < best_score:
            best, best_ms, best_score = cfg, ms, score
        now = time.perf_counter()
        if now - last_print >= _PROGRESS_EVERY_S and done < total:
            last_print = now
            left = (now - start) / done * (total - done)
            print(f"[moe_inductor] autotuning {key}: {done}/{total} configs, {now - start:.0f} s, about {left:.0f} s "
                  "left", file=sys.stderr, flush=True)
    assert best is not None, f"no config ran for {key}"
    print(f"[moe_inductor] autotuned {key} in {time.perf_counter() - start:.1f} s: {best} ({best_ms * 1e3:.1f} us); "
          f"saved in {TABLE.user_path()}", file=sys.stderr, flush=True)
    TABLE.store(key, best, persist=True)
    return best


#: seconds between autotune progress lines
_PROGRESS_EVERY_S = 5.0
