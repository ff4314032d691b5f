"""transformers v4.55-4.57's GPT-OSS MoE block, run inside the v5 GPT-OSS model ``bench_hf.py`` builds (family
``gpt_oss_v4``): what every GPT-OSS user of those releases compiles.

The device has transformers v5, whose experts go through its experts interface. v4.55-4.57 spelled the block
differently, and the backend recognises that spelling by other passes (tests/corpus/hf_v4_gpt_oss.py):

- the router returns a dense (T, E) table, ``zeros_like(logits).scatter_(1, ids, softmax(topk values))``;
- in eval, every expert runs on every token: ``x.repeat(E, 1).view(E, -1, H)`` through ``bmm`` with the biases, the
  clamped glu on interleaved gate/up columns, scaled by the transposed table and summed over the experts
  (passes/dense_repeated.py rewrites it to k of E experts per token);
- in training, a loop over the hit experts, ``for e in hit[:]``, with ``torch.where`` of the expert's one-hot mask
  under ``no_grad`` and ``index_add_`` of each expert's rows (hit_loops.py and passes/unrolled_loop.py).

The v5 modules keep the same parameters (``router.weight``/``bias``, ``experts.gate_up_proj`` (E, H, 2I) and its
bias, ``down_proj`` (E, I, H) and its bias), so ``use_v4_moe_code`` only replaces each block's ``forward``.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _router_table(router, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(flat, router.weight, router.bias)
    top_values, top_ids = torch.topk(logits, router.top_k, dim=-1)
    top_values = F.softmax(top_values, dim=1, dtype=top_values.dtype)
    return torch.zeros_like(logits).scatter_(1, top_ids, top_values), top_ids


def _clamped_glu(experts, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=experts.limit)
    up = up.clamp(min=-experts.limit, max=experts.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))


def _experts(experts, hidden_states: torch.Tensor, router_indices: torch.Tensor,
             routing_weights: torch.Tensor) -> torch.Tensor:
    batch = hidden_states.shape[0]
    hidden = experts.gate_up_proj.shape[1]
    flat = hidden_states.reshape(-1, hidden)
    count = routing_weights.shape[1]
    if experts.training:
        result = torch.zeros_like(flat)
        with torch.no_grad():
            mask = F.one_hot(router_indices, num_classes=count).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit[:]:
            with torch.no_grad():
                _, tok = torch.where(mask[expert_idx[0]])
            gate_up = flat[tok] @ experts.gate_up_proj[expert_idx] + experts.gate_up_proj_bias[expert_idx]
            out = _clamped_glu(experts, gate_up) @ experts.down_proj[expert_idx] + experts.down_proj_bias[expert_idx]
            result.index_add_(0, tok, (out[0] * routing_weights[tok, expert_idx, None]).to(flat.dtype))
        return result.view(batch, -1, hidden)
    repeated = flat.repeat(count, 1).view(count, -1, hidden)
    gate_up = torch.bmm(repeated, experts.gate_up_proj) + experts.gate_up_proj_bias[..., None, :]
    out = torch.bmm(_clamped_glu(experts, gate_up), experts.down_proj) + experts.down_proj_bias[..., None, :]
    out = out.view(count, batch, -1, hidden)
    out = out * routing_weights.transpose(0, 1).view(count, batch, -1)[..., None]
    return out.sum(dim=0)


def _block_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v4.55's ``GptOssMLP.forward``: (the block's output, the dense router table)."""
    table, ids = _router_table(self.router, hidden_states.reshape(-1, hidden_states.shape[-1]))
    return _experts(self.experts, hidden_states, ids, table), table


def use_v4_moe_code(model: torch.nn.Module) -> int:
    """Replace every GPT-OSS MoE block's ``forward`` in ``model`` with v4.55's; returns how many were replaced
    (0 raises: the model has no block of the v5 layout this mirrors)."""
    replaced = 0
    for module in model.modules():
        if type(module).__name__ == "GptOssMLP":
            module.forward = types.MethodType(_block_forward, module)
            replaced += 1
    if not replaced:
        raise ValueError("use_v4_moe_code: the model has no GptOssMLP block")
    return replaced
