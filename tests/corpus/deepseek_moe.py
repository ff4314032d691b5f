"""DeepSeek-MoE 16B's remote code, mirrored from deepseek-ai's ``modeling_deepseek.py`` for deepseek-moe-16b-base /
-chat (``MoEGate``, ``AddAuxiliaryLoss``, ``DeepseekMLP``, ``DeepseekMoE`` with ``moe_infer``; the Hub file, read in
the GitHub copies that vendor it, as deepseek-ai/DeepSeek-MoE itself holds only the README and finetune script).
The first DeepSeek MoE, before V2's group-limited routing and sorted ``torch.cat`` inference path
(``deepseek_v2.py``, ``deepseek_v2_infer.py``).

Style: the gate is an (E, H) weight read by ``F.linear`` in the input's dtype, a softmax over all experts,
``topk(sorted=False)``, no renormalisation (``norm_topk_prob`` off in the 16B config; the ``top_k > 1 and
norm_topk_prob`` branch is kept) and no scaling factor; in training a sequence-level auxiliary loss
(``seq_aux``: a per-sequence ``scatter_add_`` of ones ``div_``ided by ``seq_len * k / E``, times the mean scores)
attached by ``AddAuxiliaryLoss``. Shared experts are one ``DeepseekMLP`` of width ``n_shared * I``.

- inference (``deepseek_moe_infer``): ``moe_infer`` under ``@torch.no_grad()``: the flat ids ``argsort``ed, the
  counts ``bincount().cpu().numpy().cumsum(0)`` (end offsets on the host), ``for i, end_idx in
  enumerate(...)`` with ``start_idx = 0 if i == 0 else counts[i - 1]``, experts with no tokens skipped by
  ``continue``, the expert's rows ``x[idxs[start:end] // k]``, its output scaled in place (``mul_``) by
  ``flat_weights[idxs[start:end]]`` and accumulated by ``expert_cache.scatter_reduce_(0, tok.view(-1, 1).repeat(1,
  H), out, reduce='sum')`` into ``zeros_like(x)`` (not V2's ``cat`` and ``new_x[idxs] = outs``).
- training (``deepseek_moe_train``): the tokens ``repeat_interleave``d k times, ``y[flat_ids == i] =
  expert(x[flat_ids == i])`` into ``empty_like``, ``(y.view(T, k, H) * w.unsqueeze(-1)).sum(dim=1)``.

Both are rewritten: inference as MiniMind's walk of host end offsets (split_loop; its ``scatter_reduce_`` "sum" is
read as the ``scatter_add_`` it equals, passes/scatter_sums.py), training as an unrolled loop.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K, N_SHARED = 16, 12, 8, 2, 2


class DeepseekMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.n_routed_experts = K, E
        self.alpha, self.seq_aux, self.norm_topk_prob = 0.001, True, False
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        scores = logits.softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        aux_loss = None
        if self.training and self.alpha > 0.0:
            ids_for_aux = topk_idx.view(bsz, -1)
            seq_scores = scores.view(bsz, seq_len, -1)
            ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
            ce.scatter_add_(1, ids_for_aux, torch.ones(bsz, seq_len * self.top_k, device=hidden_states.device))
            ce.div_(seq_len * self.top_k / self.n_routed_experts)
            aux_loss = (ce * seq_scores.mean(dim=1)).sum(dim=1).mean() * self.alpha
        return topk_idx, topk_weight, aux_loss


class AddAuxiliaryLoss(torch.autograd.Function):
    """The forward value unchanged; the auxiliary loss gets a gradient of one in backward."""

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


class DeepseekMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = K
        self.experts = nn.ModuleList([DeepseekMLP(I) for _ in range(E)])
        self.gate = MoEGate()
        self.shared_experts = DeepseekMLP(I * N_SHARED)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
            y = AddAuxiliaryLoss.apply(y, aux_loss)
        else:
            y = self.moe_infer(hidden_states, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        return y + self.shared_experts(identity)

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        ends = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // self.num_experts_per_tok
        for i, end_idx in enumerate(ends):
            start_idx = 0 if i == 0 else ends[i - 1]
            if start_idx == end_idx:
                continue
            expert = self.experts[i]
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_out = expert(x[exp_token_idx])
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
        return expert_cache


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


_SRC = "deepseek-ai deepseek-moe-16b modeling_deepseek.py DeepseekMoE"
CASES = [
    Case("deepseek_moe_infer", _SRC + ".moe_infer (inference: host end offsets, scatter_reduce_)",
         lambda: DeepseekMoE().eval(), _input, form="split_loop"),
    Case("deepseek_moe_train", _SRC + " (training: repeat_interleave, masked writes, seq aux loss)", DeepseekMoE,
         _input, form="unrolled_loop"),
]
