"""Launch configurations: heuristics, an optional on-device tuner, and tuned H200 tables shipped as JSON.

The key never holds the raw token count: it holds (kernel, E, N, K, dtype, flags, bucket of rows per expert), so a new
T reuses a config and never recompiles or re-tunes.
"""
from __future__ import annotations

import functools
import json
import os
import sys
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


class ConfigTable:
    """A process-wide table from tuning key to config, seeded from the shipped JSON files."""

    def __init__(self) -> None:
        self._table: dict[str, LaunchConfig] = {}
        self._loaded_devices: set[str] = set()

    @staticmethod
    def device_tag() -> str:
        if not torch.cuda.is_available():
            return "cpu"
        return torch.cuda.get_device_name().replace(" ", "_")

    def _load(self) -> None:
        if self._loaded_devices:
            return
        tag = self.device_tag()
        self._loaded_devices.add(tag)
        path = _TUNED_DIR / f"{tag}.json"
        if path.exists():
            for key, cfg in json.loads(path.read_text()).items():
                self._table[key] = LaunchConfig(**cfg)

    def lookup(self, key: str) -> LaunchConfig | None:
        self._load()
        return self._table.get(key)

    def store(self, key: str, cfg: LaunchConfig) -> None:
        self._table[key] = cfg

    def dump(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({k: asdict(v) for k, v in sorted(self._table.items())}, indent=1))


TABLE = ConfigTable()


def tune(key: str, candidates: Callable[[], list[LaunchConfig]], run: Callable[[LaunchConfig], None]) -> LaunchConfig:
    """Time each candidate with do_bench medians and keep the fastest; prints one progress line."""
    from triton.testing import do_bench

    best, best_ms = None, float("inf")
    candidates = candidates()
    print(f"[moe_inductor] autotuning {key} over {len(candidates)} configs ...", file=sys.stderr, flush=True)
    for cfg in candidates:
        try:
            ms = do_bench(lambda: run(cfg), warmup=5, rep=20, return_mode="median")
        except Exception:  # a config that does not fit (shared memory, registers) is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    assert best is not None, f"no config ran for {key}"
    print(f"[moe_inductor] autotuned {key}: {best} ({best_ms * 1e3:.1f} us)", file=sys.stderr, flush=True)
    TABLE.store(key, best)
    return best
