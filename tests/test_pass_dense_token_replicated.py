"""Llama 4's reference MoE (meta-llama/llama-models): every token copied once per expert, scaled before the experts
by an (E, T) score that is zero off the top-k, bmm over (E, T, H), ``scatter_add_`` into the shared expert's output.
Rewritten to the op with the weight on the input, equal to eager forward and backward; look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E = 16, 12, 4


class ReplicatedMoE(nn.Module):
    def __init__(self, style, k=1):
        super().__init__()
        self.style, self.k = style, k
        self.router = nn.Parameter(torch.randn(H, E) * H ** -0.5)
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        s, T = self.style, x.shape[0]
        logits = torch.matmul(x, self.router)  # (T, E)
        top, ids = torch.topk(logits, self.k, dim=1)
        if s == "soft":  # every expert weighted by its sigmoid: nothing is zero, nothing to skip
            scores = torch.sigmoid(logits).transpose(0, 1)
        elif s == "zeros_scatter":  # the weights scattered into zeros, no sigmoid
            scores = torch.zeros_like(logits).scatter(1, ids, torch.softmax(top, dim=-1)).transpose(0, 1)
        else:
            scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, top).transpose(0, 1))
        rows = torch.arange(T).view(1, -1).expand(E, -1)
        idx = rows.reshape(-1, 1).expand(-1, H)
        gather_idx = torch.arange(T).flip(0).view(1, -1).expand(E, -1).reshape(-1, 1).expand(-1, H) if (
            s == "gathered_other_rows") else idx
        xs = torch.gather(x, dim=0, index=gather_idx)
        if s != "score_after":
            xs = xs * scores.reshape(-1, 1)
        xs = xs.view(E, -1, H)
        h = F.silu(torch.bmm(xs, self.w1)) * torch.bmm(xs, self.w3)
        ys = torch.bmm(h, self.w2)
        if s == "score_after":  # the score on the output: fine math, but not the spelling this proves
            ys = ys * scores.reshape(E, T, 1)
        out = self.shared(x)
        out.scatter_add_(dim=0, index=idx, src=ys.view(-1, H))
        return out


@pytest.mark.parametrize("style,k", [("llama4", 1), ("llama4", 2), ("zeros_scatter", 2)])
def test_token_replicated_is_rewritten_and_equal(style, k):
    torch.manual_seed(0)
    model = ReplicatedMoE(style, k)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "dense_experts", f"{style} T={T}")


@pytest.mark.parametrize("style", ["soft", "gathered_other_rows", "score_after"])
def test_token_replicated_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = ReplicatedMoE(style, 2)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert sum(counters["moe_inductor_left_alone"].values()) >= 1  # explain() says something
    assert_close(out, model(x), torch.float32, style)
