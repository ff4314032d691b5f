"""transformers v4.x Qwen2-MoE, mirrored from huggingface/transformers (v4.5x,
``src/transformers/models/qwen2_moe/modeling_qwen2_moe.py``: ``Qwen2MoeSparseMoeBlock``).

Style: like v4 Mixtral, but the loop runs only over the experts that got tokens:
``expert_hitted = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()`` and ``for expert_idx in
expert_hitted`` (a loop over a tensor with a data-dependent length), ``torch.where(expert_mask[expert_idx]
.squeeze(0))``; no renormalisation (``norm_topk_prob=False``); a shared expert scaled by a sigmoid gate.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 6, 2


class Qwen2MoeMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, False
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(I) for _ in range(E)])
        self.shared_expert = Qwen2MoeMLP(2 * I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hitted = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hitted:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Qwen2MoeSparseMoeBlock()

    def forward(self, x):
        return self.mlp(x)[0]


CASES = [Case("hf_v4_qwen2_moe", "huggingface/transformers v4.5x models/qwen2_moe/modeling_qwen2_moe.py "
              "Qwen2MoeSparseMoeBlock", Wrapped, lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop",
              expect=("rewritten",))]  # the loop over the hit experts is unrolled over every expert (hit_loops.py)
