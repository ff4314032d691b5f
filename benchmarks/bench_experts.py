"""Experts forward (and forward+backward) on the GPU: moe_inductor against the paths users have today.

    python benchmarks/bench_experts.py --json results.json          # the full table (bf16, random data)
    python benchmarks/bench_experts.py --shapes qwen3 --tokens 4096  # one row

Columns, all from one run (do_bench medians, ms):
  ours          moe_inductor.fused_experts (its default engine choice; ``engine`` says which ran)
  ours_fused    the same with config.gemm_engine = "triton" (our fused kernels only), where "auto" chose
                torch._grouped_mm for the GEMMs (ops/grouped_mm_engine.py)
  sort_gmm      sort + torch._grouped_mm twice + unpermute (the reference path)
  hf_eager      transformers' grouped_mm experts forward (a Qwen3MoeExperts module of this shape)
  hf_compile    the same under torch.compile (Inductor, static shapes)
  liger         Liger-Kernel's fused MoE (``LigerFusedMoEFunction``: SwiGLU, HF's (E, 2I, H)/(E, H, I) weights), where
                installed (``pip install -e '.[bench]'``) and asked for (``--liger-shapes``); its own autotuner picks
                its configs at its first call for each (H, I), made at the run's largest T (``liger_first_call_s``)
  dense         a dense cuBLAS GEMM pair with the same FLOPs (T*k rows)
  floor         max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s), the ceilings measured on this H200 model
Peak memory is torch.cuda.max_memory_allocated above the inputs, in MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

import moe_inductor

SHAPES = {  # name: (H, I, E, k)
    "mixtral": (4096, 14336, 8, 2),
    "qwen3": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "gptoss": (2880, 2880, 32, 4),
    "deepseekv3": (7168, 2048, 256, 8),
}
PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def hf_expert_weights(shape: str, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (E, 2I, H) gate_up and (E, H, I) down weights of a named shape, in HF's layout, scaled like a
    trained layer (variance 1/fan-in)."""
    H, I, E, _ = SHAPES[shape]
    w1 = torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H ** -0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype) * I ** -0.5
    return w1, w2


def make_routing(T, E, k, skew: bool, gen, device):
    if skew:  # Zipf over experts: expert r gets weight 1/(r+1)
        probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float)
        ids = torch.multinomial(probs.expand(T, E), k, replacement=False, generator=gen)
    else:
        ids = torch.randn(T, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    return ids.to(device), weights.to(device)


def floor_ms(T, H, I, E, k) -> float:
    flops = 2 * T * k * (H * 2 * I + I * H)
    experts_touched = E * (1 - (1 - 1 / E) ** (T * k))
    bytes_ = 2 * (experts_touched * 3 * H * I + 2 * T * H)
    return max(flops / PEAK_FLOPS, bytes_ / PEAK_BYTES) * 1e3


def sort_grouped_mm(x, ids, weights, w1_kn, w2_kn):
    """The reference path: sort, gather, torch._grouped_mm twice, unpermute, sum over k."""
    T, k = ids.shape
    E = w1_kn.shape[0]
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    xs = x[perm // k]
    counts = torch.histc(sorted_ids.int(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gu = torch._grouped_mm(xs, w1_kn, offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    out = torch._grouped_mm(h, w2_kn, offs=offs) * weights.reshape(-1)[perm, None]
    y = torch.empty_like(out)
    y[perm] = out
    return y.view(T, k, -1).sum(1)


def liger_experts():
    """Liger-Kernel's fused MoE as ``fn(x, ids, weights, gate_up (E, 2I, H), down (E, H, I)) -> y``, or None where
    liger-kernel is not installed. It takes int32 ids (``ids`` must already be int32) and SwiGLU experts only."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    return lambda x, ids, weights, w1, w2: LigerFusedMoEFunction.apply(x, w1, w2, ids, weights)


def liger_warmup(liger, shape: str, T: int, w1, w2) -> float:
    """Liger's first call for this shape, in seconds. Its autotuner keys on (H, I) alone, so whatever token count
    comes first fixes its configs for every T: it is tuned here at the largest T of the run (where the time goes),
    not at the smallest."""
    H, I, E, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(1)  # its own: the rows' data stays that of runs without Liger
    x = torch.randn(T, H, generator=gen).to("cuda", w1.dtype)
    ids, weights = make_routing(T, E, k, False, gen, "cuda")
    t0 = time.perf_counter()
    liger(x, ids.to(torch.int32), weights.to(x.dtype), w1, w2)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def liger_version() -> str:
    """The installed liger-kernel's version, or "not installed"."""
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "not installed"


def hf_experts_module(H, I, E, k, w1, w2):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w1, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return mod


@contextlib.contextmanager
def gemm_engine(name: str):
    old = moe_inductor.config.gemm_engine
    moe_inductor.config.gemm_engine = name
    try:
        yield
    finally:
        moe_inductor.config.gemm_engine = old


def engine_chosen(x, ids, w1, w2, backward: bool = False) -> str:
    """Which engine the op's default rule picks for these inputs (the fused_experts call's own views), for the
    forward or the backward."""
    from moe_inductor.ops import expert_weight_views, grouped_mm_engine

    g, u, d, _, _ = expert_weight_views(w1, w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    picked = grouped_mm_engine.grouped_mm_weights(x, g, u, d, None, None, "output", False, ids.numel(),
                                                  backward=backward)
    return "grouped_mm" if picked is not None else "triton"


def run_shape(name, tokens, skews, do_backward, do_hf, rows, skew_tokens=None, liger=None):
    H, I, E, k = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    w1, w2 = hf_expert_weights(name, dev, dt)
    w1_kn, w2_kn = w1.transpose(1, 2), w2.transpose(1, 2)
    liger_first_call_s = liger_warmup(liger, name, max(tokens), w1, w2) if liger is not None else None
    hf_fwd = hf_compiled = None
    if do_hf:
        from transformers.integrations.moe import grouped_mm_experts_forward

        mod = hf_experts_module(H, I, E, k, w1, w2)
        hf_fwd = partial(grouped_mm_experts_forward, mod)
    for T in tokens:
        for skew in skews:
            if skew and skew_tokens is not None and T not in skew_tokens:
                continue
            x = torch.randn(T, H, device=dev, dtype=dt)
            ids, weights = make_routing(T, E, k, skew, gen, dev)
            weights = weights.to(dt)
            row = {"shape": name, "H": H, "I": I, "E": E, "k": k, "T": T, "routing": "zipf" if skew else "balanced"}
            ours = lambda: moe_inductor.fused_experts(x, ids, weights, w1, w2)  # noqa: E731
            ref = lambda: sort_grouped_mm(x, ids, weights, w1_kn, w2_kn)  # noqa: E731
            with torch.no_grad():
                y_ours, y_ref = ours(), ref()
                err = ((y_ours.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
                row["rel_err_vs_ref"] = err
                row["ours"] = bench(ours)
                row["sort_gmm"] = bench(ref)
                row["mem_ours_mib"] = peak_mib(ours)
                row["engine"] = engine_chosen(x, ids, w1, w2)
                if row["engine"] != "triton":
                    with gemm_engine("triton"):
                        row["ours_fused"] = bench(ours)
                row["mem_sort_gmm_mib"] = peak_mib(ref)
                if liger is not None:
                    ids32 = ids.to(torch.int32)  # converted outside the timing: Liger's call itself takes int32
                    lig = lambda: liger(x, ids32, weights, w1, w2)  # noqa: E731
                    y_lig = lig()
                    row["rel_err_liger_vs_ref"] = ((y_lig.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
                    row["liger"] = bench(lig)
                    row["mem_liger_mib"] = peak_mib(lig)
                if hf_fwd is not None:
                    row["hf_eager"] = bench(lambda: hf_fwd(x, ids, weights))
                    if not skew:
                        if hf_compiled is None:  # compiled once per shape, default dynamic=None, as a user would
                            hf_compiled = torch.compile(hf_fwd)
                        row["hf_compile"] = bench(lambda: hf_compiled(x, ids, weights))
                if not skew:
                    xd = torch.randn(T * k, H, device=dev, dtype=dt)
                    wa, wb = torch.randn(H, 2 * I, device=dev, dtype=dt), torch.randn(I, H, device=dev, dtype=dt)
                    row["dense"] = bench(lambda: (xd @ wa)[:, :I] @ wb)
            row["floor"] = floor_ms(T, H, I, E, k)
            if liger_first_call_s is not None:
                row["liger_first_call_s"] = liger_first_call_s
            if do_backward and not skew and T in (4096,):
                row.update(bench_backward(x, ids, weights, w1, w2, w1_kn, w2_kn, liger=liger))
                # the fused kernels alone, where the default hands the forward's or the backward's GEMMs to CUTLASS
                if row["engine"] != "triton" or engine_chosen(x, ids, w1, w2, backward=True) != "triton":
                    with gemm_engine("triton"):
                        fused = bench_backward(x, ids, weights, w1, w2, w1_kn, w2_kn, ours_only=True)
                    row["fwdbwd_ours_fused"] = fused["fwdbwd_ours"]
            rows.append(row)
            print(format_row(row), flush=True)
    torch.cuda.empty_cache()


def bench_backward(x, ids, weights, w1, w2, w1_kn, w2_kn, ours_only=False, liger=None):
    xg = x.detach().requires_grad_()
    wg = weights.detach().requires_grad_()
    w1g = w1.detach().requires_grad_()
    w2g = w2.detach().requires_grad_()
    dy = torch.randn_like(x)

    def ours():
        y = moe_inductor.fused_experts(xg, ids, wg, w1g, w2g)
        torch.autograd.grad(y, (xg, wg, w1g, w2g), dy)

    def ref():
        y = sort_grouped_mm(xg, ids, wg, w1g.transpose(1, 2), w2g.transpose(1, 2))
        torch.autograd.grad(y, (xg, wg, w1g, w2g), dy)

    if ours_only:
        return {"fwdbwd_ours": bench(ours, 10, 50)}
    out = {"fwdbwd_ours": bench(ours, 10, 50), "fwdbwd_sort_gmm": bench(ref, 10, 50),
           "mem_fwdbwd_ours_mib": peak_mib(ours), "mem_fwdbwd_sort_gmm_mib": peak_mib(ref)}
    if liger is not None:
        ids32 = ids.to(torch.int32)

        def lig():
            y = liger(xg, ids32, wg, w1g, w2g)
            torch.autograd.grad(y, (xg, wg, w1g, w2g), dy)

        out.update(fwdbwd_liger=bench(lig, 10, 50), mem_fwdbwd_liger_mib=peak_mib(lig))
    return out


COLUMNS = ["ours", "sort_gmm", "hf_eager", "hf_compile", "liger", "dense", "floor"]


def format_row(r) -> str:
    cells = [f"{r['shape']:<10} T={r['T']:<6} {r['routing']:<8}"]
    for c in COLUMNS:
        cells.append(f"{c}={r[c]:.3f}" if c in r else f"{c}=-")
    best_other = min((r[c] for c in ("sort_gmm", "hf_eager", "hf_compile") if c in r), default=float("nan"))
    cells.append(f"ours/best={r['ours'] / best_other:.2f} engine={r['engine']}")
    if "ours_fused" in r:
        cells.append(f"ours_fused={r['ours_fused']:.3f}")
    if "fwdbwd_ours" in r:
        cells.append(f"fwdbwd ours={r['fwdbwd_ours']:.3f} ref={r['fwdbwd_sort_gmm']:.3f}"
                     f" fused={r.get('fwdbwd_ours_fused', float('nan')):.3f}")
    if "liger" in r:
        cells.append(f"ours/liger={r['ours'] / r['liger']:.2f} liger_err={r['rel_err_liger_vs_ref']:.1e}")
    if "fwdbwd_liger" in r:
        cells.append(f"fwdbwd liger={r['fwdbwd_liger']:.3f}")
    cells.append(f"mem ours={r['mem_ours_mib']:.0f}MiB ref={r['mem_sort_gmm_mib']:.0f}MiB err={r['rel_err_vs_ref']:.1e}")
    return " ".join(cells)


def markdown(rows, liger_missing: str = "–") -> str:
    """The rows as a markdown table; ``liger_missing`` fills Liger's cells where it did not run ("not installed"
    where the package is absent)."""
    head = ("| shape | T | routing | ours | engine | ours, fused kernels only | sort+_grouped_mm | HF eager | HF compile "
            "| Liger | dense | floor | ours / best other | ours / Liger | fwd+bwd ours | fwd+bwd fused only "
            "| fwd+bwd sort+gmm | fwd+bwd Liger | peak MiB ours / ref |")
    lines = [head, "|" + "---|" * 19]
    for r in rows:
        others = [r[c] for c in ("sort_gmm", "hf_eager", "hf_compile") if c in r]
        f = lambda c, missing="–": f"{r[c]:.3f}" if c in r else missing  # noqa: E731
        vs_liger = f"{r['ours'] / r['liger']:.2f}" if "liger" in r else liger_missing
        lines.append(
            f"| {r['shape']} | {r['T']} | {r['routing']} | {f('ours')} | {r['engine']} | {f('ours_fused')} | "
            f"{f('sort_gmm')} | {f('hf_eager')} | {f('hf_compile')} | {f('liger', liger_missing)} | {f('dense')} | "
            f"{f('floor')} | {r['ours'] / min(others):.2f} | {vs_liger} | {f('fwdbwd_ours')} | "
            f"{f('fwdbwd_ours_fused')} | {f('fwdbwd_sort_gmm')} | {f('fwdbwd_liger', liger_missing)} | "
            f"{r['mem_ours_mib']:.0f} / {r['mem_sort_gmm_mib']:.0f} |"
        )
    return "\n".join(lines)


def routing_check_cost(T: int = 4096, shape: str = "qwen3") -> dict:
    """The compiled op with its device-side routing-id check (``config.validate_routing``, on by default) against
    the same op without it, each under torch.compile (Inductor): what the check costs in a compiled graph."""
    H, I, E, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = make_routing(T, E, k, False, gen, "cuda")
    w1, w2 = hf_expert_weights(shape, "cuda", torch.bfloat16)
    times = {}
    for check in (True, False):
        moe_inductor.config.validate_routing = check
        torch._dynamo.reset()
        fn = torch.compile(lambda x, ids, w: moe_inductor.fused_experts(x, ids, w.to(x.dtype), w1, w2))
        with torch.no_grad():
            fn(x, ids, weights)
            times[check] = bench(lambda: fn(x, ids, weights))
    moe_inductor.config.validate_routing = False
    return {"shape": shape, "T": T, "with_check_ms": times[True], "without_check_ms": times[False],
            "check_share": times[True] / times[False] - 1.0}


def gptoss_weights(gen: torch.Generator, device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """GPT-OSS's experts weights as the model holds them, drawn from ``gen``: (E, H, 2I) gate_up with interleaved
    columns, (E, I, H) down, and their biases."""
    H, I, E, _ = SHAPES["gptoss"]
    return ((torch.randn(E, H, 2 * I, generator=gen) * H ** -0.5).to(device, dtype),
            (torch.randn(E, I, H, generator=gen) * I ** -0.5).to(device, dtype),
            (torch.randn(E, 2 * I, generator=gen) * 0.02).to(device, dtype),
            (torch.randn(E, H, generator=gen) * 0.02).to(device, dtype))


def gptoss_layout(T: int) -> dict:
    """GPT-OSS's experts as the model holds them: (E, H, 2I) gate_up with interleaved columns, biases, the clamped
    glu. ``ours`` reads the interleaved weight as one contiguous tile per step; ``ours_strided`` passes gate and up
    as stride-2 views of two copies, which the kernel cannot pair (how every interleaved weight ran before);
    ``ours_mild_skew_fused`` is ``ours_fused`` on a mildly uneven routing like the model's;
    ``sort_gmm`` is HF's grouped_mm path (one GEMM over the whole weight, the glu on its columns). ``engine``: whether
    "auto" gives the GEMMs to ``torch._grouped_mm`` at this T; ``ours_fused`` is the same call on our fused kernels
    only, and ``fwd_bwd_*`` time forward + backward of each (every input a leaf); ``fwd_bwd_whole*`` with the gate_up
    weight passed to the op whole, as a compiled training step does."""
    H, _, E, k = SHAPES["gptoss"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = make_routing(T, E, k, False, gen, "cuda")
    weights = weights.to(torch.bfloat16)
    gate_up, down, b_gate_up, b_down = gptoss_weights(gen, "cuda", torch.bfloat16)
    kw = dict(activation="gptoss_glu", layout="kn", b2=b_down)
    ours = partial(moe_inductor.fused_experts, x, ids, weights, gate_up, down, b1=b_gate_up, gate_up="interleaved",
                   **kw)
    # the model's own routing is mildly uneven (the busiest of 32 experts about 2.2x the mean at T = 1024, RESULTS.md
    # seventeenth session): expert weights exp(0.5 N(0, 1)) give about that
    mild = torch.multinomial(torch.exp(0.5 * torch.randn(E, generator=gen)).expand(T, E), k, replacement=False,
                             generator=gen).to("cuda")
    ours_mild = partial(moe_inductor.fused_experts, x, mild, weights, gate_up, down, b1=b_gate_up,
                        gate_up="interleaved", **kw)
    apart = (gate_up.clone()[..., 0::2], gate_up.clone()[..., 1::2])
    strided = partial(moe_inductor.fused_experts, x, ids, weights, apart, down, b1=(b_gate_up[:, 0::2],
                      b_gate_up[:, 1::2]), **kw)

    def sort_gmm():
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        rows = x[order // k]
        h = torch._grouped_mm(rows, gate_up, offs=offs) + b_gate_up[flat[order]]
        g, u = h[:, 0::2].clamp(max=7.0), h[:, 1::2].clamp(-7.0, 7.0)
        act = (u + 1) * g * torch.sigmoid(1.702 * g)
        o = torch._grouped_mm(act, down, offs=offs) + b_down[flat[order]]
        y = torch.empty_like(o).index_copy_(0, order, o)
        return (y.view(T, k, H) * weights[..., None]).sum(1)

    def fused(fn):  # the same call on our fused kernels only, wherever "auto" would pick the engine
        def run():
            engine, moe_inductor.config.gemm_engine = moe_inductor.config.gemm_engine, "triton"
            try:
                return fn()
            finally:
                moe_inductor.config.gemm_engine = engine
        return run

    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, gate_up, down, b_gate_up, b_down)]
    dy = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)

    def fwd_bwd():
        lx, lw, lgu, ld, lbgu, lbd = leaves
        y = moe_inductor.fused_experts(lx, ids, lw, lgu, ld, b1=lbgu, gate_up="interleaved", activation="gptoss_glu",
                                       layout="kn", b2=lbd)
        torch.autograd.grad(y, leaves, dy)

    from moe_inductor.ops import grouped_mm_engine

    E_rows = T * k / E
    engine_ran = grouped_mm_engine.grouped_mm_weights(
        x, gate_up[..., 0::2], gate_up[..., 1::2], down, b_gate_up[:, 0::2], b_down, "output", False, T * k) is not None
    with torch.no_grad():
        err = (ours().float() - sort_gmm().float()).norm() / sort_gmm().float().norm()
        err_fused = (fused(ours)().float() - sort_gmm().float()).norm() / sort_gmm().float().norm()
        row = {"shape": "gptoss (HF layout)", "T": T, "rows_per_expert": E_rows, "engine": engine_ran,
               "ours": bench(ours), "ours_fused": bench(fused(ours)), "ours_strided": bench(strided),
               "ours_mild_skew_fused": bench(fused(ours_mild)),
               "busiest_over_mean_mild": float(torch.bincount(mild.flatten(), minlength=E).max() / (T * k / E)),
               "sort_gmm": bench(sort_gmm), "rel_err_vs_sort_gmm": float(err),
               "rel_err_fused_vs_sort_gmm": float(err_fused)}
    row["fwd_bwd_ours"] = bench(fwd_bwd)
    row["fwd_bwd_fused"] = bench(fused(fwd_bwd))
    # as a compiled training step runs it: the interleaved weight passed to the op whole, one gradient for it
    moe_inductor.ops._whole_gate_up_eagerly = True
    try:
        row["fwd_bwd_whole"] = bench(fwd_bwd)
        row["fwd_bwd_whole_fused"] = bench(fused(fwd_bwd))
    finally:
        moe_inductor.ops._whole_gate_up_eagerly = False
    return row


def list_stack_cost(T: int, shape: str) -> dict:
    """Experts held as a ModuleList of per-expert weights (mistral-src, Megatron, HF v4): the list op stacks them at
    every call (a cached stack misses writes through ``p.data``), against the same op on weights already stacked."""
    from moe_inductor.ops.expert_lists import experts_forward_list

    H, I, E, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids, weights = make_routing(T, E, k, False, gen, "cuda")
    weights = weights.to(torch.bfloat16)
    w1, w2 = hf_expert_weights(shape, "cuda", torch.bfloat16)
    gate, up, down = list(w1[:, :I].unbind(0)), list(w1[:, I:].unbind(0)), list(w2.unbind(0))
    gate, up, down = ([t.contiguous() for t in ws] for ws in (gate, up, down))
    per_expert = partial(experts_forward_list, x, ids, weights, gate, up, down, [], [], [], "silu_glu", False, "output",
                         "nk", None)
    stacked = partial(moe_inductor.fused_experts, x, ids, weights, w1, w2)
    stack_only = lambda: [torch.stack(ws) for ws in (gate, up, down)]  # noqa: E731
    with torch.no_grad():
        return {"shape": shape, "T": T, "list_op_ms": bench(per_expert), "stacked_op_ms": bench(stacked),
                "stack_alone_ms": bench(stack_only)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=[16, 512, 4096, 16384])
    ap.add_argument("--no-skew", action="store_true", help="skip the Zipf-routing rows")
    ap.add_argument("--skew-tokens", nargs="*", type=int, default=None, help="token counts that get a Zipf row")
    ap.add_argument("--hf-shapes", nargs="*", default=None, help="shapes that get the transformers columns")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers columns")
    ap.add_argument("--liger-shapes", nargs="*", default=[],
                    help="shapes that get the Liger-Kernel columns (default none: its autotune compiles ~240 "
                         "configs per shape, minutes each)")
    ap.add_argument("--autotune", action="store_true", help="tune kernel configs on first use (prints a line each)")
    ap.add_argument("--dump-tuned", default=None, help="write the tuned config table (JSON) here")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--markdown", default=None, help="write a markdown table here")
    ap.add_argument("--extras", nargs="*", default=[], choices=["check", "gptoss_layout", "list_stack"],
                    help="also time the compiled routing-id check's cost at T=4096 (check), and GPT-OSS's experts "
                         "in the model's own layout at each --tokens (gptoss_layout), and experts held as per-expert "
                         "weights, stacked at each call, at each --shapes and --tokens (list_stack)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_experts.py needs a CUDA GPU")
    import triton

    liger = liger_experts()
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "liger": liger_version()}
    print(meta, flush=True)
    moe_inductor.config.autotune = args.autotune
    moe_inductor.config.validate_routing = False  # as inside compiled graphs: no eager id check (a host sync)
    rows: list[dict] = []
    extras: list[dict] = []
    if "check" in args.extras:
        extras.append(routing_check_cost())
        print(extras[-1], flush=True)
    if "list_stack" in args.extras:
        for name in args.shapes:
            for T in args.tokens:
                extras.append(list_stack_cost(T, name))
                print(extras[-1], flush=True)
    if "gptoss_layout" in args.extras:
        for T in args.tokens:
            extras.append(gptoss_layout(T))
            print(extras[-1], flush=True)
    skews = [False] if args.no_skew else [False, True]
    for name in args.shapes:
        do_hf = not args.no_hf and (args.hf_shapes is None or name in args.hf_shapes)
        do_liger = name in args.liger_shapes
        run_shape(name, args.tokens, skews, not args.no_backward, do_hf, rows, args.skew_tokens,
                  liger if do_liger else None)
        if args.json:  # after every shape, so a run cut short still leaves its rows
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows, "extras": extras}, f, indent=1)
    if args.dump_tuned:
        from moe_inductor.kernels.configs import TABLE

        TABLE.dump(args.dump_tuned)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "extras": extras}, f, indent=1)
    table = markdown(rows, "–" if liger is not None else "not installed")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
