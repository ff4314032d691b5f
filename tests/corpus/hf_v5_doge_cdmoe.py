"""transformers v5's Doge cross-domain MoE (SmallDoge), mirrored from huggingface/transformers (v5.24,
``src/transformers/models/doge/modeling_doge.py``: ``DogeCDMoE``, the ``mlp`` of a ``DogeDecoderLayer`` when
``config.is_moe``).

Style: a product-key router over many tiny experts. Each expert is one row of two ``nn.Embedding`` tables,
``down_embed`` and ``up_embed`` (E, H): a rank-one MLP ``act(x . d_e) * u_e``. ``router_gate`` (H -> 2 sqrt(E),
bias-free) gives two halves of keys, taken by ``.view(2, B * S, -1)`` of the (B, S, 2 sqrt(E)) logits (so the
halves mix tokens, as the source's comment says, kept for its checkpoints); ``topk(sqrt(E))`` of each half, the
candidate scores ``scores_x[..., None] + scores_y[..., None, :]`` and ids ``ix * sqrt(E) + iy``, flattened, a
second ``topk(k)`` and ``gather`` of the ids; the weights a softmax over the k scores (``norm_topk_prob`` off).
The experts run as gathered weights: ``down_embed(indices)`` (T, k, H) ``matmul`` the token as an (H, 1) column,
``act`` of that times the weights, then ``matmul`` of the (1, k) row with ``up_embed(indices)`` (T, k, H). A
shared gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, silu) runs on every token and the routed sum is added
to it; it returns ``(hidden, router_logits)``, the decoder layer keeping ``[0]``.

E = 16384, k = 64 in the config; here E = 9 (sqrt 3, not a power of two), k = 3; input (B, S, H).

Outcome: left alone (moe_region: the ids feed per-expert matmuls no form proves). The experts are embedding rows
gathered by ``nn.Embedding`` (an (E, H) table, not an (E, N, K) weight) and each is rank one: a width-1
"intermediate" that the gathered-weights form does not take, and that a grouped GEMM would not speed up.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 24, 9, 3


class DogeCDMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.intermediate_size = H, I
        self.act_fn = nn.SiLU()
        self.num_experts = E
        self.num_keys = math.floor(math.sqrt(self.num_experts))
        self.top_k = K
        self.norm_topk_prob = False
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.router_gate = nn.Linear(H, self.num_keys * 2, bias=False)
        self.down_embed = nn.Embedding(E, H)
        self.up_embed = nn.Embedding(E, H)

    def forward(self, hidden_states):
        bsz, seq_len, _ = hidden_states.shape
        router_logits = self.router_gate(hidden_states).view(2, bsz * seq_len, -1)
        (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(self.num_keys, dim=-1)
        all_scores = scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)
        all_indices = indices_x.unsqueeze(-1) * self.num_keys + indices_y.unsqueeze(-2)
        all_scores = all_scores.view(*all_scores.shape[:-2], -1)
        all_indices = all_indices.view(*all_indices.shape[:-2], -1)
        scores, position_indices = all_scores.topk(self.top_k, dim=-1)
        indices = all_indices.gather(-1, position_indices)
        routing_weights = F.softmax(scores, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        down_embed = self.down_embed(indices)
        up_embed = self.up_embed(indices)
        experts_weights = torch.matmul(down_embed, hidden_states.view(bsz * seq_len, -1, 1)).view(bsz * seq_len, -1)
        experts_weights = self.act_fn(experts_weights) * routing_weights
        experts_states = torch.matmul(experts_weights.view(bsz * seq_len, 1, -1), up_embed).view(bsz, seq_len, -1)
        hidden_states = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        hidden_states = hidden_states + experts_states
        return hidden_states, router_logits


class Wrapped(nn.Module):
    """``DogeDecoderLayer``: ``hidden_states = self.mlp(hidden_states)``, then ``[0]`` when ``is_moe``."""

    def __init__(self):
        super().__init__()
        self.mlp = DogeCDMoE()

    def forward(self, x):
        return self.mlp(x)[0]


CASES = [
    Case("hf_v5_doge_cdmoe", "huggingface/transformers v5.24 models/doge/modeling_doge.py DogeCDMoE (product-key "
         "router, embedding experts)", Wrapped, lambda T, g: torch.randn(2, T, H, generator=g),
         form="gathered_weights", expect=("left_alone", "moe_region", "that no MoE form proves")),
]
