"""Yuan2.0-M32's MoE layer with its attention router, written after IEIT-Yuan's Hugging Face remote code for
Yuan2-M32-hf (``yuan_hf_model.py``: ``ParallelAttention_router``, ``MoEDroplessTokenDispatcher``, ``GroupedMLP``,
``YuanMoeLayer``; the Hub file, read in a GitHub copy the code index holds). IEIT-Yuan/Yuan2.0-M32's own AutoGPTQ
copy (``3rd_party/AutoGPTQ/auto_gptq/modeling/yuan_moe_hf_model.py`` at bb14520a: ``YuanMoeLayer``,
``YuanExpertMLP``) runs the same router through a v4.36 Mixtral loop instead: the second case.

Style:

- the router is attention over the experts, token by token: one bias-free ``query_key_value`` linear (H -> 3E),
  ``torch.split`` into q, k, v of width E, each cast to float32 and viewed (B, S, E, 1); ``q @ k^T`` is an (E, E)
  score matrix per token, softmaxed over its last dim, times v, viewed (T, E): the logits;
- ``routing``: ``topk`` of the logits first, then a float32 softmax over the k picked logits, ``type_as`` the
  logits, cast to the tokens' dtype;
- ``token_permutation`` (Megatron's dropless dispatcher cut down to one rank): a ``ones_like(ids).bool()`` map,
  ``masked_select`` of the ids and of the probabilities by it, its ``nonzero()[:, 0]`` (the token of each choice)
  expanded to (T k, H) and ``torch.gather``ed from the tokens; ``argsort`` of the flat ids, the counts by ``histc``
  moved to the host (``.cpu().to(torch.long)``), and a second ``gather`` by the sort expanded to (T k, H);
- ``GroupedMLP``: two ``nn.ModuleList``s, ``w1[i]`` (H -> 2F, gate and up stacked) and ``w2[i]``; ``for i in
  range(num_experts)`` with ``if tokens_per_expert[i] == 0: continue``, a running ``start_idx``/``end_idx`` from the
  host counts, ``silu(chunk[0]) * chunk[1]``, the outputs ``torch.cat``ed;
- ``token_unpermutation``: ``zeros_like(..).scatter(0, indices, out)`` back to choice order, times the probabilities
  ``view(-1, 1)``, then ``zeros(T, H).scatter_add(0, global_local_map, ..)`` onto the tokens.

The AutoGPTQ copy (``yuan2_m32_autogptq``): the router's logits (T, E) softmaxed in float32 over all experts,
``topk``, renormalised in place when ``norm_topk_prob``, cast back; an (E, k, T) one-hot mask, ``for expert_idx in
range(num_experts)``, ``torch.where``, ``if top_x.shape[0] == 0: continue``, ``.tolist()`` rows, experts
``YuanExpertMLP`` (one ``w1`` H -> 2F, ``torch.chunk``, ``silu(x[0]) * x[1]``, ``w2``), ``index_add_``; it returns
``(hidden, router_logits)``.

E = 32, k = 2 in the model; here E = 7 (prime), k = 2; input (B, S, H).

Outcome: the dispatcher falls back (``GroupedMLP`` branches on ``tokens_per_expert[i] == 0``, an element of the
host counts as a CPU tensor: data-dependent branching under the capture flags); the AutoGPTQ copy is rewritten.
host_counts.py reads such an element as its ``.tolist()`` integer only for a proven per-expert count vector
(tests/test_count_branches.py), and this ``histc`` counts ``max_ind.masked_select(ones_like(max_ind).bool())``,
which nothing proves to be the top-k ids flattened, so the branch stays Dynamo's. Past it the rest is no form yet:
the masked_select's length is unbacked, so ``token_unpermutation``'s ``assert indices.shape == hidden_states.shape``
cannot be decided against the loop's slices, and the dispatch (``nonzero()[:, 0]`` of the all-ones map as the token
of each choice, two ``gather``s, the ``scatter`` back to choice order, the probabilities, the ``scatter_add``) is
read by no matcher.

Departures: ``histc`` is given the ids as float32 (CPU's ``histc`` takes no int64; on CUDA the source's int64
``histc`` counts the same); the ``torch.cuda.set_device`` calls are left out.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, FFN, E, K = 16, 12, 7, 2


class ParallelAttention_router(nn.Module):
    def __init__(self):
        super().__init__()
        self.projection_size = E
        self.query_key_value = nn.Linear(H, self.projection_size * 3, bias=False)

    def forward(self, hidden_states):
        mixed_x_layer = self.query_key_value(hidden_states)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, self.projection_size, -1)
        b, s, z = query_layer.shape
        query_layer = query_layer.float().view(b, s, z, 1)
        key_layer = key_layer.float().view(b, s, z, 1)
        value_layer = value_layer.float().view(b, s, z, 1)
        attn_weights = torch.matmul(query_layer, key_layer.transpose(2, 3))
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_layer)
        return attn_output.view(-1, z)


class MoEDroplessTokenDispatcher:
    def __init__(self, num_experts):
        self.num_experts = num_experts
        self.router_topk = K

    def token_permutation(self, hidden_states, max_prob, max_ind):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        if self.router_topk > 1:
            global_local_map = torch.ones_like(max_ind).bool()
            local_indices = max_ind.masked_select(global_local_map)
            local_probs = max_prob.masked_select(global_local_map)
            global_local_map = global_local_map.nonzero()[:, 0]
            global_local_map = global_local_map.view(-1, 1).expand(-1, hidden_states.shape[-1])
            local_hidden_states = torch.gather(hidden_states, 0, global_local_map)
        indices = torch.argsort(local_indices, dim=0)
        tokens_per_expert = torch.histc(local_indices.float(), bins=self.num_experts, min=0,
                                        max=self.num_experts - 1)
        tokens_per_expert = tokens_per_expert.cpu().to(torch.long)
        indices = indices.view(-1, 1).expand(-1, hidden_states.shape[-1])
        permuted_local_hidden_states = torch.gather(local_hidden_states, 0, indices)
        return permuted_local_hidden_states, tokens_per_expert, local_probs, indices, global_local_map

    def token_unpermutation(self, hidden_states, scores, indices, global_local_map=None):
        scores = scores.to(dtype=hidden_states.dtype)
        unpermuted_local_hidden = torch.zeros_like(hidden_states)
        assert indices.shape == hidden_states.shape, f"{indices.shape}, {hidden_states.shape}"
        unpermuted_local_hidden = unpermuted_local_hidden.scatter(0, indices, hidden_states)
        if self.router_topk > 1:
            unpermuted_local_hidden = unpermuted_local_hidden * scores.view(-1, 1)
        output_total = unpermuted_local_hidden
        if self.router_topk > 1:
            global_num_tokens = self.hidden_shape[0] * self.hidden_shape[1]
            unpermuted_global_hidden = torch.zeros([global_num_tokens, hidden_states.shape[-1]],
                                                   dtype=hidden_states.dtype, device=hidden_states.device)
            output_total = unpermuted_global_hidden.scatter_add(0, global_local_map, unpermuted_local_hidden)
        return output_total.view(self.hidden_shape)


class GroupedMLP(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts

        def glu(x):
            x = torch.chunk(x, 2, dim=-1)
            return torch.nn.functional.silu(x[0]) * x[1]

        self.activation_func = glu
        self.w1 = nn.ModuleList([nn.Linear(H, FFN * 2, bias=False) for _ in range(num_experts)])
        self.w2 = nn.ModuleList([nn.Linear(FFN, H, bias=False) for _ in range(num_experts)])

    def forward(self, permuted_hidden_states, tokens_per_expert):
        fc2_outputs = []
        start_idx = 0
        for i in range(self.num_experts):
            if tokens_per_expert[i] == 0:
                continue
            end_idx = start_idx + tokens_per_expert[i]
            fc1_output = self.w1[i](permuted_hidden_states[start_idx:end_idx])
            intermediate_parallel = self.activation_func(fc1_output)
            fc2_outputs.append(self.w2[i](intermediate_parallel))
            start_idx = end_idx
        return torch.cat(fc2_outputs, dim=0)


class YuanMoeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.router = ParallelAttention_router()
        self.token_dispatcher = MoEDroplessTokenDispatcher(self.num_experts)
        self.experts = GroupedMLP(self.num_experts)

    def routing(self, logits):
        top_logits, indices = torch.topk(logits, k=self.top_k, dim=1)
        scores = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
        return scores, indices

    def forward(self, hidden_states):
        logits = self.router(hidden_states)
        scores, indices = self.routing(logits)
        scores = scores.to(hidden_states.dtype)
        dispatched_input, tokens_per_expert, scores, indices, global_local_map = (
            self.token_dispatcher.token_permutation(hidden_states, scores, indices))
        expert_output = self.experts(dispatched_input, tokens_per_expert)
        return self.token_dispatcher.token_unpermutation(expert_output, scores, indices, global_local_map)


class YuanExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gated_linear_unit = True
        self.w1 = nn.Linear(H, FFN * 2, bias=False)
        self.act_fn = nn.SiLU()
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        x = self.w1(x)
        if self.gated_linear_unit:
            x = torch.chunk(x, 2, dim=-1)
            x = self.act_fn(x[0]) * x[1]
        else:
            x = self.act_fn(x)
        return self.w2(x)


class YuanMoeLayerLoop(nn.Module):
    """``YuanMoeLayer`` of the AutoGPTQ copy."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, True
        self.gate = ParallelAttention_router()
        self.experts = nn.ModuleList([YuanExpertMLP() for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_dim)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class WrappedLoop(nn.Module):
    """``YuanDecoderLayer`` unpacks ``hidden_states, router_logits = self.mlp(hidden_states)``."""

    def __init__(self):
        super().__init__()
        self.mlp = YuanMoeLayerLoop()

    def forward(self, x):
        out, _router_logits = self.mlp(x)
        return out


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


CASES = [
    # GroupedMLP branches on an element of the host counts tensor (``tokens_per_expert[i] == 0`` on a CPU tensor):
    # its histc counts ids taken by masked_select, not proven the top-k ids flattened, so the element stays a 0-d
    # tensor and the branch data-dependent under the capture flags; the frame is compiled as plain capture would
    Case("yuan2_m32", "IEIT-Yuan Yuan2-M32-hf yuan_hf_model.py YuanMoeLayer (attention router, dropless dispatcher, "
         "GroupedMLP)", YuanMoeLayer, _input, form="split_loop", expect=("fell_back",)),
    Case("yuan2_m32_autogptq", "IEIT-Yuan/Yuan2.0-M32 3rd_party/AutoGPTQ/auto_gptq/modeling/yuan_moe_hf_model.py "
         "YuanMoeLayer (attention router, v4.36 Mixtral loop)", WrappedLoop, _input, form="unrolled_loop"),
]
