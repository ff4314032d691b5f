"""The dense all-experts form's expert-major spelling (passes/dense_repeated.py, transformers v4.55-4.57's GPT-OSS and
Qwen3-VL-MoE at inference): tokens repeated once per expert, bmm over the experts, scaled by the transposed routing
table and summed over the experts. Rewritten and equal to eager (forward and gradients), with and without biases,
split over a batch dim or not, at static and at dynamic token counts. Look-alikes, equal to eager and not
rewritten: a soft mixture (no top-k scatter), the table read without its transpose, the tokens repeated another way
(``repeat(1, E)``), the experts' outputs used elsewhere too, and the routing split over the tokens otherwise than
the outputs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_gpu_bf16_rewrite, assert_rewritten_like_eager, compile_moe

E, H, I, K = 5, 16, 8, 2


class Repeated(nn.Module):
    """``variant`` names what differs from the genuine layer (``"bias"``: GPT-OSS's biases and clamped glu)."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.b1 = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.b2 = nn.Parameter(torch.randn(E, H) * 0.1)
        self.side = None

    def forward(self, x):  # x: (B, S, H)
        B = x.shape[0]
        flat = x.reshape(-1, H)
        logits = self.router(flat)
        probs = F.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        table = torch.zeros_like(logits).scatter_(1, ids, w / w.sum(-1, keepdim=True))
        if self.variant == "soft":
            table = probs
        if self.variant == "repeat_columns":  # (T, E*H) viewed (E, T, H): rows are not the tokens in order
            xs = flat.repeat(1, E).view(E, -1, H)
        else:
            xs = flat.repeat(E, 1).view(E, -1, H)
        gate_up = torch.bmm(xs, self.gate_up)
        if self.variant == "bias":
            gate_up = gate_up + self.b1[..., None, :]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate, up = gate.clamp(min=None, max=7.0), up.clamp(min=-7.0, max=7.0)
            h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = up * F.silu(gate)
        out = torch.bmm(h, self.down)
        if self.variant == "bias":
            out = out + self.b2[..., None, :]
        if self.variant == "used_twice":
            self.side = out.mean()
        if self.variant == "flat":  # no batch split: (E, T, H) * (E, T, 1), summed to (T, H)
            return (out * table.transpose(0, 1)[..., None]).sum(dim=0)
        out = out.view(E, B, -1, H)
        if self.variant == "untransposed":  # the (T, E) table viewed (E, B, S) as it lies: not token t's row
            scale = table.reshape(E, B, -1)[..., None]
        elif self.variant == "other_split":  # the table's tokens split (S, B) where the outputs split (B, S)
            scale = table.transpose(0, 1).reshape(E, -1, B).transpose(1, 2)[..., None]
        else:
            scale = table.transpose(0, 1).view(E, B, -1)[..., None]
        return (out * scale).sum(dim=0)


@pytest.mark.parametrize("variant", ["plain", "bias", "flat"])
def test_the_expert_major_dense_layer_is_rewritten_and_equal_to_eager(variant):
    torch.manual_seed(0)
    model = Repeated(variant)
    assert_rewritten_like_eager(model, torch.randn(2, 5, H), "dense_experts")
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["moe_inductor_left_alone"]


def test_dynamic_token_counts_keep_the_rewrite():
    torch.manual_seed(0)
    model = Repeated("bias")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for S in (3, 4, 7, 9):
        x = torch.randn(2, S, H)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["dense_experts"] == 2  # the first compile, then the dynamic one
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("variant", ["soft", "untransposed", "repeat_columns", "used_twice", "other_split"])
def test_look_alikes_are_left_alone(variant):
    torch.manual_seed(0)
    model = Repeated(variant)
    x = torch.randn(2, 3, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


def test_explain_says_why_a_soft_mixture_stays_dense():
    torch.manual_seed(0)
    report = moe_inductor.explain(Repeated("soft"), torch.randn(2, 3, H))
    assert any(left.form == "dense_experts" and "not sparse" in left.reason for left in report.left_alone), \
        report.left_alone


def test_our_kernels_run_the_biased_interleaved_layer(triton_kernels):
    """The op's Triton kernels (the interpreter's, on CPU tensors) on GPT-OSS's (E, H, 2I) interleaved gate/up weight
    with both biases, read in place ("kn"): equal to eager."""
    torch.manual_seed(0)
    model = Repeated("bias")
    x = torch.randn(2, 3, H)
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"]["dense_experts"] == 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "bias"])
def test_gpu_kernels_run_the_expert_major_dense_layer_bf16(variant):
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(Repeated(variant), "dense_experts")
