"""transformers v4.x Phi-3.5-MoE, mirrored from huggingface/transformers (v4.4x-v4.5x,
``src/transformers/models/phimoe/modeling_phimoe.py``: ``PhimoeSparseMoeBlock``, ``sparsemixer``,
``PhimoeBlockSparseTop2MLP``).

Style: Mixtral's block with SparseMixer routing (inference path: the module is in ``eval()``, so no Gumbel sampling,
no input jitter and no ``MultiplierProcessor`` autograd function). ``sparsemixer`` works on the raw logits, twice:
under ``torch.no_grad()`` it takes ``max(dim=-1, keepdim=True)``, a ``factor = scores.abs().clamp(min=max)`` and
masks every logit with ``(max - scores) / factor > 2 * jitter_eps`` to -inf; the multiplier is the softmax of the
masked logits ``gather``-ed at the argmax. The first choice is then ``torch.scatter``-ed to -inf and the same is
done for the second; multipliers and experts are ``torch.concat``-ed to (T, 2). The block builds the (E, k, T)
one-hot ``expert_mask``, loops ``for expert_idx in range(num_experts)`` with ``torch.where``, skips an expert with
``if top_x.shape[0] == 0: continue``, and ``index_add_``-s the weighted SwiGLU expert output. Input (B, S, H).
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E, K = 16, 24, 4, 2
JITTER = 0.01  # PhimoeConfig.router_jitter_noise


def sparsemixer(scores, jitter_eps, training, top_k=2):
    if top_k != 2:
        raise ValueError("top_k must be equal to 2")
    # first choice
    with torch.no_grad():
        threshold, max_ind = scores.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        threshold = ((threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates = scores.masked_fill(threshold, float("-inf"))
    selected_experts = max_ind  # training samples with Gumbel noise instead
    masked_gates = torch.softmax(masked_gates, dim=-1)
    multiplier = masked_gates.gather(dim=-1, index=selected_experts)

    # second choice: the first masked out
    masked_scores = torch.scatter(scores, -1, selected_experts, float("-inf"))
    with torch.no_grad():
        threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        threshold = ((threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates_top2 = masked_scores.masked_fill(threshold, float("-inf"))
    selected_experts_top2 = max_ind
    masked_gates_top2 = torch.softmax(masked_gates_top2, dim=-1)
    multiplier_top2 = masked_gates_top2.gather(dim=-1, index=selected_experts_top2)

    multiplier = torch.concat((multiplier, multiplier_top2), dim=-1)
    selected_experts = torch.concat((selected_experts, selected_experts_top2), dim=-1)
    return multiplier, selected_experts


class PhimoeBlockSparseTop2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class PhimoeSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim, self.ffn_dim, self.num_experts, self.top_k = H, I, E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([PhimoeBlockSparseTop2MLP() for _ in range(E)])
        self.router_jitter_noise, self.input_jitter_noise = JITTER, 0.01

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.input_jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(
                1.0 - self.input_jitter_noise, 1.0 + self.input_jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights, selected_experts = sparsemixer(router_logits, jitter_eps=self.router_jitter_noise,
                                                        training=self.training)
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
    """The block returns (hidden, router_logits), as the HF decoder layer consumes it."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = PhimoeSparseMoeBlock()

    def forward(self, x):
        return self.block_sparse_moe(x)[0]


def _build():
    return Wrapped().eval()  # sparsemixer's inference path (training samples the experts)


CASES = [Case("hf_v4_phimoe", "huggingface/transformers v4.4x models/phimoe/modeling_phimoe.py "
              "PhimoeSparseMoeBlock + sparsemixer (eval)", _build,
              lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop")]
