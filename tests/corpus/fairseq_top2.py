"""fairseq's top-2 MoE, mirrored from facebookresearch/fairseq (``fairseq/modules/moe/top2gate.py``:
``top2gating``, ``one_hot``; ``fairseq/modules/moe/moe_layer.py``: ``MOELayer``).

Style: softmax in fp32 (``use_fp32``: the combine weights go back to the input's dtype), ``argmax(keepdim=True)`` + a
scatter-based ``one_hot`` for each choice (second policy "all"), an int capacity ``2 * ceil(T / E)``, ``cumsum - 1``
positions with the second choices behind the first, ``mask * lt(locations, capacity)`` drops, gates renormalised after
dropping, combine weights built by ``bmm`` of (S, E, 1) gates with (S, 1, C) one-hot locations; dispatch
``mm(dispatch_mask.permute(1, 2, 0).view(E*C, S), x)``, experts over ``chunk``, combine ``mm(combine_weights.view(S,
E*C), expert_output.view(E*C, M))``. The experts are fairseq's FFN: ``fc2(relu(fc1(x)))`` with biases.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 12, 4


def one_hot(indices, num_classes, unsqueeze_indices=False):
    if unsqueeze_indices:
        indices = indices.unsqueeze(-1)
    output = torch.zeros(indices.shape[:-1] + (num_classes,), device=indices.device, dtype=indices.dtype)
    output.scatter_(len(output.shape) - 1, indices, 1)
    return output


def top2gating(logits):
    orig_dtype = logits.dtype  # fairseq's use_fp32: the gating in fp32, the combine weights back in the input's dtype
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = 2 * math.ceil(num_tokens / num_experts)
    indices1_s = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = one_hot(indices1_s, num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1, keepdim=True)
    mask2 = one_hot(indices2_s, num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    locations1_sc = one_hot(locations1_s, num_classes=capacity, unsqueeze_indices=True)
    locations2_sc = one_hot(locations2_s, num_classes=capacity, unsqueeze_indices=True)
    combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
    combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
    combine_weights = combine1_sec + combine2_sec
    return combine_weights.to(orig_dtype), combine_weights.bool()


class FeedForwardNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, I)
        self.fc2 = nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class MOELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([FeedForwardNetwork() for _ in range(E)])
        self.num_local_experts, self.all2all_size = E, 1

    def forward(self, x):
        d_model = x.shape[-1]
        reshaped_input = x.reshape(-1, d_model)
        combine_weights, dispatch_mask = top2gating(self.wg(reshaped_input))
        dispatch_mask = dispatch_mask.to(x.dtype).permute(1, 2, 0)  # S,E,C -> E,C,S
        e, c, s = dispatch_mask.size()
        m = reshaped_input.size(1)
        dispatched_input = torch.mm(dispatch_mask.view(e * c, s), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.all2all_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.experts)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = expert_output.reshape(self.all2all_size * self.num_local_experts, -1, d_model)
        combined_output = combine_weights.view(s, e * c).mm(expert_output.view(e * c, m))
        return combined_output.reshape(x.shape)


CASES = [Case("fairseq_top2", "facebookresearch/fairseq fairseq/modules/moe/top2gate.py + moe_layer.py", MOELayer,
              lambda T, g: torch.randn(T, H, generator=g), form="padded_capacity")]
