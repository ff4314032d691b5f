"""One top-1 pass of boolean-mask writes per choice of a top-k router (RaF-in/Build-deepseek-from-scratch's MOE)::

    routed = torch.zeros_like(x)
    for j in range(k):
        ids, probs = topk_indices[..., j], topk_probs[..., j]
        for e in range(E):
            mask = ids == e
            routed[mask] += experts[e](x[mask]) * probs[mask].unsqueeze(-1)

is the top-k MoE of (topk_indices, topk_probs) (``top1_masks._choices_spec``): rewritten, forward and backward equal
to eager, with (T, H) or (B, T, H) tokens, behind ``if mask.any():`` or not. Look-alikes are left alone, equal to
eager: a pass scaled by another choice's weight, a choice missing or taken twice, writes that replace rather than
add, a pass over ids that are not a column of the router's, passes that run different experts, and the buffer
changed in place between the passes."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E = 16, 12, 4


class ChoicePasses(nn.Module):
    def __init__(self, style: str = "plain", k: int = 2):
        super().__init__()
        self.style, self.k = style, k
        self.gate = nn.Linear(H, E)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H)) for _ in range(E))

    def forward(self, x):
        s, k = self.style, self.k
        topk_logits, topk_indices = torch.topk(self.gate(x), k=k, dim=-1)
        topk_probs = torch.softmax(topk_logits, dim=-1)
        routed = torch.zeros_like(x)
        choices = [0] * k if s == "same_choice_twice" else range(k - 1) if s == "missing_choice" else range(k)
        for j in choices:
            ids, probs = topk_indices[..., j], topk_probs[..., j]
            if s == "other_choice_weight":
                probs = topk_probs[..., (j + 1) % k]
            elif s == "shifted_ids" and j == 1:  # not a column of the router's ids
                ids = (ids + 1) % E
            if s == "clobbered" and j == 1:
                routed[..., 0] = 0.0
            for e in range(E):
                mask = ids == e
                expert = self.experts[(e + 1) % E if s == "other_experts" and j == 1 else e]
                if s == "guarded" and not mask.any():
                    continue
                if s == "assigned":
                    routed[mask] = expert(x[mask]) * probs[mask].unsqueeze(-1)
                else:
                    routed[mask] += expert(x[mask]) * probs[mask].unsqueeze(-1)
        return routed


def _tokens(batched: bool, T: int) -> torch.Tensor:
    return torch.randn(2, T, H) if batched else torch.randn(T, H)


@pytest.mark.parametrize("style,k,batched", [
    ("plain", 2, False),  # (T,) ids per pass
    ("plain", 3, True),  # (B, T) ids per pass: the flat op, viewed back
    ("guarded", 2, True),  # each write behind mask.any(), the skips proven by the masks' own (ids, e)
], ids=["T-k2", "BT-k3", "BT-k2-guarded"])
def test_passes_over_the_choices_are_rewritten(style, k, batched):
    torch.manual_seed(0)
    model = ChoicePasses(style, k).eval()
    for T in (3, 9):  # 3 tokens: some expert gets none
        assert_rewritten_like_eager(model, _tokens(batched, T), "unrolled_loop", f"{style} k={k} T={T}")


@pytest.mark.parametrize("style,reason", [
    ("other_choice_weight", "not scaled by column"),
    ("missing_choice", "not each column"),
    ("same_choice_twice", "rows are written twice"),
    ("assigned", "replaces the rows"),
    ("shifted_ids", "different id tensors"),
    ("other_experts", "run different experts"),
    ("clobbered", "changed by something other than its masked writes"),
])
def test_look_alike_passes_are_left_alone(style, reason):
    torch.manual_seed(0)
    model = ChoicePasses(style, k=3 if style == "missing_choice" else 2).eval()
    x = _tokens(True, 7)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"], "a pass must say why it left the loop alone"
    assert_close(out, model(x), torch.float32, style)
    import moe_inductor

    report = moe_inductor.explain(model, x)
    assert any(reason in m.reason for m in report.left_alone), [m.reason for m in report.left_alone]
