"""transformers v4.x Mixtral, mirrored from huggingface/transformers (v4.4x,
``src/transformers/models/mixtral/modeling_mixtral.py``: ``MixtralSparseMoeBlock`` and
``MixtralBlockSparseTop2MLP``).

Style: softmax in fp32 over all experts, top-k, renormalised in place, cast back; an (E, k, T) one-hot
``expert_mask``; ``for expert_idx in range(num_experts)`` with ``idx, top_x = torch.where(expert_mask[expert_idx])``,
``hidden_states[None, top_x].reshape(-1, H)``, and ``index_add_`` of the cast expert output. Input (B, S, H).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 24, 4, 2


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = H, E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP() for _ in range(E)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Wrapped(nn.Module):
    """The block returns (hidden, router_logits), as the HF decoder layer consumes it."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = MixtralSparseMoeBlock()

    def forward(self, x):
        return self.block_sparse_moe(x)[0]


CASES = [Case("hf_v4_mixtral", "huggingface/transformers v4.4x models/mixtral/modeling_mixtral.py "
              "MixtralSparseMoeBlock", Wrapped, lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop")]
