"""Unsloth's torch reference of its grouped GEMM (``torch_grouped_gemm``: a zeros buffer written expert by expert at
running slices of the sorted rows, each behind ``if m_size > 0:`` on an element of the device counts), read as the
sorted grouped GEMM it is (passes/sliced_gemm.py; host_counts.py reads ``m_sizes[g]`` as its number, speculation.py
takes the skip). Rewritten and equal to eager, forward and gradients, at token counts that leave experts empty;
the look-alikes compute something else and stay as they are, equal to eager, with nothing rewritten."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_inductor import report
from tests.corpus.harness import Case, check_rewritten, check_unchanged, run_case

H, I, E, K = 16, 12, 6, 2


def grouped_gemm(X, W, m_sizes, variant="plain"):
    """``torch_grouped_gemm`` of the reference (transpose=True), with one knob per look-alike."""
    if variant.startswith("tolist"):
        return listed_grouped_gemm(X, W, m_sizes, variant)
    result = torch.zeros((X.shape[0], W.shape[1]), dtype=X.dtype, device=X.device)
    m_start = 0
    for g in range(m_sizes.shape[0]):
        m_size = m_sizes[g]
        if (m_size > 1) if variant == "skip_single" else (m_size > 0):
            m_end = m_start + m_size
            expert = (g + 1) % E if variant == "other_expert" else g
            start = m_start + 1 if variant == "skip_first_row" and g == 0 else m_start
            result[start:m_end] = X[start:m_end] @ W[expert].T
            m_start = m_end
    return result


def listed_grouped_gemm(X, W, m_sizes, variant):
    """The same loop over the counts' ``.tolist()``, with no skip: nothing for speculation.py to take, the slices
    read by passes/sliced_gemm.py alone."""
    result = torch.zeros((X.shape[0], W.shape[1]), dtype=X.dtype, device=X.device)
    m_start = 0
    for g, m_size in enumerate(m_sizes.tolist()):
        m_end = m_start + m_size
        start = m_start + 1 if variant == "tolist_skip_first_row" and g == 0 else m_start
        result[start:m_end] = X[start:m_end] @ W[g].T
        m_start = m_end
    return result


class UnslothBlock(nn.Module):
    """Qwen3MoeGroupedGEMMBlock of the reference, with ``variant`` picking a look-alike."""

    def __init__(self, variant="plain"):
        super().__init__()
        self.variant = variant
        self.gate = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        T = x.shape[0]
        weights = F.softmax(F.linear(x, self.gate), dim=1, dtype=torch.float)
        weights, ids = torch.topk(weights, K, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        with torch.no_grad():
            flat = ids.view(-1)
            counted = (flat + 1) % E if self.variant == "counts_of_other_ids" else flat
            counts = torch.histc(counted.float(), bins=E, min=0, max=E).to(flat.dtype)
            order = torch.argsort(-flat if self.variant == "descending" else flat, stable=True)
        xs = x[order // K]
        h = grouped_gemm(xs, self.gate_up_proj, counts, self.variant)
        h = F.silu(h[..., :I]) * h[..., I:]
        ys = grouped_gemm(h, self.down_proj, counts, self.variant)
        out = torch.empty_like(ys)
        out.index_copy_(0, order, ys)
        return (out.view(T, K, H) * weights[..., None]).sum(dim=1)


#: Dynamo before 2.13 fails on the slices at the counts' numbers (a guard on a data-dependent size, or the branch on
#: a device count): the frame falls back, equal to eager (README's known limits)
BEFORE_2_13 = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)


def _case(variant: str, expect: tuple) -> Case:
    # 3 tokens with 2 choices each reach at most 6 of the 6 experts, and mostly fewer: eager takes the skip
    return Case(f"unsloth-{variant}", "tests/test_unsloth_reference.py", lambda: UnslothBlock(variant),
                lambda T, g: torch.randn(T, H, generator=g), form="sorted_grouped_mm", expect=expect,
                token_counts=(3, 5, 9), before_2_13=("fell_back",))


@pytest.mark.slow  # each case compiles a model
@pytest.mark.parametrize("variant", [
    "plain",
    "tolist",  # the counts listed first and walked with no skip: the slices alone, no speculation
])
def test_sliced_grouped_gemm_is_rewritten_and_equal_to_eager(variant):
    case = _case(variant, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == case.expected(), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    if BEFORE_2_13:
        check_unchanged(case, outcome)
        return
    check_rewritten(case, outcome)
    assert outcome.rewrites == {"sorted_grouped_mm": outcome.graphs}
    assert not outcome.fallbacks and not outcome.left_alone


def test_some_expert_is_empty_at_the_token_counts_tested():
    """The genuine case exercises the skip: at 3 tokens some expert gets no row."""
    torch.manual_seed(0)
    model = UnslothBlock()
    x = _case("plain", ("rewritten",)).make_input(3, torch.Generator().manual_seed(1))
    ids = torch.topk(F.linear(x, model.gate), K, dim=-1).indices
    assert torch.bincount(ids.view(-1), minlength=E).eq(0).any()


@pytest.mark.slow
@pytest.mark.parametrize("variant, said", [
    # a slice that skips the first sorted row: it stays zero, the op would compute it (the skip is not proven)
    ("skip_first_row", "selects no expert's rows"),
    # counts of other ids than the sort's: not a proven count vector, so its elements stay tensors
    ("counts_of_other_ids", "Data-dependent branching"),
    # the rows sorted in descending expert order, the weights read in ascending order: no grouped GEMM proven,
    # so the counts read by the loop are still read
    ("descending", "are still read by"),
    ("other_expert", "are still read by"),  # slice g multiplied by expert g + 1's weight
    ("skip_single", "Data-dependent branching"),  # ``if m_size > 1``: not a no-rows skip
    # the first row skipped with no speculation in the way: the slices are no run from row 0, so no form takes it
    ("tolist_skip_first_row", "no MoE form proves"),
])
def test_look_alikes_are_not_rewritten_and_equal_to_eager(variant, said):
    case = _case(variant, ("fell_back",))
    with report.collecting(report.Report()) as seen:
        outcome = run_case(case)
    assert outcome.kind != "crash", outcome.declared()
    assert not outcome.rewrites, outcome.rewrites
    check_unchanged(case, outcome)
    reasons = [f.reason for f in seen.fallbacks] + [a.reason for a in seen.left_alone]
    assert BEFORE_2_13 or any(said in r for r in reasons), reasons  # before 2.13 the slices themselves fail
