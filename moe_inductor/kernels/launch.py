"""Host wrappers for the Triton kernels: grid, blocks, constexprs, config, launch. No host syncs: only shapes are read.

Each kernel of kernels/ has its wrapper here (``launch_route``, ``launch_grouped_gemm``,
``launch_grouped_weight_grad``, ``launch_combine``, ``launch_backward_middle``, ``launch_activation``); ops/
prepares the routing once and calls them, and nothing here calls back into ops/.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any, NamedTuple, Optional

import torch

from . import configs
from .modes import ROWS_SORTED, SCALE_NONE
from .tma import ensure_scratch_allocator, rows_descriptor_ok, tma_weights_apply, weight_descriptor
from .weight_table import WeightTable
from .weight_views import interleaved_pairs


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
route_count_kernel = LazyKernel("routing", "route_count_kernel")
route_place_kernel = LazyKernel("routing", "route_place_kernel")
combine_kernel = LazyKernel("combine", "combine_kernel")
backward_middle_kernel = LazyKernel("backward_middle", "backward_middle_kernel")
activation_kernel = LazyKernel("activation", "activation_kernel")
expert_row_sums_kernel = LazyKernel("row_sums", "expert_row_sums_kernel")


class Rows(NamedTuple):
    """How a grouped launch finds its rows (legend in grouped_gemm.py): the expert-sorted ``order`` (M,), the
    per-expert ``offsets`` (E+1,) into it, and k, which turns an assignment into its token."""

    order: torch.Tensor
    offsets: torch.Tensor
    topk: int


class Epilogue(NamedTuple):
    """What the grouped GEMM does with its tile after the dot, in the kernel's order: a second dot with ``b2`` (the
    up half of a gated activation), the raw results into ``pre``, the routing weight ``scale`` (M,) when
    ``scale_mode`` is SCALE_ACC, ``bias`` (``bias2`` for the up half), activation ``act_id`` (with GPT-OSS's
    ``alpha``/``limit``), ``scale`` when SCALE_OUT, and the store (added to ``out`` when ``accumulate``)."""

    b2: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    bias2: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    scale_mode: int = SCALE_NONE
    act_id: int = 0
    alpha: float = 0.0
    limit: float = 0.0
    pre: Optional[torch.Tensor] = None
    accumulate: bool = False


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
# read its hint instead, or take the path that is right for every count. Per thread: the body runs in the thread
# that traces it, and an opaque op running meanwhile in another thread launches as it always does.
_state = threading.local()


@contextlib.contextmanager
def traceable_launches():
    """Launch through ``wrap_triton`` and decide from size hints, for the duration, in this thread (see
    ``tracing_launches``)."""
    previous = getattr(_state, "traceable", False)
    _state.traceable = True
    try:
        yield
    finally:
        _state.traceable = previous


def tracing_launches() -> bool:
    """Whether this thread is inside ``traceable_launches``."""
    return getattr(_state, "traceable", False)


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


def _pick(key: str, default: configs.LaunchConfig, candidates, run, autotune: bool,
          first_margin: float = 0.0) -> configs.LaunchConfig:
    """The tuned config for ``key``, else tune now (if ``autotune``), else ``default``. ``candidates`` is a thunk;
    ``first_margin``: see ``configs.tune``."""
    cfg = configs.TABLE.lookup(key)
    if cfg is not None:
        return cfg
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if autotune and not capturing and not configs.interpreting() and not tracing_launches():
        return configs.tune(key, candidates, run, first_margin=first_margin)
    return default


def launch_grouped_gemm(a: torch.Tensor, b: torch.Tensor, rows: Rows, out: torch.Tensor, *, a_rows: int, c_rows: int,
                        epilogue: Epilogue, autotune: bool = False, tail_split: bool = True, tma_weights: str = "off",
                        tma_min_rows_per_expert: int = 128, tma_descriptors: str = "device") -> None:
    """See ``grouped_gemm_kernel``: ``out[rows_c] (+)= epilogue(a[rows_a] @ b[e])``. The row count M (the length of
    ``rows.order``) only sizes the grid. ``autotune``: tune the config on first use of its key (else the shipped
    table's, or the default). ``tail_split``: run each expert's partial last tile apart where the
    table holds a tail config (``config.gemm_tail_split``); ``tma_weights``, ``tma_min_rows_per_expert``,
    ``tma_descriptors``: see ``tma_weights_apply``."""
    order, offsets, topk = rows
    b2, bias, bias2, scale, scale_mode, act_id, alpha, limit, pre, accumulate = epilogue
    num_rows = order.shape[0]
    num_experts, k_dim, n_dim = b.shape
    if tracing_launches():  # (eager shapes are ints already: this stays off the hot path)
        num_experts, k_dim, n_dim = static_dim(num_experts), static_dim(k_dim), static_dim(n_dim)
    gated = b2 is not None
    tabled = isinstance(b, WeightTable)  # per-expert tensors read through their addresses (pointer loads only)
    pairs = None if tabled else interleaved_pairs(b, b2)
    has_bias = bias is not None
    dummy = offsets
    # the config only changes speed, so a traced (symbolic) row count may pick it from its example value
    bucket = configs.rows_bucket(size_hint(num_rows) / max(num_experts, 1))
    # Every launch decision below depends only on this tuple, so it is made once per tuple: the per-call host work
    # is then one dict lookup, the argument list and the Triton launch (small T is host-bound).
    # (a symbolic row count never takes TMA: a dynamic graph serves small counts too, where it loses). Under "tuned"
    # the table decides per key, and only a key with a TMA entry pays for the per-call check of whether this call
    # can take it (below); "auto" and "on" check every call here.
    by_table = tma_weights == "tuned" and not tabled
    tma_ok = not by_table and not tabled and pairs is None and isinstance(num_rows, int) and tma_weights_apply(
        a, b, b2, num_rows, num_experts, tma_weights, tma_min_rows_per_expert, tma_descriptors,
        traced=tracing_launches())
    fixed_desc = (2 if tma_descriptors == "device" else 1) if tma_ok else 0
    b_nk = b.stride(1) == 1  # an (E, K, N) view of HF's (E, N, K) weight: the layout the TMA descriptor reads
    def rows_through_descriptor() -> bool:
        """Whether this call's sorted token rows can come through a descriptor made in the kernel (alignment is per
        call, so this is asked per call wherever a descriptor launch may run)."""
        return a_rows == ROWS_SORTED and rows_descriptor_ok(a, b.dtype)

    rows_ok = tma_ok and rows_through_descriptor()
    decision_key = (num_experts, n_dim, k_dim, a.dtype, gated, a_rows, c_rows, bucket, scale_mode, act_id, has_bias,
                    pre is not None, accumulate, a.device, autotune,
                    configs.interpreting(), pairs is not None, tail_split, by_table, fixed_desc, b_nk, rows_ok, tabled)
    decided = _GEMM_DECISIONS.get(decision_key)

    def run(cfg: configs.LaunchConfig, meta: dict) -> None:
        # m-tiles: sum over experts of cdiv(rows_e, BLOCK_M) < cdiv(M, BLOCK_M) + (experts with rows), and at most
        # min(E, M) experts have rows: at decode (M = T*k small, E large) most of the E extra tiles never exist
        # (a symbolic row count keeps the grid a plain expression: no min() over a symbol in Inductor's wrapper)
        busy = min(num_experts, num_rows) if isinstance(num_rows, int) else num_experts
        split = meta.get("SPLIT", 0)
        if split == 1:  # whole tiles only: at most M // BLOCK_M of them
            m_tiles = cdiv(num_rows, cfg.BLOCK_M)
        elif split == 2:  # each busy expert's tail, fewer than FULL_M rows, in at most this many tiles
            per_expert = cdiv(meta["FULL_M"] - 1, cfg.BLOCK_M)
            m_tiles = busy * per_expert
            if isinstance(num_rows, int):
                m_tiles = min(m_tiles, cdiv(num_rows, cfg.BLOCK_M) + busy)
        else:
            m_tiles = cdiv(num_rows, cfg.BLOCK_M) + busy
        tiles = m_tiles * cdiv(n_dim, cfg.BLOCK_N)
        grid = (tiles,)
        if meta["B_DESC"] == 2:
            ensure_scratch_allocator()
        if meta["PERSISTENT"]:  # (a static row count: only those take descriptors made in the kernel)
            # (the interpreter: a few programs, so that each walks several tiles as on a GPU)
            sms = _sm_count(a.device.index) if a.is_cuda else 2
            grid = (min(tiles, _PERSISTENT_PROGRAMS_PER_SM * sms),)
        b_ = pairs if pairs is not None else b
        b2_ = b2 if gated else b
        b_strides, b2_strides = b_.stride(), b2_.stride()
        tables = (dummy, dummy)
        if tabled:  # expert 0's weights, and each expert's distance from them
            tables = (b_.table, b2_.table)
            b_, b2_ = b_.like, b2_.like
        if meta["B_DESC"] == 1:  # (the strides above are then unused by the kernel)
            b_, b2_ = (weight_descriptor(w, cfg.BLOCK_K, cfg.BLOCK_N) for w in (b_, b2_))
        bias_ = bias if has_bias else dummy
        bias2_ = bias2 if (has_bias and gated) else bias_
        pre_ = pre if pre is not None else out
        args = (
            a, b_, b2_, bias_, bias2_, out, pre_, order, scale if scale is not None else dummy, offsets, *tables,
            n_dim, k_dim, topk, a.shape[0], tiles,
            a.stride(0), a.stride(1),
            b_strides[0], b_strides[1], b_strides[2],
            b2_strides[0], b2_strides[1], b2_strides[2],
            bias_.stride(0) if has_bias else 0, bias_.stride(-1) if has_bias else 0,
            bias2_.stride(0) if has_bias else 0, bias2_.stride(-1) if has_bias else 0,
            out.stride(0), out.stride(1), pre_.stride(0), pre_.stride(1),
            float(alpha), float(limit),
        )
        launch_kernel(grouped_gemm_kernel, grid, args, meta)

    def table_tma_ok() -> bool:
        """Whether this call can take a "tuned" TMA entry (hardware, dtype, weight strides; a static row count)."""
        return pairs is None and isinstance(num_rows, int) and tma_weights_apply(
            a, b, b2, num_rows, num_experts, "tuned", tma_min_rows_per_expert, "device", traced=tracing_launches())

    if decided is None:
        def meta_for(cfg: configs.LaunchConfig, split: int = 0, full_m: int = 1, b_desc: int = fixed_desc,
                     a_desc: bool = rows_ok) -> dict:
            a_desc = b_desc == 2 and a_desc
            return dict(
                NUM_EXPERTS=num_experts, E_POW2=next_pow2(num_experts),
                A_ROWS=a_rows, C_ROWS=c_rows, SCALE_MODE=scale_mode,
                GATED=gated, ACT=act_id, HAS_BIAS=has_bias, SAVE_PRE=pre is not None,
                ACCUMULATE=accumulate, UPCAST=configs.interpreting(), DOT_PRECISION=_dot_precision(a.dtype),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                EVEN_K=k_dim % cfg.BLOCK_K == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                INTERLEAVED=pairs is not None, SPLIT=split, FULL_M=full_m, B_DESC=b_desc, B_NK=b_desc > 0 and b_nk,
                A_DESC=a_desc, PERSISTENT=b_desc == 2, B_TABLE=b.aligned_elements if tabled else 0,
            )

        def launches(cfg: configs.LaunchConfig, tail: configs.LaunchConfig | None) -> tuple:
            """(config, constexprs) of each launch: one over every row, or, with a ``tail`` config of smaller tiles,
            ``cfg``'s whole tiles and then every expert's remaining rows in ``tail``'s."""
            if tail is None or tail.BLOCK_M >= cfg.BLOCK_M:
                return ((cfg, meta_for(cfg)),)
            return ((cfg, meta_for(cfg, 1)), (tail, meta_for(tail, 2, cfg.BLOCK_M)))

        key = f"gemm|E{num_experts}|N{n_dim}|K{k_dim}|{a.dtype}|g{int(gated)}|a{a_rows}|c{c_rows}|m{bucket}"
        if pairs is not None:
            key += "|il"
        default = configs.default_gemm_config(bucket, n_dim, k_dim, a.dtype, gated)
        # Tuning re-runs the launch, so an accumulating launch borrows the config of its plain twin.
        cfg = configs.TABLE.lookup(key) or (
            default if accumulate else _pick(key, default, lambda: configs.gemm_candidates(a.dtype),
                                             lambda c: run(c, meta_for(c)), autotune=autotune)
        )
        tail = None
        if tail_split and cfg.BLOCK_M > 16:
            # no tail entry means no split: the tuner stores one only where the pair beat the one launch (it is
            # among the candidates, as a "tail" of the same BLOCK_M)
            tail_key = key + "|tail"
            tail = configs.TABLE.lookup(tail_key) or (
                None if accumulate else _pick(tail_key, cfg, lambda: configs.tail_candidates(cfg, a.dtype, gated),
                                              lambda c: [run(*x) for x in launches(cfg, c)], autotune=autotune))
        decided = launches(cfg, tail)
        cache = not autotune or accumulate or configs.TABLE.lookup(key) is not None
        tma_parts = None
        if by_table and pairs is None and a.dtype.itemsize == 2:
            # the table's TMA entry for this key: a tile for the persistent descriptor launch, or POINTERS where the
            # tuner measured these launches (its first candidate) no slower by the margin; no entry: these. The
            # entries are measured on the forward's (E, N, K) weight views; another layout has a key of its own.
            tma_key = key + ("|tma" if b_nk else "|kn|tma")
            pointers = decided
            rows_now = rows_through_descriptor()

            def run_tma(c: configs.LaunchConfig) -> None:
                for part in pointers if c == configs.POINTERS else ((c, meta_for(c, b_desc=2, a_desc=rows_now)),):
                    run(*part)

            chosen = configs.TABLE.lookup(tma_key)
            if chosen is None and not accumulate and autotune:
                cache = False  # (a default for now: a later tuning run, after a capture, may measure it)
                if table_tma_ok():
                    chosen = _pick(tma_key, configs.POINTERS, lambda: configs.tma_candidates(cfg, a.dtype, gated),
                                   run_tma, autotune=True, first_margin=_TMA_MARGIN)
                    cache = configs.TABLE.lookup(tma_key) is not None
            if chosen is not None and chosen != configs.POINTERS:
                # by whether the call's sorted rows can come through a descriptor too
                tma_parts = {flag: ((chosen, meta_for(chosen, b_desc=2, a_desc=flag)),) for flag in (False, True)}
        decided = (decided, tma_parts)
        if cache:
            _GEMM_DECISIONS[decision_key] = decided
    parts, tma_parts = decided
    if tma_parts is not None and table_tma_ok():  # (the entry's key is taken; this call's strides may not be)
        parts = tma_parts[rows_through_descriptor()]
    with device_guard(a):
        for part in parts:
            run(*part)


# A TMA candidate displaces the pointer launches only when this fraction faster: repeated do_bench medians of one
# launch differ by about 1% on the H200, and a win within that is not worth a second kernel variant.
_TMA_MARGIN = 0.02

# Programs per SM of a persistent launch. One: at the tuned 8-warp configs a persistent program needs over half an
# SM's registers, so a second one per SM would only start once the first has walked all its tiles.
_PERSISTENT_PROGRAMS_PER_SM = 1


@functools.lru_cache(maxsize=None)
def _sm_count(index: Optional[int]) -> int:
    """Streaming multiprocessors of CUDA device ``index``; asked per persistent launch."""
    index = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


# (shape, dtype, flags, bucket, device) -> ((config, the kernel's constexpr arguments) of each of its pointer launches
# (one, or two with a tail split), and under "tuned" the TMA launch of a table entry, by whether the sorted rows come
# through a descriptor too, or None); see launch_grouped_gemm.
_GEMM_DECISIONS: dict[tuple, tuple[tuple[tuple[configs.LaunchConfig, dict], ...], Optional[dict]]] = {}


def launch_kernel(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, or through ``wrap_triton`` while traced (see ``tracing_launches``): every
    launch of ours (routing, GEMMs, combine) goes through here."""
    if isinstance(kernel, LazyKernel):
        kernel = kernel.resolve()
    if tracing_launches():
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def launch_grouped_weight_grad(a: torch.Tensor, g: torch.Tensor, rows: Rows, dw: torch.Tensor, *, a_rows: int,
                               g_rows: int, scale: Optional[torch.Tensor] = None, autotune: bool = False) -> None:
    """dw[e] (K, N) = a_e^T @ (scale * g_e); every expert's block is written, zeros for empty experts.
    ``autotune`` as in ``launch_grouped_gemm``."""
    order, offsets, topk = rows
    num_experts, k_dim, n_dim = dw.shape
    if tracing_launches():
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


def launch_expert_row_sums(g: torch.Tensor, rows: Rows, out: torch.Tensor, *, g_rows: int,
                           scale: Optional[torch.Tensor] = None) -> None:
    """row_sums.py's kernel: ``out`` (E, N) = per expert, the sum of the rows of ``g`` its sorted rows read
    (``g_rows`` a row mode of grouped_gemm.py), each times ``scale`` of its assignment where given; zeros for an
    empty expert. ``out``'s rows must be dense."""
    order, offsets, topk = rows
    num_experts, n_dim = out.shape
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"moe_inductor: expert row sums are written to dense rows; got strides {out.stride()}")
    if tracing_launches():
        num_experts, n_dim = static_dim(num_experts), static_dim(n_dim)
    block_m, block_n = (16, 32) if configs.interpreting() else (32, 128)
    with device_guard(g):
        launch_kernel(expert_row_sums_kernel, (num_experts, cdiv(n_dim, block_n)),
                      (g, out, order, scale if scale is not None else offsets, offsets, n_dim, topk,
                       g.stride(0), g.stride(1), out.stride(0)),
                      dict(G_ROWS=g_rows, HAS_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                           num_warps=4))


class KernelActivation(NamedTuple):
    """An activation as the kernels take it: gated or not, its epilogue id (grouped_gemm.py), GPT-OSS's parameters."""

    gated: bool
    act_id: int
    alpha: float
    limit: float


class SortedRouting(NamedTuple):
    """What the elementwise kernels read of a call's routing: the routing weight of each assignment (M,), the
    expert-sorted ``order`` (M,), the expert of each sorted row (``num_experts`` for a dropped row)."""

    scale: torch.Tensor
    order: torch.Tensor
    sorted_expert: torch.Tensor
    num_experts: int


# Up to this many routed rows one program does everything in one launch; above it, programs of CHUNK_ROWS rows,
# which sort their chunks in parallel (benchmarks/RESULTS.md has the timings).
SINGLE_LAUNCH_MAX_ROWS = 1024
CHUNK_ROWS = 1024


def launch_route(topk_ids: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                 chunked: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, sorted_expert, offsets) of ``topk_ids`` (T, k) by the kernels of routing.py, equal to
    ``ops.routing.route_reference``.

    ``chunked``: take the count-then-place path (two launches), which is right for every row count; by default only
    a symbolic row count (a dynamic graph) does, and a known one picks one launch when it fits in one chunk.
    """
    T, k = topk_ids.shape
    if tracing_launches():
        k, num_experts = static_dim(k), static_dim(num_experts)
    M = T * k
    ids = topk_ids.contiguous()
    order = ids.new_empty(M, dtype=torch.int32)
    sorted_expert = ids.new_empty(M, dtype=torch.int32)
    offsets = ids.new_empty(num_experts + 1, dtype=torch.int32)
    bins = next_pow2(num_experts + 1)
    if chunked is None:
        chunked = tracing_launches() and not isinstance(M, int)  # deciding on a symbolic M would guard on it
    if chunked:
        chunk = 16 if configs.interpreting() else CHUNK_ROWS
        num_chunks, single, t_rows = torch.sym_max(cdiv(M, chunk), 1), False, torch.sym_max(T, 1)
    else:
        # One chunk (and one launch) covers small batches; large ones are split so the per-program sort stays small.
        chunk = 16 if configs.interpreting() else (SINGLE_LAUNCH_MAX_ROWS if M <= SINGLE_LAUNCH_MAX_ROWS else CHUNK_ROWS)
        num_chunks, t_rows = max(cdiv(M, chunk), 1), max(T, 1)
        single = num_chunks == 1
    # the per-chunk histograms; one chunk counts in registers, and its kernel never reads this (order stands in)
    # (flat: a symbolic (num_chunks, bins) shape would make tracing guard on num_chunks == 1, i.e. on the token count)
    counts = order if single else ids.new_empty(num_chunks * bins, dtype=torch.int32)
    meta = dict(CHOICE_MAJOR=capacity is not None, TOPK=k, CHUNK=chunk, BINS=bins, SINGLE=single,
                num_warps=8 if chunk > 1024 else 4)
    cap = M + 1 if capacity is None else capacity
    with device_guard(ids):
        if not single:
            launch_kernel(route_count_kernel, (num_chunks,), (ids, counts, M, t_rows, num_experts),
                          dict(CHOICE_MAJOR=meta["CHOICE_MAJOR"], TOPK=k, CHUNK=chunk, BINS=bins))
        launch_kernel(route_place_kernel, (num_chunks,),
                      (ids, counts, order, sorted_expert, offsets, M, t_rows, num_experts, cap, num_chunks), meta)
    return order, sorted_expert, offsets


def launch_combine(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                   row_of: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y (T, H) by combine.py's kernel: the sum over k of ``rows`` (T*k, H), skipping out-of-range ids; ``row_of``
    and ``scale`` as the kernel's INDEXED and SCALED; ``bias`` (E, H): each assignment's row gets its expert's
    bias added before its scale."""
    T, k = topk_ids.shape
    H = rows.shape[1]
    y = rows.new_empty(T, H)
    if tracing_launches():
        k, H, num_experts = static_dim(k), static_dim(H), static_dim(num_experts)
    bias_c = bias.contiguous() if bias is not None else None
    if T > 0:
        block_h = min(1024, next_pow2(H))
        with device_guard(rows):
            launch_kernel(combine_kernel, (T, cdiv(H, block_h)),
                          (rows, topk_ids.contiguous(), y, row_of if row_of is not None else rows,
                           scale if scale is not None else rows, bias_c if bias_c is not None else rows, H,
                           rows.stride(0), y.stride(0), bias_c.stride(0) if bias_c is not None else 0),
                          dict(NUM_EXPERTS=num_experts, TOPK=k, BLOCK_H=block_h, INDEXED=row_of is not None,
                               SCALED=scale is not None, BIASED=bias_c is not None))
    return y


def launch_backward_middle(pre: torch.Tensor, g: torch.Tensor, routing: SortedRouting,
                           biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]], outs: tuple,
                           act: KernelActivation, scale_h: bool = False, whole: Optional[str] = None) -> None:
    """backward_middle.py's kernel: writes ``outs`` = (h, d_gate, d_up or None, d_scale) from the raw up projection
    ``pre`` and ``g`` = dy @ W2^T; ``biases`` = (b1, b1_up), both None without biases. d_up, where given, has
    d_gate's strides: dense columns, or the odd columns of one (M, 2I) tensor whose even columns are d_gate.
    ``whole``: d_gate is one (M, 2I) tensor holding both, as "halves" or "pairs" (d_up then None): what a traced
    launch needs, since Inductor clones a view it writes without the rest of its storage."""
    h, d_gate, d_up, d_scale = outs
    if whole is not None and (whole not in ("halves", "pairs") or d_up is not None or not act.gated
                              or d_gate.shape[1] != 2 * g.shape[1] or d_gate.stride(1) != 1):
        raise ValueError(f"moe_inductor: a whole d_pre ({whole!r}) must be one dense (M, 2I) tensor of a gated "
                         f"activation, got {tuple(d_gate.shape)} with strides {d_gate.stride()}")
    if d_up is not None and d_up.stride() != d_gate.stride():
        raise ValueError(f"moe_inductor: d_gate and d_up must share strides; got {d_gate.stride()} and {d_up.stride()}")
    pairs = whole == "pairs" or (d_up is not None and d_gate.stride(1) == 2
                                 and d_up.storage_offset() == d_gate.storage_offset() + 1)
    if whole is None and d_gate.shape[1] > 1 and d_gate.stride(1) != 1 and not pairs:
        raise ValueError("moe_inductor: d_gate's columns must be dense, or with d_up the even and odd columns of one "
                         f"tensor; got strides {d_gate.stride()}, storage offsets {d_gate.storage_offset()} and "
                         f"{d_up.storage_offset() if d_up is not None else None}")
    M, I = g.shape
    num_experts = routing.num_experts
    if tracing_launches():
        I, num_experts = static_dim(I), static_dim(num_experts)
    b1, b1_up = biases
    has_bias = b1 is not None
    b1c = b1.contiguous() if has_bias else g
    b1_upc = b1_up.contiguous() if has_bias and act.gated else b1c
    if M:
        # pairs join two (BLOCK_M, BLOCK_I) tiles before their store: half the width keeps that in registers (at 256
        # it spills on sm_90; tests/test_sm90_compile.py)
        block_m, block_i = (16, 32) if configs.interpreting() else (16, 128 if pairs else 256)
        with device_guard(g):
            launch_kernel(
                backward_middle_kernel, (cdiv(M, block_m),),
                (pre, g, routing.scale, routing.order, routing.sorted_expert, b1c, b1_upc, h, d_gate,
                 d_up if act.gated and whole is None else pre, d_scale,  # (pre: never written there)
                 M, I, pre.stride(0), g.stride(0), h.stride(0), d_gate.stride(0),
                 b1c.stride(0) if has_bias else 0,
                 float(act.alpha), float(act.limit)),
                dict(NUM_EXPERTS=num_experts, GATED=act.gated, ACT=act.act_id, HAS_BIAS=has_bias, BLOCK_M=block_m,
                     BLOCK_I=block_i, SCALE_H=scale_h, PAIRS=pairs, UP_AFTER_GATE=whole == "halves",
                     num_warps=4),
            )


def launch_activation(pre: torch.Tensor, act: KernelActivation, interleaved: bool = False,
                      biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
                      sorted_expert: Optional[torch.Tensor] = None,
                      pre_out: Optional[torch.Tensor] = None, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h (M, I) = act(pre) by activation.py's kernel; ``pre`` (M, 2I) holds [gate | up] when gated, or (gate, up)
    pairs in its even and odd columns when ``interleaved``; with ``up`` (M, I) given, ``pre`` (M, I) is the gate
    alone. ``biases`` = (b1, b1_up), (E, I) each, added per row by its expert (``sorted_expert``); ``pre_out``
    (M, 2I): also write pre there as [gate | up] halves."""
    M = pre.shape[0]
    separate = up is not None
    if separate and (not act.gated or interleaved or up.shape != pre.shape or up.stride(1) != 1
                     or pre.stride(1) != 1):
        raise ValueError("moe_inductor: a separate up projection needs a gated activation and two (M, I) row-major "
                         f"halves, got {tuple(pre.shape)} and {tuple(up.shape)}")
    I = pre.shape[1] // (2 if act.gated and not separate else 1)
    h = pre.new_empty(M, I)
    b1, b1_up = biases
    has_bias = b1 is not None
    if has_bias and sorted_expert is None:
        raise ValueError("moe_inductor: biases in the activation pass need each row's expert (sorted_expert)")
    b1c = b1.contiguous() if has_bias else pre
    b1_upc = b1_up.contiguous() if has_bias and act.gated else b1c
    if M:
        block_m, block_i = (16, 32) if configs.interpreting() else (8, 512)
        with device_guard(pre):
            launch_kernel(activation_kernel, (cdiv(M, block_m), cdiv(I, block_i)),
                          (pre, h, sorted_expert if has_bias else pre, b1c, b1_upc,
                           pre_out if pre_out is not None else pre, up if separate else pre, M, I, pre.stride(0),
                           h.stride(0), b1c.stride(0) if has_bias else 0,
                           pre_out.stride(0) if pre_out is not None else 0, up.stride(0) if separate else 0,
                           float(act.alpha), float(act.limit)),
                          dict(GATED=act.gated, ACT=act.act_id, BLOCK_M=block_m, BLOCK_I=block_i,
                               INTERLEAVED=interleaved and act.gated, HAS_BIAS=has_bias,
                               NUM_EXPERTS=b1c.shape[0] if has_bias else 1, STORE_PRE=pre_out is not None,
                               SEPARATE_UP=separate, num_warps=4))
    return h
