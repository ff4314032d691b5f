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


@pytest.mark.gpu
def test_gpu_kernels_run_the_rewritten_capacity_bf16():
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(CapacityMoE("top2"), "padded_capacity")
