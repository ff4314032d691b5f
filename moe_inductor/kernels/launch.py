"""Host wrappers for the Triton kernels: check, pick a config, launch. No host syncs: only shapes are read."""
from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from . import configs


class LazyKernel:
    """A Triton kernel named by its module in kernels/ and its name there, imported at its first launch.

    The ops name their kernels this way so that ``import moe_inductor`` and the plain-torch CPU path need no triton
    (it is absent on macOS, Windows and many CPU-only installs); triton loads when a kernel first runs.
    """

    __slots__ = ("module", "name", "_kernel")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name, self._kernel = module, name, None

    def resolve(self) -> Any:
        """The Triton kernel itself (imports its module, and triton, the first time)."""
        if self._kernel is None:
            self._kernel = getattr(importlib.import_module(f"{__package__}.{self.module}"), self.name)
        return self._kernel

    def __repr__(self) -> str:
        return f"LazyKernel({self.module}.{self.name})"


grouped_gemm_kernel = LazyKernel("grouped_gemm", "grouped_gemm_kernel")
grouped_weight_grad_kernel = LazyKernel("grouped_gemm", "grouped_weight_grad_kernel")


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function, several microseconds a call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (n >= 1)."""
    return 1 << (n - 1).bit_length()


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU current for a launch; a no-op (no context switch) when it already is."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# Set while the Inductor-visible op's body runs (lowerings/visible.py): every launch then goes through
# ``torch.library.wrap_triton`` so that Inductor can trace it, and decisions that would read a (symbolic) token count
# read its hint instead, or take the path that is right for every count.
_traceable = False


@contextlib.contextmanager
def traceable_launches():
    """Launch through ``wrap_triton`` and decide from size hints, for the duration (see ``_traceable``)."""
    global _traceable
    previous, _traceable = _traceable, True
    try:
        yield
    finally:
        _traceable = previous


def tracing_launches() -> bool:
    return _traceable


def static_dim(n) -> int:
    """A weight or hidden dimension as a plain int. These pick constexprs and cache keys; a symbolic one (a graph
    traced with every dimension dynamic) is specialised, i.e. guarded on, which is right for a weight's shape. Never
    call it on the token count: that is what ``size_hint`` is for."""
    return n if isinstance(n, int) else int(n)


def size_hint(n, fallback: int = 64) -> int:
    """``n`` as a plain int: a SymInt's example value (no guard is added), ``fallback`` when it has none."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else fallback


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 must match eager fp32 matmuls, which do not use tf32 by default
    return "ieee" if dtype == torch.float32 else "tf32"


def _pick(key: str, default: configs.LaunchConfig, candidates, run, autotune: bool) -> configs.LaunchConfig:
    """The tuned config for ``key``, else tune now (if ``autotune``), else ``default``. ``candidates`` is a thunk."""
    cfg = configs.TABLE.lookup(key)
    if cfg is not None:
        return cfg
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if autotune and not capturing and not configs.interpreting() and not _traceable:
        return configs.tune(key, candidates, run)
    return default


def interleaved_pairs(b: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor | None:
    """The whole (E, K, 2N) weight when ``b`` and ``b2`` are its even and odd columns (GPT-OSS's interleaved
    gate_up_proj, as two stride-2 views), else None. The kernel then loads it contiguously (``INTERLEAVED``)."""
    if b2 is None or b.stride(2) != 2 or b2.stride() != b.stride() or b2.dtype != b.dtype:
        return None
    try:
        same = b2.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except Exception:  # a fake tensor (Inductor tracing the visible op) has no data: views of one base are one weight
        same = b._base is not None and b._base is b2._base
    if not same:
        return None
    if b2.storage_offset() - b.storage_offset() != 1 or b.stride(1) < 2 * b.shape[2]:
        return None
    E, K, N = b.shape
    return b.as_strided((E, K, 2 * N), (b.stride(0), b.stride(1), 1))


def launch_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    *,
    a_rows: int,
    c_rows: int,
    num_rows: int,
    b2: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    scale_mode: int = 0,
    act_id: int = 0,
    alpha: float = 1.702,
    limit: float = 7.0,
    pre: torch.Tensor | None = None,
    accumulate: bool = False,
    autotune: bool = False,
) -> None:
    """See ``grouped_gemm_kernel``. ``num_rows`` is M, the length of ``order``; it only sizes the grid.
    ``autotune``: tune the config on first use of its key (else the shipped table's, or the default)."""
    num_experts, k_dim, n_dim = b.shape
    if _traceable:  # (eager shapes are ints already: this stays off the hot path)
        num_experts, k_dim, n_dim = static_dim(num_experts), static_dim(k_dim), static_dim(n_dim)
    gated = b2 is not None
    pairs = interleaved_pairs(b, b2)
    has_bias = bias is not None
    dummy = offsets
    # the config only changes speed, so a traced (symbolic) row count may pick it from its example value
    bucket = configs.rows_bucket(size_hint(num_rows) / max(num_experts, 1))
    # Every launch decision below depends only on this tuple, so it is made once per tuple: the per-call host work
    # is then one dict lookup, the argument list and the Triton launch (small T is host-bound).
    decision_key = (num_experts, n_dim, k_dim, a.dtype, gated, a_rows, c_rows, bucket, scale_mode, act_id, has_bias,
                    pre is not None, accumulate, a.device, autotune,
                    configs.interpreting(), pairs is not None)
    decided = _GEMM_DECISIONS.get(decision_key)

    def run(cfg: configs.LaunchConfig, meta: dict) -> None:
        # m-tiles: sum over experts of cdiv(rows_e, BLOCK_M) < cdiv(M, BLOCK_M) + (experts with rows), and at most
        # min(E, M) experts have rows: at decode (M = T*k small, E large) most of the E extra tiles never exist
        # (a symbolic row count keeps the grid a plain expression: no min() over a symbol in Inductor's wrapper)
        busy = min(num_experts, num_rows) if isinstance(num_rows, int) else num_experts
        grid = ((cdiv(num_rows, cfg.BLOCK_M) + busy) * cdiv(n_dim, cfg.BLOCK_N),)
        b_ = pairs if pairs is not None else b
        b2_ = b2 if gated else b
        bias_ = bias if has_bias else dummy
        bias2_ = bias2 if (has_bias and gated) else bias_
        pre_ = pre if pre is not None else out
        args = (
            a, b_, b2_, bias_, bias2_, out, pre_, order, scale if scale is not None else dummy, offsets,
            n_dim, k_dim, topk,
            a.stride(0), a.stride(1),
            b_.stride(0), b_.stride(1), b_.stride(2),
            b2_.stride(0), b2_.stride(1), b2_.stride(2),
            bias_.stride(0) if has_bias else 0, bias_.stride(-1) if has_bias else 0,
            bias2_.stride(0) if has_bias else 0, bias2_.stride(-1) if has_bias else 0,
            out.stride(0), out.stride(1), pre_.stride(0), pre_.stride(1),
            float(alpha), float(limit),
        )
        launch_kernel(grouped_gemm_kernel, grid, args, meta)

    if decided is None:
        def meta_for(cfg: configs.LaunchConfig) -> dict:
            return dict(
                NUM_EXPERTS=num_experts, E_POW2=next_pow2(num_experts),
                A_ROWS=a_rows, C_ROWS=c_rows, SCALE_MODE=scale_mode,
                GATED=gated, ACT=act_id, HAS_BIAS=has_bias, SAVE_PRE=pre is not None,
                ACCUMULATE=accumulate, UPCAST=configs.interpreting(), DOT_PRECISION=_dot_precision(a.dtype),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                EVEN_K=k_dim % cfg.BLOCK_K == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                INTERLEAVED=pairs is not None,
            )

        key = f"gemm|E{num_experts}|N{n_dim}|K{k_dim}|{a.dtype}|g{int(gated)}|a{a_rows}|c{c_rows}|m{bucket}"
        if pairs is not None:
            key += "|il"
        default = configs.default_gemm_config(bucket, n_dim, k_dim, a.dtype, gated)
        # Tuning re-runs the launch, so an accumulating launch borrows the config of its plain twin.
        cfg = configs.TABLE.lookup(key) or (
            default if accumulate else _pick(key, default, lambda: configs.gemm_candidates(a.dtype),
                                             lambda c: run(c, meta_for(c)), autotune=autotune)
        )
        decided = (cfg, meta_for(cfg))
        if not autotune or accumulate or configs.TABLE.lookup(key) is not None:
            _GEMM_DECISIONS[decision_key] = decided  # not a default that a later tuning run (after capture) replaces
    with device_guard(a):
        run(*decided)


# (shape, dtype, flags, bucket, device) -> (config, the kernel's constexpr arguments); see launch_grouped_gemm.
_GEMM_DECISIONS: dict[tuple, tuple[configs.LaunchConfig, dict]] = {}


def launch_kernel(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, or through ``wrap_triton`` while traced (see ``_traceable``): every launch of
    ours (routing, GEMMs, combine) goes through here."""
    if isinstance(kernel, LazyKernel):
        kernel = kernel.resolve()
    if _traceable:
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def launch_grouped_weight_grad(
    a: torch.Tensor,
    g: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    topk: int,
    dw: torch.Tensor,
    *,
    a_rows: int,
    g_rows: int,
    scale: torch.Tensor | None = None,
    autotune: bool = False,
) -> None:
    """dw[e] (K, N) = a_e^T @ (scale * g_e); every expert's block is written, zeros for empty experts.
    ``autotune`` as in ``launch_grouped_gemm``."""
    num_experts, k_dim, n_dim = dw.shape
    if _traceable:
        num_experts, k_dim, n_dim = static_dim(num_experts), static_dim(k_dim), static_dim(n_dim)
    # rows per expert is the kernel's reduction length: a few hundred rows want other tiles than thousands
    bucket = configs.rows_bucket(size_hint(order.shape[0]) / max(num_experts, 1))
    key = f"wgrad|E{num_experts}|N{n_dim}|K{k_dim}|{a.dtype}|a{a_rows}|g{g_rows}|m{bucket}"

    def run(cfg: configs.LaunchConfig) -> None:
        grid = (num_experts * cdiv(k_dim, cfg.BLOCK_K) * cdiv(n_dim, cfg.BLOCK_N),)
        launch_kernel(
            grouped_weight_grad_kernel, grid,
            (a, g, dw, order, scale if scale is not None else offsets, offsets,
             k_dim, n_dim, topk,
             a.stride(0), a.stride(1), g.stride(0), g.stride(1), dw.stride(0), dw.stride(1), dw.stride(2)),
            dict(A_ROWS=a_rows, G_ROWS=g_rows, HAS_SCALE=scale is not None,
                 UPCAST=configs.interpreting(), DOT_PRECISION=_dot_precision(a.dtype),
                 BLOCK_M=cfg.BLOCK_M, BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )

    default = configs.default_weight_grad_config(k_dim, n_dim, a.dtype)
    cfg = _pick(key, default, lambda: configs.weight_grad_candidates(a.dtype), run, autotune=autotune)
    with device_guard(a):
        run(cfg)
