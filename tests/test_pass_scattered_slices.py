"""The split loop's per-expert spelling (passes/scattered_slices.py): MiniMind's ``moe_infer`` body, each expert on
``x[tok[s:e]]``, its output weighted by ``weights.view(-1, 1)[order[s:e]]`` and ``scatter_add_``-ed into zeros by
``tok[s:e].view(-1, 1).repeat(1, H)``, one write per expert over contiguous slices of the sorted order.

Genuine spellings, rewritten and equal to eager (forward, under no_grad as MiniMind's eval path runs; one also with
gradients): MiniMind's own body, ``index_add_``, an ``expand`` index, the weight out of place, the weight as a
flat gather, the rows as slices of ``x[tok]``, stacked weights, and MiniMind's cumulative host walk with its skip (of
top-k ids, and of a top-1 router's ``max(dim=-1, keepdim=True)`` ids).
Look-alikes, not rewritten and equal to eager, each with the reason explain() gives where the buffer carries the
form's mark: the scatter index from another sort of the same ids, the weight gathered by the token order, a buffer
that is not zeros, a slice one row too long, a slice run that starts at row 1, an extra write into the buffer, a read
of the buffer between the writes, half the columns scattered, counts of other ids, an expert output read besides
its write, and one changed in place before it is weighted.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor import report
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ScatteredSlicesMoE(nn.Module):
    """A top-k router, then MiniMind's per-expert scatter body over contiguous slices of the sorted order;
    ``variant`` picks a genuine spelling or a look-alike."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def expert(self, e, rows):
        if self.variant == "stacked":
            return F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
        return self.experts[e](rows)

    def forward(self, x):
        v = self.variant
        k = 1 if v == "walk_max" else K
        if v == "walk_max":  # a top-1 router's max ids: one per row, below E as topk's are
            weights, ids = self.gate(x).softmax(dim=-1).max(dim=-1, keepdim=True)
        else:
            weights, ids = torch.topk(self.gate(x).softmax(dim=-1), K, dim=-1)
        flat = ids.view(-1)
        order = flat.argsort()
        tok = order // k
        column = weights.view(-1, 1)
        out = torch.full_like(x, 0.5) if v == "not_zeros" else torch.zeros_like(x)
        if v.startswith("walk"):  # MiniMind's own walk: cumulative host counts, empty experts skipped
            if "tolist" in v:  # the torch spelling: bincount with minlength, cumsum on the device, then .tolist()
                cum = flat.bincount(minlength=E).cumsum(0).tolist()
            else:
                cum = flat.bincount().cpu().numpy().cumsum(0)
            for i, end in enumerate(cum):
                start = 0 if i == 0 else cum[i - 1]
                if start == end:
                    continue
                y = self.expert(i, x[tok[start:end]])
                # walk_token_weight: the weight gathered by the token order, not the assignment order
                y.mul_(column[(tok if v.endswith("token_weight") else order)[start:end]])
                out.scatter_add_(0, tok[start:end].view(-1, 1).repeat(1, H), y)
            return out
        counts = F.one_hot(flat, E).sum(0)
        if v == "other_counts":  # the counts of the next expert: each slice holds another expert's rows
            counts = counts.roll(1)
        sizes = counts.tolist()
        index_tok = (flat.argsort(descending=True) // K).flip(0) if v == "other_order" else tok
        xs = x[tok] if v == "sorted_rows" else None
        start, extra = (1 if v == "starts_at_one" else 0), 0.0
        for e in range(E):
            end = start + sizes[e]
            stop = end + 1 if (v == "one_too_long" and e == 1) else end
            rows = xs[start:end] if xs is not None else x[tok[start:stop]]
            y = self.expert(e, rows)
            w = column[order[start:stop]]
            if v == "flat_weight":
                w = weights.view(-1)[order[start:end]].unsqueeze(-1)
            elif v == "token_weight":  # the weight gathered by the token order, not the assignment order
                w = column[tok[start:end]]
            if v == "changed_then_weighted":  # the output changed in place, then weighted out of place
                y.add_(1.0)
            if v in ("out_of_place", "changed_then_weighted"):
                y = y * w
            else:
                y.mul_(w)
            if v == "output_read":
                extra = extra + y.sum()
            if v == "index_add":
                out.index_add_(0, index_tok[start:stop], y)
            elif v == "expand":
                out.scatter_add_(0, index_tok[start:stop].unsqueeze(1).expand(-1, H), y)
            else:
                width = H // 2 if v == "half_columns" else H
                out.scatter_add_(0, index_tok[start:stop].view(-1, 1).repeat(1, width), y)
            if v == "read_between" and e == 1:
                extra = out.sum()
            start = end
        if v == "extra_write":
            out[0] += 1.0
        return out + extra


GENUINE = ["minimind", "index_add", "expand", "out_of_place", "flat_weight", "sorted_rows", "stacked", "walk",
           "walk_max", "walk_tolist"]


@pytest.mark.parametrize("variant", GENUINE)
def test_per_expert_scatters_over_sorted_slices_are_rewritten(variant):
    torch.manual_seed(0)
    model = ScatteredSlicesMoE(variant).eval()
    for T in (5, 11):  # 10 assignments over 4 experts at T = 5: an expert may get none
        x = torch.randn(T, H)
        with torch.no_grad():
            out = compile_moe(model, x)
            ref = model(x)
        assert counters["moe_inductor"] == {"split_loop": 1}, (dict(counters["moe_inductor"]),
                                                               dict(counters["moe_inductor_left_alone"]))
        assert not counters["moe_inductor_fallback"], dict(counters["moe_inductor_fallback"])
        assert_close(out, ref, torch.float32, f"{variant} T={T}")


def test_the_weighted_scatters_are_rewritten_with_gradients_too():
    torch.manual_seed(0)
    assert_rewritten_like_eager(ScatteredSlicesMoE("out_of_place"), torch.randn(7, H), "split_loop", "out_of_place")


@pytest.mark.parametrize("variant, said", [
    # the index from another sort of the same ids: within an expert its rows may come in another order than x's
    ("other_order", None),
    ("token_weight", "routing weights are not read at its own slice of the sorted order"),
    ("not_zeros", None),  # the outputs added onto 0.5, not zeros
    ("one_too_long", "not a run of one count"),  # expert 1 also runs on the first row of expert 2's slice
    ("starts_at_one", "not contiguous runs of the sorted order from row 0"),
    ("extra_write", "a write into the buffer is not a scatter_add_"),
    ("read_between", "the buffer is read or viewed before its last write"),
    ("half_columns", None),  # repeat(1, H // 2): only the first half of each row is added
    ("other_counts", "not every expert's number of assignments"),
    # y.mul_(w) is read out of place under no_grad (passes/private_writes.py): the weighted output is read again
    ("output_read", "the weighted expert output is read besides its write"),
    # y.add_(1.0) likewise: y + 1 is what is weighted, no projection of the expert's own
    ("changed_then_weighted", "not a bias-free projection on its own weights"),
])
def test_look_alikes_are_left_alone_and_equal_to_eager(variant, said):
    torch.manual_seed(0)
    model = ScatteredSlicesMoE(variant).eval()
    x = torch.randn(9, H)
    with torch.no_grad(), report.collecting(report.Report()) as seen:
        out = compile_moe(model, x)
        ref = model(x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    if said is not None:
        reasons = [m.reason for m in seen.left_alone if m.form == "split_loop"]
        assert len(reasons) == 1 and said in reasons[0], reasons
    assert_close(out, ref, torch.float32, variant)


def test_a_walk_whose_body_is_left_alone_falls_back_saying_why():
    """MiniMind's walk with the weight read at the tokens: the frame falls back (the walked counts would outlive the
    loop), and its reason carries what split_loop said of the body, not only that the counts are still read."""
    torch.manual_seed(0)
    model = ScatteredSlicesMoE("walk_token_weight").eval()
    x = torch.randn(9, H)
    with torch.no_grad(), report.collecting(report.Report()) as seen:
        out = compile_moe(model, x)
        ref = model(x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    reasons = [f.reason for f in seen.fallbacks]
    assert any("split_loop left" in r and "routing weights are not read at its own slice" in r for r in reasons), (
        reasons)
    assert_close(out, ref, torch.float32, "walk_token_weight")


def test_a_tolist_walk_that_falls_back_names_no_row_list_it_did_not_need():
    """The walk's cumulative counts as ``.tolist()``, the body's weight read at the tokens: the walk is traced as a
    speculation (host_cumsum.py), which takes the tolist, so list_indices' note that it would not trace that list as
    its tensor is no part of the fallback's reason; split_loop's is."""
    torch.manual_seed(0)
    model = ScatteredSlicesMoE("walk_tolist_token_weight").eval()
    x = torch.randn(9, H)
    with torch.no_grad(), report.collecting(report.Report()) as seen:
        out = compile_moe(model, x)
        ref = model(x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    reasons = [f.reason for f in seen.fallbacks]
    assert any("split_loop left" in r for r in reasons), reasons
    assert not any("is not traced as its tensor" in r for r in reasons), reasons
    assert_close(out, ref, torch.float32, "walk_tolist_token_weight")
