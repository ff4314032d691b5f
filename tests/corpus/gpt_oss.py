"""GPT-OSS's reference MoE block, mirrored from openai/gpt-oss (``gpt_oss/torch/model.py``: ``MLPBlock`` and
``swiglu``).

Style: RMSNorm, gate with bias, ``torch.topk(sorted=True)`` then softmax over the k values; gathered weights
``mlp1_weight[expert_indices, ...]`` (E, 2I, H) with interleaved gate/up and biases, einsum ``"beck,bk->bec"``;
the clamped swiglu (``x[..., ::2]`` / ``x[..., 1::2]``, clamp, ``x * sigmoid(alpha * x) * (linear + 1)``); the down
einsum ``"beck,bek->bec"`` and ``t += bias``; combine einsum ``"bec,be->bc"``; residual.
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


def swiglu(x, alpha: float = 1.702, limit: float = 7.0):
    x_glu, x_linear = x[..., ::2], x[..., 1::2]
    x_glu = x_glu.clamp(min=None, max=limit)
    x_linear = x_linear.clamp(min=-limit, max=limit)
    out_glu = x_glu * torch.sigmoid(alpha * x_glu)
    return out_glu * (x_linear + 1)


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        t, dtype = x.float(), x.dtype
        t = t * torch.rsqrt(torch.mean(t ** 2, dim=-1, keepdim=True) + self.eps)
        return (t * self.scale).to(dtype)


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts_per_token, self.swiglu_limit = K, 7.0
        self.norm = RMSNorm(H)
        self.gate = nn.Linear(H, E)
        self.mlp1_weight = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.mlp1_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.mlp2_weight = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.mlp2_bias = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x):
        t = self.norm(x)
        g = self.gate(t)
        experts = torch.topk(g, k=self.experts_per_token, dim=-1, sorted=True)
        expert_weights = torch.nn.functional.softmax(experts.values, dim=1)
        expert_indices = experts.indices
        mlp1_weight = self.mlp1_weight[expert_indices, ...]
        mlp1_bias = self.mlp1_bias[expert_indices, ...]
        t = torch.einsum("beck,bk->bec", mlp1_weight, t) + mlp1_bias
        t = swiglu(t, limit=self.swiglu_limit)
        mlp2_weight = self.mlp2_weight[expert_indices, ...]
        mlp2_bias = self.mlp2_bias[expert_indices, ...]
        t = torch.einsum("beck,bek->bec", mlp2_weight, t)
        t += mlp2_bias
        t = torch.einsum("bec,be->bc", t, expert_weights)
        return x + t


CASES = [Case("gpt_oss", "openai/gpt-oss gpt_oss/torch/model.py MLPBlock", MLPBlock,
              lambda T, g: torch.randn(T, H, generator=g), form="gathered_weights")]
