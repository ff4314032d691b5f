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

MiniMind's walk of cumulative counts (``bincount().cpu().numpy().cumsum(0)``, ``start = 0 if i == 0 else cum[i -
1]``; moe_inductor/host_cumsum.py), with DeepSeek-V2's body: rewritten without minlength (the bincount shorter than
E), with it, by torch's cumsum, by ``.tolist()``, over ``for end in cum``; look-alikes kept, each equal to eager: a
skipped branch that counts, the wrong neighbour read, a walk that stops early, the index read after the loop, a
list noted before the skip, a bincount of other ids, ``.tolist()`` without minlength, ``enumerate(cum, 1)``.
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
    def move_count(counts):
        """Expert 2's count given to expert 1 in place: the counts still add up to the rows, but are not the
        experts' own, so eager runs expert 1 on expert 2's rows."""
        counts[1] += counts[2]
        counts[2] -= counts[2]

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
        if self.variant == "cpu_written":  # the .cpu() copy, whose memory the array shares, changed first
            host = per_expert.cpu()
            self.move_count(host)
            per_expert = host.numpy()
        else:
            per_expert = per_expert.tolist() if self.variant == "tolist" else per_expert.cpu().numpy()
        if self.variant == "array_written":
            self.move_count(per_expert)
        elif self.variant == "array_swapped":
            per_expert[[1, 2]] = per_expert[[2, 1]]
        outputs = self.kept if self.variant == "kept_list" else []
        self.kept.clear()
        start, ran, scale = 0, 0, 0.0
        for e, n in enumerate(per_expert):
            if self.variant == "walk_written" and e == 0:  # NumPy's iteration reads each element as it goes
                self.move_count(per_expert)
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
    ("array_written", "walked as numbers are changed in place"),
    ("array_swapped", "walked as numbers are changed in place"),
    ("cpu_written", "walked as numbers are changed in place"),
    ("walk_written", "walked as numbers are changed in place"),
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


# --- cumulative counts (MiniMind's moe_infer walk: moe_inductor/host_cumsum.py) -----------------------------------


class CumulativeWalkMoE(WalkingMoE):
    """The experts' boundaries walked instead of their counts, as MiniMind's ``moe_infer`` does: ``cum =
    flat.bincount().cpu().numpy().cumsum(0)``, ``for i, end in enumerate(cum)``, ``start = 0 if i == 0 else cum[i -
    1]``, ``if start == end: continue``; here with DeepSeek-V2's body (outputs appended, cat, weighted unsort), which
    sorted_grouped_mm takes, so that what decides each outcome is the walk. ``variant`` picks the spelling or the
    look-alike."""

    def __init__(self, variant: str):
        super().__init__(variant)
        if variant == "cum_last_idle":  # the last expert never chosen: the bincount is always shorter than E
            with torch.no_grad():
                self.gate.weight[E - 1] = -self.gate.weight[:E - 1].abs().sum(0) * 4

    def boundaries(self, flat):
        if self.variant in ("cum_minlength", "cum_stops_early_min"):
            return flat.bincount(minlength=E).cpu().numpy().cumsum(0)
        if self.variant == "cum_torch":
            return flat.bincount().cumsum(0).cpu().numpy()
        if self.variant == "cum_tolist":
            return flat.bincount(minlength=E).cumsum(0).tolist()
        if self.variant == "cum_tolist_padded":
            return flat.bincount().cumsum(0).tolist()
        if self.variant == "cum_not_ids":
            return (flat // 2).bincount().cpu().numpy().cumsum(0)
        return flat.bincount().cpu().numpy().cumsum(0)

    def forward(self, x):
        weights, ids, order, rows, _ = self.route(x)
        cum = self.boundaries(ids.view(-1))
        outputs = []
        if self.variant == "cum_plain_for":  # ``for end in cum`` with the start carried by hand
            start = 0
            for e, end in enumerate(cum):
                if start == end:
                    continue
                outputs.append(self.expert(e, rows[start:end]))
                start = end
            return self.unsort(torch.cat(outputs, dim=0), order, ids, weights)
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                continue
            outputs.append(self.expert(i, rows[start:end]))
        return self.unsort(torch.cat(outputs, dim=0), order, ids, weights)


class SkipCountingWalkMoE(CumulativeWalkMoE):
    """The cumulative walk whose skipped branch counts the idle experts (eager counts those below the largest id
    only), the output scaled by that count (each look-alike has its own forward: the checks read its bytecode)."""

    def forward(self, x):
        weights, ids, order, rows, _ = self.route(x)
        cum = self.boundaries(ids.view(-1))
        outputs, skipped = [], 0
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                skipped += 1
                continue
            outputs.append(self.expert(i, rows[start:end]))
        return self.unsort(torch.cat(outputs, dim=0), order, ids, weights) * (1 + skipped)


class IndexAfterWalkMoE(CumulativeWalkMoE):
    """The loop index read after the loop: the largest id in eager, E - 1 in a walk over all E experts."""

    def forward(self, x):
        weights, ids, order, rows, _ = self.route(x)
        cum = self.boundaries(ids.view(-1))
        outputs = []
        for i, end in enumerate(cum):
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                continue
            outputs.append(self.expert(i, rows[start:end]))
        return self.unsort(torch.cat(outputs, dim=0), order, ids, weights) * (i + 1) / E


class NotedWalkMoE(CumulativeWalkMoE):
    """Each expert walked noted in a list before the skip, the output scaled by its length (eager notes experts up
    to the largest id only); or (``cum_from_1``) the walk numbered from 1, ``enumerate(cum, 1)``."""

    def forward(self, x):
        weights, ids, order, rows, _ = self.route(x)
        cum = self.boundaries(ids.view(-1))
        outputs, seen = [], []
        if self.variant == "cum_from_1":
            for i, end in enumerate(cum, 1):
                start = 0 if i == 1 else cum[i - 2]
                if start == end:
                    continue
                outputs.append(self.expert(i - 1, rows[start:end]))
            return self.unsort(torch.cat(outputs, dim=0), order, ids, weights)
        for i, end in enumerate(cum):
            seen.append(i)
            start = 0 if i == 0 else cum[i - 1]
            if start == end:
                continue
            outputs.append(self.expert(i, rows[start:end]))
        return self.unsort(torch.cat(outputs, dim=0), order, ids, weights) * len(seen) / E


class ScatteringWalkMoE(CumulativeWalkMoE):
    """MiniMind's own body (each expert's output weighted in place and ``scatter_add_``-ed into zeros), which a
    token left out leaves at zero, for the look-alikes that leave tokens out: a walk that stops at E // 2, and one
    whose start reads the wrong neighbour, ``cum[i - 2]``."""

    def forward(self, x):
        weights, ids, order, _, _ = self.route(x)
        flat = ids.view(-1)
        cum = self.boundaries(flat)
        out, tok = torch.zeros_like(x), order // K
        for i, end in enumerate(cum):
            if self.variant.startswith("cum_stops_early") and i == E // 2:
                break
            start = 0 if i == 0 else cum[i - 1]
            if self.variant == "cum_wrong_neighbour":
                start = 0 if i < 2 else cum[i - 2]
            if start == end:
                continue
            y = self.expert(i, x[tok[start:end]])
            y.mul_(weights.view(-1, 1)[order[start:end]])
            out.scatter_add_(0, tok[start:end].view(-1, 1).repeat(1, H), y)
        return out


def _cumulative_case(variant: str, expect: tuple) -> Case:
    kind = {"cum_skip_counts": SkipCountingWalkMoE, "cum_index_after": IndexAfterWalkMoE,
            "cum_stops_early": ScatteringWalkMoE, "cum_stops_early_min": ScatteringWalkMoE,
            "cum_wrong_neighbour": ScatteringWalkMoE, "cum_noted": NotedWalkMoE,
            "cum_from_1": NotedWalkMoE}.get(variant, CumulativeWalkMoE)
    return Case(f"walk-{variant}", "tests/test_host_counts.py", lambda: kind(variant),
                lambda T, g: torch.randn(T, H, generator=g), form="sorted_grouped_mm", expect=expect,
                token_counts=(3, 9))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["cum_numpy", "cum_minlength", "cum_torch", "cum_tolist", "cum_plain_for",
                                     "cum_last_idle"])
def test_a_walk_of_cumulative_host_counts_is_rewritten_and_equal_to_eager(variant):
    """The bincount without minlength has max id + 1 entries (3 tokens reach at most 6 of 8 experts, and
    ``cum_last_idle`` never reaches the last): traced as all E, the experts past the largest id skipped."""
    case = _cumulative_case(variant, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    check_rewritten(case, outcome)
    assert outcome.rewrites == {"sorted_grouped_mm": outcome.graphs}


@pytest.mark.slow
@pytest.mark.parametrize("variant, said", [
    # the skipped branch counts idle experts: eager counts those below the largest id only
    ("cum_skip_counts", "does not go straight to the next iteration"),
    # start = cum[i - 2]: the test is c[i-1] + c[i] == 0, of two counts, so no skip is assumed (Dynamo's break)
    ("cum_wrong_neighbour", "Data-dependent branching"),
    # a walk that stops at E // 2: the experts past it never run
    ("cum_stops_early", "not every one of its iterations reaches a skip"),
    ("cum_stops_early_min", "not every one of its iterations reaches a skip"),
    # the loop index read after the loop: its last value is the largest id in eager, E - 1 in the walk over all E
    ("cum_index_after", "read after it"),
    # each expert walked appended to a list before the skip: the list's length is the largest id + 1 in eager
    ("cum_noted", "the code before its skip"),
])
def test_a_cumulative_walk_that_is_not_the_experts_loop_is_kept_and_equal_to_eager(variant, said):
    case = _cumulative_case(variant, ("fell_back",))
    with report.collecting(report.Report()) as seen:
        outcome = run_case(case)
    assert outcome.fallbacks and outcome.kind != "crash", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_unchanged(case, outcome)
    reasons = [f.reason for f in seen.fallbacks] + [r for f in seen.fallbacks for r in getattr(f, "also", ())]
    assert any(said in r for r in reasons), reasons


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    "cum_not_ids",  # bincount of flat // 2, not of the routing ids: its length is no bound of E
    "cum_tolist_padded",  # .tolist() of a bincount without minlength: a list whose length (max id + 1) is read
    "cum_from_1",  # enumerate(cum, 1): the walk's index is not the expert's (no consumer the walk takes)
])
def test_cumulative_counts_that_are_not_the_experts_are_left_to_dynamo(variant):
    case = _cumulative_case(variant, ("graph_break",))
    outcome = run_case(case)
    assert outcome.kind in ("graph_break", "fell_back") and not outcome.rewrites, outcome.declared()
    check_unchanged(case, outcome)
