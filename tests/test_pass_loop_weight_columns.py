"""The per-expert loop with each row's routing weight read as a column of ``weights[tok, pos]`` (``.unsqueeze(-1)``,
``[:, None]``, ``.view(-1, 1)``, possibly cast to the experts' dtype first: transformers v4's DeepSeek-V3 and many
hand-written loops), and an fp32 accumulator under half-precision experts (``zeros_like(x, dtype=weights.dtype)``).
Rewritten and equal to eager, forward and backward; look-alikes (another choice's weight, a cast that rounds the
weight to another dtype) left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 5, 2


class ColumnLoopMoE(nn.Module):
    def __init__(self, style: str, buffer_fp32: bool = False):
        super().__init__()
        self.style, self.buffer_fp32 = style, buffer_fp32
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        weights, ids = torch.topk(torch.softmax(self.router(x).float(), dim=-1), K, dim=-1)  # fp32 weights
        out = torch.zeros_like(x, dtype=weights.dtype) if self.buffer_fp32 else torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 0, 1)  # (E, T, k)
        for e in range(E):
            tok, pos = torch.where(mask[e])
            if tok.numel() > 0:
                chosen = weights[tok, (pos + 1) % K if s == "other_choice" else pos]
                if s == "unsqueeze":
                    w = chosen.unsqueeze(-1)
                elif s == "index_none":
                    w = chosen[:, None]
                elif s == "view":
                    w = chosen.view(-1, 1)
                elif s == "cast_to_experts":
                    w = chosen.to(x.dtype).unsqueeze(-1)
                elif s == "cast_to_bf16":  # rounds an fp32 model's weight to bf16: another function
                    w = chosen.to(torch.bfloat16).unsqueeze(-1)
                else:  # other_choice
                    w = chosen.unsqueeze(-1)
                xe = x[tok]
                y = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
                out.index_add_(0, tok, (y * w).to(out.dtype))
        return out.type(x.dtype)


@pytest.mark.parametrize("style", ["unsqueeze", "index_none", "view", "cast_to_experts"])
def test_weight_columns_are_read_as_the_routing_weight(style):
    torch.manual_seed(0)
    model = ColumnLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


def test_an_fp32_accumulator_under_bf16_experts_is_rewritten():
    """The fp32 buffer holds the bf16 experts' weighted outputs; the op's result is widened to it, and the loop's
    ``.type(x.dtype)`` brings it back, as eager does."""
    torch.manual_seed(0)
    model = ColumnLoopMoE("unsqueeze", buffer_fp32=True).bfloat16()
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H, dtype=torch.bfloat16), "unrolled_loop", f"T={T}")


@pytest.mark.parametrize("style", ["other_choice", "cast_to_bf16"])
def test_other_weights_are_left_alone(style):
    torch.manual_seed(0)
    model = ColumnLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)
