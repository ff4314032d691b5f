"""lucidrains' mixture-of-experts, mirrored from lucidrains/mixture-of-experts
(``mixture_of_experts/mixture_of_experts.py``: ``Top2Gating``, ``Experts``, ``MoE``, ``cumsum_exclusive``,
``safe_one_hot``).

Style: GShard top-2 over groups (the batch dimension): the gating weight applied by einsum
``"...bnd,...de->...bne"``, ``topk(k=1)`` twice (the first choice zeroed out by ``1 - mask``), gates renormalised,
capacity ``max(min(n, int(n * factor / E)), 4)`` from the group size, exclusive-cumsum positions (``F.pad`` then
``cumsum``), drops by ``position < capacity``, second choices behind all first choices; combine tensor
(b, n, E, C) from ``safe_one_hot`` (its width ``max(positions.max() + 1, C)`` depends on the data), dispatch
``combine.bool()``; einsum ``"bnd,bnec->ebcd"`` in, experts by einsum on (E, D, I) weights with GELU, einsum
``"ebcd,bnec->bnd"`` out. Second-expert policy "all" (no sampling) so eager is deterministic.

Rewritten in one graph: ``safe_one_hot``'s width is provably above the positions' maximum, so
``moe_inductor/data_widths.py`` traces it as ``eq(pos[..., None], arange(width))`` (a graph break under every other
backend: one_hot's schema takes an ``int``), and the per-group queues are proven by
``passes/grouped_capacity.py``, which runs the op once per group.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 12, 4
MIN_EXPERT_CAPACITY = 4


def cumsum_exclusive(t, dim=-2):
    num_pad_dims = -dim - 1
    pre_padding = (0, 0) * num_pad_dims
    pre_slice = (slice(None),) * num_pad_dims
    padded_t = F.pad(t, (*pre_padding, 1, 0)).cumsum(dim=dim)
    return padded_t[(..., slice(None, -1), *pre_slice)]


def safe_one_hot(indexes, max_length):
    max_index = indexes.max() + 1
    return F.one_hot(indexes, max(max_index + 1, max_length))[..., :max_length]


def top1(t):
    values, index = t.topk(k=1, dim=-1)
    return values.squeeze(dim=-1), index.squeeze(dim=-1)


class Top2Gating(nn.Module):
    def __init__(self, capacity_factor=1.25, eps=1e-9):
        super().__init__()
        self.eps, self.num_gates, self.capacity_factor = eps, E, capacity_factor
        self.w_gating = nn.Parameter(torch.randn(H, E) * H ** -0.5)

    def forward(self, x):
        *_, b, group_size, dim = x.shape
        num_gates = self.num_gates
        raw_gates = torch.einsum("...bnd,...de->...bne", x, self.w_gating).softmax(dim=-1)
        gate_1, index_1 = top1(raw_gates)
        mask_1 = F.one_hot(index_1, num_gates).float()
        gates_without_top_1 = raw_gates * (1.0 - mask_1)
        gate_2, index_2 = top1(gates_without_top_1)
        mask_2 = F.one_hot(index_2, num_gates).float()
        denom = gate_1 + gate_2 + self.eps
        gate_1 = gate_1 / denom
        gate_2 = gate_2 / denom
        expert_capacity = min(group_size, int((group_size * self.capacity_factor) / num_gates))
        expert_capacity = max(expert_capacity, MIN_EXPERT_CAPACITY)
        expert_capacity_f = float(expert_capacity)
        position_in_expert_1 = cumsum_exclusive(mask_1, dim=-2) * mask_1
        mask_1 = mask_1 * (position_in_expert_1 < expert_capacity_f).float()
        mask_1_count = mask_1.sum(dim=-2, keepdim=True)
        mask_1_flat = mask_1.sum(dim=-1)
        position_in_expert_1 = position_in_expert_1.sum(dim=-1)
        gate_1 = gate_1 * mask_1_flat
        position_in_expert_2 = cumsum_exclusive(mask_2, dim=-2) + mask_1_count
        position_in_expert_2 = position_in_expert_2 * mask_2
        mask_2 = mask_2 * (position_in_expert_2 < expert_capacity_f).float()
        mask_2_flat = mask_2.sum(dim=-1)
        position_in_expert_2 = position_in_expert_2.sum(dim=-1)
        gate_2 = gate_2 * mask_2_flat
        combine_tensor = (
            gate_1[..., None, None] * mask_1_flat[..., None, None] * F.one_hot(index_1, num_gates)[..., None]
            * safe_one_hot(position_in_expert_1.long(), expert_capacity)[..., None, :]
            + gate_2[..., None, None] * mask_2_flat[..., None, None] * F.one_hot(index_2, num_gates)[..., None]
            * safe_one_hot(position_in_expert_2.long(), expert_capacity)[..., None, :])
        dispatch_tensor = combine_tensor.bool().to(combine_tensor)
        return dispatch_tensor, combine_tensor


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.act = nn.GELU()

    def forward(self, x):
        hidden = torch.einsum("...nd,...dh->...nh", x, self.w1)
        hidden = self.act(hidden)
        return torch.einsum("...nh,...hd->...nd", hidden, self.w2)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate = Top2Gating()
        self.experts = Experts()

    def forward(self, inputs):
        b, n, d, e = *inputs.shape, self.num_experts
        dispatch_tensor, combine_tensor = self.gate(inputs)
        expert_inputs = torch.einsum("bnd,bnec->ebcd", inputs, dispatch_tensor)
        orig_shape = expert_inputs.shape
        expert_inputs = expert_inputs.reshape(e, -1, d)
        expert_outputs = self.experts(expert_inputs)
        expert_outputs = expert_outputs.reshape(*orig_shape)
        return torch.einsum("ebcd,bnec->bnd", expert_outputs, combine_tensor)


CASES = [Case("lucidrains_moe", "lucidrains/mixture-of-experts mixture_of_experts/mixture_of_experts.py MoE",
              MoE, lambda T, g: torch.randn(2, T, H, generator=g), form="padded_capacity",
              # 2.11 traces the per-group routing of the recompile (a symbolic capacity) into other views (README)
              before_2_13=("partly_rewritten", "1 of 2"))]
