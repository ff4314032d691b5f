"""transformers v4.x IBM Granite MoE, mirrored from huggingface/transformers (v4.4x,
``src/transformers/models/granitemoe/modeling_granitemoe.py``: ``GraniteMoeMoE``, ``GraniteMoeParallelExperts``,
``GraniteMoeTopKGating``; the v4 forward, before the scattermoe kernel).

Style: JetMoE's layer as HF ported it, with the bookkeeping moved into the router: ``GraniteMoeTopKGating`` takes
the top-k of the fp32 logits, softmaxes the k and casts back (``type_as``), scatters a (T, E) indicator to count
the tokens per expert, calls ``expert_size.tolist()`` itself, sorts the flat expert ids and returns
``(index_sorted_experts, batch_index, batch_gates, expert_size, logits)``. The block indexes ``layer_input[batch_index]``,
runs two bias-free ``GraniteMoeParallelExperts`` (``inputs.split(expert_size)`` then ``F.linear`` per expert, one
(E, 2I, H) input weight whose output is ``chunk(2, dim=-1)``-ed for the SwiGLU), scales by ``batch_gates[:, None]``
and combines by out-of-place ``zeros.index_add``; it returns ``(layer_output, router_logits)`` with no output bias.
Input (B, S, H).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


class GraniteMoeParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size).normal_(0.0, 0.2))
        self.num_experts, self.input_size, self.output_size = num_experts, input_size, output_size

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(F.linear(input_list[i], self.weight[i]))
        return torch.cat(output_list, dim=0)


class GraniteMoeTopKGating(nn.Module):
    def __init__(self, input_size, num_experts, top_k):
        super().__init__()
        self.num_experts, self.input_size, self.top_k = num_experts, input_size, top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)

        # tokens per expert, from a (T, E) indicator
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype,
                            device=top_k_gates.device)
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0)
        expert_size = expert_size.tolist()

        # group the (token, choice) pairs by expert
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        top_k_gates = top_k_gates.flatten()
        batch_gates = top_k_gates[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits


class GraniteMoeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_size, self.hidden_size = H, I
        self.activation = nn.SiLU()
        self.input_linear = GraniteMoeParallelExperts(E, H, 2 * I)
        self.output_linear = GraniteMoeParallelExperts(E, I, H)
        self.router = GraniteMoeTopKGating(input_size=H, num_experts=E, top_k=K)
        self.num_experts, self.top_k = E, K

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)

        expert_inputs = layer_input[batch_index]
        hidden_states = self.input_linear(expert_inputs, expert_size)
        chunked_hidden_states = hidden_states.chunk(2, dim=-1)
        hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]
        expert_outputs = self.output_linear(hidden_states, expert_size)

        expert_outputs = expert_outputs * batch_gates[:, None]

        zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
        layer_output = zeros.index_add(0, batch_index, expert_outputs)
        layer_output = layer_output.view(bsz, length, self.input_size)
        return layer_output, router_logits


class Wrapped(nn.Module):
    """The decoder layer takes ``hidden_states, router_logits = self.block_sparse_moe(...)``."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = GraniteMoeMoE()

    def forward(self, x):
        hidden_states, _router_logits = self.block_sparse_moe(x)
        return hidden_states


CASES = [Case("hf_v4_granitemoe", "huggingface/transformers v4.4x models/granitemoe/modeling_granitemoe.py "
              "GraniteMoeMoE + GraniteMoeParallelExperts + GraniteMoeTopKGating", Wrapped,
              lambda T, g: torch.randn(2, T, H, generator=g), form="split_loop")]
