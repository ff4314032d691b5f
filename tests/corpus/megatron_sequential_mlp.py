"""Megatron-Core's MoE without expert parallelism, mirrored from NVIDIA/Megatron-LM
(``megatron/core/transformer/moe/router.py``: ``TopKRouter``; ``moe_utils.py``: ``topk_softmax_with_capacity``,
``permute``, ``unpermute``; ``token_dispatcher.py``: ``MoEAllGatherTokenDispatcher``; ``experts.py``:
``SequentialMLP``; ``mlp.py``: ``MLP`` with ``gated_linear_unit``).

Style: top-k of the logits then softmax of the k (``use_pre_softmax=False``), scattered into (T, E) probs and a
boolean ``routing_map``; ``permute`` gathers tokens expert-major by ``arange(T).expand(E, T).masked_select(map.T)``
and ``index_select``; ``SequentialMLP`` splits by ``tokens_per_expert.tolist()`` and runs each expert's MLP, whose
``linear_fc1`` is one (2I, H) weight split by ``torch.chunk(x, 2, dim=-1)``; ``unpermute`` scales by the probs
picked by ``masked_select`` and ``scatter_add_``-s back.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(H, 2 * I, bias=False)
        self.linear_fc2 = nn.Linear(I, H, bias=False)

    def forward(self, hidden_states):
        intermediate_parallel = self.linear_fc1(hidden_states)

        def glu(x):
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]

        intermediate_parallel = glu(intermediate_parallel)
        return self.linear_fc2(intermediate_parallel), None


class SequentialMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.local_experts = nn.ModuleList([MLP() for _ in range(E)])

    def forward(self, permuted_local_hidden_states, tokens_per_expert):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        output_local_list = []
        for expert, tokens in zip(self.local_experts, tokens_list):
            output, _ = expert(tokens)
            output_local_list.append(output)
        return torch.cat(output_local_list, dim=0)


def permute(tokens, routing_map):
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    _, hidden = restore_shape
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)

    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores, top_indices = torch.topk(logits, k=K, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = SequentialMLP()

    def forward(self, hidden_states):
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        probs, routing_map = self.router(hidden_states)
        tokens_per_expert = routing_map.sum(dim=0).long().cpu()
        permuted, sorted_indices = permute(hidden_states, routing_map)
        expert_output = self.experts(permuted, tokens_per_expert)
        output = unpermute(expert_output, sorted_indices, hidden_states.shape, probs, routing_map)
        return output.view(hidden_shape)


CASES = [Case("megatron_sequential_mlp", "NVIDIA/Megatron-LM megatron/core/transformer/moe/ (TopKRouter, "
              "MoEAllGatherTokenDispatcher permute/unpermute, SequentialMLP)", MoELayer,
              lambda T, g: torch.randn(T, 1, H, generator=g), form="split_loop")]
