"""litgpt's MoE block, written after Lightning-AI/litgpt (``litgpt/model.py``: ``LLaMAMoE``, ``GroupedTopkRouter``,
``LLaMAMLP``).

Style: (B, T, C) input kept as ``residual_x = x.clone()`` and flattened with ``view(-1, C)``; a bias-free linear gate,
top-k of the logits, softmax over the k in fp32 cast back; one broadcast comparison
``indices.unsqueeze(-1) == arange(E)`` gives (T, k, E) masks, ``permute(2, 0, 1)`` makes them (E, T, k), and the
loop runs ``for mask, expert in zip(masks, self.experts)`` (iterating over the rows of a tensor, not over
``range(E)``), each ``torch.where(mask)`` giving (token, slot) pairs, ``y[token_idx] += probs[token_idx, slot, None] *
expert(x[token_idx])`` into ``zeros_like``. The experts are ``LLaMAMLP``: ``proj(silu(fc_1(x)) * fc_2(x))``.

The DeepSeek-V3 configuration (``n_expert_groups``): ``GroupedTopkRouter`` computes fp32 sigmoid scores of an
``F.linear`` on fp32 casts, picks the ids under ``@torch.no_grad()`` (a score-correction-bias buffer added, the top-2
scores of each group summed, ``topk(sorted=False)`` of the groups, a ``scatter_`` group mask expanded to the experts,
``masked_fill(~mask, 0)``, ``topk(sorted=False)``), then ``scores.gather(1, ids)`` renormalised in place
(``topk_weights /= denominator``); the block scales the weights by ``routed_scaling_factor`` and adds a shared
``LLaMAMLP`` of the residual copy.

Both are rewritten as the unrolled loop: the loop is mistral_src.py's but for its mask, one (E, T, k) tensor from
the broadcast ``==`` against ``arange(E)`` and a permute, read row by row (``loop_rows.expert_hot`` reads it as
``ids == e``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

C, I = 32, 24


class Config:
    def __init__(self, n_expert, n_expert_per_token, n_expert_groups=None, n_topk_groups=None,
                 n_topk_scores_per_group=None, n_shared_expert=None, routed_scaling_factor=1.0):
        self.n_embd, self.moe_intermediate_size, self.bias = C, I, False
        self.n_expert, self.n_expert_per_token = n_expert, n_expert_per_token
        self.n_expert_groups, self.n_topk_groups = n_expert_groups, n_topk_groups
        self.n_topk_scores_per_group = n_topk_scores_per_group
        self.n_shared_expert = n_shared_expert
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = True


class LLaMAMLP(nn.Module):
    def __init__(self, config, intermediate_size):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, intermediate_size, bias=config.bias)
        self.proj = nn.Linear(intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x):
        a = self.fc_1(x)
        b = self.fc_2(x)
        return self.proj(F.silu(a) * b)


class GroupedTopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.randn(config.n_expert, config.n_embd) * config.n_embd ** -0.5)
        # litgpt starts it at zeros and updates it outside the forward; a fixed nonzero bias exercises the read
        self.register_buffer("e_score_correction_bias", torch.linspace(-0.1, 0.1, config.n_expert))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        cfg = self.config
        per_group = cfg.n_expert // cfg.n_expert_groups
        choice = scores.view(-1, cfg.n_expert) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(-1, cfg.n_expert_groups, per_group).topk(
            cfg.n_topk_scores_per_group, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.n_topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, cfg.n_expert_groups, per_group).reshape(-1, cfg.n_expert)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(choice, k=cfg.n_expert_per_token, dim=-1, sorted=False)[1]

    def forward(self, x):
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        if self.config.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        return topk_weights, topk_indices


class LLaMAMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = (nn.Linear(config.n_embd, config.n_expert, bias=False) if not config.n_expert_groups
                     else GroupedTopkRouter(config))
        self.experts = nn.ModuleList(LLaMAMLP(config, config.moe_intermediate_size) for _ in range(config.n_expert))
        if config.n_shared_expert:
            self.shared_experts = LLaMAMLP(config, config.moe_intermediate_size * config.n_shared_expert)
        self.config = config

    def forward(self, x):
        B, T, C_ = x.size()
        residual_x = x.clone()
        x = x.view(-1, C_)
        if not self.config.n_expert_groups:
            router = self.gate(x)
            probs, indices = torch.topk(router, self.config.n_expert_per_token)
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        else:
            probs, indices = self.gate(x)
        if self.config.routed_scaling_factor != 1.0:
            probs = probs * self.config.routed_scaling_factor
        masks = indices.unsqueeze(-1) == torch.arange(self.config.n_expert, device=x.device)
        masks = masks.permute(2, 0, 1)  # (E, B*T, k)
        y = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts):
            token_idx, slot_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, slot_idx, None] * expert(x[token_idx])
        y = y.view(B, T, C_)
        if self.config.n_shared_expert:
            y = y + self.shared_experts(residual_x)
        return y


def _input(T, g):
    return torch.randn(1, T, C, generator=g)


SOURCE = "Lightning-AI/litgpt litgpt/model.py LLaMAMoE + LLaMAMLP"
CASES = [
    Case("litgpt_llama_moe", SOURCE + " (linear gate, E=6, top-2)",
         lambda: LLaMAMoE(Config(n_expert=6, n_expert_per_token=2)), _input, form="unrolled_loop"),
    Case("litgpt_llama_moe_grouped", SOURCE + " + GroupedTopkRouter (E=8 in 4 groups, top-3, a shared expert, "
         "routed_scaling_factor 2.5)",
         lambda: LLaMAMoE(Config(n_expert=8, n_expert_per_token=3, n_expert_groups=4, n_topk_groups=2,
                                 n_topk_scores_per_group=2, n_shared_expert=1, routed_scaling_factor=2.5)),
         _input, form="unrolled_loop"),
]
