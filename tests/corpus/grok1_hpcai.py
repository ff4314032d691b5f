"""Grok-1's MoE as its PyTorch port runs it, written after HPC-AI Tech's Hugging Face remote code for
hpcai-tech/grok-1 (``modeling_grok1.py``: ``MoeBlock``, ``MoeMLP``), read in the copy tenstorrent/tt-metal vendors
as its reference (``models/experimental/grok/reference/model.py`` at 390dce04, header "SPDX-FileCopyrightText: ©
2024 HPC-AI Tech"; its ``tlog`` debug calls and unused ``expert_outputs`` lists left out).

Style: transformers v4.36's Mixtral loop with Grok's expert: softmax in fp32 over all experts (``dim=1``), top-k,
**no renormalisation** (Grok's router keeps the two raw probabilities), cast back to the input dtype; an (E, k, T)
one-hot ``expert_mask``; ``for expert_idx in range(self.num_experts)`` with ``idx, top_x = torch.where(...)``,
``if top_x.shape[0] == 0: continue``, the rows and weights read through ``top_x.tolist()`` / ``idx.tolist()``;
the expert is ``linear_1(gelu(linear(x)) * linear_v(x))`` with the exact (erf) ``nn.GELU()``, three bias-free
linears named after the JAX checkpoint; the block scales the expert output by ``routing_weights[top_x_list,
idx_list, None]`` itself and ``index_add_``s the cast result. It returns ``(hidden, router_logits)``; the decoder
layer wraps it in ``pre_moe_norm`` / ``post_moe_norm`` (left out). E = 8 in Grok-1; here 6 (not a power of two).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, FFN, E, K = 16, 20, 6, 2


class MoeMLP(nn.Module):
    def __init__(self, hidden_dim, ffn_dim):
        super().__init__()
        self.linear_v = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.linear_1 = nn.Linear(ffn_dim, hidden_dim, bias=False)
        self.linear = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.linear(hidden_states)) * self.linear_v(hidden_states)
        return self.linear_1(current_hidden_states)


class MoeBlock(nn.Module):
    def __init__(self, hidden_dim=H, ffn_dim=FFN, num_experts=E, top_k=K):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(hidden_dim, num_experts, bias=False)
        self.experts = nn.ModuleList([MoeMLP(hidden_dim, ffn_dim) for _ in range(num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            expert_output = expert_layer(current_state)
            current_hidden_states = expert_output * routing_weights[top_x_list, idx_list, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Wrapped(nn.Module):
    """``DecoderLayer`` unpacks ``hidden_states, router_logits = self.moe_block(hidden_states)``."""

    def __init__(self):
        super().__init__()
        self.moe_block = MoeBlock()

    def forward(self, x):
        out, _router_logits = self.moe_block(x)
        return out


CASES = [Case("grok1_hpcai", "hpcai-tech grok-1 modeling_grok1.py MoeBlock (via tenstorrent/tt-metal "
              "models/experimental/grok/reference/model.py)", Wrapped, lambda T, g: torch.randn(2, T, H, generator=g),
              form="unrolled_loop")]
