"""transformers v4.36 Mixtral, mirrored from huggingface/transformers (v4.36-v4.39,
``src/transformers/models/mixtral/modeling_mixtral.py``: ``MixtralSparseMoeBlock`` and
``MixtralBLockSparseTop2MLP``), the release that indexes the expert's rows with Python lists.

Style: softmax in fp32 over all experts, top-k, renormalised in place, cast back; an (E, k, T) one-hot
``expert_mask``; ``for expert_idx in range(num_experts)`` with ``idx, top_x = torch.where(expert_mask[expert_idx])``,
``if top_x.shape[0] == 0: continue``, then ``top_x_list = top_x.tolist()``, ``idx_list = idx.tolist()`` ("in torch
it is faster to index using lists than torch tensors"), ``hidden_states[None, top_x_list].reshape(-1, H)``; the
routing weight ``routing_weights[top_x_list, idx_list, None]`` is handed to the expert, which scales its own output
(``routing_weights * w2(act(w1(x)) * w3(x))``); ``index_add_`` of the cast output at ``top_x``. The block returns
``(hidden, router_logits)``. E = 6 (not a power of two), k = 2; input (B, S, H).

Outcome: rewritten (the row lists are traced as the tensors they were made from: moe_inductor/list_indices.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 20, 6, 2


class MixtralBLockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_dim, self.hidden_dim = I, H
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, routing_weights):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current_hidden_states = self.w2(current_hidden_states)
        return routing_weights * current_hidden_states


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim, self.ffn_dim, self.num_experts, self.top_k = H, I, E, K
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBLockSparseTop2MLP() for _ in range(self.num_experts)])

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
            if top_x.shape[0] == 0:
                continue
            # in torch it is faster to index using lists than torch tensors
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state, routing_weights[top_x_list, idx_list, None])
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Wrapped(nn.Module):
    """The decoder layer unpacks ``hidden_states, router_logits = self.block_sparse_moe(hidden_states)``."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = MixtralSparseMoeBlock()

    def forward(self, x):
        out, _router_logits = self.block_sparse_moe(x)
        return out


CASES = [Case("hf_v4_36_mixtral", "huggingface/transformers v4.36 models/mixtral/modeling_mixtral.py "
              "MixtralSparseMoeBlock (list indexing)", Wrapped, lambda T, g: torch.randn(1, T, H, generator=g),
              form="unrolled_loop")]
