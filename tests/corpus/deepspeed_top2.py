"""DeepSpeed's GShard-style top-2 gating, mirrored from deepspeedai/DeepSpeed (``deepspeed/moe/sharded_moe.py``:
``top2gating``, ``_capacity``, ``_one_hot_to_float``, ``MOELayer``; ``deepspeed/moe/experts.py``: ``Experts``).

Style: gating in float32 (``TopKGate`` casts the input and ``wg`` up), softmax gates, ``argmax`` for the first
choice, the first masked to -inf and ``argmax`` again for the second (no second-expert sampling here, so eager is
deterministic); ``cumsum - 1`` queue positions, the second choices
queued behind every first choice; a capacity computed as a tensor, ``ceil(T / E * 2 * capacity_factor)``, raised
to ``min_capacity`` by ``if capacity < min_capacity``; ``mask *= torch.lt(locations, capacity)`` drops;
``F.one_hot(locations_s, num_classes=capacity)`` with the tensor capacity; einsum ``"se,sc->sec"`` combine weights,
``"sec,sm->ecm"`` dispatch, experts over ``chunk(E, dim=1)``, ``"sec,ecm->sm"`` combine.

One graph under moe_inductor: the capacity is a 0-d tensor of literals and sizes, so ``moe_inductor.shape_tensors``
evaluates ``if capacity < min_capacity`` as a shape guard and ``num_classes=capacity`` as a SymInt (every other
backend breaks the graph at the branch), and the padded-capacity proof reads ``lt(locations, capacity)`` as the
slots' C.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 12, 4


def _capacity(gates, capacity_factor, min_capacity):
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


def _one_hot_to_float(x, num_classes):
    return F.one_hot(x, num_classes=num_classes).float()


def top2gating(logits, capacity_factor, min_capacity):
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
    mask1 *= torch.lt(locations1, capacity)
    mask2 *= torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = _one_hot_to_float(locations1_s, capacity)
    locations2_sc = _one_hot_to_float(locations2_s, capacity)
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    return combine_weights, combine_weights.bool()


class Expert(nn.Module):
    """A user's expert (DeepSpeed wraps any module): a bias-free gelu MLP."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, I, bias=False)
        self.fc2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([Expert() for _ in range(E)])
        self.num_local_experts = E

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.deepspeed_experts)]
        return torch.cat(expert_outputs, dim=1)


class MOELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = Experts()
        self.ep_size, self.num_local_experts = 1, E

    def forward(self, x):
        d_model = x.shape[-1]
        reshaped_input = x.reshape(-1, d_model)
        # TopKGate gates in float32 whatever the model's dtype: the input and wg's weight are cast up
        logits = F.linear(reshaped_input.float(), self.wg.weight.float())
        combine_weights, dispatch_mask = top2gating(logits, 1.0, 4)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights.type_as(x), expert_output)
        return combined_output.reshape(x.shape)


CASES = [Case("deepspeed_top2", "deepspeedai/DeepSpeed deepspeed/moe/sharded_moe.py top2gating + MOELayer", MOELayer,
              lambda T, g: torch.randn(2, T, H, generator=g), form="padded_capacity")]
