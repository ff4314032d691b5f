"""An independent, naive MoE in plain torch: the yardstick every op and pass is tested against.

It shares no code with the ops (no sort, no offsets): each expert takes its tokens through a boolean mask, and
capacity drops are found with the one-hot cumsum of GShard. Autograd through it gives the reference gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .activations import GPTOSS_ALPHA, GPTOSS_LIMIT, apply_activation


def capacity_keep_mask(topk_ids: Tensor, num_experts: int, capacity: int) -> Tensor:
    """(T, k) bool: kept assignments, first choices of all tokens before second choices, in token order."""
    T, k = topk_ids.shape
    one_hot = torch.nn.functional.one_hot(topk_ids.long(), num_experts)  # (T, k, E)
    keep = torch.zeros(T, k, dtype=torch.bool, device=topk_ids.device)
    used = torch.zeros(num_experts, dtype=torch.long, device=topk_ids.device)
    for j in range(k):
        slot = torch.cumsum(one_hot[:, j], 0) - 1 + used  # (T, E)
        keep[:, j] = (slot * one_hot[:, j]).sum(-1) < capacity
        used = used + one_hot[:, j].sum(0)
    return keep


def moe_reference(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w1_up: Optional[Tensor],
    w2: Tensor,
    b1: Optional[Tensor] = None,
    b1_up: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    activation: str = "silu_glu",
    weight_position: str = "output",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    capacity: Optional[int] = None,
) -> Tensor:
    """Same arguments as ``moe_inductor::experts_forward`` (logical (E, K, N) weights); differentiable."""
    T, H = x.shape
    E = w1.shape[0]
    keep = capacity_keep_mask(topk_ids, E, capacity) if capacity is not None else torch.ones_like(topk_ids, dtype=torch.bool)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        token, choice = torch.nonzero((topk_ids == e) & keep, as_tuple=True)
        if token.numel() == 0:
            continue
        w = topk_weights[token, choice].to(x.dtype)[:, None]
        inp = x[token] * w if weight_position == "input" else x[token]
        gate = inp @ w1[e] + (b1[e] if b1 is not None else 0)
        up = inp @ w1_up[e] + (b1_up[e] if b1_up is not None else 0) if w1_up is not None else None
        h = apply_activation(activation, gate, up, alpha, limit)
        if weight_position == "between":
            h = h * w
        out = h @ w2[e] + (b2[e] if b2 is not None else 0)
        if weight_position == "output":
            out = out * w
        y = y.index_add(0, token, out.float())
    return y.to(x.dtype)
