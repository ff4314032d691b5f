"""vLLM's torch-native iterative MoE: every expert on every token in a ``range(E)`` loop, each output scaled by
``(weights * (ids == e)).sum(-1, keepdim=True)`` and summed. Rewritten (with a shared expert added after, too),
equal to eager forward and backward; look-alikes (a skipped expert, an expert scaled by another's column, a soft
mixture, ids not from topk) left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class DenseLoopMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        s = self.style
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(K, dim=-1)
        if s == "ids_not_topk":
            ids = ids.clone()
        y = None
        for e in range(E - 1 if s == "skipped_expert" else E):
            p = F.linear(x, self.w1[e])
            out = F.linear(p[:, I:] * F.silu(p[:, :I]), self.w2[e])
            if s == "soft":  # every expert weighted by its softmax probability: nothing to skip
                col = probs[:, e:e + 1]
            else:
                col = (weights * (ids == ((e + 1) % E if s == "other_column" else e))).sum(dim=-1, keepdim=True)
            y = out * col if y is None else y + out * col
        return y + self.shared(x) if s == "with_shared" else y


@pytest.mark.parametrize("style", ["vllm", "with_shared"])
def test_dense_loop_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = DenseLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "dense_experts", f"{style} T={T}")
        assert not counters["moe_inductor_left_alone"], dict(counters["moe_inductor_left_alone"])


@pytest.mark.parametrize("style", ["skipped_expert", "other_column", "soft", "ids_not_topk"])
def test_dense_loop_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = DenseLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)
