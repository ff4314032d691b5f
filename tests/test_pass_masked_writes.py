"""DeepSeek-V2/DeepSeek-MoE's training loop: the tokens repeated k times, ``buf[flat_ids == e] = expert(xr[flat_ids
== e])`` into ``torch.empty_like``, then ``(buf.view(T, k, H) * w.unsqueeze(-1)).sum(1)``, or the weight on each
expert's input (``xr[flat == e] * w.reshape(-1, 1)[flat == e]``) and a plain ``.sum(1)``. Rewritten and equal to
eager forward and backward; look-alikes (a skipped expert, ``repeat`` instead of ``repeat_interleave``, a mask of
other ids, ids that are not from topk, the weights of other rows) left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class MaskedWritesMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.gate = nn.Linear(H, E, bias=False)
        self.up = nn.ModuleList([nn.Linear(H, I, bias=False) for _ in range(E)])
        self.down = nn.ModuleList([nn.Linear(I, H, bias=False) for _ in range(E)])
        self.w_up = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        scores = self.gate(x).softmax(dim=-1)
        weights, ids = torch.topk(scores, K, dim=-1)
        if s == "ids_not_topk":  # may repeat an expert within a token: still every row written, but not proven
            ids = torch.argsort(scores, dim=-1)[:, -K:].contiguous()
        flat = ids.view(-1)
        other = torch.roll(flat, 1)
        xr = x.repeat(K, 1) if s == "repeat_not_interleave" else x.repeat_interleave(K, dim=0)
        buf = torch.empty_like(xr)
        experts = range(E - 1) if s == "skipped_expert" else range(E)  # expert E-1's rows stay garbage
        wf = weights.reshape(-1, 1)
        for e in experts:
            rows = xr[other == e] if s == "mask_of_other_ids" else xr[flat == e]
            if s in ("weight_on_input", "weight_of_other_mask"):  # the routing weight inside, the combine a sum
                rows = rows * (wf[other == e] if s == "weight_of_other_mask" else wf[flat == e])
            if s == "stacked":
                out = F.linear(F.gelu(F.linear(rows, self.w_up[e])), self.w_down[e])
            else:
                out = self.down[e](F.relu(self.up[e](rows)))
            buf[flat == e] = out
        if s == "skipped_expert":
            buf[flat == E - 1] = 0.0  # defined, so eager is deterministic; still not an MoE over all experts
        if s in ("weight_on_input", "weight_of_other_mask"):
            return buf.view(*weights.shape, -1).sum(dim=1)
        return (buf.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("style", ["per_expert", "stacked", "weight_on_input"])
def test_masked_writes_are_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = MaskedWritesMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


@pytest.mark.parametrize("style", ["skipped_expert", "repeat_not_interleave", "mask_of_other_ids", "ids_not_topk",
                                   "weight_of_other_mask"])  # rows of expert e scaled by the weights of other rows
def test_masked_write_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = MaskedWritesMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert sum(counters["moe_inductor_left_alone"].values()) >= 1  # explain() says something
    assert_close(out, model(x), torch.float32, style)
