"""The dense all-experts form: matched in two styles, equal to eager (fwd and bwd), look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_gpu_bf16_rewrite, compile_moe

E, H, I = 6, 16, 8


class DenseMoE(nn.Module):
    def __init__(self, style="einsum", k=2):
        super().__init__()
        self.style, self.k = style, k
        self.router = nn.Linear(H, E, bias=False)
        kn = style == "kn_mulsum"
        self.w1 = nn.Parameter(torch.randn((E, H, I) if kn else (E, I, H)) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn((E, H, I) if kn else (E, I, H)) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn((E, I, H) if kn else (E, H, I)) * I ** -0.5)

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        values, ids = torch.topk(probs, self.k, dim=-1)
        if self.style == "einsum":
            routing = torch.zeros_like(probs).scatter(1, ids, values)
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        if self.style == "kn_mulsum":  # (E, in, out) weights, in-place scatter, plain activation, mul+sum combine
            routing = torch.zeros_like(probs)
            routing.scatter_(1, ids, values)
            h = F.gelu(torch.einsum("bk,ekn->ben", x, self.w1))
            out = torch.einsum("ben,enm->bem", h, self.w2)
            return (out * routing[..., None]).sum(1)
        if self.style == "soft":  # every expert weighted by the full softmax: not sparse, must stay dense
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), probs)
        if self.style == "edited_inplace_scatter":  # the in-place scatter's result written again: not the top-k
            routing = torch.zeros_like(probs).scatter_(1, ids, values)
            routing[:, :] = 0.0
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        if self.style == "ones_base":  # scattered into ones, not zeros: unselected experts still count
            routing = torch.ones_like(probs).scatter(1, ids, values)
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        if self.style == "mutated_base":  # the "zeros" are changed before the scatter
            base = torch.zeros_like(probs)
            base.add_(0.1)
            routing = base.scatter(1, ids, values)
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        if self.style in ("topk_over_tokens", "second_scatter"):
            if self.style == "topk_over_tokens":  # each expert picks its tokens (dim 0), not each token its experts
                v0, i0 = torch.topk(probs, 2, dim=0)
                routing = torch.zeros_like(probs).scatter(0, i0, v0)
            else:  # a second scatter adds onto the first: a choice counts twice
                routing = torch.zeros_like(probs).scatter(1, ids, values).scatter_add(1, ids[:, :1], values[:, :1])
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        if self.style in ("view_mutated_base", "view_mutated_routing"):  # changed in place through a view
            base = torch.zeros_like(probs)
            if self.style == "view_mutated_base":
                base[:, :1].add_(0.1)  # expert 0 counts for every token
            routing = base.scatter(1, ids, values)
            if self.style == "view_mutated_routing":
                routing[:, :1].mul_(0.5)
            h = F.silu(torch.einsum("th,eih->tei", x, self.w1)) * torch.einsum("th,eih->tei", x, self.w3)
            return torch.einsum("teh,te->th", torch.einsum("tei,ehi->teh", h, self.w2), routing)
        raise ValueError(self.style)


@pytest.mark.parametrize("style", ["einsum", "kn_mulsum"])
@pytest.mark.parametrize("k", [1, 2, E], ids=["k1", "k2", "k-eq-E"])
def test_styles_are_rewritten_and_equal(style, k):
    torch.manual_seed(0)
    model = DenseMoE(style, k)
    for T in (1, 7, 20):
        x = torch.randn(T, H)
        out, ref = compile_moe(model, x), model(x)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        assert counters["moe_inductor"]["dense_experts"] == 1
        assert sum(counters["graph_break"].values()) == 0
        assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("style", ["einsum", "kn_mulsum"])
def test_gradients_match_eager(style):
    torch.manual_seed(0)
    model = DenseMoE(style)
    x = torch.randn(9, H, requires_grad=True)
    params = [x, model.router.weight, model.w1, model.w2] + ([model.w3] if style == "einsum" else [])  # gated?
    out = compile_moe(model, x, inner="aot_eager")
    assert counters["moe_inductor"]["dense_experts"] == 1
    grads = torch.autograd.grad(out.square().sum(), params)
    ref_grads = torch.autograd.grad(model(x).square().sum(), params)
    for g, r in zip(grads, ref_grads):
        assert ((g - r).norm() / r.norm()).item() < 1e-5


@pytest.mark.parametrize("style", ["soft", "ones_base", "mutated_base", "view_mutated_base", "view_mutated_routing",
                                   "topk_over_tokens", "second_scatter", "edited_inplace_scatter"])
def test_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = DenseMoE(style)
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    # every one of them mixes all experts by a matrix that is not a provable top-k scatter: said so, once
    assert counters["moe_inductor_left_alone"] == {"dense_experts": 1}


def test_explain_says_a_soft_mixture_is_not_sparse():
    torch.manual_seed(0)
    report = moe_inductor.explain(DenseMoE("soft"), torch.randn(5, H))
    (left,) = report.left_alone
    assert left.form == "dense_experts" and "soft mixture of every expert is not sparse" in left.reason
    assert "test_pass_dense_experts.py" in left.where


@pytest.mark.gpu
def test_gpu_kernels_run_the_rewritten_dense_experts_bf16():
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(DenseMoE("einsum"), "dense_experts")
