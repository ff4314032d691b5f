"""transformers v5's eager experts loop written into user code, mirrored from huggingface/transformers (v5.x,
``src/transformers/models/qwen3_moe/modeling_qwen3_moe.py``: ``Qwen3MoeExperts``, and
``models/gpt_oss/modeling_gpt_oss.py``: ``GptOssExperts``), the form people copy out of v5 models.

Style: experts as stacked 3D parameters; the mask ``one_hot(ids, num_classes=E + 1)`` (one spare class for ids an
expert-parallel router masks to E; GPT-OSS's uses E classes) permuted to (classes, k, T); the loop over
``greater(mask.sum((-1, -2)), 0).nonzero()``; ``expert_idx = expert_idx[0]`` (a 0-d index) and ``if expert_idx ==
num_experts: continue``; ``top_k_pos, token_idx = torch.where(mask[expert_idx])``. Qwen3's body: ``F.linear`` on
``gate_up_proj[e]`` (E, 2I, H) chunked into gate and up; GPT-OSS's: ``x @ gate_up_proj[e] + bias[e]`` on (E, H, 2I)
with interleaved gate/up and the clamped glu, then ``@ down_proj[e] + bias[e]``; both ``index_add_`` the weighted
rows. Outside the experts module: Qwen3's router (softmax, top-k, renormalised) and GPT-OSS's (top-k of the logits,
softmax over the k).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 5, 2


class StackedExperts(nn.Module):
    """Qwen3-MoE's experts: one (E, 2I, H) gate/up weight, one (E, H, I) down weight, an expert-parallel spare class."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:  # the spare class: masked choices
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            rows = hidden_states[token_idx]
            gate, up = F.linear(rows, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


class Qwen3StyleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = StackedExperts()

    def forward(self, x):
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        return self.experts(flat, ids, weights).reshape(batch, seq, hidden)


class BiasedInterleavedExperts(nn.Module):
    """GPT-OSS's experts: (E, H, 2I) gate/up with interleaved columns, biases, the clamped glu."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.1)
        self.alpha, self.limit = alpha, limit

    def glu(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states, router_indices, routing_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            rows = hidden_states[token_idx]
            gate_up = rows @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
            h = self.glu(gate_up) @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
            out.index_add_(0, token_idx, (h * routing_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


class GptOssStyleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = BiasedInterleavedExperts()

    def forward(self, x):
        batch, seq, hidden = x.shape
        flat = x.reshape(-1, hidden)
        top_values, ids = torch.topk(self.router(flat), K, dim=-1)
        weights = F.softmax(top_values, dim=1, dtype=top_values.dtype)
        return self.experts(flat, ids, weights).reshape(batch, seq, hidden)


CASES = [
    Case("hf_v5_qwen3_eager_experts", "huggingface/transformers v5.x models/qwen3_moe/modeling_qwen3_moe.py "
         "Qwen3MoeExperts (eager loop) in user code", Qwen3StyleBlock, lambda T, g: torch.randn(2, T, H, generator=g),
         form="unrolled_loop"),
    Case("hf_v5_gpt_oss_eager_experts", "huggingface/transformers v5.x models/gpt_oss/modeling_gpt_oss.py "
         "GptOssExperts (eager loop) in user code", GptOssStyleBlock, lambda T, g: torch.randn(1, T, H, generator=g),
         form="unrolled_loop"),
]
