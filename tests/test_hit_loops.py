"""Loops over the experts that got tokens (moe_inductor/hit_loops.py): transformers v4's ``for expert_idx in
greater(expert_mask.sum((-1, -2)), 0).nonzero()`` traced as the loop over every expert, kept only where the
unrolled_loop rewrite takes every body, else the frame falls back.

Genuine: the v4 Qwen2-MoE / Mixtral spelling and three other spellings of "expert e got tokens" (``> 0`` on the
summed mask, ``one_hot(...).any(dims)``, ``bincount(...) >= 1``), rewritten without gradients, equal to eager at
token counts that leave most experts empty, in at most 2 compiles over 4 token counts and no graph break; with
gradients rewritten too, equal to eager, forward and gradients (an empty expert's weights keep a None gradient). The body may skip
its own empty expert (``if len(top_x) == 0: continue``) and index by ``expert_idx.item()``. Look-alikes, each
equal to eager and not rewritten, with the reason explain() gives: a count > 1, a vector unrelated to the router, a
hit vector edited in place, a body that also writes a buffer, appends to a list read after the loop, selects another
expert's rows (a computed index, a constant expert), skips on another expert's count or on fewer than 2 rows, or sets
a local read after the loop.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.corpus.harness import Case, check_rewritten, run_case
from tests.helpers import assert_loop_rewritten_beside_eager, compile_beside_eager, rel_err

H, I, E, K = 16, 8, 8, 2
TOKEN_COUNTS = (1, 2, 3, 9)  # 1 token with 2 choices reaches 2 of the 8 experts: 6 get no rows


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HitLoopMoE(nn.Module):
    """transformers v4.48+ MixtralSparseMoeBlock (v4.5x Qwen2MoeSparseMoeBlock without its shared expert): the loop
    over the hit experts; ``hit`` picks how the hit experts are found, ``body`` what else the body does."""

    def __init__(self, hit: str = "greater_sum", body: str = "mlp"):
        super().__init__()
        self.hit, self.body = hit, body
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])
        self.register_buffer("hits", torch.zeros(E))
        self.register_buffer("preference", torch.randn(E))

    def hit_experts(self, ids, expert_mask):
        if self.hit == "greater_sum":  # transformers v4.48+ Mixtral, v4.5x Qwen2-MoE, v5 eager
            return torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        if self.hit == "gt_sum":
            return (expert_mask.sum(dim=(1, 2)) > 0).nonzero()
        if self.hit == "any":
            return F.one_hot(ids, num_classes=E).any(dim=(0, 1)).nonzero()
        if self.hit == "bincount":
            return (torch.bincount(ids.flatten(), minlength=E) >= 1).nonzero()
        if self.hit == "count_above_1":  # experts with 2 rows or more: an expert with one row is skipped
            return torch.greater(expert_mask.sum(dim=(-1, -2)), 1).nonzero()
        if self.hit == "unrelated":  # experts a buffer prefers, whatever the router chose
            return (self.preference > 0).nonzero()
        if self.hit == "edited":  # expert 0 is skipped even when it got tokens
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0)
            hit[0] = False
            return hit.nonzero()
        raise ValueError(self.hit)

    def forward(self, x):
        batch, seq, hidden = x.shape
        x = x.view(-1, hidden)
        weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        weights, ids = torch.topk(weights, K, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        y = torch.zeros((batch * seq, hidden), dtype=x.dtype, device=x.device)
        expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        ran = []
        for expert_idx in self.hit_experts(ids, expert_mask):
            if self.body == "item_skip":  # copies of the loop that index with the int
                expert_idx = expert_idx.item()
            expert_layer = self.experts[expert_idx]
            if self.body == "other_expert":
                idx, top_x = torch.where(expert_mask[(expert_idx + 1) % E].squeeze(0))
            elif self.body == "expert_0":
                idx, top_x = torch.where(expert_mask[0])
            else:
                idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            if self.body in ("skip_empty", "item_skip") and len(top_x) == 0:  # a no-tokens skip, as copies add
                continue
            if self.body == "skip_on_expert_0" and len(torch.where(expert_mask[0])[1]) == 0:  # another expert's
                continue
            if self.body == "skip_below_2" and len(top_x) < 2:  # not a no-tokens test: an expert with 1 row skipped
                continue
            current = x[None, top_x].reshape(-1, hidden)
            out = expert_layer(current) * weights[top_x, idx, None]
            if self.body == "buffer":
                self.hits[expert_idx] += 1
            if self.body == "list":
                ran.append(expert_idx)
            y.index_add_(0, top_x, out.to(x.dtype))
        if self.body == "list":
            y = y * len(ran)
        return y.reshape(batch, seq, hidden)


class LastExpertMoE(HitLoopMoE):
    """The loop over the hit experts, keeping the last expert it ran in a local read after the loop (a local set
    in the loop is seen in the bytecode, whichever branch sets it, so this is a class of its own)."""

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=1, dtype=torch.float), K, dim=-1)
        y = torch.zeros_like(x)
        expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for expert_idx in self.hit_experts(ids, expert_mask):
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            out = self.experts[expert_idx](x[None, top_x].reshape(-1, H)) * weights[top_x, idx, None]
            y.index_add_(0, top_x, out)
            last = expert_idx
        return (y + last).view(1, -1, H)


def _run(model: nn.Module):
    """Compile ``model`` (inner compiler "eager") and call it at each token count without gradients, next to eager:
    (compiled and eager outputs, graphs compiled, graph breaks, what explain() would report)."""
    eager = type(model)(model.hit, model.body)
    eager.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    got = compile_beside_eager(model, eager, [torch.randn(1, T, H, generator=gen) for T in TOKEN_COUNTS])
    assert torch.equal(model.hits, eager.hits)  # the module's own state, as eager left it
    return got


def _build(hit: str = "greater_sum", body: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    return LastExpertMoE(hit, body) if body == "local" else HitLoopMoE(hit, body)


@pytest.mark.parametrize("hit, body", [("greater_sum", "mlp"), ("gt_sum", "mlp"), ("any", "mlp"), ("bincount", "mlp"),
                                       ("greater_sum", "skip_empty"), ("greater_sum", "item_skip"),
                                       ("bincount", "item_skip")])
def test_a_loop_over_the_hit_experts_is_rewritten_and_equal_to_eager(hit, body):
    """Also with the body's own no-tokens skip (``if len(top_x) == 0: continue``) and with ``expert_idx.item()``,
    as copies of the loop that offload experts write it."""
    assert_loop_rewritten_beside_eager(_run(_build(hit, body)), TOKEN_COUNTS)


def test_with_gradients_it_is_rewritten_and_equal_to_eager_forward_and_backward():
    """Per-expert nn.Linear weights: eager leaves an expert that got no tokens without a gradient (None), and so
    does the rewrite (grad_gate.py gates each expert's own weights on ``(ids == e).any()``)."""
    case = Case("hit-loop-training", "tests/test_hit_loops.py", lambda: HitLoopMoE(),
                lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop", token_counts=(1, 3, 9))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks)
    check_rewritten(case, outcome)  # forward and gradients equal to eager, the same gradients None
    got, ref = outcome.steps[0]
    assert len(ref.grads) < 1 + 3 * E + 1  # one token reaches 2 experts: the others' weights have no gradient


@pytest.mark.parametrize("hit, body, said", [
    ("count_above_1", "mlp", "not 'expert e got tokens'"),
    ("unrelated", "mlp", "not a count of the router's ids per expert"),
    ("edited", "mlp", "is changed in place"),
    ("greater_sum", "local", "sets last, read after it"),
], ids=["count-above-1", "unrelated-vector", "hit-vector-edited", "local-read-after"])
def test_a_loop_that_is_not_over_the_hit_experts_is_not_unrolled(hit, body, said):
    outputs, _, breaks, seen = _run(_build(hit, body))
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert breaks >= 1  # the loop graph-breaks, as under plain torch.compile
    for got, ref in outputs:
        assert rel_err(got, ref) < 1e-5
    assert any("was not unrolled" in n and said in n for n in seen.notes), seen.notes


@pytest.mark.parametrize("body, said", [
    ("buffer", "no rewrite took its body"),
    ("list", "changes Python state"),
    ("other_expert", "selects no expert's rows"),
    ("expert_0", "reads the rows of expert 0"),
    ("skip_on_expert_0", "does not count the rows of its own expert"),
], ids=["buffer-write", "list-append", "computed-other-expert", "constant-expert", "skip-on-another-expert"])
def test_a_body_that_is_not_the_expert_accumulation_falls_back(body, said):
    outputs, _, _, seen = _run(_build("greater_sum", body))
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    for got, ref in outputs:
        assert rel_err(got, ref) < 1e-5
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


def test_a_skip_that_is_not_of_no_tokens_is_not_assumed_away():
    """``if len(top_x) < 2: continue`` skips an expert with one row, which the rewrite would compute: the branch is
    not assumed away, the frame falls back, and the result is eager's."""
    outputs, _, _, seen = _run(_build("greater_sum", "skip_below_2"))
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    for got, ref in outputs:
        assert rel_err(got, ref) < 1e-5
    assert seen.fallbacks or counters["graph_break"]


@pytest.mark.parametrize("body", ["mlp", "item_skip"])
def test_the_hooks_do_nothing_under_another_backend(body):
    """backend="eager" (plain Dynamo): the loop over the hit experts still graph-breaks, as without moe_inductor,
    and so does its ``.item()``."""
    torch._dynamo.reset()
    model = _build("greater_sum", body)
    x = torch.randn(1, 3, H)
    assert torch._dynamo.explain(model)(x).graph_break_count >= 1
    with torch.no_grad():
        assert torch.allclose(torch.compile(model, backend="eager")(x), model(x))
