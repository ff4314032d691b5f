"""inclusionAI's LLaDA2 / Ling MoE block in inference, written after its Hugging Face remote code
(``modeling_llada2_moe.py``: ``LLaDA2MoeGate``, ``LLaDA2MoeSparseMoeBlock.forward`` with ``self.training`` False,
and its ``moe_infer``).

Style: the gate an fp32 ``F.linear`` of an fp32 copy of the tokens, ``sigmoid`` scores, an ``expert_bias`` added for
the choice only, groups scored by the sum of their top-2, ``topk_group`` groups kept by a ``scatter_`` mask and
``masked_fill(-inf)``, ``topk`` of the masked scores, the weights ``gather``ed from the unbiased scores, renormalised
(for k > 1) and scaled; ``moe_infer`` as DeepSeek-V2's but reading each walked element by ``num_tokens.item()``,
the slice bound computed after the skip, each output moved ``.to(x.device)`` (a no-op here); shared experts added.

Departure: the block returns the hidden states only (the source also returns the router logits and ids, for its
loss); the expert bias is random (a checkpoint's is learnt).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K, GROUPS, TOPK_GROUP = 16, 8, 8, 2, 4, 2


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gate_proj = nn.Linear(H, width, bias=False)
        self.up_proj = nn.Linear(H, width, bias=False)
        self.down_proj = nn.Linear(width, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.register_buffer("expert_bias", torch.randn(E) * 0.1)
        self.routed_scaling_factor = 2.5

    def group_limited_topk(self, scores):
        tokens = scores.shape[0]
        group_scores = scores.view(tokens, GROUPS, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=TOPK_GROUP, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(tokens, GROUPS, E // GROUPS).reshape(tokens, -1)
        return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=K, dim=-1)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = torch.sigmoid(logits.float()).type_as(logits)
        _, topk_idx = self.group_limited_topk(scores + self.expert_bias)
        scores = torch.gather(scores, dim=1, index=topk_idx).type_as(logits)
        topk_weight = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if K > 1 else scores
        return topk_idx, topk_weight * self.routed_scaling_factor


class SparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Mlp(I) for _ in range(E))
        self.gate = Gate()
        self.shared_experts = Mlp(I)

    def forward(self, hidden_states):
        identity = hidden_states
        bsz, seq_len, h = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(bsz, seq_len, h)
        return y + self.shared_experts(identity)

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        counted = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        counted.scatter_(1, topk_ids, 1)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = counted.sum(dim=0).cpu().numpy()
        outputs, start_idx = [], 0
        for i, num_tokens_tensor in enumerate(tokens_per_expert):
            num_tokens = num_tokens_tensor.item()
            if num_tokens == 0:
                continue
            end_idx = start_idx + num_tokens
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]).to(x.device))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(new_x.dtype))


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


_SRC = "inclusionAI/LLaDA2.0 modeling_llada2_moe.py LLaDA2MoeSparseMoeBlock.moe_infer + LLaDA2MoeGate (inference)"
CASES = [
    Case("llada2_moe_infer", _SRC, lambda: SparseMoeBlock().eval(), _input, form="sorted_grouped_mm"),
    Case("llada2_moe_infer_bf16", _SRC + " (bf16)", lambda: SparseMoeBlock().eval(), _input,
         form="sorted_grouped_mm", dtype=torch.bfloat16),
]
