"""A routing weight of exactly zero in the capacity forms that dispatch combine's support (``combine.bool()``,
``combine != 0``): eager leaves such a (token, choice) out of its slot, so the slot runs the expert on a zero row and
the weight's gradient there is ``dy . expert(0)`` (zero for bias-free experts, not for biased ones), while the
token's row gets none. Softmax underflow (fp16/bf16, or a hard -inf mask) makes such weights; a gate whose
derivative at the zero is not zero (here a learned offset after the softmax, initialised to zero) carries that
gradient into the parameters (without the fix, the offset's gradient differs from eager's in every test here).
Every form is compared with eager forward and backward at token counts that drop."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor.backend import moe_inductor_backend
from tests.corpus import lucidrains_moe as luc
from tests.helpers import rel_err

E, H, I = 4, 16, 8
#: logits pushed this far down underflow to an exact zero in the softmax, in fp32 as well
_FAR = -1e4


def _probs(logits: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities with every third token allowed one expert only (its others underflow to exactly
    0), plus a zero-initialised learned offset: the zeros stay zero and their gradients reach the offset."""
    t = torch.arange(logits.shape[-2], device=logits.device)[:, None]
    e = torch.arange(E, device=logits.device)
    banned = (t % 3 == 0) & (e != t % E)
    return F.softmax(logits + banned * _FAR, dim=-1) + offset


def _gshard_top2(probs: torch.Tensor, C: int) -> torch.Tensor:
    """GShard top-2 into a (T, E, C) combine; choice 2 queued behind every first choice."""
    idx1 = probs.argmax(-1)
    mask1 = F.one_hot(idx1, E)
    idx2 = probs.masked_fill(mask1.bool(), float("-inf")).argmax(-1)
    mask2 = F.one_hot(idx2, E)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    mask1 = mask1 * torch.lt(loc1, C)
    mask2 = mask2 * torch.lt(loc2, C)
    g1 = (probs * mask1).sum(dim=1)
    g2 = (probs * mask2).sum(dim=1)
    slot1 = F.one_hot(torch.sum(loc1 * mask1, dim=1), C)
    slot2 = F.one_hot(torch.sum(loc2 * mask2, dim=1), C)
    return (g1[:, None, None] * mask1[:, :, None] * slot1[:, None, :]
            + g2[:, None, None] * mask2[:, :, None] * slot2[:, None, :])


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class GShardMoE(nn.Module):
    """GShard top-2, dispatch ``combine.bool()`` (or ``!= 0``); experts stacked and bias-free (einsum silu-glu), or
    fairseq's biased nn.Linear MLP per ``chunk``."""

    def __init__(self, experts="stacked", dispatch="bool", capacity=3):
        super().__init__()
        self.experts_kind, self.dispatch, self.capacity = experts, dispatch, capacity
        self.router = nn.Linear(H, E, bias=False)
        self.offset = nn.Parameter(torch.zeros(E))
        if experts == "stacked":
            self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
            self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
            self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        else:
            self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        combine = _gshard_top2(_probs(self.router(x), self.offset), self.capacity)
        if self.dispatch == "bool":
            dispatch = combine.bool().to(x.dtype)
        elif self.dispatch == "ne":
            dispatch = (combine != 0).to(x.dtype)
        else:  # "gt": not the support where a gate is negative (a look-alike)
            dispatch = (combine > 0).to(x.dtype)
        xin = torch.einsum("tec,th->ech", dispatch, x)
        if self.experts_kind == "stacked":
            h = F.silu(torch.einsum("ech,eih->eci", xin, self.w1)) * torch.einsum("ech,eih->eci", xin, self.w3)
            out = torch.einsum("eci,ehi->ech", h, self.w2)
        else:
            out = torch.cat([ex(c) for ex, c in zip(self.experts, xin.chunk(E, dim=0))], dim=0)
        return torch.einsum("tec,ech->th", combine, out)


class StackedMoE(nn.Module):
    """nanoMoE's k choices stacked in one (k, T, E) mask, experts by bmm with (E, 1, N) biases."""

    def __init__(self, capacity=3):
        super().__init__()
        self.capacity = capacity
        self.router = nn.Linear(H, E, bias=False)
        self.offset = nn.Parameter(torch.zeros(E))
        self.c_fc = nn.Parameter(torch.randn(E, H, I) * 0.2)
        self.c_proj = nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.fc_bias = nn.Parameter(torch.randn(E, 1, I) * 0.1)
        self.proj_bias = nn.Parameter(torch.randn(E, 1, H) * 0.1)

    def forward(self, x):
        T, k, C = x.shape[0], 2, self.capacity
        probs = _probs(self.router(x), self.offset)
        ids = probs.topk(k, dim=-1).indices
        mask = F.one_hot(ids, E).view(T, k, E).permute(1, 0, 2)
        rank = (torch.cumsum(mask.reshape(k * T, E), dim=0) - 1).reshape(k, T, E)
        mask = mask * torch.lt(rank, C)
        rank = torch.sum(mask * rank, dim=-1)
        weights = mask * probs[None, :]
        combine = torch.sum(weights.unsqueeze(3) * F.one_hot(rank, C).unsqueeze(2), dim=0)
        xin = combine.bool().permute(1, 2, 0).type_as(x) @ x
        out = F.gelu(torch.bmm(xin, self.c_fc) + self.fc_bias)
        out = torch.bmm(out, self.c_proj) + self.proj_bias
        return combine.view(T, -1) @ out.view(-1, H)


class GroupedMoE(nn.Module):
    """lucidrains' grouped top-2 (per-group queues), bias-free GELU experts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Parameter(torch.randn(luc.H, luc.E) * luc.H ** -0.5)
        self.offset = nn.Parameter(torch.zeros(luc.E))
        self.experts = luc.Experts()

    def forward(self, x):
        b, n, _ = x.shape
        t = torch.arange(n, device=x.device)[:, None]
        banned = (t % 3 == 0) & (torch.arange(luc.E, device=x.device) != t % luc.E)
        raw = F.softmax(torch.einsum("bnd,de->bne", x, self.router) + banned * _FAR, dim=-1) + self.offset
        g1, i1 = luc.top1(raw)
        m1 = F.one_hot(i1, luc.E).float()
        g2, i2 = luc.top1(raw * (1.0 - m1))
        m2 = F.one_hot(i2, luc.E).float()
        C = max(min(n, int(n * 1.25 / luc.E)), 4)
        p1 = luc.cumsum_exclusive(m1, dim=-2) * m1
        m1 = m1 * (p1 < float(C)).float()
        count1 = m1.sum(dim=-2, keepdim=True)
        flat1, p1 = m1.sum(dim=-1), p1.sum(dim=-1)
        p2 = (luc.cumsum_exclusive(m2, dim=-2) + count1) * m2
        m2 = m2 * (p2 < float(C)).float()
        flat2, p2 = m2.sum(dim=-1), p2.sum(dim=-1)
        combine = (g1[..., None, None] * flat1[..., None, None] * F.one_hot(i1, luc.E)[..., None]
                   * luc.safe_one_hot(p1.long(), C)[..., None, :]
                   + g2[..., None, None] * flat2[..., None, None] * F.one_hot(i2, luc.E)[..., None]
                   * luc.safe_one_hot(p2.long(), C)[..., None, :])
        dispatch = combine.bool().to(combine)
        xin = torch.einsum("bnd,bnec->ebcd", x, dispatch)
        out = self.experts(xin.reshape(luc.E, -1, luc.H)).reshape(xin.shape)
        return torch.einsum("ebcd,bnec->bnd", out, combine)


def _grads(model, x, seed):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (y * probe).sum().backward()
    return y.detach(), {"x": x.grad, **{n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}}


def _compare(model, inputs):
    """Compiled beside eager on each input, forward and every gradient; returns the rewrite counters."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=lambda gm, ex: moe_inductor_backend(gm, ex, options={"inner": "eager"}))
    for i, x in enumerate(inputs):
        got, got_grads = _grads(compiled, x, i)
        ref, ref_grads = _grads(model, x, i)
        assert rel_err(got, ref) < 1e-5, f"input {i}: forward"
        for name, g in ref_grads.items():
            assert got_grads[name] is not None and rel_err(got_grads[name], g) < 1e-5, f"input {i}: gradient of {name}"
    return dict(counters["moe_inductor"]), dict(counters["moe_inductor_left_alone"])


def _tokens(*counts, batch=None):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(*(() if batch is None else (batch,)), T, H, generator=gen) for T in counts]


@pytest.mark.parametrize("experts,dispatch", [("stacked", "bool"), ("stacked", "ne"), ("linears", "bool"),
                                              ("linears", "ne")], ids=["stacked-bool", "stacked-ne",
                                                                       "biased-linears-bool", "biased-linears-ne"])
def test_gshard_zero_weights_match_eager(experts, dispatch):
    torch.manual_seed(0)
    model = GShardMoE(experts, dispatch)
    # capacity 3 of 4 experts: 13 tokens drop choices, and the zero-weight choices hold slots of their own
    rewrites, _ = _compare(model, _tokens(6, 13))
    assert rewrites == {"padded_capacity": counters["stats"]["unique_graphs"]}


def test_stacked_choices_zero_weights_match_eager():
    torch.manual_seed(0)
    rewrites, _ = _compare(StackedMoE(), _tokens(6, 13))
    assert rewrites == {"padded_capacity": counters["stats"]["unique_graphs"]}


def test_grouped_zero_weights_match_eager():
    torch.manual_seed(0)
    rewrites, _ = _compare(GroupedMoE(), _tokens(9, 14, batch=2))
    assert rewrites == {"padded_capacity": counters["stats"]["unique_graphs"]}


def test_greater_than_zero_dispatch_is_left_alone():
    """``combine > 0`` is the support only where no gate is negative, which nothing proves here (the offset is a
    free parameter): left alone, still eager's numbers."""
    torch.manual_seed(0)
    rewrites, left = _compare(GShardMoE("stacked", "gt"), _tokens(6, 13))
    assert not rewrites
    assert left.get("padded_capacity")
