"""transformers v5's Qwen3-Next sparse MoE block, mirrored from huggingface/transformers (v5.x,
``src/transformers/models/qwen3_next/modeling_qwen3_next.py``: ``Qwen3NextTopKRouter``, ``Qwen3NextExperts``,
``Qwen3NextSparseMoeBlock``), its experts run by the two non-eager implementations of v5's experts interface
(``src/transformers/integrations/moe.py``: ``batched_mm_experts_forward`` and ``grouped_mm_experts_forward``, the
default a ``from_pretrained`` model dispatches to).

Style: the shared expert runs first on the flattened tokens; the router is a raw (E, H) weight (``F.linear``),
softmax in fp32, top-k, renormalised (``norm_topk_prob``), cast back to the logits' dtype; the shared expert's output
is scaled by ``sigmoid(shared_expert_gate(x))`` (an (H -> 1) linear) after the routed experts ran, then added.

The experts hold v5's stacked (E, 2I, H) gate/up and (E, H, I) down weights; their forward is one of:

- ``batched_mm``: every token repeated k times (``repeat_interleave(k, dim=0)``), the weights gathered per
  assignment (``gate_up_proj[expert_ids]``: an (S, 2I, H) copy), ``torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)``,
  the gate chunked off, the down projection the same way, scaled by the flat weights and summed with
  ``view(T, k, H).sum(dim=1)`` (no ``index_add_``);
- ``grouped_mm``: ``torch.sort`` of the flat ids (not stable), the rows ``x[perm // k]`` and weights ``w[perm]``,
  ``histc`` of the sorted ids as floats (``bins=E, min=0, max=E - 1``: the CPU branch) and an int32 ``cumsum`` as
  offsets, ``F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)`` for both projections, the weight applied after the
  down projection, the unsort by an inverse permutation (``inv_perm[perm] = arange(S)``, ``out[inv_perm]``) and the
  same ``view(T, k, H).sum(dim=1)``.

Departures: the ``_grouped_mm`` dispatcher is reduced to the branch it takes for bf16 weights (``F.grouped_mm``;
for other dtypes under compile transformers swaps in its own ``grouped_mm_fallback`` custom op, and torch's
grouped_mm meta kernel takes bf16 only), so the grouped_mm case runs in bf16; no expert-parallel sentinels
(``_is_expert_parallel`` is False outside EP).

Outcome: both compile in one graph per shape with no graph break and are rewritten. The batched_mm experts (flat
T*k rows of ``repeat_interleave``, per-assignment weight copies, ``bmm``) by gathered_weights' flat-rows spelling;
the grouped_mm experts by sorted_grouped_mm, which reads their counts (histc of the sorted ids) and their unsort (a
gather by the inverse permutation, ``out[inv_perm]``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, K = 32, 16, 2


class Qwen3NextMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen3NextTopKRouter(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob, self.hidden_dim = K, num_experts, True, H
        self.weight = nn.Parameter(torch.randn(num_experts, H) * H ** -0.5)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index


def _batched_linear(x, weight):
    """(S, in) rows times their own (S, out, in) weights."""
    return torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)


def _grouped_linear(x, weight, offs):
    """(S, in) expert-sorted rows times the (E, out, in) stack, group e being rows [offs[e-1], offs[e])."""
    return F.grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offs=offs)


class Qwen3NextExperts(nn.Module):
    def __init__(self, num_experts, implementation):
        super().__init__()
        self.num_experts, self.implementation = num_experts, implementation
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, H, I) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.implementation == "batched_mm":
            return self.batched_mm_forward(hidden_states, top_k_index, top_k_weights)
        return self.grouped_mm_forward(hidden_states, top_k_index, top_k_weights)

    def batched_mm_forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        rows = hidden_states.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        h = self._apply_gate(_batched_linear(rows, self.gate_up_proj[expert_ids]))
        h = _batched_linear(h, self.down_proj[expert_ids])
        weighted = h * sample_weights.unsqueeze(-1)
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

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
        h = self._apply_gate(_grouped_linear(rows, self.gate_up_proj, offsets))
        h = _grouped_linear(h, self.down_proj, offsets)
        weighted = h * weights_sorted.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


class Qwen3NextSparseMoeBlock(nn.Module):
    def __init__(self, num_experts=6, implementation="batched_mm"):
        super().__init__()
        self.gate = Qwen3NextTopKRouter(num_experts)
        self.experts = Qwen3NextExperts(num_experts, implementation)
        self.shared_expert = Qwen3NextMLP(2 * I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat = hidden_states.view(-1, hidden_dim)
        shared = self.shared_expert(flat)
        _, routing_weights, selected_experts = self.gate(flat)
        out = self.experts(flat, selected_experts, routing_weights)
        shared = F.sigmoid(self.shared_expert_gate(flat)) * shared
        out = out + shared
        return out.reshape(batch_size, sequence_length, hidden_dim)


SOURCE = "huggingface/transformers v5.x models/qwen3_next/modeling_qwen3_next.py Qwen3NextSparseMoeBlock"
CASES = [
    Case("hf_v5_qwen3_next_batched_mm", SOURCE + " (integrations/moe.py batched_mm_experts_forward), E=6",
         lambda: Qwen3NextSparseMoeBlock(6, "batched_mm"), lambda T, g: torch.randn(2, T, H, generator=g),
         form="gathered_weights"),
    Case("hf_v5_qwen3_next_grouped_mm", SOURCE + " (integrations/moe.py grouped_mm_experts_forward), E=8",
         lambda: Qwen3NextSparseMoeBlock(8, "grouped_mm"), lambda T, g: torch.randn(1, T, H, generator=g),
         form="sorted_grouped_mm", dtype=torch.bfloat16),
]
