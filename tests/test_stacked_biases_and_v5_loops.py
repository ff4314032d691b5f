"""Two spellings from transformers v5's eager experts loops, written into user code.

- Stacked biases in a per-expert loop (passes/unrolled_loop.py ``biased_linear``): ``x @ w[e] + b[e]`` and
  ``F.linear(x, w[e], b[e])`` with (E, out) biases. Genuine: rewritten, forward and every gradient (biases
  included) equal to eager. Look-alikes, equal to eager and left alone with the reason: another expert's bias row,
  one bias shared by every expert, a bias that does not match the weight's width.
- The loop over the hit experts with a 0-d index and a branch on it (hit_loops.py): ``expert_idx = expert_idx[0]``,
  ``if expert_idx == num_experts: continue`` (the spare class of an E + 1 one-hot skipped whole), or the loop over
  the nonzero's one column (``squeeze(-1)``, ``flatten()``, ``view(-1)``, ``[:, 0]``). Genuine: rewritten, equal to
  eager. Look-alikes, equal to eager and not rewritten: a skip of a real expert (``== 0``), a comparison with a
  tensor (not known while tracing), the first column of a two-column nonzero.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class BiasedLoop(nn.Module):
    """A loop over range(E) with stacked weights and biases; ``style`` picks how the bias is spelled."""

    def __init__(self, style: str = "matmul"):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        nk = style == "linear"
        self.w1 = nn.Parameter(torch.randn((E, 2 * I, H) if nk else (E, H, 2 * I)) * H ** -0.5)
        self.b1 = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.w2 = nn.Parameter(torch.randn((E, H, I) if nk else (E, I, H)) * I ** -0.5)
        self.b2 = nn.Parameter(torch.randn(E, H) * 0.1)
        self.shared_b2 = nn.Parameter(torch.randn(H) * 0.1)
        self.wide_b2 = nn.Parameter(torch.randn(E, 2 * H) * 0.1)

    def down_bias(self, e: int) -> torch.Tensor:
        if self.style == "other_expert_bias":
            return self.b2[(e + 1) % E]
        if self.style == "shared_bias":
            return self.shared_b2
        if self.style == "wide_bias":
            return self.wide_b2[e][:H]
        return self.b2[e]

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            if self.style == "linear":
                gate, up = F.linear(x[tok], self.w1[e], self.b1[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.w2[e], self.b2[e])
            else:
                gate, up = (x[tok] @ self.w1[e] + self.b1[e]).chunk(2, dim=-1)
                y = (F.silu(gate) * up) @ self.w2[e] + self.down_bias(e)
            out.index_add_(0, tok, y * weights[tok, pos, None])
        return out


@pytest.mark.parametrize("style", ["matmul", "linear"])
def test_stacked_biases_are_rewritten_and_equal_to_eager(style):
    torch.manual_seed(0)
    assert_rewritten_like_eager(BiasedLoop(style), torch.randn(9, H), "unrolled_loop")


@pytest.mark.parametrize("style,reason", [
    ("other_expert_bias", "output is not a matmul or F.linear on w[0]"),
    ("shared_bias", "output is not a matmul or F.linear on w[0]"),
    ("wide_bias", "output is not a matmul or F.linear on w[0]"),
])
def test_bias_look_alikes_are_left_alone(style, reason):
    torch.manual_seed(0)
    model = BiasedLoop(style)
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    (left,) = moe_inductor.explain(model, x).left_alone
    assert left.form == "unrolled_loop" and reason in left.reason, left


class V5HitLoop(nn.Module):
    """transformers v5's eager loop over the hit experts; ``skip`` picks the branch on the index, ``column`` loops
    over the nonzero's one column (0-d indices, no ``expert_idx[0]``) in one of its spellings."""

    def __init__(self, skip: str = "spare_class", column: str = ""):
        super().__init__()
        self.skip, self.column = skip, column
        self.num_experts = E
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.register_buffer("skipped", torch.tensor(E))

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(ids, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        if self.column:
            hit = {"squeeze": lambda: hit.squeeze(-1), "flatten": hit.flatten, "view": lambda: hit.view(-1),
                   "first": lambda: hit[:, 0]}[self.column]()
        for expert_idx in hit:
            if not self.column:
                expert_idx = expert_idx[0]
            if self.skip == "spare_class" and expert_idx == self.num_experts:
                continue
            if self.skip == "expert_0" and expert_idx == 0:  # a real expert skipped: not an MoE over range(E)
                continue
            if self.skip == "tensor" and expert_idx == self.skipped:  # unknown while tracing
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert_idx]) * weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


@pytest.mark.parametrize("column", ["", "squeeze", "flatten", "view", "first"])
def test_the_v5_hit_loop_is_rewritten_and_equal_to_eager(column):
    torch.manual_seed(0)
    assert_rewritten_like_eager(V5HitLoop(column=column), torch.randn(9, H), "unrolled_loop")


def test_a_loop_over_a_nonzero_of_two_columns_is_not_unrolled():
    """The nonzero of a (E, k) matrix has two columns: its first column repeats experts, it is no list of hit
    experts. Equal to eager, not rewritten."""

    class TwoColumns(V5HitLoop):
        def forward(self, x):
            weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
            out = torch.zeros_like(x)
            mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
            for expert_idx in (mask.sum(-1) > 0).nonzero()[:, 0]:  # (E, k) counts: an expert once per slot
                top_k_pos, token_idx = torch.where(mask[expert_idx])
                h = F.relu(F.linear(x[token_idx], self.gate_up_proj[expert_idx][:I]))
                y = F.linear(h, self.down_proj[expert_idx])
                out.index_add_(0, token_idx, y * weights[token_idx, top_k_pos, None])
            return out

    torch.manual_seed(0)
    model = TwoColumns()
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


@pytest.mark.parametrize("skip", ["expert_0", "tensor"])
def test_a_v5_loop_that_skips_other_than_the_spare_class_is_not_rewritten(skip):
    torch.manual_seed(0)
    model = V5HitLoop(skip)
    for T in (1, 7):
        x = torch.randn(T, H)
        assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
        assert not counters["moe_inductor"], dict(counters["moe_inductor"])
