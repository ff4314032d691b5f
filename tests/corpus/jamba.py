"""Jamba's sparse MoE block, mirrored from two codebases: alxndrTL/mamba.py (``mambapy/jamba.py``:
``SparseMoEBlock``, ``MLP``; taken, as its comment says, from AI21's original remote code) and
huggingface/transformers v4.4x (``src/transformers/models/jamba/modeling_jamba.py``: ``JambaSparseMoeBlock``,
``JambaMLP``).

Style: Mixtral's block without renormalisation: the router is ``self.router`` (bias-free ``nn.Linear``),
``softmax(dim=1, dtype=torch.float)``, ``topk``, the weights cast back; an (E, k, T) one-hot ``expert_mask``;
``for expert_idx in range(num_experts)`` with ``idx, top_x = torch.where(expert_mask[expert_idx])`` and
``if top_x.shape[0] == 0: continue``; the weighted SwiGLU output (gate, up, down without biases) ``index_add_``-ed
into zeros. The block returns ``(hidden, router_logits)``.

- ``jamba_mambapy``: the rows are indexed with Python lists, ``top_x_list = top_x.tolist()`` and
  ``idx_list = idx.tolist()`` ("in torch it is faster to index using lists than torch tensors", as in
  transformers v4.36's Mixtral); a one-expert layer skips the routing (``if self.num_experts == 1``).
- ``hf_v4_jamba``: the same loop indexing with the tensors ``top_x`` and ``idx``.

E = 6 (not a power of two), k = 2; input (B, S, H).

Outcome: both are rewritten (the empty-expert skip is traced as running every body). In ``jamba_mambapy`` the row
lists, read only as indices of tensors, are traced as the tensors they were made from (moe_inductor/list_indices.py).
Dynamo's own ``tolist`` cannot make a list of ``top_x``, whose length is data-dependent (its ``unbind`` guards on
``Eq(u0, 0)``): without the substitution the frame fails under the capture settings and is compiled as plain capture
would, without rewrites.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 6, 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim, self.ffn_dim = H, I
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoEBlock(nn.Module):
    """mambapy's block, with AI21's list indexing."""

    def __init__(self, num_experts=E, num_experts_per_tok=K):
        super().__init__()
        self.hidden_dim, self.ffn_dim = H, I
        self.num_experts, self.top_k = num_experts, num_experts_per_tok
        self.router = nn.Linear(H, num_experts, bias=False) if num_experts > 1 else None
        self.experts = nn.ModuleList([MLP() for _ in range(num_experts)])

    def forward(self, x):
        batch_size, sequence_length, hidden_dim = x.shape
        if self.num_experts == 1:
            final_hidden_states = self.experts[0](x)
            router_logits = torch.ones((batch_size * sequence_length, 1), device=x.device, dtype=x.dtype,
                                       requires_grad=x.requires_grad)
            return final_hidden_states, router_logits
        x = x.view(-1, hidden_dim)
        router_logits = self.router(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights.to(x.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=x.dtype, device=x.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            # the source indexes with Python lists, which it finds faster than tensors in eager
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            current_state = x[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(x.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class JambaSparseMoeBlock(nn.Module):
    """transformers v4.4x's block."""

    def __init__(self):
        super().__init__()
        self.hidden_dim, self.ffn_dim, self.num_experts, self.top_k = H, I, E, K
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.router(hidden_states)
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
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Wrapped(nn.Module):
    """The decoder layer unpacks ``x, router_logits = self.moe(x)``."""

    def __init__(self, block):
        super().__init__()
        self.moe = block

    def forward(self, x):
        out, _router_logits = self.moe(x)
        return out


CASES = [
    Case("jamba_mambapy", "alxndrTL/mamba.py mambapy/jamba.py SparseMoEBlock (list indexing)",
         lambda: Wrapped(SparseMoEBlock()), lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
    Case("hf_v4_jamba", "huggingface/transformers v4.4x models/jamba/modeling_jamba.py JambaSparseMoeBlock",
         lambda: Wrapped(JambaSparseMoeBlock()), lambda T, g: torch.randn(2, T, H, generator=g),
         form="unrolled_loop"),
]
