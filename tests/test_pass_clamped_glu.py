"""Step-3.7's clamped silu-glu read off the graph (``passes/gated_reads.clamped_silu_glu``): the spellings of
``silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)`` are rewritten, equal to eager forward and
backward, and explain() names the activation ("silu_glu" at ``limit = inf``, where both clamps are the identity);
look-alikes whose clamps are another function (bounds of their own, the clamp before the silu, a bound below on the
silu, one side only on up) are left alone, equal to eager.

The projections are about N(0, 1): a limit of 0.5 binds on both factors.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_rewritten_like_eager, compile_moe, rel_err

H, I, E, K = 16, 8, 4, 2
LIMIT = 0.5


def hidden(spelling: str, gate: torch.Tensor, up: torch.Tensor, limit: float, act: nn.Module) -> torch.Tensor:
    """The expert's hidden state from its gate and up projections, in ``spelling``: Step-3.7's clamped silu-glu
    (the genuine ones) or a look-alike."""
    if spelling == "step3p7":  # transformers v5.24's Step3p7Experts._apply_gate
        return act(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    if spelling == "torch_clamp":  # torch.clamp with positional bounds, the factors the other way round
        return torch.clamp(up, -limit, limit) * torch.clamp(F.silu(gate), None, limit)
    if spelling == "clamp_before_silu":
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    if spelling == "up_max_only":
        return F.silu(gate).clamp(max=limit) * up.clamp(max=limit)
    if spelling == "gate_min":  # a bound below on the silu too (it binds: silu's minimum is about -0.28)
        return F.silu(gate).clamp(min=-limit / 4, max=limit) * up.clamp(min=-limit, max=limit)
    if spelling == "limits_differ":
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-2 * limit, max=2 * limit)
    if spelling == "up_asymmetric":
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit / 2, max=limit)
    if spelling == "up_unbounded":  # the gate's bound, none on up (inf): not one limit on both
        return F.silu(gate).clamp(max=limit) * up.clamp(min=-math.inf, max=math.inf)
    if spelling == "gelu":
        return F.gelu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    raise AssertionError(spelling)


class ClampedLoop(nn.Module):
    """A top-k router and a ``range(E)`` loop over experts whose hidden state is ``hidden(spelling, ...)``:
    ``storage`` "fused" ((E, 2I, H) gate_up chunked into halves, Step-3.7's), "separate" ((E, I, H) gate and up
    weights) or "modulelist" (nn.Linear gate, up and down per expert)."""

    def __init__(self, spelling="step3p7", limit=LIMIT, storage="fused"):
        super().__init__()
        self.spelling, self.limit, self.storage = spelling, limit, storage
        self.router = nn.Linear(H, E, bias=False)
        self.act = nn.SiLU()
        if storage == "modulelist":
            self.experts = nn.ModuleList(nn.ModuleDict({"gate": nn.Linear(H, I, bias=False), "up": nn.Linear(
                H, I, bias=False), "down": nn.Linear(I, H, bias=False)}) for _ in range(E))
        elif storage == "fused":
            self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        else:
            self.gate_w = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
            self.up_w = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        if storage != "modulelist":
            self.down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def expert(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        if self.storage == "modulelist":
            m = self.experts[e]
            return m["down"](hidden(self.spelling, m["gate"](xe), m["up"](xe), self.limit, self.act))
        if self.storage == "fused":
            gate, up = F.linear(xe, self.gate_up[e]).chunk(2, dim=-1)
        else:
            gate, up = F.linear(xe, self.gate_w[e]), F.linear(xe, self.up_w[e])
        return F.linear(hidden(self.spelling, gate, up, self.limit, self.act), self.down[e])

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.expert(e, x[tok]) * weights[tok, pos, None])
        return out


class ClampedGathered(nn.Module):
    """gpt-fast's gathered-weight experts (``w[ids]`` and einsums) with Step-3.7's clamped silu-glu."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        gate, up = torch.einsum("th,tkih->tki", x, self.gate_up[ids]).chunk(2, dim=-1)
        h = F.silu(gate).clamp(max=LIMIT) * up.clamp(min=-LIMIT, max=LIMIT)
        out = torch.einsum("tki,tkhi->tkh", h, self.down[ids])
        return torch.einsum("tkh,tk->th", out, weights)


def _input(T=11, scale=1.0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(1)) * scale


@pytest.mark.parametrize("spelling,storage,limit,activation", [
    pytest.param("step3p7", "fused", LIMIT, "clamped_silu_glu", id="step3p7-fused"),
    pytest.param("torch_clamp", "fused", LIMIT, "clamped_silu_glu", id="torch-clamp-swapped"),
    pytest.param("step3p7", "separate", LIMIT, "clamped_silu_glu", id="separate-weights"),
    # nn.Linear experts at a limit the list op does not run: stacked for the stacked op
    pytest.param("step3p7", "modulelist", LIMIT, "clamped_silu_glu", id="modulelist-stacked"),
    # at the list op's own limit (7, Step-3.7-Flash's): the list op runs it, on inputs wide enough for 7 to bind
    pytest.param("step3p7", "modulelist", 7.0, "clamped_silu_glu", id="modulelist-list-op"),
    # both clamps at inf are the identity: plain silu_glu
    pytest.param("step3p7", "fused", math.inf, "silu_glu", id="limit-inf"),
])
def test_clamped_silu_glu_is_rewritten_like_eager(spelling, storage, limit, activation):
    torch.manual_seed(0)
    model = ClampedLoop(spelling, limit, storage)
    x = _input(scale=12.0 if limit == 7.0 else 1.0)
    assert_rewritten_like_eager(model, x, "unrolled_loop", spelling)
    (rewrite,) = moe_inductor.explain(model, x).rewrites
    assert rewrite.activation == activation
    assert f"act={activation} " in str(moe_inductor.explain(model, x))


def test_the_bound_binds_in_these_tests():
    """The rewritten function is the clamped one: with the same weights, a limit of 0.5 changes the output."""
    torch.manual_seed(0)
    bounded, free = ClampedLoop(limit=LIMIT), ClampedLoop(limit=math.inf)
    free.load_state_dict(bounded.state_dict())
    x = _input()
    assert rel_err(bounded(x), free(x)) > 1e-2


def test_gathered_weights_take_it_too():
    torch.manual_seed(0)
    model = ClampedGathered()
    assert_rewritten_like_eager(model, _input(), "gathered_weights")
    (rewrite,) = moe_inductor.explain(model, _input()).rewrites
    assert rewrite.activation == "clamped_silu_glu"


@pytest.mark.parametrize("spelling", ["clamp_before_silu", "up_max_only", "gate_min", "limits_differ",
                                      "up_asymmetric", "up_unbounded", "gelu"])
def test_look_alike_clamps_are_left_alone(spelling):
    """Each look-alike computes another function than the genuine clamped silu-glu at these inputs, and is left as
    it was (the loop's proof finds no activation it knows), equal to eager."""
    torch.manual_seed(0)
    model, genuine = ClampedLoop(spelling), ClampedLoop()
    genuine.load_state_dict(model.state_dict())
    x = _input()
    with torch.no_grad():
        ref = model(x)
        assert rel_err(ref, genuine(x)) > 1e-3, f"{spelling} computes what the genuine clamped silu-glu does"
        out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"] == {"unrolled_loop": 1}
    torch.testing.assert_close(out, ref)
    (left,) = moe_inductor.explain(model, x).left_alone
    assert "not a known activation" in left.reason, left.reason
