"""MiniMind's MoE feed-forward, written after jingyaogong/minimind (``model/model_minimind.py``: ``MoEGate``,
``MOEFeedForward``, ``FeedForward``), an educational repository that many small-LLM projects copy whole (the index
holds dozens of its forks, some with ``if mask.any():`` around the write).

Style: the gate a raw (E, H) parameter applied by ``F.linear``, ``softmax`` scores, ``topk(sorted=False)``,
renormalised (``/ (sum + 1e-20)``) when k > 1; in training a sequence-level auxiliary loss (``scatter_add_`` of ones
into (B, E) counts, ``.div_``, times the mean scores) kept on the module as ``self.aux_loss``. The layer, in
training: DeepSeek-V2's training path, every token repeated k times (``repeat_interleave``), an fp16 buffer
``torch.empty_like(x, dtype=torch.float16)`` written per expert by a boolean mask (``y[flat == i] =
expert(x[flat == i]).to(y.dtype)``), ``(y.view(T, k, H) * w.unsqueeze(-1)).sum(dim=1)``; in eval, ``moe_infer``:
``argsort`` of the flat ids, ``bincount().cpu().numpy().cumsum(0)`` host boundaries walked with ``enumerate``,
``if start == end: continue``, each expert on ``x[token_idxs[start:end]]``, ``.mul_`` by its weights and
``scatter_add_`` into ``zeros_like(x)``. A shared expert is added on the input. Each expert: SwiGLU
``down(silu(gate(x)) * up(x))`` with dropout (p = 0 here).

Outcomes: training rounds every expert output to fp16 in the buffer, a different function from the fp32 model's
experts, which the masked-writes proof does not take for the op (left alone, the cast named as the reason; equal to
eager); eval's walk of the cumulative host counts traces as one graph (moe_inductor/host_cumsum.py: the bincount's
max id + 1 entries walked as all E experts, proven), and its body, each expert's output weighted in place and
``scatter_add_``-ed into zeros at its own slice of the sorted order, is the split loop's per-expert spelling
(passes/scattered_slices.py): rewritten, equal to eager.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 32, 16, 4, 2


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class MoEGate(nn.Module):
    def __init__(self, alpha=0.1, seq_aux=True):
        super().__init__()
        self.alpha, self.seq_aux = alpha, seq_aux
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        scores = F.linear(hidden_states, self.weight, None).softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=K, dim=-1, sorted=False)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        if self.training and self.alpha > 0.0:
            idx_for_aux = topk_idx.view(bsz, -1)
            counts = torch.zeros(bsz, E, device=hidden_states.device)
            counts.scatter_add_(1, idx_for_aux, torch.ones(bsz, seq_len * K, device=hidden_states.device)).div_(
                seq_len * K / E)
            aux_loss = (counts * scores.view(bsz, seq_len, -1).mean(dim=1)).sum(dim=1).mean() * self.alpha
        else:
            aux_loss = 0
        return topk_idx, topk_weight, aux_loss


class MOEFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(FeedForward() for _ in range(E))
        self.gate = MoEGate()
        self.shared_experts = nn.ModuleList([FeedForward()])

    def forward(self, x):
        identity, orig_shape = x, x.shape
        topk_idx, topk_weight, aux_loss = self.gate(x)
        x = x.view(-1, x.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            x = x.repeat_interleave(K, dim=0)
            y = torch.empty_like(x, dtype=torch.float16)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(x[flat_topk_idx == i]).to(y.dtype)
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
        else:
            y = self.moe_infer(x, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        for expert in self.shared_experts:
            y = y + expert(identity)
        self.aux_loss = aux_loss
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // K
        for i, end_idx in enumerate(tokens_per_expert):
            start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
            if start_idx == end_idx:
                continue
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_out = self.experts[i](x[exp_token_idx]).to(expert_cache.dtype)
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
            expert_cache.scatter_add_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out)
        return expert_cache


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


SOURCE = "jingyaogong/minimind model/model_minimind.py MOEFeedForward + MoEGate"
CASES = [
    Case("minimind_moe_train", SOURCE + " (training: fp16 buffer, masked writes)", lambda: MOEFeedForward().train(),
         _input, form="unrolled_loop",
         expect=("left_alone", "unrolled_loop", "expert 0's output is cast from float32 to float16")),
    Case("minimind_moe_eval", SOURCE + " (eval: moe_infer over numpy host counts)", lambda: MOEFeedForward().eval(),
         _input, form="split_loop"),
]
