"""transformers v5's ERNIE 4.5 MoE block, mirrored from huggingface/transformers (v5.x,
``src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py``: ``Ernie4_5_MoeStatics``,
``Ernie4_5_MoeTopKRouter``, ``Ernie4_5_MoeExperts``, ``Ernie4_5_MoeSparseMoeBlock``).

Style: the shared experts run first, on the flattened tokens, before any routing. The router is forced to fp32 inside
``maybe_autocast(device_type, enabled=False)`` (a real ``torch.autocast`` only when autocast is already on, else a
``nullcontext``): ``F.linear`` of fp32 copies of the tokens and of the raw (E, H) weight, ``softmax(dim=1)``; the
choice is a top-k over the probabilities plus a score-correction bias that lives in a child module
(``moe_statics``: a frozen ``(1, E)`` Parameter, ``requires_grad=False``, added after ``.squeeze()``); the weights
are ``torch.gather``ed back from the uncorrected probabilities and renormalised by ``sum.clamp(min=norm_min)``, then
cast to the input dtype. The experts are v5's stacked-3D eager loop (``one_hot(ids, E + 1)``, the hit-expert loop,
``F.linear`` on ``gate_up_proj[e]`` chunked, ``index_add_``); the block adds the shared output, reshapes to 3D and
ends with a ``.to(hidden_states.dtype)``.

Departures: the correction bias is random (zeros in the source until a checkpoint fills it). E = 6 (not a power of
two), k = 2, SiLU; one shared expert of twice the routed width (``moe_num_shared_experts = 2``).
"""
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 32, 16, 6, 2


def maybe_autocast(device_type, enabled=True):
    """transformers' helper: autocast only when it would change something."""
    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, enabled=enabled)
    return nullcontext()


class Ernie4_5_MoeMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Ernie4_5_MoeStatics(nn.Module):
    """Only holds the gate's correction bias, as a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.randn(1, E, dtype=torch.float32) * 0.05,
                                                    requires_grad=False)

    def forward(self, probs):
        return probs + self.e_score_correction_bias.squeeze()


class Ernie4_5_MoeTopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H, dtype=torch.float32) * H ** -0.5)
        self.moe_statics = Ernie4_5_MoeStatics()
        self.top_k, self.num_experts, self.norm_min = K, E, 1e-12

    def forward(self, hidden_states):
        device_type = hidden_states.device.type if isinstance(hidden_states.device.type, str) else "cpu"
        with maybe_autocast(device_type=device_type, enabled=False):
            logits = F.linear(hidden_states.float(), self.weight.float())
            probs = F.softmax(logits, dim=1, dtype=torch.float)
            _, chosen = torch.topk(self.moe_statics(probs), self.top_k, dim=-1)
            weights = torch.gather(probs, dim=-1, index=chosen)
            weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
        return logits, weights.to(hidden_states.dtype), chosen


class Ernie4_5_MoeExperts(nn.Module):
    """v5's stacked experts: (E, 2I, H) gate/up, (E, H, I) down, the eager hit-expert loop."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final


class Ernie4_5_MoeSparseMoeBlock(nn.Module):
    def __init__(self, num_shared_experts=2):
        super().__init__()
        self.hidden_dim = H
        self.gate = Ernie4_5_MoeTopKRouter()
        self.experts = Ernie4_5_MoeExperts()
        self.shared_experts = Ernie4_5_MoeMLP(I * num_shared_experts) if num_shared_experts > 0 else None

    def forward(self, hidden_states):
        batch_size, sequence_length, _ = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden_states)
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        out = self.experts(hidden_states, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            out = out + shared
        out = out.reshape(batch_size, sequence_length, self.hidden_dim)
        return out.to(hidden_states.dtype)


CASES = [Case("hf_v5_ernie4_5_moe", "huggingface/transformers v5.x models/ernie4_5_moe/modeling_ernie4_5_moe.py "
              "Ernie4_5_MoeSparseMoeBlock (eager experts loop)", Ernie4_5_MoeSparseMoeBlock,
              lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop")]
