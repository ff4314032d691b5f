"""Branches on the elements of a host count tensor (Yuan2-M32's ``GroupedMLP``: ``if tokens_per_expert[i] == 0:
continue`` on a CPU tensor, ``end_idx = start_idx + tokens_per_expert[i]``), read as the ``.tolist()`` integers they
equal during a moe_inductor compile (moe_inductor/host_counts.py ``subscript``), with DeepSeek-V2's sort and unsort
around the loop (passes/sorted_grouped_mm.py through slice runs).

Skipping an expert with no rows equals running it on an empty slice only where the body computes nothing outside its
rows: the speculation proves that (speculation.py), and every count read must go with the rewrite.

Genuine, rewritten and equal to eager, forward and gradients, at token counts that leave experts empty: the counts
as ``.cpu()`` and as Yuan's ``.cpu().to(torch.long)``, each element's ``.item()``, and the device counts indexed where
they lie (read on the host by eager's ``if`` and slices all the same). Look-alikes, each equal to eager
and not rewritten, with the reason explain() gives: a skip of experts with fewer than 2 tokens whose branch outputs
zeros, a skipped body that appends to a list the module keeps (a change the caller sees), a count read after the
loop as a number that scales the result, the host counts changed in place between reads (experts 1 and 2 trading
counts: an element listed before would be stale; on the host copy or the device counts), and the outputs unsorted into a buffer of the rows' static shape (the pass answers no, without a guard error).
"""
import pytest
import torch

from moe_inductor import report
from tests.corpus.harness import Case, check_rewritten, check_unchanged, run_case
from tests.test_host_counts import E, H, WalkingMoE


class IndexedCountsMoE(WalkingMoE):
    """A top-2 MoE whose loop reads the host counts tensor by index; ``variant`` picks the spelling or look-alike.
    The router, experts and sort are test_host_counts' walking MoE's."""

    def counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        if self.variant in ("device", "device_mutated"):
            return per_expert
        if self.variant in ("to_long", "item"):
            return per_expert.cpu().to(torch.long)
        return per_expert.cpu()

    def forward(self, x):
        weights, ids, order, rows, per_expert = self.route(x)
        tokens_per_expert = self.counts(per_expert)
        outputs = self.kept if self.variant == "kept_list" else []
        self.kept.clear()
        start = 0
        for i in range(E):
            if self.variant in ("mutated", "device_mutated") and i == 1:  # experts 1 and 2 trade counts after expert 0
                tokens_per_expert[1:3] = tokens_per_expert[1:3].flip(0)
            if self.variant == "fewer_than_2" and tokens_per_expert[i] < 2:  # experts with one token output zeros
                end = start + tokens_per_expert[i]
                outputs.append(rows[start:end] * 0)
                start = end
                continue
            if tokens_per_expert[i] == 0:
                continue
            n = tokens_per_expert[i].item() if self.variant == "item" else tokens_per_expert[i]
            end = start + n
            outputs.append(self.expert(i, rows[start:end]))
            start = end
        out = torch.cat(outputs, dim=0)
        placed = torch.empty_like(rows if self.variant == "rows_buffer" else out)
        placed[order] = out
        y = placed.view(*ids.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(dim=-1)).sum(dim=1)
        if self.variant == "numbers_used":
            y = y * tokens_per_expert[0]
        return y


def _case(variant: str, expect: tuple) -> Case:
    return Case(f"indexed-{variant}", "tests/test_count_branches.py", lambda: IndexedCountsMoE(variant),
                lambda T, g: torch.randn(T, H, generator=g), form="sorted_grouped_mm", expect=expect,
                token_counts=(3, 9))


@pytest.mark.slow  # each case compiles a model
# "device": the count vector never brought to the host, indexed where it lies; eager reads the element on the host at
# the ``if`` and at the slice bounds, as the ``.tolist()`` does once (Unsloth's ``torch_grouped_gemm`` does this)
@pytest.mark.parametrize("variant", ["cpu", "to_long", "item", "device"])
def test_a_branch_on_a_host_count_element_is_rewritten_and_equal_to_eager(variant):
    case = _case(variant, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    check_rewritten(case, outcome)
    # 3 tokens with 2 choices each reach at most 6 of the 8 experts: eager took the skip
    assert outcome.rewrites == {"sorted_grouped_mm": outcome.graphs}
    assert not outcome.fallbacks, outcome.fallbacks


@pytest.mark.slow
@pytest.mark.parametrize("variant, said", [
    ("fewer_than_2", "is not a test of 'this expert got no tokens'"),
    ("kept_list", "the skipped body changes Python state"),
    ("numbers_used", "are still read by"),
    ("mutated", "are changed in place"),
    ("device_mutated", "are changed in place"),  # the same on the device counts indexed where they lie
])
def test_a_count_branch_that_is_not_an_empty_expert_skip_is_kept_and_equal_to_eager(variant, said):
    case = _case(variant, ("fell_back",))
    with report.collecting(report.Report()) as seen:
        outcome = run_case(case)
    assert outcome.fallbacks and outcome.kind != "crash", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    assert not outcome.rewrites, outcome.rewrites
    check_unchanged(case, outcome)
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


@pytest.mark.slow
def test_a_buffer_of_the_rows_shape_is_not_proven_and_the_pass_says_no_without_raising(caplog):
    """``empty_like(rows)`` receives the unsorted outputs (DeepSeek-V2 writes ``empty_like(out)``): the buffer's static
    T*k rows against the loop's unbacked total, which the pass cannot prove equal. It answers no (a plain shape ``==``
    raised a data-dependent guard error inside the pass), and the frame falls back, equal to eager."""
    case = _case("rows_buffer", ("fell_back",))
    outcome = run_case(case)
    assert outcome.fallbacks and not outcome.rewrites, (outcome.declared(), outcome.rewrites)
    check_unchanged(case, outcome)
    assert not [r.message for r in caplog.records if "pass failed" in r.message]
