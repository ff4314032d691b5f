"""Gathered weights with biases and GPT-OSS's clamped glu (openai/gpt-oss's reference MLPBlock): ``w[ids, ...]``
einsums plus ``b[ids, ...]``, interleaved gate/up, ``t += b2[ids]``; rewritten with the biases and the user's alpha
and limit, equal to eager forward and backward; look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


def swiglu(x, alpha, limit, lo=None):
    x_glu, x_linear = x[..., ::2], x[..., 1::2]
    x_glu = x_glu.clamp(min=None, max=limit)
    x_linear = x_linear.clamp(min=-limit if lo is None else lo, max=limit)
    return x_glu * torch.sigmoid(alpha * x_glu) * (x_linear + 1)


class GptOssMoE(nn.Module):
    def __init__(self, style="reference", alpha=1.702, limit=7.0):
        super().__init__()
        self.style, self.alpha, self.limit = style, alpha, limit
        self.gate = nn.Linear(H, E)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5 * 4)  # big enough that the clamps bite
        self.b1 = nn.Parameter(torch.randn(E, 2 * I))
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.b2 = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x):
        s = self.style
        experts = torch.topk(self.gate(x), k=K, dim=-1, sorted=True)
        weights, ids = torch.softmax(experts.values, dim=1), experts.indices
        bias_ids = ids.flip(1) if s == "bias_of_other_choice" else ids
        t = torch.einsum("beck,bk->bec", self.w1[ids, ...], x) + self.b1[bias_ids, ...]
        t = swiglu(t, self.alpha, self.limit, lo=-3.0 if s == "asymmetric_clamp" else None)
        t = torch.einsum("beck,bek->bec", self.w2[ids, ...], t)
        if s != "no_down_bias":
            t += self.b2[ids, ...]
        return torch.einsum("bec,be->bc", t, weights)


@pytest.mark.parametrize("style,alpha,limit", [("reference", 1.702, 7.0), ("reference", 1.0, 2.5),
                                               ("no_down_bias", 1.702, 7.0)], ids=["gpt-oss", "own-alpha-limit",
                                                                                   "no-b2"])
def test_gpt_oss_reference_is_rewritten_and_equal(style, alpha, limit):
    torch.manual_seed(0)
    model = GptOssMoE(style, alpha, limit)
    assert_rewritten_like_eager(model, torch.randn(9, H), "gathered_weights", style)


@pytest.mark.parametrize("style", ["bias_of_other_choice", "asymmetric_clamp"])
def test_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = GptOssMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"]["gathered_weights"] >= 1  # explain() says why
    assert_close(out, model(x), torch.float32, style)
