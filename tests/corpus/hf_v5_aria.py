"""transformers v5's Aria text MoE layer, mirrored from huggingface/transformers (v5.x,
``src/transformers/models/aria/modeling_aria.py``: ``AriaTextTopKRouter``, ``AriaExperts``,
``AriaSharedExpertsMLP``, ``AriaTextMoELayer``), its experts run by their own eager loop or by v5's default
``grouped_mm`` implementation (``src/transformers/integrations/moe.py``: ``grouped_mm_experts_forward`` with
``is_transposed=True``).

Style: the router is a raw (E, H) weight; the choice is a top-k of the raw logits and the weights are the softmax
over the k chosen logits only (in the logits' dtype). The experts are the transposed stacked layout that v5 declares
with ``use_experts_implementation(is_transposed=True)``: (E, H, 2I) gate/up and (E, I, H) down, the layout
grouped_mm consumes as is; always SiLU-gated. The layer flattens the tokens, routes, runs the experts,
``.view(original_shape)`` and adds shared experts applied to the 3D input (``x.view(original_shape)``). The experts'
forward is one of:

- eager: v5's hit-expert loop (``one_hot(ids, E + 1)``, ``continue`` on the spare class) with ``rows @
  gate_up_proj[e]`` chunked into gate and up and ``@ down_proj[e]``, ``index_add_`` of the weighted rows;
- grouped_mm: ``torch.sort`` of the flat ids, ``x[perm // k]``, ``histc`` of the sorted ids as floats (``bins=E,
  min=0, max=E - 1``) and an int32 ``cumsum`` as offsets, ``F.grouped_mm(x, w, offs=offsets)`` on the untransposed
  stacks, the weight applied after the down projection, the unsort by ``inv_perm[perm] = arange(S)`` and
  ``out[inv_perm]``, then ``view(T, k, H).sum(dim=1)``.

Departures: the ``_grouped_mm`` dispatcher is reduced to the branch it takes for bf16 weights (``F.grouped_mm``;
torch's grouped_mm meta kernel takes bf16 only, transformers swaps in a custom op for other dtypes under compile), so
that case runs in bf16; no expert-parallel sentinels.

Outcome: the eager loop is rewritten (unrolled_loop, the ``@`` on (in, out) stacks read as a transposed layout);
the grouped_mm path is rewritten by sorted_grouped_mm (its counts are histc of the sorted ids, its unsort a gather by
the inverse permutation, ``out[inv_perm]``), its (in, out) stacks read as the "kn" layout.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, K = 32, 16, 2


class AriaSharedExpertsMLP(nn.Module):
    def __init__(self, num_shared_experts=2):
        super().__init__()
        inter = I * num_shared_experts
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AriaTextTopKRouter(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.num_experts, self.top_k = num_experts, K
        self.weight = nn.Parameter(torch.randn(num_experts, H) * H ** -0.5)

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        top_logits, top_index = torch.topk(logits, self.top_k, dim=-1)
        return logits, F.softmax(top_logits, dim=-1), top_index


class AriaExperts(nn.Module):
    """(E, H, 2I) gate/up and (E, I, H) down: stored (in, out), as grouped_mm takes them."""

    def __init__(self, num_experts, implementation):
        super().__init__()
        self.num_experts, self.implementation = num_experts, implementation
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, H, 2 * I) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, I, H) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.implementation == "eager":
            return self.eager_forward(hidden_states, top_k_index, top_k_weights)
        return self.grouped_mm_forward(hidden_states, top_k_index, top_k_weights)

    def eager_forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = (hidden_states[token_idx] @ self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = (self.act_fn(gate) * up) @ self.down_proj[expert_idx]
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final

    def grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights):
        device = hidden_states.device
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        ids_sorted, perm = torch.sort(expert_ids)
        rows = hidden_states[perm // num_top_k]
        weights_sorted = sample_weights[perm]
        counts_input = ids_sorted.float() if device.type in ("cpu", "mps") else ids_sorted.int()
        tokens_per_expert = torch.histc(counts_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.grouped_mm(rows.to(self.gate_up_proj.dtype), self.gate_up_proj, offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        h = F.grouped_mm(h.to(self.down_proj.dtype), self.down_proj, offs=offsets)
        weighted = h * weights_sorted.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


class AriaTextMoELayer(nn.Module):
    def __init__(self, num_experts=8, implementation="eager"):
        super().__init__()
        self.router = AriaTextTopKRouter(num_experts)
        self.experts = AriaExperts(num_experts, implementation)
        self.shared_experts = AriaSharedExpertsMLP()

    def forward(self, hidden_states):
        original_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.size(-1))
        _, top_k_weights, top_k_index = self.router(hidden_states)
        expert_output = self.experts(hidden_states, top_k_index, top_k_weights).view(original_shape)
        shared_output = self.shared_experts(hidden_states.view(original_shape))
        return expert_output + shared_output


SOURCE = "huggingface/transformers v5.x models/aria/modeling_aria.py AriaTextMoELayer"
CASES = [
    Case("hf_v5_aria_eager", SOURCE + " (AriaExperts eager loop, transposed weights), E=8",
         lambda: AriaTextMoELayer(8, "eager"), lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
    Case("hf_v5_aria_grouped_mm", SOURCE + " (integrations/moe.py grouped_mm_experts_forward, is_transposed), E=6",
         lambda: AriaTextMoELayer(6, "grouped_mm"), lambda T, g: torch.randn(1, T, H, generator=g),
         form="sorted_grouped_mm", dtype=torch.bfloat16),
]
