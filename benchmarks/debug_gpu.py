"""One-off GPU diagnostics (kept so the next session can rerun them): DBRX views through the op, the unrolled-loop
graph on CUDA, HF's compiled decode with our backend, and a host-side profile of one fused_experts call.

    python benchmarks/debug_gpu.py dbrx dbrx_model dbrx_spread loop decode host route prefill_host op_overhead tma_ab \
        decode_visible
"""
import cProfile
import pstats
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, ".")


def dbrx():
    import moe_inductor
    from moe_inductor.ops import moe_reference

    torch.manual_seed(0)
    E, I, H, T, k = 4, 16, 32, 24, 2
    for dtype in (torch.float32, torch.bfloat16):
        w1, v1, w2 = (torch.randn(E * I, H, device="cuda", dtype=dtype) * 0.2 for _ in range(3))
        x = torch.randn(T, H, device="cuda", dtype=dtype)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        tw = torch.rand(T, k, device="cuda", dtype=dtype)
        g, u, d = w1.view(E, I, H).transpose(1, 2), v1.view(E, I, H).transpose(1, 2), w2.view(E, I, H)
        y = moe_inductor.fused_experts(x, ids, tw, (g, u), d, activation="silu_glu", layout="kn")
        ref = moe_reference(x.double(), ids, tw.double(), g.double(), u.double(), d.double(), None, None, None,
                            "silu_glu")
        gc, uc = g.contiguous(), u.contiguous()
        y2 = moe_inductor.fused_experts(x, ids, tw, (gc, uc), d, activation="silu_glu", layout="kn")
        print("dbrx", dtype, "strided", ((y.double() - ref).norm() / ref.norm()).item(),
              "contiguous", ((y2.double() - ref).norm() / ref.norm()).item(), flush=True)


def dbrx_model():
    """Whole tiny DBRX on the GPU, compiled vs eager, fp32 and bf16, error per position: a few large rows and a
    clean fp32 run would mean bf16 router near-ties flipping an expert choice, not a wrong op."""
    from tests.hf_models import tiny

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny("dbrx").to("cuda", dtype)
        ids = torch.randint(0, 64, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
        with torch.no_grad():
            ref = model(ids).logits.float()
            out = compiled(ids).logits.float()
        rows = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
        print("dbrx model", dtype, "total", ((out - ref).norm() / ref.norm()).item(), "per position",
              [round(v, 4) for v in rows.tolist()], dict(counters["moe_inductor"]), flush=True)


def dbrx_spread():
    """How far apart are HF's own bf16 eager implementations of tiny DBRX? If eager-vs-eager already differs at a few
    positions as much as ours does, those positions are router near-ties, not a wrong rewrite."""
    from tests.hf_models import tiny

    ids = torch.randint(0, 64, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model = tiny("dbrx", experts_implementation=impl).to("cuda", torch.bfloat16)
        with torch.no_grad():
            logits[impl] = model(ids).logits.float()
    model = tiny("dbrx").to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        logits["moe_inductor"] = torch.compile(model, backend="moe_inductor")(ids).logits.float()
    model32 = tiny("dbrx").to("cuda")
    with torch.no_grad():
        truth = model32(ids).logits.float()
    for impl, got in logits.items():
        rows = ((got - truth).norm(dim=-1) / truth.norm(dim=-1)).flatten()
        print("dbrx bf16", impl, "vs fp32 truth", round(((got - truth).norm() / truth.norm()).item(), 4),
              [round(v, 3) for v in rows.tolist()], flush=True)
    for impl in ("grouped_mm", "batched_mm"):
        ref = logits["eager"]
        rows = ((logits[impl] - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
        print("dbrx bf16", impl, "vs eager", round(((logits[impl] - ref).norm() / ref.norm()).item(), 4),
              [round(v, 3) for v in rows.tolist()], flush=True)


def loop():
    """The unrolled-loop model on CUDA: the Dynamo graph our passes see, the graph breaks, and the rewrites."""
    from moe_inductor.backend import moe_inductor_backend
    from moe_inductor.capture import BACKEND_MARKER
    from tests.test_pass_unrolled_loop import LoopMoE

    torch.manual_seed(0)
    m = LoopMoE("where_matmul", 4, 2).to("cuda", torch.bfloat16)

    def show(gm, inputs, **kwargs):
        print("LOOP GRAPH\n" + gm.code.replace("\n    ", "\n  | ")[:4000], flush=True)
        return moe_inductor_backend(gm, inputs, options={"inner": "eager"})

    setattr(show, BACKEND_MARKER, True)  # so that scoped capture treats this compile as ours
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        torch.compile(m, backend=show)(torch.randn(8, 16, device="cuda", dtype=torch.bfloat16))
    print("loop rewrites", dict(counters["moe_inductor"]), "graph breaks", dict(counters["graph_break"]), flush=True)


def decode():
    from transformers.generation.configuration_utils import CompileConfig

    from tests.hf_models import tiny

    model = tiny("qwen3_moe").to("cuda")
    prompt = torch.randint(0, 64, (2, 7), device="cuda")
    gen = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    for how in ("kwarg", "attribute"):
        torch._dynamo.reset()
        counters.clear()
        cc = CompileConfig(backend="moe_inductor", mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            if how == "kwarg":
                got = model.generate(prompt, compile_config=cc, **gen)
            else:
                model.generation_config.compile_config = cc
                got = model.generate(prompt, **gen)
        print("decode", how, got[0].tolist(), dict(counters["moe_inductor"]), "skips",
              counters["inductor"]["cudagraph_skips"], "graphs", counters["stats"]["unique_graphs"], flush=True)


def host():
    import moe_inductor
    from tests.helpers import make_problem

    p = make_problem(16, 2048, 768, 128, 8, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    moe_inductor.config.validate_routing = False
    f = lambda: moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)  # noqa: E731
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        f()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def prefill_host():
    """Is the T = 512 prefill (bench_hf's 4-layer Qwen3 model) host-bound, and by how much? For inductor, moe_inductor
    and moe_inductor with the experimental visible kernels:
    host time to enqueue one forward (no sync) against wall time per forward (synced), over 30 forwards, with the
    experimental fast launch off and on alternately in the same process (separate processes differ by more than the
    effect). Then a cProfile of 20 forwards, top entries by own time."""
    import time

    from benchmarks.bench_hf import build
    from moe_inductor import config

    model, cfg = build(False, 4, "cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
    for name in ("inductor", "moe_inductor", "moe_inductor_opaque"):  # the last: config.visible_kernels off
        torch._dynamo.reset()
        config.visible_kernels = name != "moe_inductor_opaque"
        fwd = torch.compile(model.forward, **({} if name == "inductor" else {"backend": "moe_inductor"}))
        with torch.no_grad():
            for _ in range(5):
                fwd(input_ids=ids)
            for rep in range(3):
                for fast in (False, True):
                    config.fast_launch = fast
                    fwd(input_ids=ids)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(30):
                        fwd(input_ids=ids)
                    host = (time.perf_counter() - t0) / 30 * 1e3
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - t0) / 30 * 1e3
                    print(f"PREFILL512 {name:<13} rep {rep} fast_launch={int(fast)}: host enqueue {host:.3f} ms, "
                          f"wall {wall:.3f} ms per forward", flush=True)
            config.fast_launch = False
            config.visible_kernels = True
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                fwd(input_ids=ids)
            prof.disable()
            torch.cuda.synchronize()
        print("PREFILL HOST", name, flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def op_overhead():
    """Host wall time per call, Qwen3 shape at T = 512: the op's body called directly vs through the dispatcher
    (what Inductor's wrapper does), under no_grad; then a cProfile of the dispatched calls by cumulative time."""
    import time

    from moe_inductor.ops import expert_weight_views, experts_forward_impl
    from tests.helpers import make_problem

    p = make_problem(512, 2048, 768, 128, 8, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    args = (p.x, p.topk_ids, p.topk_weights, g, u, d, None, None, None, "silu_glu", "output", 1.702, 7.0, None, False)
    op = torch.ops.moe_inductor.experts_forward.default
    with torch.no_grad():
        for name, fn in (("direct", lambda: experts_forward_impl(*args)), ("op", lambda: op(*args)),
                         ("direct", lambda: experts_forward_impl(*args)), ("op", lambda: op(*args))):
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 200 * 1e6
            print(f"op_overhead {name}: host {host:.1f} us/call, wall {wall:.1f} us/call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            op(*args)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


def tma_ab():
    """config.tma_weights off vs on in one process (alternating, do_bench medians): forward and forward+backward of
    the fused experts at Mixtral and Qwen3 shapes, with the outputs compared bit for bit."""
    from triton.testing import do_bench

    import moe_inductor
    from tests.helpers import make_problem

    moe_inductor.config.validate_routing = False
    for name, (H, I, E, k), T in (("mixtral", (4096, 14336, 8, 2), 4096), ("mixtral", (4096, 14336, 8, 2), 16384),
                                  ("qwen3", (2048, 768, 128, 8), 4096)):
        p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        fwd = lambda: moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2)  # noqa: E731
        dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        both = lambda: torch.autograd.grad(fwd(), p.leaves(), dy)  # noqa: E731
        outs, row = {}, []
        for rep in range(2):
            for tma in (False, True):
                moe_inductor.config.tma_weights = tma
                with torch.no_grad():
                    outs[tma] = fwd()
                    ms = do_bench(fwd, warmup=5, rep=40, return_mode="median")
                ms_b = do_bench(both, warmup=3, rep=40, return_mode="median")
                row.append(f"tma={int(tma)} fwd {ms:.3f} fwd+bwd {ms_b:.3f}")
        moe_inductor.config.tma_weights = False
        print(f"TMA {name} T={T}:", " | ".join(row), "| equal:", torch.equal(outs[False], outs[True]), flush=True)


def route():
    from triton.testing import do_bench

    from moe_inductor.ops import routing

    for single_max, chunk in ((4096, 1024), (1024, 1024), (512, 512), (256, 256)):
        routing.SINGLE_LAUNCH_MAX_ROWS, routing.CHUNK_ROWS = single_max, chunk
        row = []
        for T, E, k in ((16, 128, 8), (64, 128, 8), (512, 128, 8), (2048, 8, 2), (4096, 128, 8), (16384, 128, 8)):
            ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
            ms = do_bench(lambda: routing.route_metadata(ids, E), warmup=5, rep=30, return_mode="median")
            row.append(f"M={T * k}:{ms * 1e3:.1f}us")
        print(f"route single<={single_max} chunk={chunk}:", " ".join(row), flush=True)
    routing.SINGLE_LAUNCH_MAX_ROWS, routing.CHUNK_ROWS = 4096, 1024


def decode_visible():
    """Why the visible op decoded batch 16 at a third of the opaque op's speed under reduce-overhead (RESULTS.md,
    fifth session). Greedy decode of 32 new tokens at batch 16, visible kernels on (forced, under CUDA graphs too)
    and off, with HF's compiled decode in reduce-overhead and in the default mode: new tokens/s of a second
    generate, graphs Dynamo compiled during it (a recompile inside the timed call would explain a slow column), how
    many ops were swapped, and the top CUDA kernels of a third generate under the profiler."""
    import time

    from transformers.generation.configuration_utils import CompileConfig

    from benchmarks.bench_hf import build
    from moe_inductor import backend, config

    model, cfg = build(False, 4, "cuda", torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab_size, (16, 32), device="cuda")
    real_rule = backend._uses_cuda_graphs
    try:
        for mode in ("reduce-overhead", "default"):
            for visible in (True, False):
                torch._dynamo.reset()
                counters.clear()
                config.visible_kernels = visible
                backend._uses_cuda_graphs = (lambda m: False) if visible else real_rule
                gen = dict(max_new_tokens=32, do_sample=False, cache_implementation="static",
                           compile_config=CompileConfig(backend="moe_inductor", mode=mode, fullgraph=True))
                with torch.no_grad():
                    model.generate(prompt, **gen)  # compile, warm up, capture
                    torch.cuda.synchronize()
                    graphs_before = counters["stats"]["unique_graphs"]
                    t0 = time.perf_counter()
                    model.generate(prompt, **gen)
                    torch.cuda.synchronize()
                    tps = 16 * 32 / (time.perf_counter() - t0)
                    new_graphs = counters["stats"]["unique_graphs"] - graphs_before
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        model.generate(prompt, **gen)
                        torch.cuda.synchronize()
                print(f"DECODE16 mode={mode} visible={int(visible)}: {tps:.0f} new tokens/s; graphs compiled in the "
                      f"timed call {new_graphs}; ops swapped {counters['moe_inductor_visible']['swapped']}; "
                      f"cudagraph skips {counters['inductor']['cudagraph_skips']}", flush=True)
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    finally:
        config.visible_kernels = True
        backend._uses_cuda_graphs = real_rule


if __name__ == "__main__":
    for name in sys.argv[1:]:
        try:
            globals()[name]()
        except Exception as exc:  # keep going: each diagnostic is independent
            print(name, "FAILED", type(exc).__name__, str(exc)[:500], flush=True)

