"""A DeepSeek-style MoE written from scratch, mirrored from RaF-in/Build-deepseek-from-scratch (``MOE.py``: ``Expert``,
``MoeGate``, ``MOE``; its ``Config`` is in ``MLA.py``).

Style: the batch dimension kept throughout. ``x`` is (B, T, C); the gate's ``nn.Linear`` scores plus an
auxiliary-loss-free bias buffer (nudged after each training step from per-expert token counts, under no_grad) go to
``topk(k=activated_experts)``, and the top-k logits are softmaxed. The routed experts run one pass per choice j: the
(B, T) ids and weights ``topk_indices[..., j]`` / ``topk_probs[..., j]``, then per expert ``mask = (ids == i)``,
skipped unless ``mask.any()``, and ``out[mask] += expert(x[mask]) * probs[mask].unsqueeze(-1)`` into a
``zeros_like(x)``. The experts are ``layer2(dropout(relu(layer1(x))))`` with biases; two shared experts of the same
shape are averaged and added. Eval mode (the bias stays put, the dropout is the identity).

Outcome:
- ``raf_deepseek_scratch_top1`` (``activated_experts = 1``, a Switch-style top-1 router): the (B, T) masked writes
  are the top-1 spelling of form "unrolled_loop" with the batch dimension kept (``passes/top1_masks.py``), the
  ``mask.any()`` skips proven (``mask_guards.py``), the eval-mode dropout read as the identity; rewritten, forward
  and gradients equal to eager.
- ``raf_deepseek_scratch`` (the source's default, ``activated_experts = 4``): four top-1 passes over the choices add
  into one buffer, pass j's masks of the column ``topk_indices[..., j]`` and its weight ``topk_probs[..., j]``; each
  pass is a complete top-1 loop over the same experts, so together they are the top-4 MoE of ``(topk_indices,
  topk_probs)`` (``top1_masks._choices_spec``); rewritten, forward and gradients equal to eager.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H = 16


@dataclass
class Config:
    n_embd: int = H
    num_of_experts: int = 4
    num_of_shared_experts: int = 2
    activated_experts: int = 4


class Expert(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer1 = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(0.3)
        self.layer2 = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.layer2(self.dropout(self.relu(self.layer1(x))))


class MoeGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.expert_selector = nn.Linear(config.n_embd, config.num_of_experts)
        self.register_buffer("bias", torch.zeros(config.num_of_experts))
        self.register_buffer("total_tokens", torch.zeros(config.num_of_experts))

    def update_bias(self, topk_indices):
        """Auxiliary-loss-free balancing: raise the bias of experts below the mean count, lower the others'."""
        with torch.no_grad():
            for j in range(self.config.activated_experts):
                for i in range(self.config.num_of_experts):
                    self.total_tokens[i] += (topk_indices[..., j] == i).float().sum()
            self.bias.data += 0.1 * torch.sign(self.total_tokens.mean() - self.total_tokens)

    def forward(self, x):
        scores = self.expert_selector(x) + self.bias
        topk_logits, topk_indices = torch.topk(scores, k=self.config.activated_experts, dim=-1)
        topk_probs = F.softmax(topk_logits, dim=-1)
        if self.training:
            self.update_bias(topk_indices)
        return topk_probs, topk_indices


class MOE(nn.Module):
    def __init__(self, activated_experts=4):
        super().__init__()
        config = self.config = Config(activated_experts=activated_experts)
        self.shared_experts = nn.ModuleList(Expert(config) for _ in range(config.num_of_shared_experts))
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.num_of_experts))
        self.gate = MoeGate(config)

    def forward(self, x):
        shared = torch.zeros_like(x)
        for expert in self.shared_experts:
            shared = shared + expert(x)
        shared /= self.config.num_of_shared_experts
        topk_probs, topk_indices = self.gate(x)
        routed = torch.zeros_like(x)
        for j in range(self.config.activated_experts):
            ids, probs = topk_indices[..., j], topk_probs[..., j]  # (B, T)
            for i in range(self.config.num_of_experts):
                mask = ids == i
                if mask.any():
                    routed[mask] += self.experts[i](x[mask]) * probs[mask].unsqueeze(-1)
        return shared + routed


_SRC = "RaF-in/Build-deepseek-from-scratch MOE.py MOE"
CASES = [
    Case("raf_deepseek_scratch_top1", f"{_SRC} (activated_experts=1)", lambda: MOE(activated_experts=1).eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
    Case("raf_deepseek_scratch", f"{_SRC} (activated_experts=4, the default)", lambda: MOE().eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
]
