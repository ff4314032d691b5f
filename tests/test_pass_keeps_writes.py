"""A rewrite removes what only its region used, never the user's own in-place writes elsewhere in the graph.

FX's dead-code removal takes every ``call_method`` as pure, and Dynamo records ``buf.add_(c)`` or
``mask.scatter_(1, i, 1)`` as call_method nodes nobody reads (later reads point at ``buf``/``mask``). Removing
them after a rewrite dropped a module's buffer update (torchtitan's token counts) and DeepSeek-V2's group mask
(every score then masked to 0: wrong routing). Both are kept now."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, compile_moe

H, I, E, K, GROUPS = 16, 8, 8, 2, 4


class WritesMoE(nn.Module):
    """gpt-fast's gathered experts behind a DeepSeek-V2-style group-limited router, counting tokens per expert."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.register_buffer("tokens_per_expert", torch.zeros(E))

    def forward(self, x):
        scores = self.gate(x).softmax(dim=-1)
        group_scores = scores.view(x.shape[0], GROUPS, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=2, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)  # an unread in-place write that the next line depends on
        score_mask = group_mask.unsqueeze(-1).expand(-1, GROUPS, E // GROUPS).reshape(x.shape[0], -1)
        weights, ids = torch.topk(scores.masked_fill(~score_mask.bool(), 0.0), K, dim=-1)
        with torch.no_grad():
            self.tokens_per_expert.add_(torch.histc(ids.view(-1).float(), bins=E, min=0, max=E))  # module state
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        out = torch.einsum("tao,taio->tai", h, self.w2[ids])
        return torch.einsum("tai,ta->ti", out, weights)


def test_rewrite_keeps_the_users_in_place_writes():
    torch.manual_seed(0)
    model, ref_model = WritesMoE(), WritesMoE()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert counters["moe_inductor"]["gathered_weights"] == 1
    assert_close(out, ref_model(x), torch.float32, "forward")
    assert torch.equal(model.tokens_per_expert, ref_model.tokens_per_expert)


class ChangedThroughAView(nn.Module):
    """An expert loop whose tokens change between two experts' reads, through a view the loop never names
    (``xv += 1``, ``torch.relu_(xv)``, ``xv.mul_(2)``, ``torch.mul(xv, 2, out=xv)``, and ``x.float().add_(1)`` on
    float32 tokens, a cast that returns x itself): experts after the first see the changed tokens, so no single
    experts call reads what the loop read."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False)) for _ in range(E))

    def forward(self, x):
        x = x.clone()
        xv = x.view(-1)
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, pos, None])
            if e == 0:
                if self.how == "iadd":
                    xv += 1.0
                elif self.how == "relu_":
                    torch.relu_(xv)
                elif self.how == "out":
                    torch.mul(xv, 2.0, out=xv)
                elif self.how == "cast":  # float32 already: .float() returns x itself
                    x.float().add_(1.0)
                else:
                    xv.mul_(2.0)
        return out


@pytest.mark.parametrize("how", ["iadd", "relu_", "out", "mul_", "cast"])
def test_tokens_changed_through_a_view_between_experts_are_not_rewritten(how):
    torch.manual_seed(0)
    model = ChangedThroughAView(how)
    x = torch.randn(9, H)
    assert_close(compile_moe(model, x), model(x), torch.float32, "forward")
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


class MaskChangedBetweenExperts(nn.Module):
    """transformers v4's one-hot expert mask, changed in place between two experts' reads (``mask[e + 1].zero_()``,
    ``mask[e + 1] = 0``): the next expert's rows are read from the changed mask, while the ids it was made from, all
    the op would read, are unchanged."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        out = torch.zeros_like(x)
        for e in range(E):
            pos, tok = torch.where(mask[e])
            h = F.linear(F.silu(F.linear(x[tok], self.w1[e])), self.w2[e])
            out.index_add_(0, tok, h * weights[tok, pos, None])
            if e + 1 < E:
                if self.how == "zero_":
                    mask[e + 1].zero_()
                else:
                    mask[e + 1] = 0
        return out


@pytest.mark.parametrize("how", ["zero_", "setitem"])
def test_a_mask_changed_between_experts_is_not_rewritten(how):
    """The region reads the mask on both sides of the write (moe_inductor/passes/stale_reads.py)."""
    torch.manual_seed(0)
    model = MaskChangedBetweenExperts(how)
    x = torch.randn(9, H)
    with torch.no_grad():
        assert_close(compile_moe(model, x), model(x), torch.float32, "forward")
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"]["unrolled_loop"] >= 1, dict(counters["moe_inductor_left_alone"])
