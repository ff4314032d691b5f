"""transformers v5's GLM-4 MoE block, mirrored from huggingface/transformers (v5.x,
``src/transformers/models/glm4_moe/modeling_glm4_moe.py``: ``Glm4MoeTopkRouter``, ``Glm4MoeExperts``, ``Glm4MoeMoE``;
dots1's ``Dots1TopkRouter`` / ``Dots1MoE`` are the same code).

Style: a DeepSeek-V3 router written the v5 way: the (E, H) router weight a raw fp32 parameter applied by
``F.linear`` on fp32 copies; ``sigmoid`` scores; an ``e_score_correction_bias`` buffer added for the choice only;
group-limited top-k with ``sorted=False`` (groups scored by the sum of their top-2, ``zeros_like`` + ``scatter_`` a
group mask, ``unsqueeze(-1).expand(...).reshape(-1, E)``, ``masked_fill(~mask.bool(), -inf)``); the weights
``gather``ed from the uncorrected scores, renormalised with ``+ 1e-20`` and scaled by ``routed_scaling_factor``
(left fp32: no cast back). The experts are v5's stacked-3D ``Glm4MoeExperts`` run by its eager loop (the one the
``use_experts_implementation`` decorator wraps: ``one_hot(ids, E + 1)``, the hit-expert loop, ``continue`` on the
spare class, ``F.linear`` on ``gate_up_proj[e]`` chunked, ``index_add_``). The block routes the 3D input (the router
flattens it), runs the experts on a 2D view, ``.view(*orig_shape)`` and adds shared experts applied to the 3D
residual.

Departures: the correction bias is random (the source starts it at zeros and a checkpoint fills it) so that the
choice really differs from the weights' ranking.

Cases: GLM-4.5's own grouping (``n_group = topk_group = 1``, the group machinery degenerate) with E = 6 (not a power
of two); dots1-style real groups (E = 8 in 4 groups, 2 kept) without renormalisation.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, K = 32, 16, 2


class Glm4MoeMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Glm4MoeTopkRouter(nn.Module):
    def __init__(self, num_experts, n_group, topk_group, norm_topk_prob, routed_scaling_factor=2.5):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = K, num_experts, H
        self.num_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.randn(num_experts, H, dtype=torch.float32) * H ** -0.5)
        self.e_score_correction_bias = nn.Buffer(torch.randn(num_experts, dtype=torch.float32) * 0.1)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.num_group
        group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights = topk_weights * self.routed_scaling_factor
        return logits, topk_weights, topk_indices


class Glm4MoeExperts(nn.Module):
    """v5's stacked experts: (E, 2I, H) gate/up, (E, H, I) down, the eager hit-expert loop."""

    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, H, I) * I ** -0.5)
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
            state = hidden_states[token_idx]
            gate, up = F.linear(state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final


class Glm4MoeMoE(nn.Module):
    def __init__(self, num_experts=6, n_group=1, topk_group=1, norm_topk_prob=True, n_shared_experts=1):
        super().__init__()
        self.experts = Glm4MoeExperts(num_experts)
        self.gate = Glm4MoeTopkRouter(num_experts, n_group, topk_group, norm_topk_prob)
        self.shared_experts = Glm4MoeMLP(I * n_shared_experts)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


SOURCE = "huggingface/transformers v5.x models/glm4_moe/modeling_glm4_moe.py Glm4MoeMoE (eager experts loop)"
CASES = [
    Case("hf_v5_glm4_moe", SOURCE + ", n_group=1, E=6", Glm4MoeMoE,
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
    Case("hf_v5_glm4_moe_grouped", SOURCE + " (dots1-style groups: E=8, 4 groups, 2 kept, no renormalisation)",
         lambda: Glm4MoeMoE(8, 4, 2, norm_topk_prob=False, n_shared_experts=2),
         lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop"),
]
