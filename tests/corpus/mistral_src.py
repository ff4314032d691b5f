"""Mistral's reference MoE layer, mirrored from mistralai/mistral-src (``moe.py``: ``MoeLayer``; the experts are
``FeedForward`` modules of three bias-free ``nn.Linear``).

Style: the gate picks top-k logits, softmax over the k picked (in fp32, cast back), and a Python loop over
``enumerate(self.experts)`` selects rows with ``torch.where(selected == i)`` and accumulates with
``results[batch_idx] += weights[batch_idx, nth, None] * expert(inputs[batch_idx])``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 24, 4, 2


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self, experts, gate, num_experts_per_tok):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.num_experts_per_tok = num_experts_per_tok

    def forward(self, inputs):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


def build():
    return MoeLayer([FeedForward(H, I) for _ in range(E)], nn.Linear(H, E, bias=False), K)


CASES = [Case("mistral_src", "mistralai/mistral-src moe.py MoeLayer", build,
              lambda T, g: torch.randn(T, H, generator=g), form="unrolled_loop")]
