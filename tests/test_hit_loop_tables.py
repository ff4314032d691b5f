"""The hit-experts loop of transformers v4.55-4.57's GPT-OSS and Qwen3-VL-MoE experts (moe_inductor/hit_loops.py,
passes/loop_rows.py): the routing weights scattered into a dense (T, E) table, ``zeros_like(logits).scatter_(1,
ids, w)``, and each body reading ``table[tok, e, None]`` with the loop's 0-d index ``e = expert_idx[0]``; the loop
over ``expert_hit`` or over ``expert_hit[:]``.

Genuine: rewritten, equal to eager forward and backward, no graph break. Look-alikes, each equal to eager and not
rewritten: a table written after its scatter (expert 0's weights zeroed), a body reading another expert's column,
and a table scattered from ids that may repeat in a row (one write kept where the weights have two).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case, check_rewritten, run_case

H, I, E, K = 16, 12, 6, 2


class TableExperts(nn.Module):
    """Stacked (E, H, 2I) / (E, I, H) experts applied by ``@`` with a 0-d expert index, weights read from a dense
    (T, E) table; ``variant`` names a look-alike's difference."""

    def __init__(self, whole_slice: bool, variant: str = "genuine"):
        super().__init__()
        self.whole_slice, self.variant = whole_slice, variant
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)

    def forward(self, x):
        x = x.reshape(-1, H)
        logits = self.router(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, K, dim=-1)
        if self.variant == "repeated_ids":  # a row may name one expert twice: the table keeps one of its weights
            ids = torch.cat([ids[:, :1], ids[:, :1]], dim=1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        table = torch.zeros_like(logits).scatter_(1, ids, w)
        if self.variant == "edited_table":
            table[:, 0] = 0.0
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in (hit[:] if self.whole_slice else hit):
            expert_idx = expert_idx[0]
            _, tok = torch.where(mask[expert_idx])
            gate, up = (x[tok] @ self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            y = (up * F.silu(gate)) @ self.down_proj[expert_idx]
            column = (expert_idx + 1) % E if self.variant == "other_column" else expert_idx
            out.index_add_(0, tok, (y * table[tok, column, None]).to(x.dtype))
        return out


def _case(whole_slice: bool, variant: str = "genuine", expect: tuple = ("rewritten",)) -> Case:
    return Case(f"table_{variant}_{'slice' if whole_slice else 'plain'}", "transformers v4.57 GptOssExperts (mirror)",
                lambda: TableExperts(whole_slice, variant), lambda T, g: torch.randn(T, H, generator=g),
                form="unrolled_loop", expect=expect, token_counts=(1, 3, 9))


@pytest.mark.parametrize("whole_slice", [False, True])
def test_a_dense_weight_table_loop_is_rewritten_and_equal_to_eager(whole_slice):
    case = _case(whole_slice)
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), outcome.declared()
    check_rewritten(case, outcome)


@pytest.mark.parametrize("variant", ["edited_table", "other_column", "repeated_ids"])
def test_a_table_that_is_not_the_choices_weights_is_not_rewritten(variant):
    outcome = run_case(_case(False, variant))
    assert outcome.rewrites == {}, (variant, outcome.rewrites)
    for got, ref in outcome.steps:  # whatever ran instead, it computed what eager does
        torch.testing.assert_close(got.out, ref.out)
        for name, grad in ref.grads.items():
            torch.testing.assert_close(got.grads[name], grad)


class OneExpertBatch(nn.Module):
    """transformers v4.55's GPT-OSS training loop: the hit loop over ``hit[:]``, ``with torch.no_grad():`` around
    the rows' ``torch.where``, the stacked weights and biases indexed by the (1,) index tensor (a (1, n, .) batch of
    one expert, read back by ``out[0]``) and the table read at it. ``variant`` names a look-alike's difference."""

    def __init__(self, variant: str = "genuine"):
        super().__init__()
        self.variant = variant
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.down_bias = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x):
        x = x.reshape(-1, H)
        logits = self.router(x)
        w, ids = torch.topk(logits, K, dim=-1)
        table = torch.zeros_like(logits).scatter_(1, ids, F.softmax(w, dim=1))
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        loop = self._loop_no_grad_mlp if self.variant == "no_grad_mlp" else self._loop
        return loop(x, mask, hit, table, out)

    def _glu_down(self, y, expert_idx):
        gate, up = y[..., ::2], y[..., 1::2]
        gate, up = gate.clamp(min=None, max=7.0), up.clamp(min=-7.0, max=7.0)
        h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
        if self.variant == "mixed_rows":  # the one-expert batch summed along its rows before [0]: not row-wise
            return (h @ self.down_proj[expert_idx]).cumsum(1) + self.down_bias[expert_idx]
        return h @ self.down_proj[expert_idx] + self.down_bias[expert_idx]

    def _loop(self, x, mask, hit, table, out):
        for expert_idx in hit[:]:
            with torch.no_grad():
                _, tok = torch.where(mask[expert_idx[0]])
            y = x[tok] @ self.gate_up_proj[expert_idx] + self.gate_up_bias[expert_idx]
            y = self._glu_down(y, expert_idx)
            out.index_add_(0, tok, (y[0] * table[tok, expert_idx, None]).to(x.dtype))
        return out

    def _loop_no_grad_mlp(self, x, mask, hit, table, out):  # the expert's projection under no_grad too
        for expert_idx in hit[:]:
            with torch.no_grad():
                _, tok = torch.where(mask[expert_idx[0]])
                y = x[tok] @ self.gate_up_proj[expert_idx]
            y = self._glu_down(y, expert_idx)
            out.index_add_(0, tok, (y[0] * table[tok, expert_idx, None]).to(x.dtype))
        return out


def _batch_case(variant: str = "genuine") -> Case:
    return Case(f"one_expert_batch_{variant}", "transformers v4.55 GptOssExperts (mirror)",
                lambda: OneExpertBatch(variant), lambda T, g: torch.randn(T, H, generator=g), form="unrolled_loop",
                token_counts=(1, 3, 9))


def test_a_one_expert_batch_loop_under_no_grad_rows_is_rewritten_and_equal_to_eager():
    case = _batch_case()
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), outcome.declared()
    check_rewritten(case, outcome)


@pytest.mark.parametrize("variant", ["no_grad_mlp", "mixed_rows"])
def test_a_one_expert_batch_look_alike_is_not_rewritten(variant):
    outcome = run_case(_batch_case(variant))
    assert outcome.rewrites == {}, (variant, outcome.rewrites)
    for got, ref in outcome.steps:
        torch.testing.assert_close(got.out, ref.out)
        for name, grad in ref.grads.items():
            if grad is None:
                assert got.grads.get(name) is None, name
            else:
                torch.testing.assert_close(got.grads[name], grad)
