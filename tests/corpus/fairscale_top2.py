"""fairscale's GShard layer, mirrored from facebookresearch/fairscale (``fairscale/nn/moe/top2gate.py``:
``top2gating``, ``one_hot``, ``Top2Gate``; ``fairscale/nn/moe/moe_layer.py``: ``MOELayer``).

Style: the gate is a bias-free ``nn.Linear`` called on the flat tokens; ``softmax(dtype=torch.float)``; the one-hot
masks come from fairscale's own ``one_hot`` (``zeros(shape + (C,))`` then ``scatter_(-1, idx.unsqueeze(-1), 1)``,
a workaround for an old ``F.one_hot`` bug); an int capacity ``2 * T // E`` with ``assert T % E == 0``; ``cumsum - 1``
queue positions, the second choices behind every first choice, ``mask *= lt(locations, capacity)`` drops; gates
renormalised with a ``clamp(min=eps)`` denominator; every einsum of the GShard paper written as a broadcast product
(``gates1_s.unsqueeze(-1) * mask1``, ``gates1.unsqueeze(2) * locations1_sc.unsqueeze(1)``); ``l_aux`` kept on the
module (``self.l_aux``) and the combine weights cast back to the logits' dtype. The layer dispatches by einsum
``"sec,sm->ecm"`` with ``dispatch_mask.float()``, reshapes to (world, E, C, M), runs the user's experts over
``chunk(E, dim=1)`` and combines by einsum ``"sec,ecm->sm"``. The experts are the user's: ``Linear -> ReLU ->
Linear`` with biases.

Departures: one rank, so the two ``_AllToAll`` exchanges are the identity and are left out; the second choice is the
plain argmax of the masked logits, without fairscale's Gumbel noise (``gumbel_rsample``), so eager is deterministic
and the compiled module can be compared with it. E = 6 (not a power of two); the input is (E, T, H), which keeps
``shape[0] % E == 0`` and ``T % E == 0`` as the layer's asserts demand.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 12, 6


def one_hot(tensor, num_classes):
    assert num_classes > 0, "num_classes must be a positive integer"
    ret = torch.zeros(tensor.shape + (num_classes,), device=tensor.device, dtype=tensor.dtype)
    ret.scatter_(-1, tensor.unsqueeze(-1), 1)
    return ret


def top2gating(logits):
    gates = F.softmax(logits, dim=1, dtype=torch.float)
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = 2 * num_tokens // num_experts
    assert num_tokens % num_experts == 0
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = one_hot(indices1_s, num_classes=num_experts)
    # fairscale adds Gumbel noise here; the noiseless argmax keeps eager reproducible
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce)
    mask1 *= torch.lt(locations1, capacity)
    mask2 *= torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    gates1 = gates1_s.unsqueeze(-1) * mask1
    gates2 = gates2_s.unsqueeze(-1) * mask2
    locations1_sc = one_hot(locations1_s, num_classes=capacity)
    locations2_sc = one_hot(locations2_s, num_classes=capacity)
    combine1_sec = gates1.unsqueeze(2) * locations1_sc.unsqueeze(1)
    combine2_sec = gates2.unsqueeze(2) * locations2_sc.unsqueeze(1)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux.to(logits.dtype), combine_weights.to(logits.dtype), dispatch_mask


class Top2Gate(nn.Module):
    def __init__(self, model_dim, num_experts):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input):
        return top2gating(self.wg(input))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class MOELayer(nn.Module):
    def __init__(self, gate, experts):
        super().__init__()
        self.gate = gate
        self.experts = experts if type(experts) == nn.ModuleList else nn.ModuleList([experts])
        self.world_size = 1  # one rank: the all-to-all is the identity
        self.num_local_experts = len(self.experts)

    def forward(self, *input):
        assert len(input) == 1, "only single input Tensor supported"
        assert len(input[0].shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        assert input[0].shape[0] % len(self.experts) == 0, "num tokens must be order of number of local experts"
        d_model = input[0].shape[2]
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.float(), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts):
            expert_outputs += [expert(chunk)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = expert_output.reshape(self.world_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
        return combined_output.reshape(input[0].shape)


def _build():
    return MOELayer(Top2Gate(H, E), nn.ModuleList([Expert() for _ in range(E)]))


CASES = [Case("fairscale_top2", "facebookresearch/fairscale fairscale/nn/moe/top2gate.py top2gating + "
              "fairscale/nn/moe/moe_layer.py MOELayer", _build,
              lambda T, g: torch.randn(E, T, H, generator=g), form="padded_capacity")]
