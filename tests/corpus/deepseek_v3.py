"""DeepSeek-V3's reference inference MoE, mirrored from deepseek-ai/DeepSeek-V3 (``inference/model.py``: ``Gate``,
``Expert``, ``MoE``).

Style: sigmoid router with a score-correction bias used only for the choice, group-limited top-k (groups scored by
their top-2 sum, ``scatter_`` a mask, ``masked_fill_`` -inf), weights gathered from the uncorrected scores and
renormalised, ``route_scale``; ``counts = torch.bincount(indices.flatten(), minlength=E).tolist()`` and a loop over
``range(E)`` that skips ``if counts[i] == 0``, ``idx, top = torch.where(indices == i)``,
``y[idx] += expert(x[idx]) * weights[idx, top, None]``; plus shared experts.

The skip is traced as running every body (speculation.py); in the corpus's training step a skipped expert's
nn.Linear weights are left without a gradient (None), as eager leaves them (grad_gate.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K, GROUPS, TOPK_GROUPS = 16, 8, 8, 2, 4, 2


class Expert(nn.Module):
    def __init__(self, dim, inter):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.topk, self.n_groups, self.topk_groups, self.route_scale = K, GROUPS, TOPK_GROUPS, 2.5
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.bias = nn.Parameter(torch.randn(E) * 0.1)

    def forward(self, x):
        scores = F.linear(x, self.weight)
        scores = scores.sigmoid()
        original_scores = scores
        scores = scores + self.bias
        scores = scores.view(x.size(0), self.n_groups, -1)
        group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(self.topk_groups, dim=-1)[1]
        mask = scores.new_ones(x.size(0), self.n_groups, dtype=bool).scatter_(1, indices, False)
        scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights *= self.route_scale
        return weights.type_as(x), indices


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.dim, self.n_routed_experts = H, E
        self.gate = Gate()
        self.experts = nn.ModuleList([Expert(H, I) for _ in range(E)])
        self.shared_experts = Expert(H, 2 * I)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.n_routed_experts):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


CASES = [Case("deepseek_v3", "deepseek-ai/DeepSeek-V3 inference/model.py MoE + Gate", MoE,
              lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop")]
