"""The padded-capacity form (GShard / Switch / fairseq top-k gating with dispatch and combine tensors): matched in
top-1 and top-2 styles, the same drops and outputs as eager (fwd and bwd), look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_gpu_bf16_rewrite, assert_rewritten_like_eager, compile_moe

E, H, I = 5, 16, 8


class CapacityMoE(nn.Module):
    """Top-1 (Switch) or top-2 (GShard/fairseq) gating into (T, E, C) dispatch/combine tensors, experts on the
    padded (E, C, H) buffer."""

    def __init__(self, style="top1", capacity=3):
        super().__init__()
        self.style, self.capacity = style, capacity
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def gating(self, x):
        # capacity=None: computed from the token count, as GShard does (a symbolic size under dynamic shapes)
        C = self.capacity if self.capacity is not None else x.shape[0] * 2 // E + 1
        gates = F.softmax(self.router(x), dim=-1)
        idx1 = torch.argmax(gates, dim=-1)
        mask1 = F.one_hot(idx1, num_classes=E)
        if self.style.startswith("top1"):  # Switch Transformers' top-1
            loc1 = torch.cumsum(mask1, dim=0) - 1
            if self.style != "top1_no_drop":
                mask1 = mask1 * torch.lt(loc1, C)
            # the raw gate (not zeroed for dropped tokens): only the mask in combine drops them
            gate1 = gates.max(dim=-1).values if self.style == "top1_raw_gate" else (gates * mask1).sum(dim=1)
            if self.style == "top1_gate_mutated":  # combine is built, then its gate changes in place
                gate_b = gate1[:, None, None]
                combine = gate_b * mask1[:, :, None] * F.one_hot(torch.sum(loc1 * mask1, dim=1), C)[:, None, :]
                gate1.mul_(2.0)
                return combine
            loc1_s = torch.sum(loc1 * mask1, dim=1)
            return gate1[:, None, None] * mask1[:, :, None] * F.one_hot(loc1_s, num_classes=C)[:, None, :]
        # fairseq's top2gating: the second choice is the best expert other than the first
        logits_wo1 = gates.masked_fill(mask1.bool(), 0.0)
        idx2 = torch.argmax(logits_wo1, dim=-1)
        mask2 = F.one_hot(idx2, num_classes=E)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1
        if self.style != "top2_second_first":
            loc2 = loc2 + torch.sum(mask1, dim=0, keepdim=True)  # second choices queue behind all first choices
        mask1 = mask1 * torch.lt(loc1, C)
        mask2 = mask2 * torch.lt(loc2, C)
        loc1_s = torch.sum(loc1 * mask1, dim=1)
        loc2_s = torch.sum(loc2 * mask2, dim=1)
        g1 = (gates * mask1).sum(dim=1)
        g2 = (gates * mask2).sum(dim=1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        if self.style == "top2_fairseq":  # fairseq's spelling: gates folded into the masks, bmm outer products
            gates1 = g1.unsqueeze(-1) * mask1.to(g1.dtype)
            gates2 = g2.unsqueeze(-1) * mask2.to(g2.dtype)
            slot1 = F.one_hot(loc1_s, num_classes=C).float()
            slot2 = F.one_hot(loc2_s, num_classes=C).float()
            return (torch.bmm(gates1.unsqueeze(-1), slot1.to(gates1.dtype).unsqueeze(1))
                    + torch.bmm(gates2.unsqueeze(-1), slot2.to(gates2.dtype).unsqueeze(1)))
        slot1 = F.one_hot(loc1_s, num_classes=C).unsqueeze(1)
        slot2 = F.one_hot(loc2_s, num_classes=C).unsqueeze(1)
        return g1[:, None, None] * (mask1.unsqueeze(-1) * slot1) + (g2.view(-1, 1, 1) * mask2[:, :, None]) * slot2

    def forward(self, x):
        combine = self.gating(x)  # (T, E, C)
        if self.style == "top1_gt_dispatch":  # a dispatch that is not provably combine's support
            dispatch = (combine > 0.5).to(x.dtype)
        elif self.style == "top1_bool_kw":  # the support by keyword
            dispatch = combine.to(dtype=torch.bool).to(x.dtype)
        elif self.style == "top2_type_bool":
            dispatch = combine.type(torch.bool).type_as(x)
        else:
            dispatch = combine.bool().to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, x)  # (E, C, H), zero rows where a slot is empty
        h = F.silu(torch.einsum("ech,eih->eci", expert_in, self.w1)) * torch.einsum("ech,eih->eci", expert_in, self.w3)
        out = torch.einsum("eci,ehi->ech", h, self.w2)
        return torch.einsum("tec,ech->th", combine.to(x.dtype), out)


def _check(model, lengths, tol=1e-5):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in lengths:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        torch.testing.assert_close(compiled(x), model(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("style", ["top1", "top2", "top1_raw_gate", "top2_fairseq", "top1_bool_kw", "top2_type_bool"])
def test_padded_capacity_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = CapacityMoE(style)
    _check(model, lengths=(4, 11, 23, 30))  # capacity 3 of 5 experts: the longer ones drop tokens
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, "at most 2 compiles over 4 token counts"
    assert counters["moe_inductor"]["padded_capacity"] == graphs
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("style", ["top1", "top2"])
def test_padded_capacity_backward_matches_eager(style):
    torch.manual_seed(1)
    model = CapacityMoE(style)
    x = torch.randn(17, H, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    y = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *model.parameters()])
    ref = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    assert counters["moe_inductor"]["padded_capacity"] == 1
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("style", ["top1_gt_dispatch", "top1_no_drop", "top2_second_first", "top1_gate_mutated"])
def test_padded_capacity_look_alikes_are_left_alone(style):
    """A dispatch that is not combine's support, a slot one-hot over undropped positions, and second choices that do
    not queue behind the first ones: none is the op's drop rule, so none may be rewritten."""
    torch.manual_seed(0)
    model = CapacityMoE(style, capacity=4)
    for T in (6, 13):
        x = torch.randn(T, H)
        try:
            got = compile_moe(model, x)
        except Exception:  # eager raises too when a one-hot index reaches C (no drop): then so must compiled
            with pytest.raises(Exception):
                model(x)
            continue
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert counters["moe_inductor_left_alone"]["padded_capacity"] == 1  # explain() says a combine was left alone


def test_padded_capacity_bf16_matches_eager():
    torch.manual_seed(2)
    model = CapacityMoE("top2").to(torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    x = torch.randn(19, H, dtype=torch.bfloat16)
    got, ref = compiled(x).float(), model(x).float()
    assert counters["moe_inductor"]["padded_capacity"] == 1
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2


class CastCombineMoE(CapacityMoE):
    """float32 gating in a bf16 model, the combine cast to x's dtype before the dispatch is taken (GShard's
    ``combine.to(x.dtype)``, then ``combine.bool()``): the dispatch is the support of the combine the einsum reads.
    ``narrower`` takes the dispatch through float16 instead, which rounds gates under 6e-8 to zero where bf16 keeps
    them: a dispatch that is not the read combine's support."""

    def __init__(self, narrower=False):
        super().__init__("top2")
        self.narrower = narrower

    def forward(self, x):
        full = self.gating(x.float())  # the router is float32
        combine = full.to(x.dtype)
        dispatch = (full.half() if self.narrower else combine).bool().to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, x)
        h = F.silu(torch.einsum("ech,eih->eci", expert_in, self.w1)) * torch.einsum("ech,eih->eci", expert_in, self.w3)
        return torch.einsum("tec,ech->th", combine, torch.einsum("eci,ehi->ech", h, self.w2))


def test_dispatch_of_the_cast_combine_is_rewritten():
    """bench_fx_forms.py's GShard layer on the GPU: bf16 experts, float32 gates, the dispatch taken from the cast."""
    torch.manual_seed(3)
    model = CastCombineMoE().to(torch.bfloat16)
    model.router.float()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (7, 19):
        x = torch.randn(T, H, dtype=torch.bfloat16)
        got, ref = compiled(x).float(), model(x).float()
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    assert counters["moe_inductor"]["padded_capacity"] >= 1
    assert not counters["moe_inductor_left_alone"]


def test_dispatch_through_a_narrower_cast_is_left_alone():
    torch.manual_seed(3)
    model = CastCombineMoE(narrower=True).to(torch.bfloat16)
    model.router.float()
    x = torch.randn(19, H, dtype=torch.bfloat16)
    torch.testing.assert_close(compile_moe(model, x), model(x))
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert counters["moe_inductor_left_alone"]["padded_capacity"] == 1


@pytest.mark.slow
def test_capacity_computed_from_the_token_count():
    """C = 2T // E + 1: one_hot specialises on C (under any backend), so every new C is a new graph; each one is
    still rewritten, with the same drops, and the graph count is the one backend="eager" gets."""
    torch.manual_seed(3)
    model = CapacityMoE("top2", capacity=None)
    lengths = (6, 11, 17, 23)

    def graphs(backend, **kw):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=backend, **kw)
        for T in lengths:
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        return counters["stats"]["unique_graphs"], counters["moe_inductor"]["padded_capacity"]

    plain, _ = graphs("eager")
    ours, rewritten = graphs("moe_inductor", options={"inner": "eager"})
    assert ours == plain
    assert rewritten == ours


def _scatter_one_hot(i, n):
    """fairseq's one_hot: a zeros buffer filled by one scatter_."""
    out = torch.zeros(i.shape[0], n, dtype=torch.long, device=i.device)
    out.scatter_(1, i.unsqueeze(-1), 1)
    return out


class _FFN(nn.Module):
    def __init__(self, bias, act, drop=None):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(H, I, bias=bias), nn.Linear(I, H, bias=bias), act
        self.drop = nn.Dropout(drop) if drop is not None else nn.Identity()  # between the projections

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class ChunkedExpertsMoE(nn.Module):
    """fairseq's top-2 (scatter one-hots, ``+=`` and ``/=``, bmm terms, mm dispatch and combine, relu experts with
    biases) or DeepSpeed's top-1 (``*=`` drop, ``einsum("se,sc->sec", gates * mask, slots)``, gelu experts), one
    nn.Linear MLP per expert on ``chunk(E, dim=1)`` of the slots. ``variant`` changes one thing: "first_behind_second"
    (its priority is second choices first) and "expert_dropout" (nn.Dropout(0.0) between each expert's projections)
    are still an MoE; every other variant makes a look-alike ("expert_dropout_p": nn.Dropout(0.1) there)."""

    def __init__(self, style, variant=None, capacity=3):
        super().__init__()
        self.style, self.variant, self.capacity, self.E = style, variant, capacity, 4
        self.wg = nn.Linear(H, self.E, bias=False)
        bias, act = (True, F.relu) if style == "fairseq" else (False, F.gelu)
        drop = {"expert_dropout": 0.0, "expert_dropout_p": 0.1}.get(variant)
        self.experts = nn.ModuleList([_FFN(bias, act, drop) for _ in range(self.E)])

    def gating(self, x):
        C, E, variant = self.capacity, self.E, self.variant
        logits = self.wg(x)
        gates = F.softmax(logits, dim=1)
        if self.style == "deepspeed":
            mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=E)
            loc1 = torch.cumsum(mask1, dim=0) - 1
            mask1 *= torch.lt(loc1, C)
            slots = F.one_hot(torch.sum(loc1 * mask1, dim=1), num_classes=C).float()
            g = gates if variant == "no_mask" else gates * mask1.float()  # no_mask: every expert, no drop
            return torch.einsum("se,sc->sec", g, slots)
        mask1 = _scatter_one_hot(torch.argmax(gates, dim=1), E)
        mask2 = _scatter_one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1), E)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1
        if variant == "first_behind_second":  # second choices first: the op takes the ids in that order
            loc1 += torch.sum(mask2, dim=0, keepdim=True)
        elif variant == "token_major":  # t0's choices, then t1's, ...: an order the op's choice-major one is not
            loc = (torch.cumsum(torch.stack([mask1, mask2], dim=1).reshape(-1, E), dim=0) - 1).reshape(-1, 2, E)
            loc1, loc2 = loc[:, 0], loc[:, 1]
        else:
            loc2 += torch.sum(mask1, dim=0, keepdim=True)
        mask1 = mask1 * torch.lt(loc1, C)
        mask2 = mask2 * torch.lt(loc2, C)
        g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        g1 /= denom
        g2 /= denom
        width = C + 1 if variant == "capacity_mismatch" else C  # slots one wider than the drop's capacity
        s1 = _scatter_one_hot(torch.sum(loc1 * mask1, dim=1), width)
        s2 = _scatter_one_hot(torch.sum(loc2 * mask2, dim=1), width)
        c1 = torch.bmm((g1[:, None] * mask1.to(g1.dtype)).unsqueeze(-1), s1.to(g1.dtype).unsqueeze(1))
        c2 = torch.bmm((g2[:, None] * mask2.to(g2.dtype)).unsqueeze(-1), s2.to(g2.dtype).unsqueeze(1))
        if variant == "gate_scaled_after":  # the combine has read g1; the op would read it later, doubled
            g1 *= 2.0
        return c1 + c2

    def forward(self, x):
        E, T = self.E, x.shape[0]
        combine = self.gating(x)
        dispatch = combine.bool().to(x.dtype)
        if self.variant == "slots_moved":  # each token dispatched one slot further than the combine reads it
            dispatch = dispatch.roll(1, dims=2)
        if self.style == "fairseq":
            d = dispatch.permute(1, 2, 0)
            e, c, s = d.size()
            xin = torch.mm(d.view(e * c, s), x).reshape(1, E, -1, H)
        else:
            xin = torch.einsum("sec,sm->ecm", dispatch, x).reshape(1, E, -1, H)
        chunks = xin.chunk(E, dim=1)
        order = [1, 0, 2, 3] if self.variant == "chunks_swapped" else range(E)  # expert 0 on expert 1's slots
        out = torch.cat([self.experts[e](chunks[j]) for e, j in zip(range(E), order)], dim=1).reshape(E, -1, H)
        if self.style == "fairseq":
            return combine.view(T, -1).mm(out.view(-1, H))
        return torch.einsum("sec,ecm->sm", combine.type_as(x), out)


@pytest.mark.parametrize("style, variant", [("fairseq", None), ("fairseq", "first_behind_second"),
                                            ("deepspeed", None)])
def test_fairseq_and_deepspeed_gates_are_rewritten_with_their_drops(style, variant):
    """Capacity 3 of 4 experts at T=13: every style drops tokens, in the order its source computes (fairseq's
    second choices behind every first one, or the first choices behind the second ones); forward and every
    gradient equal eager's."""
    torch.manual_seed(4)
    model = ChunkedExpertsMoE(style, variant)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (13,):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        got, ref = [], []
        for module, into in ((compiled, got), (model, ref)):
            xi = x.clone().requires_grad_(True)
            y = module(xi)
            into += [y, *torch.autograd.grad(y.square().sum(), [xi, *model.parameters()])]
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2
    assert counters["moe_inductor"]["padded_capacity"] == graphs
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("style, variant", [
    ("fairseq", "token_major"), ("fairseq", "capacity_mismatch"), ("fairseq", "gate_scaled_after"),
    ("fairseq", "slots_moved"), ("fairseq", "chunks_swapped"), ("deepspeed", "no_mask")])
def test_fairseq_and_deepspeed_look_alikes_are_left_alone(style, variant):
    """One look-alike per spelling these gates add: queue positions in token-major order, slots wider than the
    drop's capacity (a scatter one-hot), a gate changed in place after the combine read it (``*=``), an mm dispatch
    into other slots, an expert on another expert's chunk, and (T, E) gates with no dropped mask."""
    torch.manual_seed(4)
    model = ChunkedExpertsMoE(style, variant)
    x = torch.randn(13, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert counters["moe_inductor_left_alone"]["padded_capacity"] == 1


@pytest.mark.gpu
def test_gpu_kernels_run_the_rewritten_capacity_bf16():
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(CapacityMoE("top2"), "padded_capacity")


class BiasedSlotsMoE(nn.Module):
    """Switch top-1 into (T, E, C) tensors, experts by ``torch.bmm`` on stacked (E, in, out) weights with
    per-expert biases broadcast over the slots, and dropouts: nanoMoE's MLPExperts and GShard-style stacked experts.
    The router's bias keeps the last expert from every token (all its slots stay empty, so only its biases reach
    its output), and capacity 3 drops tokens of the others.

    ``bias``: "e_i" ((E, I) and (E, H) biases as ``b[:, None, :]`` and ``b.unsqueeze(1)``), "e1i_inplace" ((E, 1, N)
    parameters added by ``+=``), "gated" (silu glu, gate and up biases), or the look-alikes "eci" (a bias per
    slot), "gate_only" (a gated expert with a bias on the gate projection only), "shared" (one (I,) bias for every
    expert, not read as a per-expert one); None: no biases. ``drop``: (where, p) with where "after" the experts or
    "between" the projections, an ``nn.Dropout(p)`` there (it drops only in training)."""

    def __init__(self, bias="e_i", drop=None, capacity=3):
        super().__init__()
        self.bias, self.capacity = bias, capacity
        self.router = nn.Linear(H, E)
        with torch.no_grad():
            self.router.bias[-1] = -1e4
        gated = bias in ("gated", "gate_only")
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5) if gated else None
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        first, second = {"e1i_inplace": ((E, 1, I), (E, 1, H)), "eci": ((E, capacity, I), (E, capacity, H)),
                         "shared": ((I,), (H,))}.get(bias, ((E, I), (E, H)))
        self.b1 = nn.Parameter(torch.randn(first) * 0.5) if bias else None
        self.b3 = nn.Parameter(torch.randn(first) * 0.5) if bias == "gated" else None
        self.b2 = nn.Parameter(torch.randn(second) * 0.5) if bias else None
        self.where = drop[0] if drop else None
        self.drop = nn.Dropout(drop[1]) if drop else None

    def routing(self, x):
        C = self.capacity
        gates = F.softmax(self.router(x), dim=-1)
        mask = F.one_hot(torch.argmax(gates, dim=-1), num_classes=E)
        loc = torch.cumsum(mask, dim=0) - 1
        mask = mask * torch.lt(loc, C)
        gate = (gates * mask).sum(dim=1)
        return gate[:, None, None] * mask[:, :, None] * F.one_hot(torch.sum(loc * mask, dim=1), C)[:, None, :]

    def _bias(self, b):
        if self.bias in ("e_i", "gated", "gate_only"):
            return b[:, None, :] if b is self.b1 else b.unsqueeze(1)
        return b

    def project(self, xin, w, b):
        h = torch.bmm(xin, w)
        if b is None:
            return h
        if self.bias == "e1i_inplace":
            h += b
            return h
        return h + self._bias(b)

    def forward(self, x):
        combine = self.routing(x)
        xin = torch.einsum("tec,th->ech", combine.bool().to(x.dtype), x)
        h = self.project(xin, self.w1, self.b1)
        h = F.silu(h) * self.project(xin, self.w3, self.b3) if self.w3 is not None else F.gelu(h)
        if self.where == "between":
            h = self.drop(h)
        out = self.project(h, self.w2, self.b2)
        if self.where == "after":
            out = self.drop(out)
        return torch.einsum("tec,ech->th", combine, out)


def _left_alone_reason(model, x) -> str:
    """The one region explain() reports for ``model``: nothing rewritten, a padded_capacity region left alone; its
    reason. Dynamo is reset first: a recompile of the same code with another dropout p would take p as an input
    (automatic dynamic floats), no longer the literal a test asks about."""
    import moe_inductor

    torch._dynamo.reset()
    report = moe_inductor.explain(model, x)
    (left,) = report.left_alone
    assert not report.rewrites and left.form == "padded_capacity", report
    return left.reason


def _drops_and_starves(model, x) -> None:
    """The input routes more than C tokens to some expert (drops) and none to the last one (empty slots)."""
    counts = torch.bincount(model.router(x).argmax(-1), minlength=E)
    assert counts.max() > model.capacity and counts[-1] == 0, counts


@pytest.mark.parametrize("bias", ["e_i", "e1i_inplace", "gated"])
def test_stacked_biases_are_rewritten_with_drops_and_an_empty_expert(bias):
    """Per-expert biases on bmm experts: the op gets them as (E, N) views; forward and every gradient (the biases'
    included: an empty slot's biased output meets a zero combine weight) equal eager's."""
    torch.manual_seed(5)
    model = BiasedSlotsMoE(bias)
    x = torch.randn(23, H)
    _drops_and_starves(model, x)
    assert_rewritten_like_eager(model, x, "padded_capacity", bias)
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("bias, reason", [
    ("eci", "varies per slot (E, C, N)"),
    ("gate_only", "one of the gate and up projections has a bias and the other has none"),
    ("shared", "not a per-expert bias")])
def test_bias_look_alikes_are_left_alone(bias, reason):
    """A bias per slot is not a per-expert bias (the op has no slots); a gate bias without an up bias is not the
    op's gated layer; a bias shared by the experts is not read. Each is left alone, and explain() says why."""
    torch.manual_seed(5)
    model = BiasedSlotsMoE(bias)
    x = torch.randn(23, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert reason in _left_alone_reason(model, x)


@pytest.mark.parametrize("drop, train", [(("after", 0.0), True), (("between", 0.0), True), (("between", 0.1), False)])
def test_identity_dropouts_are_read_through(drop, train):
    """``nn.Dropout(0.0)`` after the experts or between the projections (in the graph as ``F.dropout(t, 0.0, True,
    False)``), and a dropout of p=0.1 in eval mode, are the identity: the region is rewritten, equal to eager."""
    torch.manual_seed(5)
    model = BiasedSlotsMoE("e_i", drop).train(train)
    x = torch.randn(23, H)
    _drops_and_starves(model, x)
    assert_rewritten_like_eager(model, x, "padded_capacity", str(drop))


@pytest.mark.parametrize("where", ["after", "between"])
def test_a_dropout_in_training_is_left_alone(where):
    """p=0.1 in training draws a random mask over the padded slots, which the op does not: left alone, with that
    reason."""
    torch.manual_seed(5)
    model = BiasedSlotsMoE("e_i", (where, 0.1))
    assert "a dropout with p=0.1 in training" in _left_alone_reason(model, torch.randn(23, H))


def test_per_expert_modules_read_through_an_identity_dropout():
    """fairseq-style experts (one nn.Linear MLP per chunk) with nn.Dropout(0.0) between their projections."""
    torch.manual_seed(4)
    model = ChunkedExpertsMoE("fairseq", "expert_dropout")
    assert_rewritten_like_eager(model, torch.randn(13, H), "padded_capacity", "expert_dropout")


def test_per_expert_modules_with_a_dropout_in_training_are_left_alone():
    torch.manual_seed(4)
    model = ChunkedExpertsMoE("fairseq", "expert_dropout_p")
    assert "a dropout with p=0.1 in training" in _left_alone_reason(model, torch.randn(13, H))


class StackedChoicesMoE(nn.Module):
    """nanoMoE's Router and MOELayer in small: top-2 ids one-hot into a (k, T, E) stack, one cumsum over its
    (k*T, E) rows (choice-major queues), ``*=`` drop, slots one-hot, ``sum(dim=0)`` of the stacked outer products;
    dispatch by ``mask.permute(1, 2, 0).type_as(x) @ x``, biased bmm experts, ``nn.Dropout(0.0)``, mm combine.
    Input (B, S, H). The router's bias keeps the last expert from every token; capacity 3 drops.

    ``variant``: "einsum" (the stack summed by ``einsum("kte,ktc->tec")``, dispatch by einsum, (T, H) input), or
    the look-alikes "token_major" (the queues numbered over the (T, k, E) mask's rows: a token's choices before the
    next token's) and "swap_ec" (the dispatch permuted to (C, E, T), with C == E so that it runs)."""

    def __init__(self, variant=None):
        super().__init__()
        self.variant, self.k = variant, 2
        self.capacity = E if variant == "swap_ec" else 3
        self.router = nn.Linear(H, E)
        with torch.no_grad():
            self.router.bias[-1] = -1e4
        self.c_fc = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.c_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.fc_bias = nn.Parameter(torch.randn(E, 1, I) * 0.5)
        self.proj_bias = nn.Parameter(torch.randn(E, 1, H) * 0.5)
        self.dropout = nn.Dropout(0.0)

    def routing(self, x):
        T, k, C = x.shape[0], self.k, self.capacity
        logits = self.router(x)
        top_logits, ids = logits.topk(k, dim=-1)
        probs = torch.full_like(logits, float("-inf"))
        probs.scatter_(-1, ids, top_logits)  # written in place before the softmax that the op's weights come from
        probs = F.softmax(probs, dim=-1)
        mask = F.one_hot(ids, num_classes=E)  # (T, k, E)
        if self.variant == "token_major":
            rank = (torch.cumsum(mask.reshape(T * k, E), dim=0) - 1).reshape(T, k, E).permute(1, 0, 2)
            mask = mask.permute(1, 0, 2)
        else:
            mask = mask.view(T, k, E).permute(1, 0, 2)
            rank = (torch.cumsum(mask.reshape(k * T, E), dim=0) - 1).reshape(k, T, E)
        mask *= torch.lt(rank, C)
        slots = F.one_hot(torch.sum(mask * rank, dim=-1), num_classes=C)  # (k, T, C)
        weights = mask * probs.view(T, E)[None, :]
        if self.variant == "einsum":
            return torch.einsum("kte,ktc->tec", weights, slots.to(weights.dtype))
        return torch.sum(weights.unsqueeze(3) * slots.unsqueeze(2), dim=0)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        combine = self.routing(x)
        if self.variant == "einsum":
            xin = torch.einsum("tec,th->ech", combine.bool().to(x.dtype), x)
        else:
            dims = (2, 1, 0) if self.variant == "swap_ec" else (1, 2, 0)
            xin = combine.bool().permute(*dims).type_as(x) @ x
        h = torch.bmm(xin, self.c_fc)
        h += self.fc_bias
        out = torch.bmm(F.gelu(h), self.c_proj)
        out += self.proj_bias
        out = self.dropout(out)
        return (combine.view(x.shape[0], -1) @ out.view(-1, H)).view(shape)


@pytest.mark.parametrize("variant", [None, "einsum"])
def test_stacked_choices_are_rewritten_with_drops_and_an_empty_expert(variant):
    """nanoMoE's gating: the stacked (k, T, E) queue is the op's choice-major one; forward and every gradient equal
    eager's at a length that drops assignments, with one expert that gets none."""
    torch.manual_seed(6)
    model = StackedChoicesMoE(variant)
    x = torch.randn(2, 9, H) if variant is None else torch.randn(18, H)
    counts = torch.bincount(model.router(x.reshape(-1, H)).topk(2, dim=-1).indices.reshape(-1), minlength=E)
    assert counts.max() > model.capacity and counts[-1] == 0, counts
    assert_rewritten_like_eager(model, x, "padded_capacity", str(variant))
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("variant, reason", [
    ("token_major", "token-major order"),
    ("swap_ec", "its slots are not filled by a dispatch of combine's support")])
def test_stacked_choices_look_alikes_are_left_alone(variant, reason):
    """Queues numbered token-major drop other assignments than the op; a dispatch permuted to (C, E, T) fills
    slot (c, e) with what the combine reads at (e, c). Both left alone, equal to eager, with their reasons."""
    torch.manual_seed(6)
    model = StackedChoicesMoE(variant)
    x = torch.randn(2, 9, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["padded_capacity"] == 0
    assert reason in _left_alone_reason(model, x)
