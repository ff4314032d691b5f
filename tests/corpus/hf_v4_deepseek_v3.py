"""transformers v4's DeepSeek-V3 MoE, mirrored from huggingface/transformers (v4.5x,
``src/transformers/models/deepseek_v3/modeling_deepseek_v3.py``: ``DeepseekV3TopkRouter``, ``DeepseekV3MoE.moe``,
``DeepseekV3MLP``; the same loop serves dots1 and GLM-4 MoE in those releases, and forks such as the one read in
the index keep it as their ``vanilla_forward``).

Style: the router a raw fp32 (E, H) parameter applied by ``F.linear`` to an fp32 copy of the tokens, ``sigmoid``
scores, an ``e_score_correction_bias`` buffer added for the choice only, groups scored by the sum of their top-2,
``topk_group`` groups kept through a ``zeros_like`` + ``scatter_`` mask expanded over the group's experts and
``masked_fill(~mask.bool(), 0.0)``, ``topk(sorted=False)`` of the masked scores, the weights ``gather``ed from
the uncorrected scores, renormalised in place (``/= sum + 1e-20``) and scaled by ``routed_scaling_factor``. The
experts loop: ``one_hot(ids, E).permute(2, 0, 1)`` read per expert by ``torch.where`` into (token, slot) pairs,
``if token_indices.numel() > 0:``, the expert on ``x[token_indices]`` times the slot's weight ``.unsqueeze(-1)``,
``index_add_`` into ``zeros_like(x, dtype=topk_weights.dtype)`` (an fp32 buffer under a bf16 model), cast back
with ``.type(x.dtype)``; shared experts added on the residual.

Departure: the correction bias is random (a checkpoint fills the source's zeros), so the choice differs from the
weights' ranking. Cases: E = 6 in 2 groups with one kept, top-2, in fp32 and in bf16 (the fp32 buffer then holds
bf16 products).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 32, 16, 6, 2


class DeepseekV3MLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3TopkRouter(nn.Module):
    def __init__(self, n_group=2, topk_group=1, routed_scaling_factor=2.5):
        super().__init__()
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.register_buffer("e_score_correction_bias", torch.randn(E) * 0.1)

    @torch.no_grad()
    def get_topk_indices(self, scores):
        choice = scores.view(-1, E) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(-1, self.n_group, E // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        masked = choice.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(masked, k=K, dim=-1, sorted=False)[1]

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, H)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        return topk_indices, topk_weights * self.routed_scaling_factor


class DeepseekV3MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(DeepseekV3MLP(I) for _ in range(E))
        self.gate = DeepseekV3TopkRouter()
        self.shared_experts = DeepseekV3MLP(I)

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_output = expert(hidden_states[token_indices])
                final_hidden_states.index_add_(0, token_indices, expert_output * expert_weights.unsqueeze(-1))
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals, orig_shape = hidden_states, hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


SOURCE = "huggingface/transformers v4.5x models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3MoE.moe + TopkRouter"
CASES = [
    Case("hf_v4_deepseek_v3", SOURCE + " (E=6, 2 groups, top-2)", DeepseekV3MoE, _input, form="unrolled_loop"),
    Case("hf_v4_deepseek_v3_bf16", SOURCE + " (bf16 model, fp32 buffer)", DeepseekV3MoE, _input,
         form="unrolled_loop", dtype=torch.bfloat16),
]
