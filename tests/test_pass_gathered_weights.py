"""The gathered-weights form (gpt-fast style): matched in several styles, equal to eager, look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_gpu_bf16_rewrite, compile_moe

E, D, I, K = 5, 16, 8, 2


class GatheredMoE(nn.Module):
    """``style`` picks how the same MoE is written."""

    def __init__(self, style="gptfast"):
        super().__init__()
        self.style = style
        self.gate = nn.Linear(D, E, bias=False)
        kn = style == "kn_swapped"
        self.w1 = nn.Parameter(torch.randn(E, D, I) if kn else torch.randn(E, I, D))
        self.w3 = nn.Parameter(torch.randn(E, D, I) if kn else torch.randn(E, I, D))
        self.w2 = nn.Parameter(torch.randn(E, I, D) if kn else torch.randn(E, D, I))

    def forward(self, x):
        x = x.view(-1, D)
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        w1, w3, w2 = self.w1[ids], self.w3[ids], self.w2[ids]
        if self.style == "gptfast":
            h = F.silu(torch.einsum("ti,taoi -> tao", x, w1)) * torch.einsum("ti, taoi -> tao", x, w3)
            out = torch.einsum("tao, taio -> tai", h, w2)
            return torch.einsum("tai,ta -> ti", out, weights)
        if self.style == "kn_swapped":  # (E, in, out) weights, other letters, operands swapped, mul+sum combine
            h = torch.einsum("bekn,bk->ben", w3, x) * F.gelu(torch.einsum("bk,bekn->ben", x, w1), approximate="tanh")
            out = torch.einsum("ben,benm->bem", h, w2)
            return (out * weights[..., None]).sum(1)
        if self.style == "plain_act":  # no gate factor: relu(up) then down, unsqueeze combine
            out = torch.einsum("tao,taio->tai", F.relu(torch.einsum("ti,taoi->tao", x, w1)), w2)
            return (out * weights.unsqueeze(-1)).sum(dim=1)
        if self.style == "wrong_contraction":  # contracts the expert-output axis of w2 with the wrong letter
            h = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x, w3)
            out = torch.einsum("tao,taoi->tai", h, w2.transpose(-1, -2).contiguous())
            return torch.einsum("tai,ta->ti", out, weights) * 1.0 + out.sum(1)  # an intermediate escapes
        if self.style == "ids_changed_after_gather":  # the weights were gathered with the ids before this change
            ids[:, 0] = ids[:, -1]
            h = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x, w3)
            return torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", h, w2), weights)
        if self.style in ("up_other_ids", "up_other_x"):  # the up branch reads other experts / other tokens
            w3_ = self.w3[(ids + 1) % E] if self.style == "up_other_ids" else w3
            x_up = x * 2 if self.style == "up_other_x" else x
            h = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x_up, w3_)
            return torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", h, w2), weights)
        if self.style == "mixed_ids":  # the down projection reads other experts than the up projection
            w2_other = self.w2[(ids + 1) % E]
            h = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x, w3)
            return torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", h, w2_other), weights)
        if self.style.startswith("rows"):  # transformers v5's batched_mm: flat rows, each by its own gathered weight
            T = x.shape[0]
            flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
            rows = x.repeat(K, 1) if self.style == "rows_tiled" else x.repeat_interleave(K, dim=0)
            kn = self.style == "rows_kn"

            def project(w, r, which):  # (S, in) rows times their own gathered weight
                if kn:
                    return torch.bmm(r.unsqueeze(1), w.transpose(1, 2)[which]).squeeze(1)
                return torch.bmm(w[which], r.unsqueeze(-1)).squeeze(-1)

            up_ids = (flat_ids + 1) % E if self.style == "rows_up_other_ids" else flat_ids
            h = F.silu(project(self.w1, rows, flat_ids)) * project(self.w3, rows, up_ids)
            ys = project(self.w2, h, flat_ids)
            if self.style == "rows_weights_after_view":
                return (ys.view(T, K, D) * weights[..., None]).sum(dim=1)
            if self.style == "rows_weights_transposed":  # weights flattened choice-major: another row's weight
                flat_w = weights.t().reshape(-1)
            return (ys * flat_w.unsqueeze(-1)).view(T, K, D).sum(dim=1)
        if self.style.startswith("halves"):  # one stacked gate/up weight, split after the gather (SGLang)
            kn = self.style == "halves_kn"
            if self.style == "halves_interleaved":  # gate rows even, up rows odd: (E, 2I, D)
                w13 = torch.stack([self.w1, self.w3], dim=2).flatten(1, 2)[ids]
                first, second = w13[:, :, ::2], w13[:, :, 1::2]
            else:
                w13 = torch.cat([self.w1, self.w3], dim=1)  # (E, 2I, D)
                w13 = (w13.transpose(1, 2) if kn else w13)[ids]  # (T, k, 2I, D), or (T, k, D, 2I) from (E, D, 2I)
                first, second = torch.chunk(w13, 2, dim=3 if kn else 2)
                if self.style == "halves_split":
                    first, second = torch.split(w13, I, dim=2)
                elif self.style == "halves_slice":
                    first, second = w13[..., :I, :], w13[..., I:, :]
                elif self.style == "halves_overlap":  # the up rows overlap the gate's: not a half
                    second = w13[..., 2:I + 2, :]
            if self.style == "halves_kn":
                h = F.silu(torch.einsum("td,tadi->tai", x, first)) * torch.einsum("td,tadi->tai", x, second)
                w2 = self.w2.transpose(1, 2)[ids]
                out = torch.einsum("tai,taid->tad", h, w2)
            elif self.style == "halves_swapped":  # the gate is the second half: not the emitter's [gate | up] split
                h = F.silu(torch.einsum("ti,taoi->tao", x, second)) * torch.einsum("ti,taoi->tao", x, first)
                out = torch.einsum("tao,taio->tai", h, w2)
            elif self.style == "halves_of_two":  # gate and up: first halves of two different gathered weights
                other = torch.chunk(torch.cat([self.w3, self.w1], dim=1)[ids], 2, dim=2)[0]
                h = F.silu(torch.einsum("ti,taoi->tao", x, first)) * torch.einsum("ti,taoi->tao", x, other)
                out = torch.einsum("tao,taio->tai", h, w2)
            else:
                h = F.silu(torch.einsum("ti,taoi->tao", x, first)) * torch.einsum("ti,taoi->tao", x, second)
                out = torch.einsum("tao,taio->tai", h, w2)
            return torch.einsum("tai,ta->ti", out, weights)
        raise ValueError(self.style)


@pytest.mark.parametrize("style", ["gptfast", "kn_swapped", "plain_act", "halves", "halves_kn", "halves_split",
                                   "halves_slice", "halves_interleaved", "rows", "rows_kn", "rows_weights_after_view"])
def test_styles_are_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = GatheredMoE(style)
    for T in (3, 9, 17):
        x = torch.randn(T, D)
        out = compile_moe(model, x)
        ref = model(x)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    assert counters["moe_inductor"]["gathered_weights"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("style,reason", [
    ("mixed_ids", "gather their weights with different ids"),
    ("up_other_ids", "gather their weights with different ids"),
    ("up_other_x", "read different inputs"),
    ("halves_swapped", "the gate projection reads the second half"),
    ("halves_of_two", "read different gathered weights"),
    ("rows_up_other_ids", "gather their weights with different ids"),
    ("rows_tiled", "not the tokens repeated k times"),
])
def test_explain_says_why_gathered_weights_were_left_alone(style, reason):
    torch.manual_seed(0)
    report = moe_inductor.explain(GatheredMoE(style), torch.randn(5, D))
    (left,) = report.left_alone
    assert left.form == "gathered_weights" and reason in left.reason, left


def test_two_look_alike_layers_are_reported_once_each():
    """Left-alone notes group by the module the gathers sit in: two unprovable MoE layers, two notes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(GatheredMoE("mixed_ids"), GatheredMoE("up_other_ids"))
    report = moe_inductor.explain(model, torch.randn(5, D))
    assert not report.rewrites
    assert [m.form for m in report.left_alone] == ["gathered_weights", "gathered_weights"]
    assert all("test_pass_gathered_weights.py" in m.where for m in report.left_alone)


@pytest.mark.parametrize("style", ["gptfast", "kn_swapped", "halves", "rows"])
def test_gradients_match_eager(style):
    torch.manual_seed(0)
    model = GatheredMoE(style)
    x = torch.randn(11, D, requires_grad=True)
    out = compile_moe(model, x, inner="aot_eager")
    params = [x, model.gate.weight, model.w1, model.w2, model.w3]
    grads = torch.autograd.grad(out.square().sum(), params)
    ref_grads = torch.autograd.grad(model(x).square().sum(), params)
    assert counters["moe_inductor"]["gathered_weights"] == 1
    for g, r in zip(grads, ref_grads):
        assert ((g - r).norm() / r.norm()).item() < 1e-5


@pytest.mark.parametrize("style", ["wrong_contraction", "mixed_ids", "ids_changed_after_gather",
                                   "up_other_ids", "up_other_x", "halves_swapped", "halves_of_two",
                                   "halves_overlap", "rows_up_other_ids", "rows_tiled", "rows_weights_transposed"])
def test_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = GatheredMoE(style)
    x = torch.randn(7, D)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    assert counters["moe_inductor_left_alone"]["gathered_weights"] == 1  # explain() and the log say so


def test_form_can_be_turned_off():
    model = GatheredMoE("gptfast")
    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="moe_inductor", options={"inner": "eager", "forms": ["hf_grouped_mm"]})(torch.randn(4, D))
    assert not counters["moe_inductor"]


def test_explain_names_the_source_line():
    import moe_inductor

    report = moe_inductor.explain(GatheredMoE("gptfast"), torch.randn(6, D))
    (rewrite,) = report.rewrites
    assert rewrite.form == "gathered_weights" and rewrite.num_experts == E and rewrite.top_k == K
    assert "einsum" in rewrite.where and "experts_forward" in report.graphs[0].code


@pytest.mark.gpu
def test_gpu_kernels_run_the_rewritten_gather_bf16():
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(GatheredMoE("gptfast"), "gathered_weights")
