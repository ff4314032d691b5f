"""Shared by the tests: problem builders, dtype-aware comparisons, compile-and-compare checks, and the work some tests
run in a fresh process without the Triton interpreter (``run_without_interpreter``): compiling every kernel for
sm_90, and tracing into the Inductor-visible op."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from moe_inductor.ops import expert_weight_views, is_gated

# relative L2 error bounds that fit the dtype (never loosened to pass a test)
REL_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    assert not torch.isnan(a).any(), "NaN in result (an unwritten row?)"
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.2e} > {REL_TOL[dtype]:.0e}"


def assert_bf16_logits_match(out: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor, what: str = "") -> None:
    """bf16 logits of a compiled model against eager's: within 2e-2 of eager's bf16 logits, or, when eager's own bf16
    run is already far from the same model in fp32 (a router near-tie that flips an expert choice in one of them), no
    further from the fp32 logits than twice eager's bf16 distance plus 2e-3. The second rule is torch._dynamo's
    accuracy check against a higher-precision reference; a wrong rewrite misses both by far."""
    err = rel_err(out, ref_bf16)
    if err <= REL_TOL[torch.bfloat16]:
        return
    ours, eagers = rel_err(out, ref_fp32), rel_err(ref_bf16, ref_fp32)
    assert ours <= 2 * eagers + 2e-3, (
        f"{what}: bf16 rel err {err:.3g} against eager bf16; against fp32: ours {ours:.3g}, eager bf16 {eagers:.3g}")


@dataclass
class Problem:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    b1: Optional[torch.Tensor]
    b2: Optional[torch.Tensor]
    activation: str
    layout: str
    gate_up: str

    def views(self):
        return expert_weight_views(self.w1, self.w2, self.b1, activation=self.activation, layout=self.layout,
                                   gate_up=self.gate_up)

    def leaves(self):
        return [t for t in (self.x, self.topk_weights, self.w1, self.w2, self.b1, self.b2) if t is not None]


def assert_matches_reference(p, y: torch.Tensor, grads, dy: torch.Tensor, dtype: torch.dtype, *,
                             activation: str = "silu_glu", layout: str = "nk", capacity=None) -> None:
    """``y`` and the gradients of ``p.leaves()`` (x, topk_weights, w1, w2) under ``dy`` match the float64 plain-torch
    reference of the unbiased experts (HF's concatenated gate/up, routing weight on the output)."""
    from moe_inductor.ops import expert_weight_views, moe_reference

    names = ["x", "topk_weights", "w1", "w2"]
    leaves64 = {n: t.detach().double().requires_grad_() for n, t in zip(names, p.leaves())}
    views = expert_weight_views(leaves64["w1"], leaves64["w2"], None, activation=activation, layout=layout,
                                gate_up="concat")
    ref = moe_reference(leaves64["x"], p.topk_ids, leaves64["topk_weights"], *views, None, activation, "output",
                        1.702, 7.0, capacity)
    assert_close(y, ref, dtype, "y")
    for name, got, want in zip(names, grads, torch.autograd.grad(ref, list(leaves64.values()), dy.double())):
        assert_close(got, want.to(got.dtype), dtype, f"d{name}")


def assert_matches_rounded_reference(p, y: torch.Tensor, grads, dy: torch.Tensor, dtype: torch.dtype, *,
                                     limit: float, toward_zero: bool = False) -> None:
    """``y`` and the gradients of ``p.leaves()`` under ``dy`` match the float64 reference of ``p``'s experts (a
    clamped glu at ``limit``, its biases where ``p`` has them, the routing weight on the output) whose raw up
    projections are rounded to ``dtype``, as the kernels keep them for the backward: to nearest, or ``toward_zero``
    (the Triton interpreter's fp32 -> bf16 cast truncates, where our kernel stores them).

    A clamp's gradient steps at its bound: a raw projection within rounding of the bound falls on the other side of
    it in a reference that does not round as the kernel did, and in a tiny problem one such element is a large part
    of a gradient. The rounding is straight-through (the gradient passes it unchanged, in float64)."""
    from moe_inductor.ops.activations import apply_activation

    leaves64 = [t.detach().double().requires_grad_() for t in p.leaves()]
    x, tw, w1, w2 = leaves64[:4]
    b1, b2 = leaves64[4:] if p.b1 is not None else (None, None)
    g, u, d, bg, bu = expert_weight_views(w1, w2, b1, activation=p.activation, layout=p.layout, gate_up=p.gate_up)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        if toward_zero:  # fp32's bits past bf16's 7-bit mantissa dropped
            kept = (t.detach().float().view(torch.int32) & ~0xFFFF).view(torch.float32)
        else:
            kept = t.detach().to(dtype)
        return t + (kept.double() - t).detach()

    ref = torch.zeros_like(x)
    for e in range(g.shape[0]):
        tok, pos = torch.nonzero(p.topk_ids == e, as_tuple=True)
        gate = rounded(x[tok] @ g[e]) + (bg[e] if bg is not None else 0)
        up = rounded(x[tok] @ u[e]) + (bu[e] if bu is not None else 0)
        h = apply_activation(p.activation, gate, up, 1.702, limit)
        ref = ref.index_add(0, tok, (h @ d[e] + (b2[e] if b2 is not None else 0)) * tw[tok, pos, None])
    assert_close(y, ref, dtype, "y")
    names = ["x", "topk_weights", "w1", "w2", "b1", "b2"]
    for name, got, want in zip(names, grads, torch.autograd.grad(ref, leaves64, dy.double())):
        assert_close(got, want.to(got.dtype), dtype, f"d{name}")


def record_launch_meta(monkeypatch, name: str) -> tuple[list, list]:
    """Record the constexpr ``name`` of every kernel launch of ours that passes one (``launch.launch_kernel``), for
    the duration of the test: returns (values of the launches made at run time, values of those Inductor traced)."""
    from moe_inductor.kernels import launch

    run, traced = [], []
    real = launch.launch_kernel

    def spy(kernel, grid, args, meta):
        if name in meta:
            (traced if launch.tracing_launches() else run).append(meta[name])
        return real(kernel, grid, args, meta)

    monkeypatch.setattr(launch, "launch_kernel", spy)
    return run, traced


def make_problem(
    T: int, H: int, I: int, E: int, k: int, *, dtype=torch.float32, device="cpu", activation="silu_glu",
    layout="nk", gate_up="concat", bias=False, routing="random", seed=0, requires_grad=True,
) -> Problem:
    """Random data (never zeros). routing: "random", "one_expert" (all tokens on expert 0), "skip_odd" (odd
    experts stay empty)."""
    gen = torch.Generator().manual_seed(seed)
    n1 = 2 * I if is_gated(activation) else I

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rnd(T, H)
    logits = torch.randn(T, E, generator=gen)
    if routing == "one_expert":
        ids = torch.stack([torch.arange(k) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        ids = ids % E
    elif routing == "skip_odd":
        logits[:, 1::2] = -1e9
        ids = logits.topk(k, dim=-1).indices
    else:
        ids = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype)
    w1_shape = (E, n1, H) if layout == "nk" else (E, H, n1)
    w2_shape = (E, H, I) if layout == "nk" else (E, I, H)
    p = Problem(
        x=x, topk_ids=ids.to(device), topk_weights=weights.to(device),
        w1=rnd(*w1_shape, scale=H ** -0.5), w2=rnd(*w2_shape, scale=I ** -0.5),
        b1=rnd(E, n1, scale=0.1) if bias else None, b2=rnd(E, H, scale=0.1) if bias else None,
        activation=activation, layout=layout, gate_up=gate_up,
    )
    if requires_grad:
        for t in p.leaves():
            t.requires_grad_(True)
    return p


def graph_keeping_backend(graphs: dict):
    """An ``aot_autograd`` backend that runs the traced forward and backward graphs as they are and keeps them in
    ``graphs`` under "fw" and "bw", for a test to read what the op was given and what the backward computes."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def compile_moe(model, *args, inner: str = "eager"):
    """Fresh Dynamo state and counters, then ``model`` compiled with moe_inductor (light inner compiler) on args."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="moe_inductor", options={"inner": inner})(*args)


def compile_beside_eager(model: torch.nn.Module, eager: torch.nn.Module, inputs) -> tuple[list, int, int, object]:
    """Compile ``model`` under moe_inductor (inner compiler "eager") and call it and ``eager`` on each of ``inputs``
    without gradients: (the (compiled, eager) outputs, graphs compiled, graph breaks, the report explain() would
    give). Graph breaks are counted from each graph's reason too, as ``torch._dynamo.explain`` does
    (``counters["graph_break"]`` misses some, such as a loop over a tensor)."""
    from torch._dynamo.utils import counters

    from moe_inductor import report
    from moe_inductor.backend import moe_inductor_backend
    from moe_inductor.capture import BACKEND_MARKER

    torch._dynamo.reset()
    counters.clear()
    graphs, breaks = [], []

    def backend(gm, example_inputs, **kwargs):
        reason = getattr(gm, "compile_subgraph_reason", None)
        graphs.append(gm)
        if reason is not None and getattr(reason, "graph_break", False):
            breaks.append(reason)
        return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})

    setattr(backend, BACKEND_MARKER, True)
    compiled = torch.compile(model, backend=backend)
    outputs = []
    with report.collecting(report.Report()) as seen, torch.no_grad():
        for x in inputs:
            outputs.append((compiled(x), eager(x)))
    return outputs, len(graphs), max(len(breaks), sum(counters["graph_break"].values())), seen


def assert_loop_rewritten_beside_eager(run: tuple, token_counts) -> None:
    """``compile_beside_eager``'s result for a data-dependent expert loop: every graph rewritten as one
    ``unrolled_loop``, in one or two graphs (static, then dynamic), with no graph break or fallback, and each token
    count's output equal to eager's."""
    from torch._dynamo.utils import counters

    outputs, graphs, breaks, seen = run
    assert dict(counters["moe_inductor"]) == {"unrolled_loop": graphs}, (dict(counters["moe_inductor"]),
                                                                          [f.reason for f in seen.fallbacks])
    assert 1 <= graphs <= 2 and breaks == 0, (graphs, breaks)
    assert not seen.fallbacks and not counters["moe_inductor_fallback"]
    for T, (got, ref) in zip(token_counts, outputs):
        assert rel_err(got, ref) < 1e-5, T


def assert_rewritten_like_eager(model: torch.nn.Module, x: torch.Tensor, form: str, what: str = "") -> None:
    """``model`` compiled with moe_inductor (light inner compiler) on ``x``: one rewrite of ``form``, and the output and
    the gradients of ``x`` and of every parameter (for one random upstream gradient) equal to eager's, within the
    tolerance of ``x``'s dtype. The counters stay as this compile left them, for the caller's own checks."""
    from torch._dynamo.utils import counters

    xc = x.clone().requires_grad_(True)
    out = compile_moe(model, xc)
    assert counters["moe_inductor"][form] == 1, dict(counters["moe_inductor"])
    probe = torch.randn(out.shape, dtype=out.dtype, device=out.device)
    (out.float() * probe.float()).sum().backward()
    got = [xc.grad] + [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    xe = x.clone().requires_grad_(True)
    ref = model(xe)
    (ref.float() * probe.float()).sum().backward()
    want = [xe.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    assert_close(out, ref, x.dtype, f"{what} forward")
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if w is not None:
            assert_close(g, w, x.dtype, f"{what} gradient {i}")


def assert_gpu_bf16_rewrite(model: torch.nn.Module, form: str, width: int = 16) -> None:
    """``model`` in bf16 on the GPU, compiled once with moe_inductor (light inner compiler) and run at two token
    counts: within bf16's tolerance of eager, no graph break, and ``form`` rewritten at least once."""
    from torch._dynamo.utils import counters

    model = model.to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (3, 40):
        x = torch.randn(T, width, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out, ref = compiled(x), model(x)
        assert_close(out, ref, torch.bfloat16, f"{form} T={T}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["moe_inductor"][form] >= 1, dict(counters["moe_inductor"])


# In a fresh process without TRITON_INTERPRET: the real Triton front end, which compiling for sm_90 and tracing
# through ``wrap_triton`` need (the interpreter hands back a kernel that cannot take fake tensors).

ROOT = Path(__file__).resolve().parents[1]


def read_beside(context, read):
    """(what ``read()`` returns inside ``context`` in a second thread, what it returns in this thread meanwhile):
    whether a context's state leaks across threads."""
    import threading

    inside, release, seen = threading.Event(), threading.Event(), {}

    def holding():
        with context:
            seen["inside"] = read()
            inside.set()
            release.wait(10)

    t = threading.Thread(target=holding)
    t.start()
    try:
        assert inside.wait(10), "the second thread never entered the context"
        seen["beside"] = read()
    finally:
        release.set()
        t.join(10)
    return seen["inside"], seen["beside"]


def run_without_interpreter(call: str, timeout: int) -> str:
    """Run ``call``, a Python expression over this module's names (``"visible_launches(False)"``), in a fresh
    interpreter without TRITON_INTERPRET; its standard output. A failure raises with the process's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", f"from tests.helpers import *; {call}"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


class _Captured(Exception):
    """Raised by a compiler callback once it has read the traced graph: the compile stops there."""


def _visible_problem(T: int, dtype=torch.float32):
    """T tokens, H 16, I 8, E 5, k 2, on the CPU with ``config.triton_on_cpu``: the problem, its (gate, up, down)
    weight views, and the visible op over them."""
    from moe_inductor import config

    config.triton_on_cpu = True
    import moe_inductor.lowerings.visible  # noqa: F401  (registers the op)

    p = make_problem(T, 16, 8, 5, 2, dtype=dtype, requires_grad=False)
    g, u, d, _, _ = expert_weight_views(p.w1, p.w2, None, activation="silu_glu", layout="nk", gate_up="concat")

    def visible(x, ids, tw, g, u, d):
        return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, g, u, d, None, None, None, "silu_glu",
                                                              "output", 1.702, 7.0, None, False)[0]

    return p, (g, u, d), visible


def _trace_visible_with_aot(fw_compiler, T: int, dynamic_tokens: bool, dynamic) -> None:
    """Compile the visible op over T tokens through Dynamo and AOT autograd up to ``fw_compiler``, which reads what
    it needs from the traced graph and raises _Captured to stop the compile there."""
    from torch._dynamo.backends.common import aot_autograd

    p, weights, visible = _visible_problem(T)
    if dynamic_tokens:
        for t in (p.x, p.topk_ids, p.topk_weights):
            torch._dynamo.mark_dynamic(t, 0)
    try:
        torch.compile(lambda x, ids, tw: visible(x, ids, tw, *weights), backend=aot_autograd(fw_compiler=fw_compiler),
                      dynamic=dynamic)(p.x, p.topk_ids, p.topk_weights)
    except Exception as e:  # stopped on purpose once the graph was read
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise


def visible_every_dim_guards() -> dict:
    """The guards of a make_fx trace of the visible op (17 tokens) in which every input dimension is symbolic (what
    opcheck's test_aot_dispatch_dynamic does), weights included, and the token count's symbol. Nothing launches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p, weights, visible = _visible_problem(17)
    gm = make_fx(visible, tracing_mode="symbolic")(p.x, p.topk_ids, p.topk_weights, *weights)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tokens = placeholders[0].meta["val"].shape[0]
    return {"guards": [str(guard.expr) for guard in tokens.node.shape_env.guards], "tokens": str(tokens)}


def visible_launches(dynamic_tokens: bool) -> list:
    """The Triton kernels the visible op launches, in order, once AOT autograd has traced into it with a static or a
    dynamic token count (3 tokens, 6 rows: one routing chunk). Nothing launches."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []

    def read_launches(gm, example_inputs):
        names.extend(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gm.graph.nodes
                     if "triton_kernel_wrapper" in str(n.target))
        raise _Captured

    _trace_visible_with_aot(read_launches, 3, dynamic_tokens, dynamic=dynamic_tokens)
    return names


def visible_dynamic_token_guards() -> list:
    """The shape guards of a Dynamo + AOT autograd trace of the visible op with the token count dynamic (17 tokens:
    one routing chunk, the guard-prone case). Nothing launches."""
    guards = []

    def read_guards(gm, example_inputs):  # after AOT autograd traced into the op: its guards are in the shape env
        fake_mode = torch._guards.TracingContext.get().fake_mode
        guards.extend(str(g.expr) for g in fake_mode.shape_env.guards)
        raise _Captured

    _trace_visible_with_aot(read_guards, 17, True, dynamic=None)
    return guards


def visible_interleaved_launches(spelling: str) -> list:
    """For a GPT-OSS-like layer (gptoss_glu, an interleaved (E, H, 2I) gate/up weight W, biases), traced into the
    visible op by Dynamo and AOT autograd: one (tensor type, ``INTERLEAVED``) pair per gated GEMM launch the traces
    make (FakeTensor: Dynamo's run of the op; FunctionalTensor: AOT autograd's). The launches are read where
    ``launch_kernel`` is called and skipped, so nothing launches and Triton never looks at the kernel (which needs
    a GPU to analyse). ``spelling``: "whole" passes W as its pairs view (the rewrite's training form), "views"
    passes W's even and odd columns (its inference form), "two_weights" passes the even columns of W and the odd
    ones of another tensor of W's shape, where the pairs layout must not be read."""
    from torch._dynamo.backends.common import aot_autograd

    from moe_inductor import config
    from moe_inductor.kernels import launch
    from moe_inductor.ops.call import pairs_view

    import moe_inductor.lowerings.visible  # noqa: F401  (registers the op)

    act = "gptoss_glu"
    p = make_problem(6, 32, 16, 5, 2, activation=act, layout="kn", gate_up="interleaved", bias=True,
                     requires_grad=False)
    _, _, d, bg, bu = expert_weight_views(p.w1, p.w2, p.b1, activation=act, layout="kn", gate_up="interleaved")
    seen = []

    def read_launch(kernel, grid, args, meta):
        if meta.get("GATED") and kernel.name == "grouped_gemm_kernel":
            seen.append((type(args[1]).__name__, bool(meta["INTERLEAVED"])))

    def stop(gm, example_inputs):
        raise _Captured

    def layer(x, ids, tw, w, other):
        if spelling == "whole":
            gate, up = pairs_view(w), None
        else:
            gate, up = w[..., 0::2], (w if spelling == "views" else other)[..., 1::2]
        return torch.ops.moe_inductor.experts_forward_visible(x, ids, tw, gate, up, d, bg, bu, p.b2, act, "output",
                                                              1.702, 7.0, None, False)[0]

    real, launch.launch_kernel = launch.launch_kernel, read_launch
    on_cpu, config.triton_on_cpu = config.triton_on_cpu, True
    try:
        torch._dynamo.reset()
        torch.compile(layer, backend=aot_autograd(fw_compiler=stop))(p.x, p.topk_ids, p.topk_weights, p.w1,
                                                                     p.w1.clone())
    except Exception as e:  # stopped on purpose once the graph was traced
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise
    finally:
        launch.launch_kernel, config.triton_on_cpu = real, on_cpu
        torch._dynamo.reset()
    return seen


def rule_off_where_unmeasured(monkeypatch) -> None:
    """Turn the speed rule off on a GPU it has no measurements for: there it keeps every layer that did not win by a
    margin elsewhere, and a test of the rewritten path on the GPU needs the rewrite. On a measured GPU (the H200,
    the H100) the rule stays on, as a user runs it."""
    import moe_inductor
    from moe_inductor import speed_rule

    if speed_rule._gpu_tag(torch.device("cuda")) not in speed_rule._tables():
        monkeypatch.setattr(moe_inductor.config, "speed_rule", False)


def hf_modes_judged(train: bool, cases) -> list[set]:
    """The modes the speed rule is asked to judge transformers' experts in, one set per (tokens, dynamic) compile of
    a tiny Qwen3-MoE (``inner="eager"``): a training step (forward and backward) where ``train``, else inference
    under no_grad."""
    from unittest import mock

    from hf_models import tiny
    from moe_inductor import speed_rule

    torch.manual_seed(0)
    model = tiny("qwen3_moe").train(train)
    modes: list[str] = []

    def record(kind, device, mode, inner, form):
        modes.append(mode)
        return "speed rule: recorded"

    seen = []
    with mock.patch.object(speed_rule, "verdict", side_effect=record), torch.set_grad_enabled(train):
        for tokens, dynamic in cases:
            torch._dynamo.reset()
            modes.clear()
            out = torch.compile(model, backend="moe_inductor", dynamic=dynamic, options={"inner": "eager"})(
                torch.randint(0, 64, (1, tokens)))
            if train:
                out.logits.sum().backward()
            seen.append(set(modes))
    return seen


def visible_backward_trace(dynamic_tokens: bool) -> dict:
    """What a make_fx trace (fake tensors) of the visible op's forward and backward over 9 tokens holds: the Triton
    kernels launched through ``wrap_triton`` ("kernels", in order) and the moe_inductor ops called as ops ("ops").
    ``dynamic_tokens`` traces with symbolic shapes. Nothing launches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p, weights, visible = _visible_problem(9)
    leaves = [t.detach().clone().requires_grad_() for t in (p.x, *weights)]

    def step(x, ids, tw, g, u, d):
        out = visible(x, ids, tw, g, u, d)
        return torch.autograd.grad(out, (x, g, u, d), torch.ones_like(out))

    gm = make_fx(step, tracing_mode="symbolic" if dynamic_tokens else "fake")(
        leaves[0], p.topk_ids, p.topk_weights, *leaves[1:])
    kernels, ops = _kernels_and_ops(gm.graph)
    return {"kernels": kernels, "ops": ops}


def visible_engine_backward_joint(traced_engine: bool) -> dict:
    """What AOT autograd's joint graph of the visible op's forward and backward holds for a bf16 call whose backward
    the ``torch._grouped_mm`` engine takes (``gemm_engine_backward = "grouped_mm"``; 9 tokens, 18 rows, static),
    with ``config.visible_engine_backward`` = ``traced_engine``: the Triton kernels launched through ``wrap_triton``
    ("kernels"), the moe_inductor ops called as ops ("ops"), and how many ``aten._grouped_mm`` nodes
    ("grouped_mm"). Read at the partitioner, so nothing is compiled or launches."""
    from torch._dynamo.backends.common import aot_autograd

    from moe_inductor import config

    config.visible_engine_backward = traced_engine
    config.gemm_engine, config.gemm_engine_backward = "triton", "grouped_mm"
    p, weights, visible = _visible_problem(9, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (p.x, *weights)]
    seen = {}

    def read_joint(joint, *args, **kwargs):
        kernels, ops = _kernels_and_ops(joint.graph)
        grouped = sum(1 for n in joint.graph.nodes if n.target is torch.ops.aten._grouped_mm.default)
        seen.update(kernels=kernels, ops=ops, grouped_mm=grouped)
        raise _Captured

    def step(x, ids, tw, g, u, d):
        return visible(x, ids, tw, g, u, d)

    try:
        torch.compile(step, backend=aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=read_joint),
                      dynamic=False)(leaves[0], p.topk_ids, p.topk_weights, *leaves[1:])
    except Exception as e:  # stopped on purpose once the graph was read
        if not isinstance(e, _Captured) and "_Captured" not in repr(e):
            raise
    return seen


def _kernels_and_ops(graph) -> tuple[list, list]:
    """A traced graph's Triton kernels launched through ``wrap_triton`` and its moe_inductor ops, each by name, in
    graph order."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in graph.nodes
               if "triton_kernel_wrapper" in str(n.target)]
    ops = [n.target._opname for n in graph.nodes if getattr(n.target, "namespace", None) == "moe_inductor"]
    return kernels, ops
