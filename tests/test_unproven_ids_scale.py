"""A top-1 loop scaled after it, ``out * p[:, None]``, whose ids are not provably in range(E) (``passes/unrolled_loop.py``).
A row of an out-of-range id is written by no expert: eager's ``0 * p`` there is NaN where p is not finite, and the
op's weighted result is 0. So the factor is the op's routing weight only where the ids are a router's over the
loop's E experts (argmax, max or topk(1) of (T, E) scores); elsewhere the op runs with weights of 1 and the user's
product stays in the graph, which gives eager's NaN. Both are rewritten; both equal eager forward and backward
where p is finite."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_rewritten_like_eager, compile_moe

H, I, E = 16, 24, 4


class ScaledLoop(nn.Module):
    """``out[tok, :] = expert(x[tok, :])`` per expert into zeros, then ``out * p.view(-1, 1)``. ``ids``: "max" (a
    router's, in range(E)), "shifted" (max's minus one: -1 comes up) or "last_skipped" (max's, the loop over the first
    E - 1 experts: the last one's rows are written by none). ``inf``: p is inf on every row."""

    def __init__(self, ids: str, inf: bool = False):
        super().__init__()
        self.ids, self.inf = ids, inf
        self.router = nn.Linear(H, E)
        self.fc1 = nn.ModuleList([nn.Linear(H, I) for _ in range(E)])
        self.fc2 = nn.ModuleList([nn.Linear(I, H) for _ in range(E)])

    def forward(self, x):
        p, ids = torch.max(F.softmax(self.router(x), dim=-1), dim=-1)
        if self.ids == "shifted":
            ids = ids - 1
        if self.inf:
            p = p * float("inf")
        out = x.new_zeros(x.shape)
        for e in range(E - 1 if self.ids == "last_skipped" else E):
            tok = torch.eq(ids, e).nonzero(as_tuple=True)[0]
            out[tok, :] = self.fc2[e](F.relu(self.fc1[e](x[tok, :])))
        return out * p.view(-1, 1)


def _note(model, x) -> str:
    (rewrite,) = moe_inductor.explain(model, x).rewrites
    return rewrite.note


@pytest.mark.parametrize("ids,folded", [
    ("max", True),  # every row has its expert: the factor is the op's weight
    ("shifted", False),  # rows of id -1: the user's product stays
    ("last_skipped", False),  # the last expert's rows: the op's E - 1 experts do not cover them
])
def test_the_factor_is_folded_only_under_ids_in_range(ids, folded):
    torch.manual_seed(0)
    model, x = ScaledLoop(ids), torch.randn(9, H)
    assert_rewritten_like_eager(model, x, "unrolled_loop", ids)
    assert ("the routing weight scaled the combined result" in _note(model, x)) is folded


@pytest.mark.parametrize("ids", ["shifted", "last_skipped"])
def test_a_row_of_no_expert_under_an_infinite_factor_is_nan_as_in_eager(ids):
    torch.manual_seed(0)
    model, x = ScaledLoop(ids, inf=True), torch.randn(9, H)
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1, dict(counters["moe_inductor"])
    unwritten = torch.isnan(ref).all(-1)
    assert unwritten.any(), "the case must have a row of no expert"
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out[~unwritten], ref[~unwritten])
