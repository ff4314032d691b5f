"""Zero-computation experts (LongCat-Flash): loop bodies that add their tokens back times the routing weight, beside
the routed experts' MLPs (``passes/zero_experts.py``). The routed experts go to the op, the rest is
``x * sum of the weights of the chosen zero experts`` in the graph: rewritten and equal to eager, forward and
backward. The op's part of it, that a choice outside [0, E) adds nothing and gets no gradient, is tested here on
every CPU implementation. Look-alikes (an expert that computes something, an unweighted pass-through beside
weighted experts, different scales, zero experts before the routed ones, another tensor's rows) are left alone
with their reason, or fall back in a loop over the hit experts, equal to eager either way."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, Z = 16, 8, 4, 3


class ZeroExpertsMoE(nn.Module):
    """E routed experts (stacked SiLU-GLU weights) and Z zero-computation experts after them, top-k over E + Z."""

    def __init__(self, style="identity", k=3, z=Z):
        super().__init__()
        self.style, self.k, self.z = style, k, z
        self.router = nn.Linear(H, E + z, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E + z, 2 * I, H) * H ** -0.5)  # sized for every choice, as LongCat's
        # zero_first's routed experts are ids z..z+E-1, each reading its own row of weights of E + z rows
        self.down = nn.Parameter(torch.randn(E + z if style == "zero_first" else E, H, I) * I ** -0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(z, H))
        self.factor = nn.Parameter(torch.tensor(2.0))

    def routed(self, xe, e):
        gate, up = F.linear(xe, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[e])

    def zero(self, x, tok, pos, weights, e):
        """What zero-computation expert e adds at its rows, in each style."""
        s, xe, w = self.style, x[tok], weights[tok, pos, None]
        if s == "weight_first":
            return w * xe
        if s == "scaled":  # a zero expert that doubles its input: modelled as the number 2
            return (xe * 2) * w
        if s == "scaled_after_weight":
            return (xe * w) / 4
        if s == "plus_bias":  # computes something: not an identity
            return (xe + self.bias[e - E]) * w
        if s == "unweighted":  # the routed experts are weighted, this one is not
            return xe
        if s == "different_scales":
            return xe * w * (2.0 if e == E else 1.0)
        if s == "tensor_factor":  # a learned factor is no number the proof reads
            return xe * self.factor * w
        if s == "other_tensor":  # adds back rows of another tensor than the experts read
            return (x * 0.5)[tok] * w
        return xe * w

    def forward(self, x):
        scores = F.softmax(self.router(x), dim=-1)
        weights, ids = torch.topk(scores, self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E + self.z):
            tok, pos = torch.where(ids == e)
            routed = e < E if self.style != "zero_first" else e >= self.z
            if self.style == "all_zero" or not routed:
                c = self.zero(x, tok, pos, weights, e if self.style != "zero_first" else e + E)
            elif self.style == "weight_on_input":
                c = self.routed(x[tok] * weights[tok, pos, None], e)
            else:
                c = self.routed(x[tok], e) * weights[tok, pos, None]
            if self.style == "setitem_add":
                out[tok] += c
            else:
                out.index_add_(0, tok, c)
        return out


class LongcatLike(nn.Module):
    """The loop over the experts that got tokens, LongCat's spelling (traced as every expert: hit_loops.py), with a
    ModuleList of nn.Linear experts and ``nn.Identity`` for the zero ones."""

    def __init__(self, unweighted_zero=False):
        super().__init__()
        self.unweighted_zero = unweighted_zero
        self.router = nn.Linear(H, E + Z, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=False), nn.GELU(), nn.Linear(I, H, bias=False))
                                     for _ in range(E))
        self.identity = nn.Identity()

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E + Z).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for t in hit:
            e = int(t.item())
            pos, tok = torch.where(mask[e].squeeze(0))
            if tok.numel() == 0:
                continue
            if e >= E:
                y = self.identity(x[tok])
                if not self.unweighted_zero:
                    y = y * weights[tok, pos, None]
            else:
                y = self.experts[e](x[tok]) * weights[tok, pos, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out


# --- the op: a choice outside [0, E) adds nothing --------------------------------------------------------------


def _reference(x, ids, weights, gate_up, down):
    """Each choice of an expert in range(E) adds its weighted SiLU-GLU output; any other id adds nothing."""
    out = torch.zeros_like(x)
    for e in range(down.shape[0]):
        tok, pos = torch.where(ids == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, tok, F.linear(F.silu(gate) * up, down[e]) * weights[tok, pos, None])
    return out


@pytest.mark.parametrize("impl", ["cpu_path", "triton", "cpu_lowering"])
def test_the_op_adds_nothing_for_ids_at_or_past_E(impl, monkeypatch, nan_empty):
    """ids in [E, E + Z) (and one far past it) next to ids of range(E): y and every gradient are those of the
    routed choices alone; the routing weight of every other choice gets a zero gradient."""
    from moe_inductor import config
    from moe_inductor.lowerings.cpu import experts_forward_traced

    monkeypatch.setattr(config, "triton_on_cpu", impl == "triton")
    gen = torch.Generator().manual_seed(0)
    T, k = 9, 3
    ids = torch.topk(torch.randn(T, E + Z, generator=gen), k, dim=-1).indices
    ids[0, 0] = E + Z + 5  # far out of range too
    leaves = [t.requires_grad_() for t in (torch.randn(T, H, generator=gen), torch.rand(T, k, generator=gen),
                                           torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                                           torch.randn(E, H, I, generator=gen) * I ** -0.5)]
    x, w, gate_up, down = leaves
    args = (x, ids, w, gate_up[:, :I].transpose(1, 2), gate_up[:, I:].transpose(1, 2), down.transpose(1, 2),
            None, None, None, "silu_glu", "output", 1.702, 7.0, None, True)
    y = (experts_forward_traced(*args) if impl == "cpu_lowering" else torch.ops.moe_inductor.experts_forward(*args))[0]
    ref = _reference(x, ids, w, gate_up, down)
    dy = torch.randn(y.shape, generator=gen)
    assert_close(y, ref, torch.float32, "y")
    for name, got, want in zip(("x", "weights", "gate_up", "down"), torch.autograd.grad(y, leaves, dy),
                               torch.autograd.grad(ref, leaves, dy)):
        assert_close(got, want, torch.float32, f"d{name}")
        if name == "weights":
            assert torch.equal(got[ids >= E], torch.zeros(int((ids >= E).sum())))


# --- the pass ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["identity", "weight_first", "scaled", "scaled_after_weight", "weight_on_input",
                                   "setitem_add"])
@pytest.mark.parametrize("k", [3, 1], ids=["k3", "k1"])
def test_zero_experts_are_rewritten_and_equal(style, k):
    torch.manual_seed(0)
    model = ZeroExpertsMoE(style, k)
    for T in (5, 12):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")
        assert not counters["moe_inductor_left_alone"] and not counters["moe_inductor_fallback"]


def test_some_rows_pick_no_zero_expert_even_at_a_non_finite_token():
    """A row with no zero-computation choice gets nothing added (not 0 * x): an inf token there gives eager's
    values, and the rows that did pick a zero expert get theirs."""
    torch.manual_seed(0)
    model = ZeroExpertsMoE("identity", k=1)
    x = torch.randn(16, H)
    with torch.no_grad():
        ids = torch.topk(F.softmax(model.router(x), dim=-1), 1, dim=-1).indices[:, 0]
    assert (ids < E).any() and (ids >= E).any()
    routed_row = int((ids < E).nonzero()[0])
    model.down.data[:, :, :] = 0.0  # the routed experts give exact zeros, so an inf stays visible only as a NaN
    x[routed_row, 0] = float("inf")
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert torch.equal(out.isnan(), ref.isnan()) and torch.allclose(out.nan_to_num(), ref.nan_to_num())


def test_the_hit_loop_with_identity_experts_is_rewritten():
    torch.manual_seed(0)
    model = LongcatLike()
    for T in (6, 13):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"T={T}")
        assert not counters["moe_inductor_fallback"]


def test_explain_names_the_zero_experts():
    torch.manual_seed(0)
    report = moe_inductor.explain(ZeroExpertsMoE("scaled"), torch.randn(7, H))
    (rewrite,) = report.rewrites
    assert rewrite.num_experts == E and "3 zero-computation experts (ids 4..6)" in rewrite.note and "times 2" in rewrite.note
    assert not report.left_alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tokens_with_fp32_routing_weights(dtype):
    """LongCat's weights are float32 under a bf16 model: the pass-through is computed in float32 and cast back, as
    eager's ``(x[tok] * w).to(x.dtype)``; fp16 the same."""
    torch.manual_seed(0)
    model = ZeroExpertsMoE("identity").to(dtype)

    class Fp32Router(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            m = self.inner
            weights, ids = torch.topk(F.softmax(F.linear(x.float(), m.router.weight.float()), dim=-1), 3, dim=-1)
            out = torch.zeros_like(x)
            for e in range(E + Z):
                tok, pos = torch.where(ids == e)
                c = x[tok] * weights[tok, pos, None] if e >= E else m.routed(x[tok], e) * weights[tok, pos, None]
                out.index_add_(0, tok, c.to(x.dtype))
            return out

    wrapped = Fp32Router(model)
    x = torch.randn(11, H, dtype=dtype)
    with torch.no_grad():
        out, ref = compile_moe(wrapped, x), wrapped(x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert out.dtype == dtype
    assert_close(out, ref, dtype, str(dtype))


@pytest.mark.parametrize("style,reason", [
    ("plus_bias", "output is not a matmul or F.linear"),
    ("tensor_factor", "output is not a matmul or F.linear"),
    ("unweighted", "without a routing weight"),
    ("different_scales", "different numbers (2, 1, 1)"),
    ("zero_first", "routed experts are [3, 4, 5, 6], not range(4)"),
    ("other_tensor", "rows of another tensor"),
    ("all_zero", "there is no expert MLP"),
])
def test_look_alikes_are_left_alone_with_their_reason(style, reason):
    torch.manual_seed(0)
    model = ZeroExpertsMoE(style)
    x = torch.randn(9, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    assert counters["moe_inductor_left_alone"] == {"unrolled_loop": 1}
    report = moe_inductor.explain(model, x)
    assert not report.rewrites
    (left,) = report.left_alone
    assert left.form == "unrolled_loop" and reason in left.reason, left


def test_an_unweighted_identity_in_the_hit_loop_falls_back_equal_to_eager():
    torch.manual_seed(0)
    model = LongcatLike(unweighted_zero=True)
    x = torch.randn(9, H)
    report = moe_inductor.explain(model, x)
    assert any("without a routing weight" in f.reason for f in report.fallbacks), report.fallbacks
    # (a later compile of the same loop is not unrolled again, unproven_loops.py: it breaks the graph at once)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
