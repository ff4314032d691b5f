"""lucidrains-style grouped GShard capacity (per-group queues, a data-width ``safe_one_hot``): genuine variants are
rewritten (one op call per group) and equal to eager, drops included; look-alikes are not rewritten, equal to eager,
and where eager raises the compiled model raises the same error."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor.backend import moe_inductor_backend
from tests.corpus import lucidrains_moe as luc
from tests.helpers import rel_err

H, E = luc.H, luc.E


def _one_hot_sliced(idx, C):  # the corpus' safe_one_hot
    return F.one_hot(idx, max(idx.max() + 2, C))[..., :C]


def _one_hot_narrow(idx, C):  # idx.max() + 1 classes, sliced to C: narrower than C wherever no queue fills up
    return F.one_hot(idx, idx.max() + 1)[..., :C]


def _one_hot_below(idx, C):  # may be narrower than idx.max() + 1: eager raises where a position reaches C + 1
    return F.one_hot(idx, max(idx.max(), C))[..., :C]


def _one_hot_unsliced(idx, C):  # the data width kept: a (.., width) tensor no capacity proof reads
    return F.one_hot(idx, max(idx.max() + 2, C))[..., :C] + 0 * F.one_hot(idx, max(idx.max() + 2, C)).sum()


class Gate(nn.Module):
    """luc.Top2Gating with switches for the look-alikes."""

    def __init__(self, factor=1.25, one_hot=_one_hot_sliced, drop_shift=0, shared_queue=False, negative=False):
        super().__init__()
        self.w_gating = nn.Parameter(torch.randn(H, E) * H ** -0.5)
        self.factor, self.one_hot, self.drop_shift = factor, one_hot, drop_shift
        self.shared_queue, self.negative = shared_queue, negative

    def cumsum_exclusive(self, t):
        if self.shared_queue:  # one queue over the whole batch, not one per group
            b, n, e = t.shape
            return luc.cumsum_exclusive(t.reshape(1, b * n, e), dim=-2).reshape(b, n, e)
        return luc.cumsum_exclusive(t, dim=-2)

    def forward(self, x):
        b, n, _ = x.shape
        raw = torch.einsum("bnd,de->bne", x, self.w_gating).softmax(dim=-1)
        g1, i1 = luc.top1(raw)
        m1 = F.one_hot(i1, E).float()
        g2, i2 = luc.top1(raw * (1.0 - m1))
        m2 = F.one_hot(i2, E).float()
        denom = g1 + g2 + 1e-9
        g1, g2 = g1 / denom, g2 / denom
        C = max(min(n, int(n * self.factor / E)), 4)
        drop_at = float(C + self.drop_shift)
        p1 = self.cumsum_exclusive(m1) * m1
        m1 = m1 * (p1 < drop_at).float()
        count1 = m1.sum(dim=-2, keepdim=True)
        flat1 = m1.sum(dim=-1)
        p1 = p1.sum(dim=-1)
        p2 = (self.cumsum_exclusive(m2) + count1) * m2
        m2 = m2 * (p2 < drop_at).float()
        flat2 = m2.sum(dim=-1)
        p2 = p2.sum(dim=-1)
        s1, s2 = p1.long(), p2.long()
        if self.negative:
            s1 = s1 - 1
        combine = (g1[..., None, None] * flat1[..., None, None] * F.one_hot(i1, E)[..., None]
                   * self.one_hot(s1, C)[..., None, :]
                   + (g2 * flat2)[..., None, None] * F.one_hot(i2, E)[..., None] * self.one_hot(s2, C)[..., None, :])
        return combine.bool().to(combine), combine


class GroupedMoE(nn.Module):
    def __init__(self, **gate):
        super().__init__()
        self.gate = Gate(**gate)
        self.experts = luc.Experts()

    def forward(self, x):
        dispatch, combine = self.gate(x)
        xin = torch.einsum("bnd,bnec->ebcd", x, dispatch)
        out = self.experts(xin.reshape(E, -1, H)).reshape(xin.shape)
        return torch.einsum("ebcd,bnec->bnd", out, combine)


def _compile(model):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend=lambda gm, ex: moe_inductor_backend(gm, ex, options={"inner": "eager"}))


def _check_equal(model, shapes):
    compiled = _compile(model)
    for i, (b, n) in enumerate(shapes):
        x = torch.randn(b, n, H, generator=torch.Generator().manual_seed(i))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, ref = compiled(xa), model(xb)
        assert rel_err(got, ref) < 1e-4, (b, n)
        got.square().sum().backward()
        ga = [xa.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref.square().sum().backward()
        gb = [xb.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        for a, r in zip(ga, gb):
            assert rel_err(a, r) < 1e-4, (b, n)
    return dict(counters["moe_inductor"]), sum(counters["graph_break"].values())


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_capacity_rewritten_with_drops(groups):
    torch.manual_seed(0)
    model = GroupedMoE(factor=1.0)
    x = torch.randn(groups, 24, H, generator=torch.Generator().manual_seed(0))
    kept = (model.gate(x)[1] != 0).sum()
    assert kept < groups * 24 * 2, "the case must drop assignments"
    rewrites, breaks = _check_equal(model, [(groups, 24), (groups, 9), (groups, 17)])
    # two compiles (the static one, then one for every N), both rewritten: torch 2.11 gives the recompile's slot
    # slices sizes of their own, proven the capacity wide (grouped_capacity._cap_wide)
    assert rewrites == {"padded_capacity": 2}
    assert breaks == 0


@pytest.mark.parametrize("gate", [dict(one_hot=_one_hot_unsliced), dict(drop_shift=1), dict(shared_queue=True),
                                  dict(one_hot=_one_hot_narrow)],
                         ids=["unsliced-width", "other-drop-capacity", "queue-shared-across-groups",
                              "slots-maybe-narrower-than-C"])
def test_look_alikes_not_rewritten(gate):
    torch.manual_seed(0)
    model = GroupedMoE(factor=1.0, **gate)
    rewrites, _ = _check_equal(model, [(2, 24), (2, 9)])
    assert not rewrites, rewrites


@pytest.mark.parametrize("gate,message", [(dict(one_hot=_one_hot_below), "smaller than num_classes"),
                                          (dict(negative=True), "non-negative")])
def test_eager_errors_kept(gate, message):
    torch.manual_seed(0)
    model = GroupedMoE(**gate)
    x = torch.randn(2, 24, H, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=message):
        model(x)
    compiled = _compile(model)
    with pytest.raises(Exception, match=message):
        compiled(x)
    assert not counters["moe_inductor"]


class CastCombineMoE(GroupedMoE):
    """float32 gating in a bf16 model: the combine cast to x's dtype, the dispatch the support of that cast (or, with
    ``narrower``, of a float16 cast, which rounds gates under 6e-8 to zero where bf16 keeps them)."""

    def __init__(self, narrower=False):
        super().__init__(factor=1.0)
        self.narrower = narrower

    def forward(self, x):
        full = self.gate(x.float())[1]
        combine = full.to(x.dtype)
        dispatch = (full.half() if self.narrower else combine).bool().to(x.dtype)
        xin = torch.einsum("bnd,bnec->ebcd", x, dispatch)
        out = self.experts(xin.reshape(E, -1, H)).reshape(xin.shape)
        return torch.einsum("ebcd,bnec->bnd", out, combine)


@pytest.mark.parametrize("narrower", [False, True], ids=["cast-combine", "narrower-dispatch"])
def test_dispatch_of_the_cast_combine(narrower):
    torch.manual_seed(0)
    model = CastCombineMoE(narrower).to(torch.bfloat16)
    model.gate.float()
    compiled = _compile(model)
    for b, n in ((2, 24), (1, 9)):
        x = torch.randn(b, n, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(n))
        assert rel_err(compiled(x).float(), model(x).float()) < 2e-2
    rewrites = counters["moe_inductor"]["padded_capacity"]
    assert rewrites == (0 if narrower else 2)  # both compiles, the (1, 9) recompile's symbolic N too
    assert counters["moe_inductor_left_alone"] or not narrower  # seen, and said why
