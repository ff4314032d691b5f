"""JetMoE's MoE layer, mirrored from myshell-ai/JetMoE (``jetmoe/utils/moe.py``: ``MoE``, ``compute_gating``;
``jetmoe/utils/gate.py``: ``top_k_gating``; ``jetmoe/utils/parallel_experts.py``: ``ParallelExperts``).

Style: top-k of fp32 logits, softmax of the k; ``compute_gating`` scatters a (T, E) indicator to count tokens per
expert, sorts the flat expert ids, ``batch_index = order.div(k, rounding_mode="trunc")`` and
``batch_gates = gates.flatten()[order]``; ``expert_size.tolist()``; ``ParallelExperts`` splits the sorted rows by
those sizes and runs ``F.linear(rows, weight[i])`` per expert; the input projection is one (E, 2I, H) weight split
by ``h.chunk(2, dim=-1)``; outputs scaled by ``batch_gates[:, None]`` and combined by out-of-place
``zeros.index_add(0, batch_index, ...)``, plus an output bias.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


def compute_gating(k, num_experts, top_k_gates, top_k_indices):
    zeros = torch.zeros([top_k_gates.size(0), num_experts], dtype=top_k_gates.dtype, device=top_k_gates.device)
    gates = zeros.scatter(1, top_k_indices, 1)
    expert_size = gates.long().sum(0)
    top_k_gates = top_k_gates.flatten()
    top_k_experts = top_k_indices.flatten()
    _, index_sorted_experts = top_k_experts.sort(0)
    batch_index = index_sorted_experts.div(k, rounding_mode="trunc")
    batch_gates = top_k_gates[index_sorted_experts]
    return batch_gates, batch_index, expert_size, index_sorted_experts


class ParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, output_size, input_size) * input_size ** -0.5)
        self.num_experts = num_experts

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = [F.linear(input_list[i], self.weight[i]) for i in range(self.num_experts)]
        return torch.cat(output_list, dim=0)


class TopKGating(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k = K
        self.layer = nn.Linear(H, E, bias=False)

    def forward(self, x):
        logits = self.layer(x).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(x)
        return top_k_indices, top_k_gates


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_size, self.num_experts, self.top_k = H, E, K
        self.input_linear = ParallelExperts(E, H, 2 * I)
        self.output_linear = ParallelExperts(E, I, H)
        self.router = TopKGating()
        self.activation = nn.SiLU()
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        bsz, length, emb_size = x.size()
        x = x.reshape(-1, emb_size)
        top_k_indices, top_k_gates = self.router(x)
        batch_gates, batch_index, expert_size, _ = compute_gating(self.top_k, self.num_experts, top_k_gates,
                                                                 top_k_indices)
        expert_size = expert_size.tolist()
        expert_inputs = x[batch_index]
        h = self.input_linear(expert_inputs, expert_size)
        h, g = h.chunk(2, dim=-1)
        h = self.activation(h) * g
        expert_outputs = self.output_linear(h, expert_size)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
        y = zeros.index_add(0, batch_index, expert_outputs)
        return y.view(bsz, length, self.input_size) + self.bias


CASES = [Case("jetmoe", "myshell-ai/JetMoE jetmoe/utils/moe.py MoE + parallel_experts.py ParallelExperts", MoE,
              lambda T, g: torch.randn(1, T, H, generator=g), form="split_loop")]
