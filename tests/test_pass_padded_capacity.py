"""The padded-capacity form (GShard / Switch / fairseq top-k gating with dispatch and combine tensors): matched in
top-1 and top-2 styles, the same drops and outputs as eager (fwd and bwd), look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_gpu_bf16_rewrite, compile_moe

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


@pytest.mark.parametrize("style", ["top1", "top2", "top1_raw_gate", "top2_fairseq"])
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
    def __init__(self, bias, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(H, I, bias=bias), nn.Linear(I, H, bias=bias), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ChunkedExpertsMoE(nn.Module):
    """fairseq's top-2 (scatter one-hots, ``+=`` and ``/=``, bmm terms, mm dispatch and combine, relu experts with
    biases) or DeepSpeed's top-1 (``*=`` drop, ``einsum("se,sc->sec", gates * mask, slots)``, gelu experts), one
    nn.Linear MLP per expert on ``chunk(E, dim=1)`` of the slots. ``variant`` changes one thing: "first_behind_second"
    is still an MoE (its priority is second choices first); every other variant makes a look-alike."""

    def __init__(self, style, variant=None, capacity=3):
        super().__init__()
        self.style, self.variant, self.capacity, self.E = style, variant, capacity, 4
        self.wg = nn.Linear(H, self.E, bias=False)
        bias, act = (True, F.relu) if style == "fairseq" else (False, F.gelu)
        self.experts = nn.ModuleList([_FFN(bias, act) for _ in range(self.E)])

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
