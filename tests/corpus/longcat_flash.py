"""Meituan's LongCat-Flash MoE with zero-computation experts, mirrored from huggingface/transformers (v5.24,
``src/transformers/models/longcat_flash/modeling_longcat_flash.py``: ``LongcatFlashTopkRouter``,
``LongcatFlashExperts``, ``LongcatFlashMoE``), which keeps its own experts loop (no ``@use_experts_implementation``).

Style: the router scores ``E + Z`` choices, ``Z = zero_expert_num`` of them "zero-computation" experts that return
their input unchanged (``nn.Identity``), so a token may spend part of its k on nothing; the logits are
``F.linear`` of the tokens and the classifier's weight both cast to float32, a softmax, the choice made on the
scores plus an ``e_score_correction_bias`` buffer under ``@torch.no_grad()`` (``topk(sorted=False)``), the weights
``gather``ed from the unbiased scores times ``routed_scaling_factor`` (6.0 in the config), cast to the logits' dtype.
The experts are 3D parameters: ``gate_up_proj`` (E + Z, 2I, H) (sized for every choice, read for the routed ones
only) and ``down_proj`` (E, H, I). The loop is v4.5x's over the hit experts (``one_hot(.., E + Z).permute(2, 1, 0)``,
``greater(sum, 0).nonzero()``, ``int(expert_idx_tensor.item())``), with ``if token_idx.numel() == 0: continue``
and a branch on the Python index: ``expert_idx >= num_routed_experts`` runs the identity, the others
``F.linear(x, gate_up_proj[e]).chunk(2)``, ``silu(gate) * up``, ``F.linear(.., down_proj[e])``; every output is
scaled by ``top_k_weights[token_idx, selection_idx, None]`` and ``index_add_``ed in the tokens' dtype.

- ``longcat_flash_zero_experts``: E = 5 routed and Z = 3 zero experts, k = 3 (the real config's 512 + 256, k = 12).
- ``longcat_flash_routed_only``: ``zero_expert_num = 0``, every choice a routed expert.

Outcome: both rewritten as an unrolled loop. The loop over the hit experts is traced over all E + Z; with zero
experts, the identity bodies (each adds its rows of the tokens times its own routing weight) are read as
zero-computation experts (``passes/zero_experts.py``): the E routed experts go to the op, on the first E rows of
``gate_up_proj``, and the identity ones are ``x * sum of the weights of the choices >= E`` beside it, in the graph.

Departures: the bias buffer is seeded non-zero (the checkpoint's is trained), so choice and weight differ.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 5, 3


class LongcatFlashTopkRouter(nn.Module):
    def __init__(self, zero_expert_num):
        super().__init__()
        self.top_k = K
        self.hidden_dim = H
        self.n_routed_experts = E + zero_expert_num
        self.routed_scaling_factor = 6.0
        self.e_score_correction_bias = nn.Buffer(0.1 * torch.randn(self.n_routed_experts))
        self.classifier = nn.Linear(H, self.n_routed_experts, bias=False)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32))
        scores = router_logits.softmax(dim=-1)
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices) * self.routed_scaling_factor
        return router_logits, topk_weights.to(router_logits.dtype), topk_indices

    @torch.no_grad()
    def get_topk_indices(self, scores):
        biased = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        return torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]


class LongcatFlashExperts(nn.Module):
    def __init__(self, zero_expert_num):
        super().__init__()
        self.num_routed_experts = E
        self.zero_expert_num = zero_expert_num
        self.total_experts = E + zero_expert_num
        self.act_fn = nn.SiLU()
        self.identity_expert = nn.Identity()
        self.gate_up_proj = nn.Parameter(torch.randn(self.total_experts, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        if top_k_index.numel() == 0:
            return final_hidden_states
        expert_mask = F.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for expert_idx_tensor in expert_hit:
            expert_idx = int(expert_idx_tensor.item())
            selection_idx, token_idx = torch.where(expert_mask[expert_idx].squeeze(0))
            if token_idx.numel() == 0:
                continue
            current_state = hidden_states[token_idx]
            if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:
                current_hidden_states = self.identity_expert(current_state)
            else:
                gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
                current_hidden_states = self.act_fn(gate) * up
                current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, selection_idx, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states


class LongcatFlashMoE(nn.Module):
    def __init__(self, zero_expert_num):
        super().__init__()
        self.experts = LongcatFlashExperts(zero_expert_num)
        self.router = LongcatFlashTopkRouter(zero_expert_num)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        return self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


_SRC = "huggingface/transformers v5.24 models/longcat_flash/modeling_longcat_flash.py LongcatFlashMoE"
CASES = [
    # the hit loop is traced over every choice; the identity bodies are the zero-computation experts' pass-through
    Case("longcat_flash_zero_experts", _SRC + " (3 zero-computation experts)", lambda: LongcatFlashMoE(3), _input,
         form="unrolled_loop"),
    Case("longcat_flash_routed_only", _SRC + " (zero_expert_num=0)", lambda: LongcatFlashMoE(0), _input,
         form="unrolled_loop"),
]
