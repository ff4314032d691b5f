"""vLLM's torch-native iterative MoE: every expert on every token in a ``range(E)`` loop, each output scaled by
``(weights * (ids == e)).sum(-1, keepdim=True)`` and summed. Rewritten (with a shared expert added after, too),
equal to eager forward and backward; look-alikes (a skipped expert, an expert scaled by another's column, a soft
mixture, ids not from topk, an expert's output changed in place before it is scaled) left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class DenseLoopMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        s = self.style
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(K, dim=-1)
        if s == "ids_not_topk":
            ids = ids.clone()
        y = None
        for e in range(E - 1 if s == "skipped_expert" else E):
            p = F.linear(x, self.w1[e])
            out = F.linear(p[:, I:] * F.silu(p[:, :I]), self.w2[e])
            if s == "output_scaled_in_place":  # the graph's ``out * col`` reads the linear's node, now doubled
                out.mul_(2.0)
            if s == "soft":  # every expert weighted by its softmax probability: nothing to skip
                col = probs[:, e:e + 1]
            else:
                col = (weights * (ids == ((e + 1) % E if s == "other_column" else e))).sum(dim=-1, keepdim=True)
            y = out * col if y is None else y + out * col
        return y + self.shared(x) if s == "with_shared" else y


@pytest.mark.parametrize("style", ["vllm", "with_shared"])
def test_dense_loop_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = DenseLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "dense_experts", f"{style} T={T}")
        assert not counters["moe_inductor_left_alone"], dict(counters["moe_inductor_left_alone"])


@pytest.mark.parametrize("style", ["skipped_expert", "other_column", "soft", "ids_not_topk", "output_scaled_in_place"])
def test_dense_loop_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = DenseLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)


class StackedModulesMoE(nn.Module):
    """Every expert's own module on every token, ``torch.stack``-ed to (T, E, H), mixed by a top-k routing matrix."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=False), nn.GELU(), nn.Linear(I, H, bias=False))
                                     for _ in range(E))

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(K, dim=-1)
        routing = torch.zeros_like(probs).scatter(1, ids, weights)
        outs = [m(x) for m in self.experts]
        if self.style == "other_act":  # one expert's activation differs from the others'
            m = self.experts[1]
            outs[1] = m[2](F.relu(m[0](x)))
        elif self.style == "other_input":  # one expert reads another input than the tokens the others read
            outs[2] = self.experts[2](2.0 * x)
        return (torch.stack(outs, dim=1) * routing[..., None]).sum(dim=1)


def test_stacked_expert_modules_are_rewritten_and_equal():
    torch.manual_seed(0)
    assert_rewritten_like_eager(StackedModulesMoE("stacked"), torch.randn(5, H), "dense_experts")


@pytest.mark.parametrize("style", ["other_act", "other_input"])
def test_stacked_expert_module_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = StackedModulesMoE(style)
    x = torch.randn(5, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"] == {"dense_experts": 1}, dict(counters["moe_inductor_left_alone"])
    assert_close(out, model(x), torch.float32, style)


def test_a_non_finite_expert_output_spreads_only_to_the_tokens_that_chose_it():
    """A known difference, stated in README's known limits: eager runs every expert on every token and scales the
    unchosen ones by 0, so one expert's infinite outputs make every token NaN (inf * 0); the rewrite runs only the
    chosen experts, so only the tokens that chose that expert are NaN, and the others equal eager's finite model."""
    torch.manual_seed(0)
    model = DenseLoopMoE("vllm")
    with torch.no_grad():
        model.w2[3] *= 1e38
        model.w2[3] *= 1e38  # overflows: expert 3's outputs are non-finite on every token
    x = torch.randn(6, H)
    with torch.no_grad():
        ref, out = model(x), compile_moe(model, x)
        chose = (model.router(x).softmax(-1).topk(K, dim=-1).indices == 3).any(-1)
        finite = DenseLoopMoE("vllm")
        finite.load_state_dict(model.state_dict())
        finite.w2[3].zero_()
        clean = finite(x)
    assert counters["moe_inductor"]["dense_experts"] == 1
    assert 0 < int(chose.sum()) < 6, chose
    assert ref.isnan().all()
    assert torch.equal(out.isnan().any(-1), chose)
    torch.testing.assert_close(out[~chose], clean[~chose], rtol=1e-5, atol=1e-5)
