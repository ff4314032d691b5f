"""NLLB-MoE's experts loop (transformers v4): a top-2 router with capacity makes a (T, E) table of kept gates, the
tokens are spread over the experts by ``einsum("bm,be->ebm", x, table.bool())``, each expert writes its weighted
output back at its own slice and rows, and the slices are summed::

    R = g1[:, None] * (one_hot(i1, E) * keep1) + g2[:, None] * (one_hot(i2, E) * keep2)
    mask = R.bool()
    buf = torch.einsum("bm,be->ebm", x, mask)
    for e, expert in enumerate(experts):
        out = expert(buf[e, mask[:, e]])
        out *= 0.8                                                   # eval's 1 - moe_token_dropout, or absent
        buf[e, mask[:, e]] = torch.einsum("b,be->be", R[mask[:, e], e], out)
    y = buf.sum(dim=0)

Rewritten (``passes/table_writes.py``), forward and backward equal to eager, with tokens dropped and not, top-2 and
top-1, each weight spelling. Look-alikes left alone (with their reason where a proof started), equal to eager: a table
with a dense term or a term changed in place (more nonzeros a row than the op would pick), a float keep, a weight
read from another table or another column, a read of another expert's slice, the written slices read beside their
sum, the tokens or the table changed in place, the buffer written elsewhere, the experts scaled by different
constants, a skipped expert, the slices averaged instead of summed."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, FFN, E = 16, 24, 4


class TableMoE(nn.Module):
    def __init__(self, style: str = "eval", capacity: int = 3, top2: bool = True, num_experts: int = E):
        super().__init__()
        self.style, self.capacity, self.top2 = style, capacity, top2
        self.classifier = nn.Linear(H, num_experts, bias=False)
        self.experts = nn.ModuleDict({f"expert_{e}": nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))
                                      for e in range(num_experts)})

    def forward(self, x):
        s, C, E = self.style, self.capacity, len(self.experts)
        # "finite_router": the router reads the tokens made finite, so a non-finite token may still be dropped
        logits = self.classifier(torch.nan_to_num(x) if s == "finite_router" else x)
        probs = torch.softmax(logits, dim=-1)
        hot1 = F.one_hot(torch.argmax(probs, dim=-1), num_classes=E)
        hot2 = F.one_hot(torch.argmax(logits.masked_fill(hot1.bool(), float("-inf")), dim=-1), num_classes=E)
        keep1 = torch.lt(torch.cumsum(hot1, dim=0) - 1, C)
        if s == "float_keep":  # NaN-capable: a NaN times one_hot's 0 would be nonzero off the expert
            keep1 = keep1.float()
        keep2 = torch.lt(torch.cumsum(hot2, dim=0) - 1 + hot1.sum(dim=0, keepdim=True), C)
        m1, m2 = hot1 * keep1, hot2 * keep2
        p1, p2 = (probs * m1).sum(dim=1), (probs * m2).sum(dim=1)
        denom = torch.clamp(p1 + p2, min=torch.finfo(probs.dtype).eps)
        first = (p1 / denom)[:, None] * m1
        if s == "term_changed":  # a second nonzero in every row of the first term
            first[:, 0] += 0.5
        table = first + (p2 / denom)[:, None] * m2 if self.top2 else p1[:, None] * m1
        if s == "dense_term":  # every expert in every row: more nonzeros than two
            table = table + 0.01 * probs
        mask = table.bool()
        tokens = x * 1.0 if s == "tokens_changed" else x
        buf = torch.einsum("bm,be->ebm", tokens, mask)
        if s == "tokens_changed":  # the spread holds the old tokens; the op would read the new ones
            tokens.mul_(2.0)
        if s == "table_changed":  # the mask holds the old table; the op would read the new weights
            table[:, 0] = 0.5
        if s == "written_elsewhere":
            buf[0, 0] = 1.0
        for e, expert in enumerate(self.experts.values()):
            if s == "skipped_expert" and e == E - 1:
                continue
            rows = mask[:, e]
            weight = {"other_table": probs[rows, e], "other_column": table[rows, (e + 1) % E]}.get(s, table[rows, e])
            out = expert(buf[(e + 1) % E if s == "other_slot" else e, rows])
            if s in ("eval", "column_weight", "different_scale"):
                out *= 0.8 if s != "different_scale" or e else 0.9
            if s == "column_weight":
                buf[e, rows] = weight[:, None] * out
            else:
                buf[e, rows] = torch.einsum("b,be->be", weight, out)
        if s == "read_elsewhere":  # the written slices read beside their sum
            return buf.sum(dim=0) + buf[0]
        return buf.mean(dim=0) if s == "averaged" else buf.sum(dim=0)


@pytest.mark.parametrize("style,top2", [
    ("eval", True),  # the eval scale 0.8 on every expert's output
    ("train", True),  # no scale
    ("column_weight", True),  # R[rows, e][:, None] * out
    ("train", False),  # a top-1 table: one term
], ids=["eval", "train", "column-weight", "top1"])
def test_table_writes_are_rewritten_and_equal(style, top2):
    torch.manual_seed(0)
    model = TableMoE(style, top2=top2)
    for T in (1, 5, 9):  # 1: three idle experts; 9: past the capacity of 3, choices and whole tokens dropped
        x = torch.randn(T, H)
        assert_rewritten_like_eager(model, x, "unrolled_loop", f"{style} T={T}")
        assert sum(counters["graph_break"].values()) == 0


def test_a_token_with_no_expert_is_zero():
    """A capacity of 1: most tokens keep no choice; eager's sum of x * 0 is 0 there, and so is the rewrite's."""
    torch.manual_seed(0)
    model = TableMoE("train", capacity=1)
    x = torch.randn(12, H)
    out = compile_moe(model, x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    ref = model(x)
    assert_close(out, ref, torch.float32, "forward")
    assert (ref == 0).all(-1).sum() >= 12 - 2 * E, "the case must drop whole tokens"


def test_more_terms_than_experts():
    """A top-2 table over one expert: two terms, but no row has more nonzeros than the one expert (the op picks
    top-1 of the mask; top-2 of a one-column mask would raise)."""
    torch.manual_seed(0)
    model = TableMoE("train", num_experts=1)
    for T in (1, 5):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"E=1 T={T}")


@pytest.mark.parametrize("num_experts", [2, 3], ids=["E=K", "E>K"])
def test_a_dropped_non_finite_token_stays_non_finite(num_experts):
    """Eager adds ``x * 0`` for every expert a row does not pick: NaN where the token is not finite. With as many
    experts as the table's terms (E == K = 2) only a row that leaves one out has such a term, a token dropped by
    capacity, say; a row that picks every expert has none."""
    torch.manual_seed(0)
    model = TableMoE("finite_router", capacity=1, num_experts=num_experts)
    x = torch.randn(8, H)
    x[6, 3] = float("inf")  # past the capacity of 1: dropped from every expert
    out = compile_moe(model, x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    ref = model(x)
    assert ref[6, 3].isnan() and ref.isnan().sum() == 1, "the case must drop the non-finite token"
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("style,reason", [
    ("other_table", "is not its output scaled by its own column of the table"),
    ("other_column", "is not its output scaled by its own column of the table"),
    # the last expert reads slice 0, already written
    ("other_slot", "read by something other than the loop's reads before its writes"),
    ("tokens_changed", "changed in place"),
    ("table_changed", "changed in place"),
    ("written_elsewhere", "changed by something other than one write per expert"),
    ("different_scale", "not all scaled by one constant"),
    ("skipped_expert", "not each of range(4) once"),
    ("averaged", "not summed over the experts once"),
    ("read_elsewhere", "read by something other than the loop's reads before its writes and the sum"),
    ("dense_term", None),  # no table of at most K nonzeros a row: no mark of this spelling
    ("term_changed", None),
    ("float_keep", None),
])
def test_table_writes_look_alikes_are_left_alone(style, reason, caplog):
    torch.manual_seed(0)
    model, x = TableMoE(style), torch.randn(9, H)
    with caplog.at_level(logging.INFO, logger="moe_inductor"):
        out = compile_moe(model, x.clone())
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    notes = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    if reason is not None:
        assert any(reason in n for n in notes), notes
    assert_close(out, model(x.clone()), torch.float32, style)
