"""Tencent's Hunyuan-Large MoE, mirrored from Tencent/Tencent-Hunyuan-Large (``models/modeling_hunyuan.py``, the
Hugging Face remote code: ``topkgating``, ``top1gating``, ``HunYuanTopKGate``, ``HunYuanMoE``, ``HunYuanMLP``; read
in the sunyanguomt/Tencent-Hunyuan-Large mirror, as the index holds only the READMEs of Tencent's own).

Style: GShard-style capacity tensors, with a capacity that never drops (k * T slots per expert). The gate is a
bias-free fp32 ``nn.Linear`` (``wg``) on the input cast up to fp32 (``if self.wg.weight.dtype == torch.float32``).

- ``topkgating`` (k >= 2, T5X's token-priority scheme): softmax, ``topk``, every choice renormalised by
  ``gates / clamp(matmul(one_hot(ids).float(), gates.unsqueeze(-1)).sum(1))`` (the whole (T, E) row divided by the
  top-k sum); the ids made k-major (``transpose(0, 1).reshape(-1)``), an int32 one-hot whose
  ``cumsum(dim=0) * mask - 1`` ranks each choice, reshaped (k, T, E), transposed and reduced by ``max(dim=1)`` to one
  priority per (token, expert); ``logical_and(priority >= 0, priority < capacity)`` valid, ``masked_fill``-ed to 0,
  ``F.one_hot(priority, capacity).to(torch.bool)`` slots masked again; the combine by einsum
  ``"...te,...tec->...tec"`` of the renormalised probabilities with the boolean dispatch mask.
- ``top1gating`` (Hunyuan-Large's own configuration, ``moe_topk=1``): ``argmax`` of the softmax, a capacity of T,
  ``topk(mask1.float(), k=capacity, dim=0)`` to keep the first ``capacity`` tokens per expert, ``scatter_``-ed
  into a zeros mask, ``cumsum - 1`` locations, ``one_hot(locations, capacity).float()`` and einsum ``"se,sc->sec"``
  of the unrenormalised gate with it; ``dispatch_mask = combine_weights.bool()``.

The layer: ``HunYuanMoE`` dispatches by einsum ``"sec,sm->ecm"`` (the mask ``type_as`` the input), runs each expert
(``HunYuanMLP``: gate, up and down ``nn.Linear`` without biases, SiLU) on its ``chunk(E, dim=0)`` slice of shape
(1, C, M), concatenates, combines by einsum ``"sec,ecm->sm"`` and adds the shared MLP (``use_mixed_mlp_moe``, one
shared expert). ``random_routing_dropped_token`` is off (its ``randperm`` would make eager irreproducible).
E = 6 (not a power of two); input (B, S, H).

Outcome: both are rewritten (padded_capacity), forward and backward equal to eager. ``top1gating``'s
``topk(mask, k=capacity, dim=0)`` + ``scatter_`` is read as a tensor of ones (a topk of k = T over the T rows returns
every row index once per column, whatever its tie-break), so its mask is the one-hot itself, kept without a drop
into C = T slots (``capacity_gating.covers``); at a capacity below T the tokens topk keeps among equal values are
the implementation's choice, and that is left alone (tests/test_hunyuan_capacity.py). ``topkgating`` dispatches by
its own boolean ``dispatch_mask``, the mask its combine multiplies, and its priority is T5X's choice-major queue
(``passes/priority_choices.py``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 8, 6


def topkgating(logits, topk):
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    expert_capacity = topk * gates.shape[0]
    num_experts = int(gates.shape[1])
    expert_gate, expert_index = torch.topk(gates, topk)
    expert_mask = F.one_hot(expert_index, num_experts)
    expert_mask_aux = expert_mask.max(dim=-2)[0]
    tokens_per_group_and_expert = torch.mean(expert_mask_aux.float(), dim=-2)
    router_prob_per_group_and_expert = torch.mean(gates.float(), dim=-2)
    l_aux = num_experts ** 2 * torch.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert)
    gates_s = torch.clamp(torch.matmul(expert_mask.float(), gates.unsqueeze(-1)).sum(dim=1),
                          min=torch.finfo(gates.dtype).eps)
    router_probs = gates / gates_s
    # k-major ranks: every first choice queues before any second choice
    expert_index = torch.transpose(expert_index, 0, 1)
    expert_index = expert_index.reshape(-1)
    expert_mask = F.one_hot(expert_index, num_experts).to(torch.int32)
    exp_counts = torch.sum(expert_mask, dim=0).detach()
    token_priority = torch.cumsum(expert_mask, dim=0) * expert_mask - 1
    token_priority = token_priority.reshape((topk, -1, num_experts))
    token_priority = torch.transpose(token_priority, 0, 1)
    token_priority = torch.max(token_priority, dim=1)[0]
    valid_mask = torch.logical_and(token_priority >= 0, token_priority < expert_capacity)
    token_priority = torch.masked_fill(token_priority, ~valid_mask, 0)
    dispatch_mask = F.one_hot(token_priority, expert_capacity).to(torch.bool)
    valid_mask = valid_mask.unsqueeze(-1).expand(-1, -1, expert_capacity)
    dispatch_mask = torch.masked_fill(dispatch_mask, ~valid_mask, 0)
    combine_weights = torch.einsum("...te,...tec->...tec", router_probs, dispatch_mask)
    exp_counts_capacity = torch.sum(dispatch_mask)
    exp_capacity_rate = exp_counts_capacity / (logits.shape[0] * topk)
    return [l_aux, exp_capacity_rate], combine_weights, dispatch_mask, exp_counts


def top1gating(logits, random_routing_dropped_token=False):
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    capacity = gates.shape[0]
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    exp_counts = torch.sum(mask1, dim=0).detach()
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    mask1_rand = mask1
    top_idx = torch.topk(mask1_rand.float(), k=capacity, dim=0)[1]
    new_mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    mask1 = new_mask1
    mask1_bk = mask1
    assert not random_routing_dropped_token  # its randperm re-routing is off in this mirror
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    mask1_float = mask1.float()
    gates = gates * mask1_float
    locations1_sc = F.one_hot(locations1_s, num_classes=capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    dispatch_mask = combine_weights.bool()
    exp_counts_capacity = torch.sum(mask1_bk)
    exp_capacity_rate = exp_counts_capacity / (logits.shape[0])
    return [l_aux, exp_capacity_rate], combine_weights, dispatch_mask, exp_counts


class HunYuanMLP(nn.Module):
    def __init__(self, is_shared_mlp=False, num_shared_expert=1):
        super().__init__()
        self.hidden_size = H
        self.intermediate_size = I * num_shared_expert if is_shared_mlp else I
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HunYuanTopKGate(nn.Module):
    def __init__(self, moe_topk):
        super().__init__()
        self.moe_topk = moe_topk
        self.min_capacity = 8
        self.random_routing_dropped_token = False
        # the gate is kept in fp32 whatever the model's dtype
        self.wg = nn.Linear(H, E, bias=False, dtype=torch.float32)

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_size)
        if self.wg.weight.dtype == torch.float32:
            hidden_states = hidden_states.float()
        logits = self.wg(hidden_states)
        if self.moe_topk == 1:
            gate_output = top1gating(logits, random_routing_dropped_token=self.random_routing_dropped_token)
        else:
            gate_output = topkgating(logits, self.moe_topk)
        return gate_output


class HunYuanMoE(nn.Module):
    def __init__(self, moe_topk):
        super().__init__()
        self.moe_topk, self.num_experts, self.use_mixed_mlp_moe = moe_topk, E, True
        self.shared_mlp = HunYuanMLP(is_shared_mlp=True)
        self.gate = HunYuanTopKGate(moe_topk)
        self.experts = nn.ModuleList([HunYuanMLP() for _ in range(E)])

    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        if self.use_mixed_mlp_moe:
            hidden_states_mlp = self.shared_mlp(hidden_states)
        l_moe, combine_weights, dispatch_mask, exp_counts = self.gate(hidden_states)
        reshaped_input = hidden_states.reshape(-1, hidden_size)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden_states), reshaped_input)
        chunks = dispatched_input.chunk(self.num_experts, dim=0)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts):
            expert_outputs.append(expert(chunk))
        expert_output = torch.cat(expert_outputs, dim=0)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights.type_as(hidden_states), expert_output)
        combined_output = combined_output.reshape(bsz, seq_len, hidden_size)
        if self.use_mixed_mlp_moe:
            output = hidden_states_mlp + combined_output
        else:
            output = combined_output
        return output


_SRC = "Tencent/Tencent-Hunyuan-Large models/modeling_hunyuan.py HunYuanMoE"
# The capacity is the token count (times k) and one_hot(num_classes=capacity) specialises on it, so each token count
# is a graph of its own under any backend: two token counts, two graphs, each rewritten.
CASES = [
    Case("hunyuan_large_top1", f"{_SRC} (top1gating, moe_topk=1)", lambda: HunYuanMoE(1),
         lambda T, g: torch.randn(2, T, H, generator=g), form="padded_capacity", token_counts=(4, 7)),
    Case("hunyuan_large_topk", f"{_SRC} (topkgating, moe_topk=2)", lambda: HunYuanMoE(2),
         lambda T, g: torch.randn(2, T, H, generator=g), form="padded_capacity", token_counts=(4, 7)),
]
