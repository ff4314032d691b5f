"""transformers' Llama 4 experts (v4.51-4.57): every token once per expert, SCALED BY ITS SCORE before the experts,
bmm over the experts (passes/dense_repeated.match_input_scaled for the repeated tokens summed over E;
dense_experts.match_token_replicated for the tokens gathered by an arange and scatter-added back), the (E, T)
scores read through the fp32 round trip ``torch.sigmoid(table.float()).to(dtype)`` (passes/score_tables.py).

Rewritten and equal to eager, forward and gradients. Look-alikes, equal to eager and not rewritten: the sigmoid of a
zeros table (0.5 off the top-k, not 0), a -inf table without the sigmoid, the fp32 copy edited in place, a table
flattened without its transpose, a bias in the experts (an expert of a zero input is then not zero), an integer
cast in the chain, the sum over the wrong dim, and the tokens repeated by columns."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_gpu_bf16_rewrite, assert_rewritten_like_eager, compile_moe

E, H, I, K = 5, 16, 8, 2


class InputScaled(nn.Module):
    """``variant`` names what differs from the genuine v4.5x layer; ``"gathered"`` is the v4.51 spelling."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.down = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.b2 = nn.Parameter(torch.randn(E, 1, H) * 0.1)
        self.shared = nn.Linear(H, H, bias=False)

    def _table(self, flat):
        logits = self.router(flat)
        v, ids = torch.topk(logits, K, dim=1)
        if self.variant in ("zeros_sigmoid", "plain_zeros"):
            table = torch.zeros_like(logits).scatter_(1, ids, v)
        else:
            table = torch.full_like(logits, float("-inf")).scatter_(1, ids, v)
        if self.variant in ("no_sigmoid", "plain_zeros"):
            return table
        if self.variant == "int_cast":
            return torch.sigmoid(table).to(torch.int32).to(flat.dtype)
        wide = table.float()
        if self.variant == "edited_copy":  # a copy in fp32 too (``float()`` of an fp32 table is the table itself)
            wide = table.double()
            wide[:, 0] = 3.0
        return torch.sigmoid(wide).to(flat.dtype)

    def _experts(self, routed_in):
        xs = routed_in.view(E, -1, H)
        gate, up = torch.bmm(xs, self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down)
        if self.variant == "expert_bias":
            out = out + self.b2
        return out.view(-1, H)

    def forward(self, x):  # x: (B, S, H)
        flat = x.reshape(-1, H)
        table = self._table(flat)
        out = self.shared(flat)
        if self.variant == "gathered":  # v4.51: gather by an arange, scatter_add_ back
            scores = table.transpose(0, 1)
            rows = torch.arange(flat.shape[0], device=flat.device).view(1, -1).expand(E, -1).reshape(-1, 1).expand(-1, H)
            routed_in = torch.gather(flat, 0, rows) * scores.reshape(-1, 1)
            out.scatter_add_(0, rows, self._experts(routed_in))
            return x + out.view(x.shape)
        scale = table.reshape(-1, 1) if self.variant == "untransposed" else table.transpose(0, 1).reshape(-1, 1)
        if self.variant == "repeat_columns":
            routed_in = flat.repeat(1, E).view(-1, H) * scale
        else:
            routed_in = flat.repeat(E, 1) * scale
        routed = self._experts(routed_in).reshape(E, -1, H)
        summed = routed.sum(dim=1).sum(dim=0, keepdim=True) if self.variant == "wrong_dim" else routed.sum(dim=0)
        out.add_(summed)
        return x + out.view(x.shape)


@pytest.mark.parametrize("variant", ["plain", "gathered", "plain_zeros"])
def test_llama4_input_scaled_experts_are_rewritten_and_equal_to_eager(variant):
    torch.manual_seed(0)
    assert_rewritten_like_eager(InputScaled(variant), torch.randn(2, 5, H), "dense_experts")
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["moe_inductor_left_alone"]


def test_dynamic_token_counts_keep_the_rewrite():
    torch.manual_seed(0)
    model = InputScaled()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for S in (3, 4, 7, 9):
        x = torch.randn(2, S, H)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["dense_experts"] == 2  # the first compile, then the dynamic one
    assert not counters["moe_inductor_left_alone"]


@pytest.mark.parametrize("variant", ["zeros_sigmoid", "no_sigmoid", "edited_copy", "untransposed", "expert_bias",
                                     "int_cast", "wrong_dim", "repeat_columns"])
def test_look_alikes_are_left_alone(variant):
    torch.manual_seed(0)
    model = InputScaled(variant)
    x = torch.randn(2, 3, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6, equal_nan=True)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


@pytest.mark.parametrize("variant, words", [("zeros_sigmoid", "sigmoid is 0 only at -inf"),
                                            ("edited_copy", "changed in place")])
def test_explain_says_why_a_table_is_not_proven(variant, words):
    torch.manual_seed(0)
    report = moe_inductor.explain(InputScaled(variant), torch.randn(2, 3, H))
    assert any(left.form == "dense_experts" and words in left.reason for left in report.left_alone), \
        report.left_alone


def test_bf16_casts_are_replayed_on_the_top_k_values():
    """In bf16 the table's sigmoid runs in fp32 and is cast back: the op's routing weights must be made the same
    way, so the rewrite equals eager to bf16 rounding of the same numbers."""
    torch.manual_seed(0)
    model = InputScaled().to(torch.bfloat16)
    x = torch.randn(2, 4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"]["dense_experts"] == 1
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "gathered"])
def test_gpu_kernels_run_the_llama4_input_scaled_layer_bf16(variant):
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(InputScaled(variant), "dense_experts")
