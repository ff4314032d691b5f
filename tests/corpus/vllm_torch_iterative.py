"""vLLM's torch-native iterative MoE, mirrored from vllm-project/vllm
(``vllm/model_executor/layers/fused_moe/moe_torch_iterative.py``: ``fused_moe``), the reference its TPU/CPU paths
and kernel tests compare against.

Style: dense over experts, no selection. Softmax in fp32, top-k, optional renormalisation; ``for expert_idx in
range(num_experts)``: every token through ``F.linear`` with the fused (E, 2I, H) ``w1[expert_idx]``, the gate and
up halves by slicing (``x[:, :I]``, ``x[:, I:]``, up times ``silu(gate)``), ``F.linear`` with ``w2[expert_idx]``,
scaled by ``(topk_weights * (selected_experts == expert_idx)).sum(dim=-1, keepdim=True)`` and summed into
``final_hidden_states`` (``None`` first, then ``+``). Wrapped in a module that owns the weights and the router.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


def fused_moe(hidden_states, w1, w2, gating_output, topk, global_num_experts, renormalize=False):
    orig_shape = hidden_states.shape
    hidden_size = hidden_states.shape[-1]
    num_tokens = hidden_states.shape[:-1].numel()
    num_experts = w1.shape[0]
    intermediate_size = w2.shape[-1]
    dtype = hidden_states.dtype
    hidden_states = hidden_states.view(num_tokens, hidden_size)
    gating_output = gating_output.view(num_tokens, global_num_experts)
    topk_weights = gating_output.softmax(dim=-1, dtype=torch.float)
    topk_weights, selected_experts = topk_weights.topk(topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights.to(dtype)
    final_hidden_states = None
    for expert_idx in range(num_experts):
        expert_w1 = w1[expert_idx]
        expert_w2 = w2[expert_idx]
        expert_mask = selected_experts == expert_idx
        expert_weights = (topk_weights * expert_mask).sum(dim=-1, keepdim=True)
        x = F.linear(hidden_states, expert_w1)
        gate = F.silu(x[:, :intermediate_size])
        x = x[:, intermediate_size:] * gate
        x = F.linear(x, expert_w2)
        current_hidden_states = x * expert_weights
        if final_hidden_states is None:
            final_hidden_states = current_hidden_states
        else:
            final_hidden_states = final_hidden_states + current_hidden_states
    return final_hidden_states.view(orig_shape)


class TorchIterativeMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        return fused_moe(x, self.w1, self.w2, self.router(x), K, E, renormalize=True)


CASES = [Case("vllm_torch_iterative", "vllm-project/vllm vllm/model_executor/layers/fused_moe/moe_torch_iterative.py "
              "fused_moe", TorchIterativeMoE, lambda T, g: torch.randn(1, T, H, generator=g), form="dense_experts")]
