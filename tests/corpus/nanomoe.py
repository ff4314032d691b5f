"""nanoMoE (a nanoGPT with MoE blocks), mirrored from wolfecameron/nanoMoE (``model.py``: ``Router``,
``MLPExperts``, ``MOELayer``; defaults of ``GPTConfig``).

Style: a dense-capacity top-k layer written with matmuls, not einsum. The router (noisy top-k and the aux/z losses
off, as in the defaults; ``nullcontext`` instead of fp32 autocast) takes ``logits.topk(k)``, scatters the k logits into
a ``full_like(-inf)`` tensor and softmaxes over all experts; the capacity is Python arithmetic on the token count,
``floor(k * capacity_factor * B*T / E)`` (train 1.25, eval 2.0), rounded up to even and raised to ``min_capacity``;
an (k, B*T, E) one-hot mask ranked by ``cumsum(dim=0) - 1`` over the k-major flattening (first choices queue first),
``exp_mask *= torch.lt(exp_rank, capacity)`` drops, ``F.one_hot(rank, num_classes=capacity)`` slots, and a
(B*T, E, C) combine tensor summed over k, with ``sec_mask = cb_weight.bool()``. The layer dispatches by
``sec_mask.permute(1, 2, 0).type_as(x) @ x``, runs ``MLPExperts`` (``torch.bmm`` with (E, H, 4H) and (E, 4H, H)
parameters, in-place ``+=`` biases, GELU) and combines by ``cb_weight.view(B*T, E*C) @ exp_out.view(E*C, H)``.
Input (B, T, H); the module is in training mode (capacity factor 1.25).
"""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, E, K = 16, 4, 2


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.n_exp = K, E
        self.train_capacity, self.eval_capacity, self.min_capacity = 1.25, 2.0, 4
        self.router_use_full_prec = False
        self.w_g = nn.Linear(H, E, bias=False)

    def forward(self, x):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        ctx = nullcontext() if not self.router_use_full_prec else torch.amp.autocast(device_type=device_type,
                                                                                     enabled=False)
        with ctx:
            B, T, _ = x.size()
            num_tokens = B * T
            logits = self.w_g(x)  # [B, T, E]
            top_k_logits, top_k_indices = logits.topk(self.top_k, dim=-1)
            router_probs = torch.full_like(logits, float("-inf"))
            router_probs.scatter_(-1, top_k_indices, top_k_logits)
            router_probs = F.softmax(router_probs, dim=-1)

            exp_capacity = self.get_capacity(num_tokens)

            # which expert each (choice, token) went to, k-major so that first choices queue first
            exp_mask = F.one_hot(top_k_indices, num_classes=self.n_exp)  # [B, T, k, E]
            exp_mask = exp_mask.view(num_tokens, self.top_k, self.n_exp).permute(1, 0, 2)  # [k, B*T, E]
            exp_rank = exp_mask.reshape(self.top_k * num_tokens, self.n_exp)
            exp_rank = torch.cumsum(exp_rank, dim=0) - 1
            exp_rank = exp_rank.reshape(self.top_k, num_tokens, self.n_exp)

            # drop what overflows
            exp_mask *= torch.lt(exp_rank, exp_capacity)
            used_capacity = torch.sum(exp_mask, dim=(0, 1))
            exp_rank = torch.sum(exp_mask * exp_rank, dim=-1)  # [k, B*T]

            router_probs = router_probs.view(num_tokens, self.n_exp)[None, :]
            exp_weights = exp_mask * router_probs  # [k, B*T, E]
            exp_rank_sc = F.one_hot(exp_rank, num_classes=exp_capacity)  # [k, B*T, C]
            cb_weight = torch.sum(exp_weights.unsqueeze(3) * exp_rank_sc.unsqueeze(2), dim=0)  # [B*T, E, C]
            sec_mask = cb_weight.bool()
            return used_capacity, cb_weight, sec_mask

    def get_capacity(self, tokens_per_batch):
        capacity_factor = self.train_capacity if self.training else self.eval_capacity
        capacity = math.floor(self.top_k * capacity_factor * tokens_per_batch / self.n_exp)
        capacity += capacity % 2
        capacity = max(capacity, self.min_capacity)
        assert capacity > 0
        return int(capacity)


class MLPExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = True
        self.c_fc = nn.Parameter(torch.randn(E, H, 4 * H) * 0.2)
        self.c_proj = nn.Parameter(torch.randn(E, 4 * H, H) * 0.1)
        self.fc_bias = nn.Parameter(torch.randn(E, 1, 4 * H) * 0.02)
        self.proj_bias = nn.Parameter(torch.randn(E, 1, H) * 0.02)
        self.gelu = nn.GELU()
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        x = torch.bmm(x, self.c_fc)
        if self.bias:
            x += self.fc_bias
        x = self.gelu(x)
        x = torch.bmm(x, self.c_proj)
        if self.bias:
            x += self.proj_bias
        return self.dropout(x)


class MOELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = MLPExperts()

    def forward(self, x):
        B, T, n_embd = x.size()
        num_tokens = B * T
        used_capacity, exp_weight, exp_mask = self.router(x)
        x = x.view(num_tokens, n_embd)
        exp_batches = exp_mask.permute(1, 2, 0).type_as(x) @ x  # [E, C, H]
        exp_out = self.experts(exp_batches)
        exp_weight = exp_weight.view(num_tokens, -1)  # [B*T, E*C]
        exp_out = exp_out.view(-1, n_embd)
        output = exp_weight @ exp_out
        return output.view(B, T, n_embd)


# The capacity is Python arithmetic on the token count and one_hot specialises on it, so each capacity is a graph
# of its own under any backend: the token counts share one (C = 8), and the second one drops an assignment.
CASES = [Case("nanomoe", "wolfecameron/nanoMoE model.py MOELayer + Router + MLPExperts", MOELayer,
              lambda T, g: torch.randn(2, T, H, generator=g), form="padded_capacity", token_counts=(6, 7))]
