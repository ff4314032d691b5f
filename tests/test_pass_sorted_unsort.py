"""torchtitan's unsort after sort + torch._grouped_mm: ``buf[order] = ys`` into zeros of (T*k, H), then
``buf.view(T, k, H).sum(1)`` (score on the input) or ``bmm(scores (T, 1, k), buf)`` (score on the output). bf16, as
_grouped_mm takes; equal to eager within bf16 rounding (forward and backward); look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

E, H, I, K = 4, 32, 16, 2
pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")


class UnsortMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)  # fused gate/up, split by chunk
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        top, ids = torch.topk(torch.sigmoid(self.router(x).float()), K, dim=1)
        counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E)
        order = torch.argsort(ids.view(-1), stable=True)
        scores = top.view(-1)[order]
        xs = x[order // K]
        if s in ("score_before", "score_twice"):
            xs = (xs.to(torch.float32) * scores.reshape(-1, 1)).to(x.dtype)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        g, u = torch._grouped_mm(xs.bfloat16(), self.w13.bfloat16().transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(g) * u, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)
        buf = torch.zeros((x.shape[0] * K, H), dtype=ys.dtype, device=ys.device)
        if s == "unsort_other_order":  # written back by another order than the one that sorted the rows
            buf[torch.flip(order, [0])] = ys
        else:
            buf[order] = ys
        if s == "buffer_read_twice":  # the (T*k, H) buffer is also returned: its rows are not the op's
            return buf.reshape(-1, K, H).sum(dim=1) + buf[: x.shape[0]]
        if s == "choice_major_rows":  # rows grouped (k, T): the sum adds other tokens' outputs
            return buf.reshape(K, -1, H).sum(dim=0)
        buf = buf.reshape(-1, K, H)
        if s in ("score_after", "score_twice"):
            return torch.bmm(top.reshape(-1, 1, K), buf.float()).to(x.dtype).squeeze(1)
        return buf.sum(dim=1)  # score_before, or "unweighted"


@pytest.mark.parametrize("style", ["score_before", "score_after"])
def test_unsort_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = UnsortMoE(style).bfloat16()
    for T in (5, 12):
        assert_rewritten_like_eager(model, torch.randn(T, H, dtype=torch.bfloat16), "sorted_grouped_mm",
                                    f"{style} T={T}")


@pytest.mark.parametrize("style", ["score_twice", "unweighted", "unsort_other_order", "buffer_read_twice",
                                   "choice_major_rows"])
def test_unsort_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = UnsortMoE(style).bfloat16()
    x = torch.randn(9, H, dtype=torch.bfloat16)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"]["sorted_grouped_mm"] == 1  # explain() and the log say so
    assert_close(out, model(x), torch.bfloat16, style)
