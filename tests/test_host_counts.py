"""Per-expert counts walked on the host (DeepSeek-V2's ``moe_infer``: ``.cpu().numpy()``, or ``.tolist()``), with a
running slice offset, a skip of experts with no tokens and the outputs appended to a list (moe_inductor/
host_counts.py, skipped_state.py; the loop read by passes/sorted_grouped_mm.py through split_loop's slice runs).

Genuine, rewritten and equal to eager, forward and gradients, at token counts that leave experts empty: the NumPy
walk over stacked weights, the ``.tolist()`` walk, one nn.Linear set per expert, each element's ``.item()``, and
``int(arr[e])`` over ``range(E)``. Look-alikes, each equal to
eager and not rewritten, with the reason explain() gives: a skip of experts with fewer than 2 tokens, a count of the
experts run kept in a local, the list's length read as a number, the counts used as numbers beyond the loop, the
outputs appended to a list the module keeps (a change the caller sees) or to one a caller made and handed in (its
reads are the caller's), and an array that is not the experts' counts.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_inductor import report
from tests.corpus.harness import Case, check_rewritten, check_unchanged, run_case

H, I, E, K = 16, 8, 8, 2


class WalkingMoE(nn.Module):
    """A top-2 MoE in moe_infer's style; ``variant`` picks the walk, the weights or the look-alike."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(),
                                                    nn.Linear(I, H, bias=False)) for _ in range(E)])
        self.kept: list = []

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self.variant == "per_expert":
            return self.experts[e](rows)
        h = F.linear(rows, self.w13[e])
        return F.linear(F.silu(h[..., :I]) * h[..., I:], self.w2[e])

    def route(self, x):
        """(weights, ids, the sort order of the flat ids, the rows in that order, each expert's count)."""
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        marks = ids.new_zeros((ids.shape[0], E))
        marks.scatter_(1, ids, 1)
        order = ids.view(-1).argsort()
        return weights, ids, order, x[order // K], marks.sum(dim=0)

    @staticmethod
    def unsort(out, order, ids, weights):
        """The outputs put back in (token, slot) order, weighted in fp32 and summed over the slots."""
        placed = torch.empty_like(out)
        placed[order] = out
        return placed.view(*ids.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(dim=-1)).sum(dim=1)

    def forward(self, x):
        weights, ids, order, rows, per_expert = self.route(x)
        if self.variant == "not_counts":
            per_expert = per_expert + 1
        per_expert = per_expert.tolist() if self.variant == "tolist" else per_expert.cpu().numpy()
        outputs = self.kept if self.variant == "kept_list" else []
        self.kept.clear()
        start, ran, scale = 0, 0, 0.0
        for e, n in enumerate(per_expert):
            end = start + n
            scale = scale + n * 0.5 if self.variant == "numbers_used" else scale
            if self.variant == "fewer_than_2" and n < 2:  # experts with one token output zeros
                outputs.append(rows[start:end] * 0)
                start = end
                continue
            if n == 0:
                continue
            outputs.append(self.expert(e, rows[start:end]))
            if self.variant == "counted":
                ran += 1
            start = end
        y = self.unsort(torch.cat(outputs, dim=0) if len(outputs) else rows.new_empty(0), order, ids, weights)
        if self.variant == "counted":
            y = y * ran / E
        elif self.variant == "numbers_used":
            y = y * scale
        return y


class LenScaledMoE(WalkingMoE):
    """The NumPy walk, its output scaled by the number of experts that ran, ``len(outputs)``: a read of the list
    that the skip changes (the check reads the function's bytecode, so this look-alike has its own forward)."""

    def forward(self, x):
        weights, ids, order, rows, per_expert = self.route(x)
        outputs, start = [], 0
        for e, n in enumerate(per_expert.cpu().numpy()):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.expert(e, rows[start:end]))
            start = end
        return self.unsort(torch.cat(outputs), order, ids, weights) * len(outputs) / E


class ReadEachMoE(WalkingMoE):
    """The NumPy copy read one element at a time: ``num_tokens = t.item()`` of each element walked (inclusionAI's
    Ling and LLaDA2 copies of ``moe_infer``), or ``int(arr[e])`` over ``range(E)``, the slice taken after the skip."""

    def forward(self, x):
        weights, ids, order, rows, per_expert = self.route(x)
        per_expert = per_expert.cpu().numpy()
        outputs, start = [], 0
        if self.variant == "numpy_item":
            for e, count in enumerate(per_expert):
                n = count.item()
                if n == 0:
                    continue
                end = start + n
                outputs.append(self.expert(e, rows[start:end]))
                start = end
        else:
            for e in range(E):
                n = int(per_expert[e])
                if n == 0:
                    continue
                end = start + n
                outputs.append(self.expert(e, rows[start:end]))
                start = end
        return self.unsort(torch.cat(outputs, dim=0) if len(outputs) else rows.new_empty(0), order, ids, weights)


class HandedListMoE(WalkingMoE):
    """The walk in a helper that appends to a list ``forward`` made and handed it, ``forward`` then scaling by the
    list's length: a read the helper's bytecode does not show, so the skip is refused (``handed_list``). Where the
    helper makes the list itself (``helper_list``), the walk is rewritten."""

    def walk(self, rows, per_expert, outputs):
        start = 0
        for e, n in enumerate(per_expert.cpu().numpy()):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.expert(e, rows[start:end]))
            start = end

    def walk_own(self, rows, per_expert):
        outputs, start = [], 0
        for e, n in enumerate(per_expert.cpu().numpy()):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.expert(e, rows[start:end]))
            start = end
        return torch.cat(outputs, dim=0)

    def forward(self, x):
        weights, ids, order, rows, per_expert = self.route(x)
        if self.variant == "helper_list":
            return self.unsort(self.walk_own(rows, per_expert), order, ids, weights)
        outputs = []
        self.walk(rows, per_expert, outputs)
        return self.unsort(torch.cat(outputs, dim=0), order, ids, weights) * len(outputs) / E


def _case(variant: str, expect: tuple) -> Case:
    kind = {"len_scaled": LenScaledMoE, "numpy_item": ReadEachMoE, "numpy_index": ReadEachMoE,
            "handed_list": HandedListMoE, "helper_list": HandedListMoE}.get(variant, WalkingMoE)
    build = lambda: kind(variant)  # noqa: E731
    return Case(f"walk-{variant}", "tests/test_host_counts.py", build,
                lambda T, g: torch.randn(T, H, generator=g), form="sorted_grouped_mm", expect=expect,
                token_counts=(3, 9))


@pytest.mark.slow  # each case compiles a model
@pytest.mark.parametrize("variant", ["numpy", "tolist", "per_expert", "numpy_item", "numpy_index", "helper_list"])
def test_a_walk_of_host_counts_is_rewritten_and_equal_to_eager(variant):
    case = _case(variant, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    check_rewritten(case, outcome)
    # 3 tokens with 2 choices each reach at most 6 of the 8 experts: eager took the skip
    assert outcome.rewrites == {"sorted_grouped_mm": outcome.graphs}


@pytest.mark.slow
@pytest.mark.parametrize("variant, said", [
    ("fewer_than_2", "is not a test of 'this expert got no tokens'"),
    ("counted", "to a number other than its value at no tokens"),
    ("len_scaled", "is read other than by append, torch.cat or a len() test"),
    ("numbers_used", "are still read by"),
    ("kept_list", "the skipped body changes Python state"),
    ("handed_list", "a list not made by this function"),
])
def test_a_walk_that_is_not_the_experts_loop_is_kept_and_equal_to_eager(variant, said):
    case = _case(variant, ("fell_back",))
    with report.collecting(report.Report()) as seen:
        outcome = run_case(case)
    assert outcome.fallbacks and outcome.kind != "crash", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_unchanged(case, outcome)
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


@pytest.mark.slow
def test_an_array_that_is_not_the_experts_counts_is_left_to_dynamo():
    """``counts + 1`` walked on the host: not a count vector, so its elements stay NumPy's (a graph break, as
    under every backend), and nothing is rewritten."""
    case = _case("not_counts", ("graph_break",))
    outcome = run_case(case)
    assert outcome.kind in ("graph_break", "fell_back") and not outcome.rewrites, outcome.declared()
    check_unchanged(case, outcome)
