"""Mixed precision: under ``torch.autocast`` to a dtype other than the tokens' and weights' (fp32 weights, bf16
autocast: transformers' Trainer with ``bf16=True``), a region whose matmuls autocast computes in bf16 is rewritten
with the op computing in bf16, its inputs cast as autocast casts the user's (``passes/grad_modes.autocast_compute``,
``passes/emit._autocast_inputs``; transformers' eager loop and batched_mm in ``hf._autocast_dtype``).

Rounding alone cannot tell a bf16 op from an fp32 one against eager's bf16 numbers (on these sizes both sit within
bf16's rounding of them), so each test also reads the dtypes the op's body was called with (``op_dtypes``)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from helpers import rel_err
from test_review_s49 import LIGHT, AutocastLoop, E, H, I, K, T

#: the form of each transformers experts implementation's substitution
FORMS = {"eager": "hf_eager_loop", "batched_mm": "hf_batched_mm"}
#: the bound on a bf16 rewrite against eager's bf16 matmuls: each rounds at other places
BF16_TOL = 2e-2


@pytest.fixture
def op_dtypes(monkeypatch) -> list:
    """The dtypes of the floating-point tensors (tokens, routing weights, expert weights and biases) each call of
    the stacked op's body receives, as the op's kernel sees them."""
    from moe_inductor.ops import experts

    calls, body = [], experts.experts_forward_call

    def spy(call):
        parts = (call.x, call.routing.topk_weights, *call.weights[:6])
        calls.append({t.dtype for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()})
        return body(call)

    monkeypatch.setattr(experts, "experts_forward_call", spy)
    return calls


def _run(model: nn.Module, x: torch.Tensor, train: bool, autocast: bool = True):
    """The compiled model's output (and its grads, training) under bf16 autocast on ``x``'s device, and eager's under
    the same autocast."""
    torch._dynamo.reset()
    counters.clear()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe_inductor", options=LIGHT)
    results = []
    for m, params in ((compiled, model), (eager, eager)):
        xi = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = m(xi)
        grads = {}
        if train:
            out.float().pow(2).sum().backward()
            grads = {"x": xi.grad, **{n: p.grad for n, p in params.named_parameters() if p.grad is not None}}
        results.append((out, grads))
    return results


def _assert_bf16_rewrite(results, calls: list, form: str, train: bool) -> None:
    (got, got_grads), (expected, expected_grads) = results
    assert counters["moe_inductor"][form] == 1, dict(counters["moe_inductor_left_alone"])
    assert calls and all(c == {torch.bfloat16} for c in calls), calls  # tokens, weights, routing weights: bf16
    assert got.dtype == expected.dtype
    assert rel_err(got, expected) <= BF16_TOL
    if train:
        assert got_grads.keys() == expected_grads.keys()
        for name, g in got_grads.items():
            assert g.dtype == expected_grads[name].dtype, name  # fp32 parameters get fp32 gradients
            assert rel_err(g, expected_grads[name]) <= BF16_TOL, name


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("inside,around", [("none", True), ("loop", False)],
                         ids=["autocast-around-the-call", "autocast-default-dtype-around-the-loop"])
def test_loop_under_autocast_computes_in_bf16(inside, around, train, op_dtypes):
    torch.manual_seed(0)
    results = _run(AutocastLoop(inside), torch.randn(T, H), train, autocast=around)
    _assert_bf16_rewrite(results, op_dtypes, "unrolled_loop", train)


def test_note_says_the_op_computes_in_autocast_dtype():
    import moe_inductor

    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        text = str(moe_inductor.explain(AutocastLoop("none"), torch.randn(T, H)))
    assert "1 MoE rewrite(s)" in text and "the op computes in torch.bfloat16" in text, text


@pytest.mark.parametrize("inside", ["one", "all"])
def test_autocast_inside_the_bodies_is_left_alone(inside, op_dtypes):
    """Look-alikes: autocast opened inside the loop's bodies (one expert's, or each one's) and closed before the
    writes: the region computes under two autocast states, which the op (one call) cannot reproduce."""
    torch.manual_seed(0)
    (got, _), (expected, _) = _run(AutocastLoop(inside), torch.randn(T, H), False, autocast=False)
    assert counters["moe_inductor"]["unrolled_loop"] == 0 and op_dtypes == []
    assert counters["moe_inductor_left_alone"]["unrolled_loop"] == 1
    assert torch.equal(got, expected)


class GroupedLoop(nn.Module):
    """Sort by expert and ``torch._grouped_mm`` per projection (no autocast op) on bf16 weights and tokens."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, I) * 0.2)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * 0.2)

    def forward(self, x):
        w, ids = self.gate(x).float().softmax(-1).topk(K, -1)
        order = torch.argsort(ids.view(-1), stable=True)
        tok = order // K
        scores = w.view(-1)[order]
        xs = x[tok]
        offs = torch.cumsum(torch.histc(ids.view(-1).float(), bins=E, min=0, max=E), dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(xs, self.w1, offs=offs))
        ys = torch._grouped_mm(h, self.w2, offs=offs) * scores.reshape(-1, 1).to(x.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, tok, ys)
        return out


def test_grouped_mm_under_autocast_to_another_dtype_keeps_its_dtype(op_dtypes):
    """``torch._grouped_mm`` is no autocast op: under fp16 autocast the user's bf16 experts compute in bf16, so
    the op does too (no cast), where the router's ``nn.Linear`` computes in fp16."""
    torch.manual_seed(0)
    model = GroupedLoop().to(torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        expected = model(x)
        got = torch.compile(model, backend="moe_inductor", options=LIGHT)(x)
    assert counters["moe_inductor"]["sorted_grouped_mm"] == 1
    assert op_dtypes and all(c == {torch.bfloat16} for c in op_dtypes), op_dtypes
    assert got.dtype == expected.dtype and rel_err(got, expected) <= BF16_TOL


def test_mixed_matmul_dtypes_are_left_alone():
    """``autocast_compute`` on a region whose matmuls compute in two dtypes (one with autocast turned off around
    it, one under the caller's autocast) says why instead of picking one."""
    from moe_inductor.passes.grad_modes import MIXED_MATMULS, autocast_compute
    from moe_inductor.passes.fx_utils import val

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm.forward

    def region(x, w1, w2):
        with torch.autocast("cpu", enabled=False):
            h = x @ w1.t()
        return F.linear(h, w2)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the passes read the caller's autocast while compiling
        torch.compile(region, backend=keep, fullgraph=True)(torch.randn(4, H), torch.randn(I, H), torch.randn(H, I))
        nodes = {n.name: n for n in graphs[0].graph.nodes}
        x, w1, w2 = nodes["l_x_"], nodes["l_w1_"], nodes["l_w2_"]
        end = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0][0]
        assert val(end).dtype == torch.bfloat16, nodes
        said = autocast_compute([x, w1, w2], end, [], x, [w1, w2])
    assert isinstance(said, str) and said.startswith(MIXED_MATMULS.split("{")[0]), said


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_hf_experts_under_autocast_compute_in_bf16(impl, train, op_dtypes):
    """transformers' own experts code (its eager loop and batched_mm) under bf16 autocast with fp32 weights."""
    from hf_models import tiny

    torch.manual_seed(0)
    block = tiny("qwen3_moe", impl).model.layers[0].mlp
    results = _run(block, torch.randn(2, 5, 32), train)
    _assert_bf16_rewrite(results, op_dtypes, FORMS[impl], train)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_loop_under_cuda_autocast_runs_the_kernels_in_bf16(train, op_dtypes):
    """Mixed-precision training on the GPU: fp32 weights under CUDA bf16 autocast; the op's Triton kernels get bf16
    inputs, and the fp32 parameters fp32 gradients equal to eager's within bf16."""
    torch.manual_seed(0)
    results = _run(AutocastLoop("none").cuda(), torch.randn(T, H, device="cuda"), train)
    _assert_bf16_rewrite(results, op_dtypes, "unrolled_loop", train)


@pytest.mark.slow
@pytest.mark.parametrize("family,impl", [("qwen3_moe", "eager"), ("gpt_oss", "batched_mm")])
def test_whole_model_training_step_under_autocast(family, impl, op_dtypes):
    """A tiny transformers model's training step (``labels=``, ``loss.backward()``) under CPU bf16 autocast with fp32
    weights, as the Trainer's ``bf16=True`` runs it: every layer's experts rewritten in bf16, the logits and every
    parameter's gradient equal to eager's within bf16 (GPT-OSS's biases and clamped glu included)."""
    from hf_models import tiny

    model = tiny(family, impl)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options=LIGHT)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    steps = []
    for m, params in ((compiled, model), (eager, eager)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        steps.append((out.logits.float(), {n: p.grad for n, p in params.named_parameters() if p.grad is not None}))
    (logits, grads), (eager_logits, eager_grads) = steps
    assert counters["moe_inductor"][FORMS[impl]] == 2  # both layers
    assert op_dtypes and all(c == {torch.bfloat16} for c in op_dtypes), op_dtypes
    assert rel_err(logits, eager_logits) <= BF16_TOL
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():  # bf16 rounding through two layers and the loss: measured <= 0.019
        assert g.dtype == torch.float32 and rel_err(g, eager_grads[name]) <= 3e-2, name
