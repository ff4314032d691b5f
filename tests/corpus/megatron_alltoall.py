"""Megatron-Core's MoE with the all-to-all token dispatcher on one rank, written after NVIDIA/Megatron-LM
(``megatron/core/transformer/moe/moe_utils.py``: ``topk_routing_with_score_function``, ``apply_router_token_dropping``,
``get_capacity``, ``permute``, ``unpermute``, ``sort_chunks_by_idxs``; ``token_dispatcher.py``:
``MoEAlltoAllTokenDispatcher``; ``experts.py``: ``SequentialMLP``; ``mlp.py``: ``MLP`` with ``per_token_scale``).

What differs from megatron_sequential_mlp.py (the allgather dispatcher of older Megatron):

- the probs travel with the tokens: ``permute`` returns the permuted probs, the experts get them and apply them as
  ``per_token_scale`` after the gated activation, before ``linear_fc2`` (the routing weight between the
  projections), and ``unpermute`` is called without probs (a plain ``scatter_add_`` back);
- the dropless ``permute`` is the fixed-shape one: ``routing_map.T`` flattened, ``argsort(descending=True,
  stable=True)``, the first ``T * k`` kept, ``% T`` for the token ids, the probs read at the same flat positions;
- with several local experts the dispatcher re-sorts the chunks by local expert (``sort_chunks_by_idxs``: split by
  ``counts.tolist()``, ``cat`` in ``sorted_idxs.tolist()`` order; on one rank the order is ``arange(E)``), and the
  experts split again by ``tokens_per_expert.tolist()``.

The drop-and-pad case sets ``moe_expert_capacity_factor`` with ``drop_policy="probs"`` and ``pad_to_capacity``: each
expert keeps the C = ceil(T * k / E * factor) tokens of highest prob (``topk`` over the token dimension of the
(T, E) probs, ``scatter`` into a capacity mask), padded to exactly C rows, so a token may reach an expert with prob 0
or miss one of its top-k. ``permute`` then takes ``routing_map.T.argsort(dim=-1, descending=True, stable=True)[:,
:C]`` and reads the probs by flat ``index_select``; ``unpermute`` is the same ``scatter_add_``. Every expert gets C
rows, so ``tokens_per_expert`` is ``torch.full((E,), C)``.

Outcomes today: the dropless case falls back. The chunk sort indexes a tuple of splits by the entries of
``sorted_idxs.tolist()`` (a tensor on the dispatcher, a plain object, so a graph input to Dynamo: the entries are
unbacked), which cannot be guarded under the capture settings, so the frames are compiled as plain capture would
(and without the chunk sort the rest is still left alone: the argsort permute with the probs between the
projections is not a form yet). The chunk order is the tensor's values at run time: tracing it as ``arange(E)``
would need a guard on a tensor's contents, which Dynamo does not have, and a run-time assert would raise where eager
runs, so the frames stay as plain capture compiles them. The drop-and-pad case is left alone at the router.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I = 32, 16


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(H, 2 * I, bias=False)
        self.linear_fc2 = nn.Linear(I, H, bias=False)

    def forward(self, hidden_states, per_token_scale=None):
        intermediate = self.linear_fc1(hidden_states)

        def glu(x):
            x_glu, x_linear = torch.chunk(x, 2, dim=-1)
            return F.silu(x_glu) * x_linear

        intermediate = glu(intermediate)
        if per_token_scale is not None:
            original_dtype = intermediate.dtype
            intermediate = intermediate * per_token_scale.unsqueeze(-1)
            intermediate = intermediate.to(original_dtype)
        return self.linear_fc2(intermediate), None


class SequentialMLP(nn.Module):
    def __init__(self, num_local_experts):
        super().__init__()
        self.local_experts = nn.ModuleList([MLP() for _ in range(num_local_experts)])

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        probs_list = torch.split(permuted_probs, tokens_per_expert)
        outputs = []
        for expert, tokens, probs in zip(self.local_experts, tokens_list, probs_list):
            output, _ = expert(tokens, probs)
            outputs.append(output)
        return torch.cat(outputs, dim=0), None


def get_capacity(num_tokens, num_experts, capacity_factor):
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def topk_routing_with_score_function(logits, topk):
    scores, top_indices = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def apply_router_token_dropping(routing_probs, routing_map, router_topk, capacity_factor):
    num_tokens, num_experts = routing_probs.shape
    expert_capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if expert_capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_probs).bool()
    else:  # drop_policy "probs"
        _, capacity_indices = torch.topk(routing_probs, k=expert_capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_probs).scatter(0, capacity_indices, 1).bool()
    final_map = capacity_mask  # pad_to_capacity
    return routing_probs * final_map, final_map


def permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    if drop_and_pad:
        capacity = num_out_tokens // num_experts
        routing_map = routing_map.to(dtype=torch.int8).T.contiguous()
        sorted_indices = routing_map.argsort(dim=-1, descending=True, stable=True)[:, :capacity].contiguous()
        sorted_indices = sorted_indices.view(-1)
        probs_t_1d = probs.T.contiguous().view(-1)
        rows = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
        flat = (rows * num_tokens + sorted_indices.view(num_experts, capacity)).view(-1)
        permuted_probs = probs_t_1d.index_select(0, flat)
    else:
        routing_map = routing_map.bool().T.contiguous()
        flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)
        flat_sorted = flat_sorted[:num_out_tokens]
        sorted_indices = flat_sorted % num_tokens
        permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens, sorted_indices, restore_shape):
    _, hidden = restore_shape
    input_dtype = permuted_tokens.dtype
    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens.to(dtype=input_dtype)


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs):
    input = torch.split(input, split_sizes.tolist(), dim=0)
    output = torch.cat([input[i] for i in sorted_idxs.tolist()], dim=0)
    probs = torch.split(probs, split_sizes.tolist(), dim=0)
    permuted_probs = torch.cat([probs[i] for i in sorted_idxs.tolist()], dim=0)
    return output, permuted_probs


class TopKRouter(nn.Module):
    def __init__(self, num_experts, topk, capacity_factor):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, H) * H ** -0.5)
        self.topk, self.capacity_factor = topk, capacity_factor

    def forward(self, x):
        logits = F.linear(x, self.weight)
        probs, routing_map = topk_routing_with_score_function(logits, self.topk)
        if self.capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(probs, routing_map, self.topk, self.capacity_factor)
        return probs, routing_map


class MoEAlltoAllTokenDispatcher:
    """One rank (ep = tp = 1): the all-to-alls are identities, so they are left out; the chunk sort is kept."""

    def __init__(self, num_experts, topk, capacity_factor):
        self.num_experts = self.num_local_experts = num_experts
        self.topk, self.capacity_factor = topk, capacity_factor
        self.drop_and_pad = capacity_factor is not None
        input_chunk_idxs = torch.arange(num_experts)
        self.sort_input_by_local_experts = input_chunk_idxs.reshape(-1, self.num_local_experts).T.ravel()
        self.restore_output_by_local_experts = input_chunk_idxs.reshape(self.num_local_experts, -1).T.ravel()

    def preprocess(self, routing_map):
        if self.drop_and_pad:
            self.capacity = get_capacity(routing_map.size(0) * self.topk, self.num_experts, self.capacity_factor)
            self.num_out_tokens = self.capacity * self.num_experts
            return torch.full((self.num_local_experts,), self.capacity, dtype=torch.long)
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()
        self.num_out_tokens = routing_map.size(0) * self.topk
        self.num_global_tokens_per_local_expert = num_local_tokens_per_expert.view(-1, self.num_local_experts)
        return num_local_tokens_per_expert

    def dispatch(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        tokens_per_expert = self.preprocess(routing_map)
        tokens, permuted_probs, self.reversed_mapping = permute(
            hidden_states, routing_map, probs, self.num_out_tokens, self.drop_and_pad)
        if self.num_local_experts > 1 and not self.drop_and_pad:
            tokens, permuted_probs = sort_chunks_by_idxs(
                tokens, self.num_global_tokens_per_local_expert.ravel(), self.sort_input_by_local_experts,
                permuted_probs)
        return tokens, tokens_per_expert, permuted_probs

    def combine(self, hidden_states):
        if self.num_local_experts > 1 and not self.drop_and_pad:
            hidden_states = torch.cat(
                [torch.split(hidden_states, self.num_global_tokens_per_local_expert.T.ravel().tolist())[i]
                 for i in self.restore_output_by_local_experts.tolist()], dim=0)
        output = unpermute(hidden_states, self.reversed_mapping, self.hidden_shape_before_permute)
        return output.view(self.hidden_shape)


class MoELayer(nn.Module):
    def __init__(self, num_experts, topk, capacity_factor=None):
        super().__init__()
        self.router = TopKRouter(num_experts, topk, capacity_factor)
        self.experts = SequentialMLP(num_experts)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(num_experts, topk, capacity_factor)

    def forward(self, hidden_states):
        probs, routing_map = self.router(hidden_states.view(-1, hidden_states.shape[-1]))
        tokens, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch(hidden_states, routing_map, probs)
        expert_output, _ = self.experts(tokens, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.combine(expert_output)


def _input(T, g):
    return torch.randn(T, 1, H, generator=g)  # Megatron's [s, b, h]


SOURCE = ("NVIDIA/Megatron-LM megatron/core/transformer/moe/ (token_dispatcher.py MoEAlltoAllTokenDispatcher, "
          "moe_utils.py permute/unpermute/sort_chunks_by_idxs, experts.py SequentialMLP, mlp.py per_token_scale)")
CASES = [
    # the chunk sort indexes a tuple by ``sorted_idxs.tolist()`` of a graph input (unbacked entries): the frames fall
    # back; without it the dispatch is still no form (the argsort permute, the probs between the projections)
    Case("megatron_alltoall_dropless", SOURCE + " (dropless, E=6, top-2)", lambda: MoELayer(6, 2), _input,
         form="split_loop", expect=("fell_back",)),
    Case("megatron_alltoall_drop_and_pad", SOURCE + " + apply_router_token_dropping (capacity factor 1.0, "
         "drop_policy probs, pad_to_capacity; E=4, top-2)", lambda: MoELayer(4, 2, 1.0), _input,
         form="split_loop", expect=("left_alone", "moe_region", "that no MoE form proves")),
]
