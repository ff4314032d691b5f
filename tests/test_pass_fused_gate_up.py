"""Gated experts stored as one fused gate/up weight (E, 2I, H) (or (E, H, 2I), or an nn.Linear(H, 2I) per expert)
and split after the projection by ``chunk(2, -1)``, ``split(I, -1)`` or slicing: rewritten in the loop, gathered
and dense forms, equal to eager forward and backward; splits that are not gate-then-up halves are left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class FusedMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)  # (E, out, in)
        self.w13_kn = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)  # (E, in, out)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.w2_kn = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.fc1 = nn.ModuleList([nn.Linear(H, 2 * I, bias=False) for _ in range(E)])
        self.fc2 = nn.ModuleList([nn.Linear(I, H, bias=False) for _ in range(E)])

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        s = self.style
        if s.startswith("gathered"):  # gpt-fast style on one fused weight
            p = torch.einsum("ti,taoi->tao", x, self.w13[ids])
            g, u = p.chunk(2, dim=-1)
            out = torch.einsum("tao,taio->tai", F.silu(g) * u, self.w2[ids])
            return torch.einsum("tai,ta->ti", out, weights)
        if s.startswith("dense"):  # every expert on every token, zero off the top-k
            routing = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(1, ids, weights)
            p = torch.einsum("th,eih->tei", x, self.w13)
            h = F.gelu(p[..., :I]) * p[..., I:]
            out = torch.einsum("tei,ehi->teh", h, self.w2)
            return torch.einsum("teh,te->th", out, routing)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            xe = x[tok]
            if s == "loop_chunk":  # transformers v5's experts body, in a range(E) loop
                g, u = F.linear(xe, self.w13[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.w2[e])
            elif s == "loop_kn_slices":
                p = xe @ self.w13_kn[e]
                y = (F.silu(p[..., :I]) * p[..., I:]) @ self.w2_kn[e]
            elif s == "loop_kn_interleaved":  # GPT-OSS's layout: gate and up in even and odd columns
                p = xe @ self.w13_kn[e]
                y = (F.silu(p[..., ::2]) * p[..., 1::2]) @ self.w2_kn[e]
            elif s == "loop_linear_split":  # Megatron's MLP: one nn.Linear(H, 2I) per expert
                g, u = torch.split(self.fc1[e](xe), I, dim=-1)
                y = self.fc2[e](F.silu(g) * u)
            elif s == "loop_up_first":  # the activation on the second half: another function
                u, g = F.linear(xe, self.w13[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, self.w2[e])
            elif s == "loop_overlapping_halves":  # up reads columns 1..I, not the second half
                p = xe @ self.w13_kn[e]
                y = (F.silu(p[..., :I]) * p[..., 1:I + 1]) @ self.w2_kn[e]
            elif s == "loop_uneven_split":  # split at 3I/4: halves of different widths
                g, u = torch.split(F.linear(xe, self.w13[e]), [I // 2, I + I // 2], dim=-1)
                y = F.linear(F.silu(g) * u[..., :I // 2], self.w2[e][:, :I // 2])
            elif s == "loop_gate_squared":  # silu(g) * g: the second half is never read
                g, _ = F.linear(xe, self.w13[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * g, self.w2[e])
            out.index_add_(0, tok, y * weights[tok, pos, None])
        return out


FORMS = {"loop_chunk": "unrolled_loop", "loop_kn_slices": "unrolled_loop", "loop_kn_interleaved": "unrolled_loop",
         "loop_linear_split": "unrolled_loop", "gathered_chunk": "gathered_weights",
         "dense_slices": "dense_experts"}



@pytest.mark.parametrize("style", list(FORMS))
def test_fused_gate_up_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = FusedMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), FORMS[style], f"{style} T={T}")


@pytest.mark.parametrize("style", [s for s in FORMS if s != "loop_linear_split"])  # that one takes the list op
def test_training_hands_the_op_a_stacked_gate_up_weight_whole(style, monkeypatch):
    """With a gradient to make, a stacked fused gate/up weight reaches the op whole (no w1_up), so its backward gives
    one gradient for it instead of two halves' gradients stitched together: (E, H, 2I) when [gate | up], its
    (E, H, I, 2) pairs when interleaved. Inference keeps the two halves."""
    from moe_inductor.ops import experts as experts_module

    seen = []
    real = experts_module.from_op_args

    def spy(args):
        seen.append((args[4] is None, tuple(args[3].shape) if isinstance(args[3], torch.Tensor) else None))
        return real(args)

    monkeypatch.setattr(experts_module, "from_op_args", spy)
    torch.manual_seed(0)
    model = FusedMoE(style)
    assert_rewritten_like_eager(model, torch.randn(6, H), FORMS[style], style)
    whole = {"loop_chunk": (E, H, 2 * I), "loop_kn_slices": (E, H, 2 * I), "gathered_chunk": (E, H, 2 * I),
             "dense_slices": (E, H, 2 * I), "loop_kn_interleaved": (E, H, I, 2)}.get(style)
    assert seen and all(s == ((True, whole) if whole else (False, s[1])) for s in seen), seen
    seen.clear()
    with torch.no_grad():
        compile_moe(model, torch.randn(6, H))
    assert seen and not any(s[0] for s in seen), seen  # inference: the halves


@pytest.mark.parametrize("style", ["loop_up_first", "loop_overlapping_halves", "loop_uneven_split",
                                   "loop_gate_squared"])
def test_splits_that_are_not_gate_up_halves_are_left_alone(style):
    torch.manual_seed(0)
    model = FusedMoE(style)
    x = torch.randn(7, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"]["unrolled_loop"] == 1  # explain() says why
    assert_close(out, model(x), torch.float32, style)
