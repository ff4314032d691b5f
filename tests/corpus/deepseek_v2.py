"""DeepSeek-V2's MoE as its Hugging Face remote code runs it in training, mirrored from deepseek-ai/DeepSeek-V2
(``modeling_deepseek.py``: ``MoEGate``, ``DeepseekV2MoE``, ``AddAuxiliaryLoss``, ``DeepseekV2MLP``).

Style: softmax scores, group-limited greedy top-k (each group scored by its max, ``scatter_`` a group mask,
``masked_fill`` the other groups to 0, ``topk(sorted=False)``), weights renormalised and scaled; a sequence-free
auxiliary loss attached by a custom ``autograd.Function``; the tokens repeated k times (``repeat_interleave``), a
boolean mask per expert (``y[flat_ids == i] = expert(x_rep[flat_ids == i])``) writing into ``torch.empty_like``,
then ``(y.view(T, k, H) * weights.unsqueeze(-1)).sum(dim=1)``; shared experts. (Its inference path, ``moe_infer``,
goes through numpy: not what a compiled training step runs.)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K, GROUPS, TOPK_GROUPS = 16, 8, 8, 2, 4, 2


class DeepseekV2MLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AddAuxiliaryLoss(torch.autograd.Function):
    """Adds the auxiliary loss's gradient without changing the forward value."""

    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = None
        if ctx.required_aux_loss:
            grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device)
        return grad_output, grad_loss


class MoEGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.n_routed_experts, self.routed_scaling_factor = K, E, 1.5
        self.n_group, self.topk_group, self.alpha, self.norm_topk_prob = GROUPS, TOPK_GROUPS, 0.001, True
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                      .reshape(bsz * seq_len, -1))
        tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
        topk_weight = topk_weight / denominator * self.routed_scaling_factor
        mask_ce = F.one_hot(topk_idx.view(-1), num_classes=self.n_routed_experts)
        ce = mask_ce.float().mean(0)
        fi = ce * self.n_routed_experts
        aux_loss = (scores.mean(0) * fi).sum() * self.alpha
        return topk_idx, topk_weight, aux_loss


class DeepseekV2MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = K
        self.experts = nn.ModuleList([DeepseekV2MLP(I) for _ in range(E)])
        self.gate = MoEGate()
        self.shared_experts = DeepseekV2MLP(2 * I)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        y = AddAuxiliaryLoss.apply(y, aux_loss)
        return y + self.shared_experts(identity)


CASES = [Case("deepseek_v2", "deepseek-ai/DeepSeek-V2 modeling_deepseek.py DeepseekV2MoE (training path) + MoEGate",
              DeepseekV2MoE, lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop")]
