"""Loops over ``.tolist()`` of a top-k router's hit experts (``moe_inductor/hit_lists.py``): GPTQModel's MiniMax-M2
port and copies of transformers v4's loop iterate the nonzero of "expert e got tokens" as Python ints::

    expert_hit = torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()
    for expert_idx in expert_hit.tolist():
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        y.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None])

Traced as the loop over every expert and kept only where the unrolled_loop rewrite takes every body (the hit loops'
proof, tests/test_hit_loops.py). Genuine: the column as ``.flatten()``, ``.squeeze(-1)``, ``[:, 0]`` or
``nonzero(as_tuple=True)[0]``, the list in a local, hit vectors by ``> 0`` or ``.any``; rewritten, equal to eager
at token counts that leave most experts empty, with no graph break, and with gradients forward and backward.
MiniMax-M2's chunk loop over an expert's rows (``range(0, rows, 1024)``) is rewritten too, traced as one pass
(tests/test_chunked_rows.py has its look-alikes). Look-alikes, equal to eager and not rewritten, each with the
reason explain() gives: a count > 1, a vector unrelated to the router, a hit vector edited in place, the list read
again, a local read after the loop, and a body that reads another expert's rows."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.corpus.harness import Case, check_rewritten, run_case
from tests.helpers import assert_loop_rewritten_beside_eager, compile_beside_eager, rel_err
from tests.test_hit_loops import Expert

H, I, E, K = 16, 8, 8, 2
TOKEN_COUNTS = (1, 2, 3, 9)  # 1 token with 2 choices reaches 2 of the 8 experts: 6 get no rows


class ListedHitMoE(nn.Module):
    """The loop over ``.tolist()`` of the hit experts; ``listed`` picks how the list is made, ``body`` what the body
    does besides the expert MLP."""

    def __init__(self, listed: str = "flatten", body: str = "mlp"):
        super().__init__()
        self.listed, self.body = listed, body
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])
        self.register_buffer("preference", torch.randn(E))

    def hit_list(self, ids, expert_mask):
        """The tensor whose ``.tolist()`` the loop iterates (taken in the loop's own function: the list must reach
        the loop's GET_ITER there)."""
        s = self.listed
        if s == "flatten":  # GPTQModel's MiniMax-M2
            return torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()
        if s == "squeeze":
            return torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        if s == "column":
            return (expert_mask.sum(dim=(1, 2)) > 0).nonzero()[:, 0]
        if s == "as_tuple":
            return torch.nonzero(F.one_hot(ids, num_classes=E).any(dim=(0, 1)), as_tuple=True)[0]
        if s == "count_above_1":  # experts with 2 rows or more: an expert with one row is skipped
            return torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 1).flatten()
        if s == "unrelated":  # experts a buffer prefers, whatever the router chose
            return torch.nonzero(self.preference > 0).flatten()
        if s == "edited":  # expert 0 is skipped even when it got tokens
            hit = expert_mask.sum(dim=(-1, -2)) > 0
            hit[0] = False
            return torch.nonzero(hit).flatten()
        raise ValueError(s)

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=1, dtype=torch.float), K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        y = torch.zeros_like(x)
        expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        return self.loop(x, weights, y, expert_mask, self.hit_list(ids, expert_mask)).view(1, -1, H)

    # each spelling with a loop of its own: the trace reads the bytecode of the whole function around the loop

    def loop(self, x, weights, y, expert_mask, hit):
        body = self.body
        if body == "read_again":
            return self._read_again(x, weights, y, expert_mask, hit)
        if body == "last_local":
            return self._last_local(x, weights, y, expert_mask, hit)
        if body == "chunks":
            return self._chunks(x, weights, y, expert_mask, hit)
        hits = hit.tolist()  # stored in a local, read once by the loop
        for expert_idx in hits:
            shift = 1 if body == "other_expert" else 0
            idx, top_x = torch.where(expert_mask[(expert_idx + shift) % E].squeeze(0))
            out = self.experts[expert_idx](x.index_select(0, top_x))
            y.index_add_(0, top_x, out * weights[top_x, idx].unsqueeze(-1))
        return y

    def _read_again(self, x, weights, y, expert_mask, hit):
        hit = hit.tolist()
        for expert_idx in hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            y.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None])
        return y * len(hit)

    def _last_local(self, x, weights, y, expert_mask, hit):
        last = -1
        for expert_idx in hit.tolist():
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            y.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None])
            last = expert_idx
        return y + last

    def _chunks(self, x, weights, y, expert_mask, hit):
        for expert_idx in hit.tolist():  # MiniMax-M2's port: each expert's rows in chunks of 4
            idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))
            for i in range(0, top_x_full.size(0), 4):
                top_x, idx = top_x_full[i:i + 4], idx_full[i:i + 4]
                y.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None])
        return y


def _run(model: nn.Module):
    """Compile ``model`` (inner compiler "eager") and call it at each token count without gradients, next to eager:
    (compiled and eager outputs, graphs compiled, graph breaks, what explain() would report)."""
    eager = ListedHitMoE(model.listed, model.body)
    eager.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    got = compile_beside_eager(model, eager, [torch.randn(1, T, H, generator=gen) for T in TOKEN_COUNTS])
    return got


def _build(listed: str = "flatten", body: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    return ListedHitMoE(listed, body)


@pytest.mark.parametrize("listed, body", [("flatten", "mlp"), ("squeeze", "mlp"), ("column", "mlp"),
                                          ("as_tuple", "mlp"), ("flatten", "chunks")],
                         ids=["flatten", "squeeze", "column", "as_tuple", "row-chunks"])
def test_a_list_of_the_hit_experts_is_rewritten_and_equal_to_eager(listed, body):
    assert_loop_rewritten_beside_eager(_run(_build(listed, body)), TOKEN_COUNTS)


def test_with_gradients_it_is_rewritten_and_equal_to_eager_forward_and_backward():
    case = Case("hit-list-training", "tests/test_hit_lists_topk.py", lambda: ListedHitMoE(),
                lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop", token_counts=(1, 3, 9))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks)
    check_rewritten(case, outcome)  # forward and gradients equal to eager, the same gradients None


@pytest.mark.parametrize("listed, body, said", [
    ("count_above_1", "mlp", "not 'expert e got tokens'"),
    ("unrelated", "mlp", "not a count of the router's ids per expert"),
    ("edited", "mlp", "is changed in place"),
    ("flatten", "read_again", "read 2 times, not once"),
    ("flatten", "last_local", "sets last, read after it"),
], ids=["count-above-1", "unrelated-vector", "hit-vector-edited", "list-read-again", "local-read-after"])
def test_a_list_that_is_not_of_the_hit_experts_is_not_traced_as_every_expert(listed, body, said):
    outputs, _, _, seen = _run(_build(listed, body))
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    for got, ref in outputs:
        assert rel_err(got, ref) < 1e-5
    assert any("was not traced as every expert" in f.reason and said in f.reason for f in seen.fallbacks), [
        f.reason for f in seen.fallbacks]


@pytest.mark.parametrize("body, said", [
    ("other_expert", "reads the rows of expert 1"),
], ids=["computed-other-expert"])
def test_a_body_that_is_not_the_expert_accumulation_falls_back(body, said):
    outputs, _, _, seen = _run(_build("flatten", body))
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    for got, ref in outputs:
        assert rel_err(got, ref) < 1e-5
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


def test_the_hooks_do_nothing_under_another_backend():
    """backend="eager" (plain Dynamo): ``.tolist()`` of the nonzero still graph-breaks, as without moe_inductor."""
    torch._dynamo.reset()
    model = _build()
    x = torch.randn(1, 3, H)
    assert torch._dynamo.explain(model)(x).graph_break_count >= 1
    with torch.no_grad():
        assert torch.allclose(torch.compile(model, backend="eager")(x), model(x))
