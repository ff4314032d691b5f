"""Spellings of the per-expert loop from transformers v4's DeepSeek-V3 and hand-written loops: each row's routing
weight read as a column of ``weights[tok, pos]`` (``.unsqueeze(-1)``, ``[:, None]``, ``.view(-1, 1)``, possibly
cast to the experts' dtype first); an fp32 accumulator under half-precision experts (``zeros_like(x,
dtype=weights.dtype)``); the rows by ``x.index_select(0, tok)``; the outputs added out of place,
``out = out.index_add(0, tok, c)``. Rewritten and equal to eager, forward and backward; look-alikes (another
choice's weight, a cast that rounds the weight to another dtype, a chain that branches or is read half-way, a
link of another kind) left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 5, 2


class ColumnLoopMoE(nn.Module):
    def __init__(self, style: str, buffer_fp32: bool = False):
        super().__init__()
        self.style, self.buffer_fp32 = style, buffer_fp32
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        weights, ids = torch.topk(torch.softmax(self.router(x).float(), dim=-1), K, dim=-1)  # fp32 weights
        out = torch.zeros_like(x, dtype=weights.dtype) if self.buffer_fp32 else torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 0, 1)  # (E, T, k)
        for e in range(E):
            tok, pos = torch.where(mask[e])
            if tok.numel() > 0:
                chosen = weights[tok, (pos + 1) % K if s == "other_choice" else pos]
                if s == "unsqueeze":
                    w = chosen.unsqueeze(-1)
                elif s == "index_none":
                    w = chosen[:, None]
                elif s == "view":
                    w = chosen.view(-1, 1)
                elif s == "cast_to_experts":
                    w = chosen.to(x.dtype).unsqueeze(-1)
                elif s == "cast_to_bf16":  # rounds an fp32 model's weight to bf16: another function
                    w = chosen.to(torch.bfloat16).unsqueeze(-1)
                else:  # other_choice
                    w = chosen.unsqueeze(-1)
                xe = x[tok]
                y = F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])
                out.index_add_(0, tok, (y * w).to(out.dtype))
        return out.type(x.dtype)


@pytest.mark.parametrize("style", ["unsqueeze", "index_none", "view", "cast_to_experts"])
def test_weight_columns_are_read_as_the_routing_weight(style):
    torch.manual_seed(0)
    model = ColumnLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


def test_an_fp32_accumulator_under_bf16_experts_is_rewritten():
    """The fp32 buffer holds the bf16 experts' weighted outputs; the op's result is widened to it, and the loop's
    ``.type(x.dtype)`` brings it back, as eager does."""
    torch.manual_seed(0)
    model = ColumnLoopMoE("unsqueeze", buffer_fp32=True).bfloat16()
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H, dtype=torch.bfloat16), "unrolled_loop", f"T={T}")


@pytest.mark.parametrize("style", ["other_choice", "cast_to_bf16"])
def test_other_weights_are_left_alone(style):
    torch.manual_seed(0)
    model = ColumnLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)


class ChainLoopMoE(nn.Module):
    """``out = out.index_add(0, tok, c)`` per expert, the rows by ``index_select``, or behind ``if tok.numel() > 0:``
    (the skip of an expert with no rows, assumed away while tracing: an add at no rows changes nothing); the
    look-alikes break the chain: two experts add to the same earlier value (a branch), the value after the first
    expert is also returned, the last link copies rows instead of adding them; behind the guard, the local ends as
    more than an add into its value, or a Python count of the experts that ran is read after the loop."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        if s.startswith("guarded"):
            return self._guarded(x, weights, ids, out)
        start, early = out, None
        for e in range(E):
            tok, pos = torch.where(ids == e)
            rows = x.index_select(0, tok) if s != "scatter" else x[tok]
            c = F.linear(F.gelu(F.linear(rows, self.w1[e])), self.w2[e]) * weights[tok, pos].unsqueeze(-1)
            if s == "branch" and e == E - 1:
                out = out + start.index_add(0, tok, c)  # the last expert adds to the zeros, not the chain
            elif s == "copy_last" and e == E - 1:
                out = out.index_copy(0, tok, c)
            elif s == "scatter":
                out = out.scatter_add(0, tok[:, None].expand(-1, H), c)
            else:
                out = out.index_add(0, tok, c)
            if s == "read_half_way" and e == 0:
                early = out
        return out if early is None else out + early

    def _guarded(self, x, weights, ids, out):
        """Behind ``if tok.numel() > 0:``; the speculation reads the rest of the iteration, so each spelling has a
        loop of its own."""
        if self.style != "guarded":
            return self._guarded_flawed(x, weights, ids, out)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            if tok.numel() > 0:
                c = self._expert(x.index_select(0, tok), e) * weights[tok, pos].unsqueeze(-1)
                out = out.index_add(0, tok, c)
        return out

    def _guarded_flawed(self, x, weights, ids, out):
        ran = 0
        for e in range(E):
            tok, pos = torch.where(ids == e)
            if tok.numel() > 0:
                c = self._expert(x.index_select(0, tok), e) * weights[tok, pos].unsqueeze(-1)
                if self.style == "guarded_scaled":  # the local ends as more than an add into its value
                    out = out.index_add(0, tok, c) * 1.5
                else:  # a Python count of the experts that ran, read after the loop
                    out = out.index_add(0, tok, c)
                    ran = ran + 1
        return out * ran if self.style == "guarded_counter" else out

    def _expert(self, rows, e):
        return F.linear(F.gelu(F.linear(rows, self.w1[e])), self.w2[e])


@pytest.mark.parametrize("style", ["index_add", "scatter", "guarded"])
def test_an_out_of_place_chain_is_rewritten(style):
    torch.manual_seed(0)
    model = ChainLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


@pytest.mark.parametrize("style", ["branch", "read_half_way", "copy_last", "guarded_scaled", "guarded_counter"])
def test_a_broken_chain_is_left_alone(style):
    torch.manual_seed(0)
    model = ChainLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)


def test_explain_names_a_weight_of_another_choice():
    """The reason a loop scaled by another choice's weight is left alone names the factor, not the projection."""
    import moe_inductor

    torch.manual_seed(0)
    report = moe_inductor.explain(ColumnLoopMoE("other_choice"), torch.randn(9, H))
    # behind its guard, the loop's reason comes with the frame's fallback (the skip went with no rewrite)
    reasons = [r.reason for r in report.left_alone] + [f.reason for f in report.fallbacks]
    assert any("scaled by a factor that is not this body's own routing weight" in r for r in reasons), reasons


def test_explain_logs_no_fallback_for_a_guarded_loop_it_rewrites(caplog):
    """explain()'s rewrites-off pass cannot prove the skip of an idle expert and falls back; that is its own, not the
    user's compile's: nothing is logged, and the report shows the rewrite and no fallback."""
    import moe_inductor
    from moe_inductor import capture

    torch.manual_seed(0)
    capture._logged_fallbacks.clear()
    with caplog.at_level("WARNING", logger="moe_inductor"):
        report = moe_inductor.explain(ChainLoopMoE("guarded"), torch.randn(9, H))
    assert [r.form for r in report.rewrites] == ["unrolled_loop"] and not report.fallbacks
    assert not [r for r in caplog.records if "failed to compile" in r.getMessage()]


def test_explain_leaves_the_users_compile_as_it_would_be():
    """explain()'s rewrites-off pass cannot compile a loop with data-dependent rows in one graph; under torch 2.11
    Dynamo then gives up on the frame (a graph break in a loop) and would skip its code for good, so that the user's
    own compile afterwards ran it eagerly. The user's compile after explain() is rewritten as without it."""
    import moe_inductor

    torch._dynamo.reset()  # this file's look-alikes share the class's code: under 2.11 their fallbacks skip it too
    torch.manual_seed(0)
    model = ColumnLoopMoE("unsqueeze")
    x = torch.randn(9, H)
    assert [r.form for r in moe_inductor.explain(model, x).rewrites] == ["unrolled_loop"]
    counters.clear()
    out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(x)
    assert dict(counters["moe_inductor"]) == {"unrolled_loop": 1}
    assert_close(out, model(x), torch.float32, "after explain")
