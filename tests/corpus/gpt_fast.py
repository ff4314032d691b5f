"""gpt-fast's Mixtral MoE, mirrored from pytorch-labs/gpt-fast (``mixtral-moe/model.py``: ``MOEFeedForward`` and
``ConditionalFeedForward``).

Style: gathered weights. Softmax over all experts, top-k of the probabilities, renormalised in place
(``expert_weights /= ...``); the experts' (E, I, H) weights are indexed by the (T, k) ids, giving (T, k, I, H)
copies, contracted by einsum ``"ti,taoi->tao"``; the combine is einsum ``"tai,ta->ti"``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 20, 6, 2


class ConditionalFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)

    def forward(self, x, expert_indices):
        w1_weights = self.w1[expert_indices]  # [T, A, D, D]
        w3_weights = self.w3[expert_indices]
        w2_weights = self.w2[expert_indices]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1_weights))
        x3 = torch.einsum("ti, taoi -> tao", x, w3_weights)
        return torch.einsum("tao, taio -> tai", (x1 * x3), w2_weights)


class MOEFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.cond_ffn = ConditionalFeedForward()
        self.dim = H
        self.num_activated_experts = K

    def forward(self, x):
        x = x.view(-1, self.dim)
        scores = self.gate(x)
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights)


CASES = [Case("gpt_fast", "pytorch-labs/gpt-fast mixtral-moe/model.py MOEFeedForward + ConditionalFeedForward",
              MOEFeedForward, lambda T, g: torch.randn(T, H, generator=g), form="gathered_weights")]
