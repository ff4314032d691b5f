"""Randomised equivalence (hypothesis): generated MoE modules across forms, routing, E, k, T and activations must
compile to the same function as eager. Examples are few: each one compiles."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor.ops import expert_weight_views, moe_reference
from tests.helpers import compile_moe

ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


class GeneratedGatheredMoE(nn.Module):
    def __init__(self, E, k, H, I, act, gated, layout, combine, renormalise):
        super().__init__()
        self.k, self.act, self.gated, self.layout, self.combine, self.renormalise = k, act, gated, layout, combine, renormalise
        self.router = nn.Linear(H, E, bias=False)
        shape_up, shape_down = ((E, I, H), (E, H, I)) if layout == "nk" else ((E, H, I), (E, I, H))
        self.w_up = nn.Parameter(torch.randn(shape_up) * H ** -0.5)
        self.w_gate = nn.Parameter(torch.randn(shape_up) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(shape_down) * I ** -0.5)

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        up_eq, down_eq = ("th,taih->tai", "tai,tahi->tah") if self.layout == "nk" else ("th,tahi->tai", "tai,taih->tah")
        h = ACTS[self.act](torch.einsum(up_eq, x, self.w_gate[ids]))
        if self.gated:
            h = h * torch.einsum(up_eq, x, self.w_up[ids])
        out = torch.einsum(down_eq, h, self.w_down[ids])
        if self.combine == "einsum":
            return torch.einsum("tah,ta->th", out, weights)
        return (out * weights[..., None]).sum(1)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.integers(2, 9), k_frac=st.floats(0, 1), T=st.integers(1, 24), act=st.sampled_from(sorted(ACTS)),
    gated=st.booleans(), layout=st.sampled_from(["nk", "kn"]), combine=st.sampled_from(["einsum", "mulsum"]),
    renormalise=st.booleans(), seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_generated_gathered_moe_compiles_to_the_same_function(E, k_frac, T, act, gated, layout, combine, renormalise,
                                                               seed):
    torch.manual_seed(seed)
    k = 1 + int(k_frac * (E - 1))
    model = GeneratedGatheredMoE(E, k, 16, 8, act, gated, layout, combine, renormalise)
    x = torch.randn(T, 16)
    out = compile_moe(model, x)
    ref = model(x)
    assert ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item() < 1e-5
    assert counters["moe_inductor"]["gathered_weights"] == 1


@settings(max_examples=25, deadline=None)
@given(
    E=st.integers(1, 9), k_frac=st.floats(0, 1), T=st.integers(0, 20),
    act=st.sampled_from(["silu_glu", "gelu_glu", "gptoss_glu", "relu", "gelu_tanh", "clamped_silu_glu"]),
    layout=st.sampled_from(["nk", "kn"]), gate_up=st.sampled_from(["concat", "interleaved"]),
    position=st.sampled_from(["output", "between", "input"]), bias=st.booleans(),
    capacity=st.one_of(st.none(), st.integers(0, 6)), seed=st.integers(0, 2**16),
)
def test_generated_op_calls_match_the_reference(E, k_frac, T, act, layout, gate_up, position, bias, capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 1 + int(k_frac * (E - 1))
    H, I = 8, 4
    n1 = 2 * I if act.endswith("glu") else I
    x = torch.randn(T, H, generator=gen)
    ids = torch.randn(T, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(T, k, generator=gen)
    w1 = torch.randn((E, n1, H) if layout == "nk" else (E, H, n1), generator=gen)
    w2 = torch.randn((E, H, I) if layout == "nk" else (E, I, H), generator=gen)
    b1 = torch.randn(E, n1, generator=gen) if bias else None
    b2 = torch.randn(E, H, generator=gen) if bias else None
    y = moe_inductor.fused_experts(x, ids, weights, w1, w2, b1=b1, b2=b2, activation=act, layout=layout,
                                   gate_up=gate_up, weight_position=position, capacity=capacity)
    views = expert_weight_views(w1, w2, b1, activation=act, layout=layout, gate_up=gate_up)
    ref = moe_reference(x, ids, weights, *views, b2, act, position, 1.702, 7.0, capacity)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


class GeneratedCapacityMoE(nn.Module):
    """GShard-style gating with a capacity: top-1 or top-2 into (T, E, C) dispatch and combine tensors."""

    def __init__(self, E, C, k, H, I, act, gated):
        super().__init__()
        self.E, self.C, self.k, self.act, self.gated = E, C, k, act, gated
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)  # (E, in, out) this time
        self.w3 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)

    def forward(self, x):
        E, C = self.E, self.C
        gates = F.softmax(self.router(x), dim=-1)
        remaining, masks, combine = gates, [], 0
        for _ in range(self.k):
            mask = F.one_hot(torch.argmax(remaining, dim=-1), num_classes=E)
            loc = torch.cumsum(mask, dim=0) - 1
            for earlier in masks:
                loc = loc + torch.sum(earlier, dim=0, keepdim=True)
            remaining = remaining.masked_fill(mask.bool(), 0.0)
            masks.append(mask)
            kept = mask * torch.lt(loc, C)
            gate = (gates * kept).sum(dim=1)
            slot = F.one_hot(torch.sum(loc * kept, dim=1), num_classes=C)
            combine = combine + gate[:, None, None] * kept[:, :, None] * slot[:, None, :]
        dispatch = (combine != 0).to(x.dtype)
        xin = torch.einsum("tec,th->ech", dispatch, x)
        h = ACTS[self.act](torch.einsum("ech,ehi->eci", xin, self.w1))
        if self.gated:
            h = h * torch.einsum("ech,ehi->eci", xin, self.w3)
        return torch.einsum("tec,ech->th", combine, torch.einsum("eci,eih->ech", h, self.w2))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.integers(2, 7), C=st.integers(1, 5), k=st.integers(1, 2), T=st.integers(1, 24),
    act=st.sampled_from(sorted(ACTS)), gated=st.booleans(), seed=st.integers(0, 2**16),
)
def test_generated_capacity_moe_compiles_to_the_same_function(E, C, k, T, act, gated, seed):
    torch.manual_seed(seed)
    model = GeneratedCapacityMoE(E, C, k, 16, 8, act, gated)
    x = torch.randn(T, 16)
    out = compile_moe(model, x)
    ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert counters["moe_inductor"]["padded_capacity"] == 1


class GeneratedLoopOrDenseMoE(nn.Module):
    """The per-expert loop (where + index_add_, or out[tok] += ...) or the dense all-experts form (a scattered
    routing matrix), with a generated E, k, activation, gating, weight layout and weight renormalisation."""

    def __init__(self, form, E, k, H, I, act, gated, layout, renormalise, position="output"):
        super().__init__()
        self.form, self.E, self.k, self.act, self.gated, self.renormalise = form, E, k, act, gated, renormalise
        self.position = position  # where the loop applies the routing weight (the dense form: the output only)
        self.kn = layout == "kn"
        self.router = nn.Linear(H, E, bias=False)
        up, down = ((E, H, I), (E, I, H)) if self.kn else ((E, I, H), (E, H, I))
        self.w1 = nn.Parameter(torch.randn(up) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(up) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(down) * I ** -0.5)

    def _mlp(self, xe, e, scale):
        """Expert e on rows xe, the routing weight ``scale`` applied at ``self.position``."""
        w1, w3, w2 = ((w[e] if self.kn else w[e].T) for w in (self.w1, self.w3, self.w2))
        if self.position == "input":
            xe = xe * scale
        h = ACTS[self.act](xe @ w1)
        h = h * (xe @ w3) if self.gated else h
        if self.position == "between":
            h = h * scale
        return h @ w2 * scale if self.position == "output" else h @ w2

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.form == "dense":
            routing = torch.zeros_like(probs).scatter(1, ids, weights)
            eq_up, eq_down = ("th,ehi->tei", "tei,eih->teh") if self.kn else ("th,eih->tei", "tei,ehi->teh")
            w1, w3, w2 = self.w1, self.w3, self.w2
            h = ACTS[self.act](torch.einsum(eq_up, x, w1))
            if self.gated:
                h = h * torch.einsum(eq_up, x, w3)
            return torch.einsum("teh,te->th", torch.einsum(eq_down, h, w2), routing)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, pos = torch.where(ids == e)
            if self.form == "loop_index_add":
                out.index_add_(0, tok, self._mlp(x[tok], e, weights[tok, pos, None]))
            else:  # "loop_setitem"
                out[tok] += self._mlp(x[tok], e, weights[tok, pos, None])
        return out


FORM_COUNTERS = {"dense": "dense_experts", "loop_index_add": "unrolled_loop", "loop_setitem": "unrolled_loop"}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    form=st.sampled_from(sorted(FORM_COUNTERS)), E=st.integers(2, 7), k_frac=st.floats(0, 1), T=st.integers(1, 20),
    act=st.sampled_from(sorted(ACTS)), gated=st.booleans(), layout=st.sampled_from(["nk", "kn"]),
    renormalise=st.booleans(), position=st.sampled_from(["output", "input", "between"]), seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_generated_loop_and_dense_moe_compile_to_the_same_function(form, E, k_frac, T, act, gated, layout,
                                                                    renormalise, position, seed):
    torch.manual_seed(seed)
    k = 1 + int(k_frac * (E - 1))
    position = "output" if form == "dense" else position
    model = GeneratedLoopOrDenseMoE(form, E, k, 16, 8, act, gated, layout, renormalise, position)
    x = torch.randn(T, 16)
    out = compile_moe(model, x)
    ref = model(x)
    assert ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item() < 1e-5
    assert counters["moe_inductor"][FORM_COUNTERS[form]] == 1


class GeneratedSortedMoE(nn.Module):
    """Sort + torch._grouped_mm (bf16, what _grouped_mm takes), with a generated E, k, activation, gating, and the
    score applied to the expert input (torchtitan) or to its output (HF)."""

    def __init__(self, E, k, H, I, act, gated, score_on):
        super().__init__()
        self.E, self.k, self.act, self.gated, self.score_on = E, k, act, gated, score_on
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        top, ids = torch.topk(torch.sigmoid(self.router(x).float()), self.k, dim=1)
        flat = ids.view(-1)
        order = torch.sort(flat)[1]
        tok = order // self.k
        offs = torch.cumsum(torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1), dim=0, dtype=torch.int32)
        scores = top.view(-1)[order][:, None]
        xs = x[tok]
        if self.score_on == "input":
            xs = (xs.float() * scores).to(x.dtype)
        h = ACTS[self.act](torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
        if self.gated:
            h = h * torch._grouped_mm(xs, self.w3.transpose(-2, -1), offs=offs)
        ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        if self.score_on == "output":
            ys = ys * scores.to(x.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, tok, ys)
        return out


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm")
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.integers(2, 7), k_frac=st.floats(0, 1), T=st.integers(1, 20), act=st.sampled_from(sorted(ACTS)),
    gated=st.booleans(), score_on=st.sampled_from(["input", "output"]), seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_generated_sorted_moe_compiles_to_the_same_function(E, k_frac, T, act, gated, score_on, seed):
    torch.manual_seed(seed)
    k = 1 + int(k_frac * (E - 1))
    model = GeneratedSortedMoE(E, k, 32, 16, act, gated, score_on).bfloat16()
    x = torch.randn(T, 32, dtype=torch.bfloat16)
    out = compile_moe(model, x).float()
    ref = model(x).float()
    assert ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item() < 2e-2
    assert counters["moe_inductor"]["sorted_grouped_mm"] == 1
