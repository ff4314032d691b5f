"""GPU-only checks: realistic sizes, CUDA-graph capture (no host sync), and compile with many token counts."""
import pytest
import torch

import moe_inductor
from moe_inductor.ops import expert_weight_views, moe_reference
from tests.helpers import assert_bf16_logits_match, assert_close, make_problem

pytestmark = pytest.mark.gpu


def _reference64(p, **kw):
    g, u, d, bg, bu = expert_weight_views(
        p.w1.double(), p.w2.double(), p.b1.double() if p.b1 is not None else None, activation=p.activation,
        layout=p.layout, gate_up=p.gate_up,
    )
    return moe_reference(p.x.double(), p.topk_ids, p.topk_weights.double(), g, u, d, bg, bu,
                         p.b2.double() if p.b2 is not None else None, p.activation, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "T,E,k,routing",
    [(1, 8, 2, "random"), (300, 7, 2, "random"), (1000, 60, 8, "random"), (256, 16, 4, "one_expert"),
     (128, 12, 2, "skip_odd"), (200, 6, 1, "random")],
    ids=["T1", "E7", "E60-k8", "all-on-one", "empty-experts", "k1"],  # k1: y and dx written without a combine
)
def test_forward_backward_matches_fp64(T, E, k, routing, dtype):
    p = make_problem(T, 256, 128, E, k, dtype=dtype, device="cuda", routing=routing, bias=True)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2)
    ref = _reference64(p)
    assert_close(y, ref, dtype, "y")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    leaves64 = [t.detach().double().requires_grad_() for t in p.leaves()]
    x, tw, w1, w2, b1, b2 = leaves64
    g, u, d, bg, bu = expert_weight_views(w1, w2, b1, activation=p.activation, layout=p.layout, gate_up=p.gate_up)
    ref_grads = torch.autograd.grad(moe_reference(x, p.topk_ids, tw, g, u, d, bg, bu, b2), leaves64, dy.double())
    for name, a, b in zip(["x", "topk_weights", "w1", "w2", "b1", "b2"], grads, ref_grads):
        assert_close(a, b, dtype, f"d{name}")


def test_gptoss_interleaved_kn_layout_bf16():
    p = make_problem(200, 256, 128, 8, 4, dtype=torch.bfloat16, device="cuda", activation="gptoss_glu", layout="kn",
                     gate_up="interleaved", bias=True)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2,
                                   activation="gptoss_glu", layout="kn", gate_up="interleaved")
    assert_close(y, _reference64(p), torch.bfloat16, "y")


def test_cuda_graph_capture_of_route_and_experts():
    """Capture routing + experts in one CUDA graph: it only works if nothing syncs with the host."""
    E, k, T, H = 8, 2, 64, 128
    p = make_problem(T, H, 64, E, k, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    router = torch.randn(H, E, device="cuda", dtype=torch.bfloat16)
    static_x = p.x.clone()

    def step():
        weights, ids = torch.softmax(static_x.float() @ router.float(), -1).topk(k)
        return moe_inductor.fused_experts(static_x, ids, weights.to(static_x.dtype), p.w1, p.w2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for seed in range(3):  # new data through the same graph: the routing changes, the graph does not
        static_x.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_y, step(), torch.bfloat16, "replay")


def test_compile_fullgraph_dynamic_one_graph_for_five_token_counts():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    p = make_problem(8, 128, 64, 6, 2, dtype=torch.bfloat16, device="cuda", requires_grad=False)

    def layer(x, router):
        weights, ids = torch.softmax(x.float() @ router, -1).topk(2)
        return moe_inductor.fused_experts(x, ids, weights.to(x.dtype), p.w1, p.w2)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    router = torch.randn(128, 6, device="cuda")
    for T in (2, 7, 64, 333, 1024):
        x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
        assert_close(compiled(x, router), layer(x, router), torch.bfloat16, f"T={T}")
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    # Dynamo specialises sizes 0 and 1 even under dynamic=True, so T=1 costs exactly one more graph.
    x = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    assert_close(compiled(x, router), layer(x, router), torch.bfloat16, "T=1")
    assert counters["stats"]["unique_graphs"] == 2


def test_bad_ids_raise_in_eager_without_illegal_access():
    p = make_problem(16, 64, 32, 4, 2, device="cuda", requires_grad=False)
    ids = p.topk_ids.clone()
    ids[3, 0] = 17
    with pytest.raises(ValueError, match=r"routing ids must lie in \[0, 4\).*got values in"):
        moe_inductor.fused_experts(p.x, ids, p.topk_weights, p.w1, p.w2)
    # the op itself (compiled graphs skip the eager check) drops the bad assignment instead of reading past E
    g, u, d, _, _ = p.views()
    y, *_ = torch.ops.moe_inductor.experts_forward(p.x, ids, p.topk_weights, g, u, d, None, None, None, "silu_glu",
                                                    "output", 1.702, 7.0, None, False)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "olmoe", "deepseek_v3",
                                    "granitemoe", "phimoe"])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_hf_models_rewritten_on_gpu_bf16(family, implementation):
    """Every HF family in every experts implementation runs the Triton kernels on the GPU and matches eager in bf16."""
    from torch._dynamo.utils import counters

    from tests.hf_models import tiny

    model = tiny(family, implementation).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    inner = "inductor" if (family, implementation) == ("qwen3_moe", "grouped_mm") else "eager"
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner})
    for T in (5, 33):
        ids = torch.randint(0, 64, (2, T), device="cuda")
        with torch.no_grad():
            out, ref = compiled(ids).logits.float(), model(ids).logits.float()
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2
    assert sum(counters["moe_inductor"].values()) >= 2
    assert sum(counters["graph_break"].values()) == 0
    if inner == "inductor":  # the default: Inductor launches every rewritten layer's kernels itself
        assert counters["moe_inductor_visible"]["swapped"] == sum(counters["moe_inductor"].values())


def test_static_cache_decode_reduce_overhead_has_no_cudagraph_skips():
    """HF's own compiled decode (static cache, CompileConfig(backend="moe_inductor", mode="reduce-overhead")):
    the same tokens as eager, the MoE layers rewritten, and 0 cudagraph skips."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    from tests.hf_models import tiny

    model = tiny("qwen3_moe").to("cuda")
    prompt = torch.randint(0, 64, (2, 7), device="cuda")
    gen = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        expected = model.generate(prompt, disable_compile=True, **gen)
        config = CompileConfig(backend="moe_inductor", mode="reduce-overhead", fullgraph=True)
        got = model.generate(prompt, compile_config=config, **gen)
        got_again = model.generate(prompt, compile_config=config, **gen)  # replays the recorded graphs
    assert torch.equal(got, expected) and torch.equal(got_again, expected)
    # transformers picks the experts implementation per step (5.17 decodes small batches with batched_mm)
    assert sum(counters["moe_inductor"].values()) >= 2, dict(counters["moe_inductor"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["moe_inductor_visible"]["swapped"] == 0  # under CUDA graphs the op stays opaque (backend.py)


@pytest.mark.parametrize("form", ["unrolled_loop", "gathered_weights", "dense_experts", "sorted_grouped_mm",
                                  "padded_capacity", "unrolled_loop/weight_on_input",
                                  "unrolled_loop/weight_between", "unrolled_loop/module_list_in_out_weight_on_input"])
def test_fx_forms_run_the_gpu_kernels(form):
    """Each FX-matched form, rewritten and run on the GPU in bf16, against eager."""
    from torch._dynamo.utils import counters

    from tests.test_pass_dense_experts import DenseMoE
    from tests.test_pass_gathered_weights import GatheredMoE
    from tests.test_pass_padded_capacity import CapacityMoE
    from tests.test_pass_sorted_grouped_mm import SortedMoE
    from tests.test_pass_unrolled_loop import LoopMoE, ModuleListMoE

    make = {"unrolled_loop": lambda: LoopMoE("where_matmul", 4, 2), "gathered_weights": lambda: GatheredMoE("gptfast"),
            "dense_experts": lambda: DenseMoE("einsum"), "sorted_grouped_mm": lambda: SortedMoE("titan", 2),
            "padded_capacity": lambda: CapacityMoE("top2"),
            "unrolled_loop/weight_on_input": lambda: LoopMoE("weight_on_input", 4, 2),
            "unrolled_loop/weight_between": lambda: LoopMoE("weight_between", 4, 2),
            "unrolled_loop/module_list_in_out_weight_on_input": lambda: ModuleListMoE("raw_in_out_input", 4, 2)}[form]
    torch.manual_seed(0)
    model = make().to("cuda", torch.bfloat16)
    width = model.w1.shape[-1] if form == "sorted_grouped_mm" else 16
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (3, 40):
        x = torch.randn(T, width, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out, ref = compiled(x).float(), model(x).float()
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["moe_inductor"][form.split("/")[0]] >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama4", "switch", "dbrx"])
def test_wrapped_hf_blocks_on_gpu(family, dtype, monkeypatch):
    """The class-wrapped HF MoE blocks. fp32 as well: if fp32 holds and bf16 does not, look at bf16 router near-ties
    before the op."""
    from torch._dynamo.utils import counters

    from tests.hf_models import tiny

    model = tiny(family).to("cuda", dtype)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    ids = torch.randint(0, 64, (2, 12), device="cuda")
    kwargs = {"decoder_input_ids": ids} if family == "switch" else {}
    from moe_inductor.ops import experts as experts_module

    gpu_runs = []  # every MoE layer the compiled model runs through our GPU kernels
    forward_gemms = experts_module._forward_gemms
    monkeypatch.setattr(experts_module, "_forward_gemms", lambda *a, **kw: gpu_runs.append(1) or forward_gemms(*a, **kw))
    with torch.no_grad():
        # eager first: Switch's router casts its classifier to fp32 on its first call (a module .to() that Dynamo
        # breaks the graph on, with any backend)
        ref = model(ids, **kwargs).logits.float()
        assert not gpu_runs
        out = compiled(ids, **kwargs).logits.float()
        ref_fp32 = tiny(family).to("cuda")(ids, **kwargs).logits.float()
    if dtype == torch.float32:
        assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    else:
        assert_bf16_logits_match(out, ref, ref_fp32, family)
    rewrites, breaks = sum(counters["moe_inductor"].values()), dict(counters["graph_break"])
    assert len(gpu_runs) >= 2 and rewrites >= 1  # after a graph break, layers can share one compiled (rewritten) frame
    if breaks and family == "switch" and torch.__version__ < "2.13":
        # HF's Switch router runs self.classifier.to(dtype) in forward; Dynamo before 2.13 breaks on the
        # nn.Parameter it builds there (pytorch#161207), under every backend. Ours must add no break of its own
        # (backend="eager" also breaks on the experts loop's nonzero, which our capture makes traceable).
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            torch.compile(model, backend="eager")(ids, **kwargs)
        plain = dict(counters["graph_break"])
        assert all(n <= plain.get(reason, 0) for reason, n in breaks.items()), (breaks, plain)
    else:
        assert not breaks, breaks


def test_bucketed_prefill_under_cuda_graphs():
    """moe_inductor.bucketed over a reduce-overhead compile: one CUDA graph per bucket, 0 skips, eager logits."""
    from torch._dynamo.utils import counters

    from tests.hf_models import tiny

    model = tiny("qwen3_moe").to("cuda")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", dynamic=False, mode="reduce-overhead")
    runner = moe_inductor.bucketed(compiled, buckets=(16, 32))
    for T in (5, 16, 21, 9, 30):
        ids = torch.randint(0, 64, (2, T), device="cuda")
        with torch.no_grad():
            got, ref = runner(ids).logits.clone(), model(ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def _compiled_with_visible_kernels(monkeypatch):
    """A gathered-weights MoE on the GPU and its moe_inductor compile with config.visible_kernels, fresh counters."""
    from torch._dynamo.utils import counters

    from moe_inductor import config
    from tests.test_pass_gathered_weights import GatheredMoE

    monkeypatch.setattr(config, "visible_kernels", True)
    torch.manual_seed(0)
    model = GatheredMoE("gptfast").cuda()
    torch._dynamo.reset()
    counters.clear()
    return model, torch.compile(model, backend="moe_inductor")


def test_visible_kernels_run_from_inductors_wrapper(monkeypatch):
    """config.visible_kernels (on by default): Inductor traces into the experts forward and launches our Triton
    kernels from its generated code; the results and the gradients stay as with the opaque op."""
    from torch._inductor.utils import run_and_get_code

    from moe_inductor.lowerings import visible

    model, compiled = _compiled_with_visible_kernels(monkeypatch)
    codes = []
    for T in (5, 17, 33, 64):
        x = torch.randn(T, 16, device="cuda", requires_grad=True)
        out, code = run_and_get_code(compiled, x)
        codes += code
        ref = model(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0],
                                   rtol=1e-4, atol=1e-4)
    text = "\n".join(codes)
    assert "grouped_gemm_kernel" in text and "torch.ops.moe_inductor.experts_forward" not in text  # no op call left
    p = make_problem(9, 64, 32, 5, 2, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")
    torch.library.opcheck(visible.experts_forward_visible, (p.x, p.topk_ids, p.topk_weights, g, u, d, None, None,
                                                            None, "silu_glu", "output", 1.702, 7.0, None, False))


def test_visible_kernels_compile_at_most_twice(monkeypatch):
    """Over four token counts: one static compile, then one dynamic. (Not checked with run_and_get_code above: it
    resets Dynamo before every call, which is what once read as four compiles.)"""
    from torch._dynamo.utils import counters

    _, compiled = _compiled_with_visible_kernels(monkeypatch)
    for T in (5, 17, 33, 64):
        compiled(torch.randn(T, 16, device="cuda", requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2


def _one_corpus_case_per_form():
    from tests.corpus.test_corpus import CASES

    chosen = {}
    for case in CASES:
        if case.expect == ("rewritten",) and case.form not in chosen:
            chosen[case.form] = case
    return list(chosen.values())


@pytest.mark.parametrize("case", _one_corpus_case_per_form(), ids=lambda c: f"{c.form}-{c.name}")
def test_one_corpus_module_per_form_runs_the_gpu_kernels_bf16(case):
    """A public-codebase MoE layer of each form, compiled with the default inner compiler on the GPU in bf16."""
    import copy

    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model32 = case.build().to("cuda", torch.float32)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor")
    gen = torch.Generator().manual_seed(1)

    def first(out):
        while isinstance(out, (tuple, list)):
            out = out[0]
        return out

    for T in (5, 64):
        x = case.make_input(T, gen).to("cuda")
        with torch.no_grad():
            out, ref = first(compiled(x.to(torch.bfloat16))), first(model(x.to(torch.bfloat16)))
            ref32 = first(model32(x))
        assert_bf16_logits_match(out, ref, ref32, f"{case.name} T={T}")
    assert counters["moe_inductor"][case.form] >= 1, dict(counters["moe_inductor"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
