"""Switch Transformers' experts loop as transformers v4.2x-v4.3x wrote it: the buffer starts as a clone of the tokens,
so a row the router dropped (past the capacity) passes its token through, and each mask is a column of the integer
one-hot with the drops in it, cast on its own::

    router_mask = F.one_hot(idx, E) * (torch.cumsum(F.one_hot(idx, E), dim=-2) <= C)     # (B, T, E) int
    next_states = x.clone()
    for e, expert in enumerate(experts.values()):
        next_states[router_mask[:, :, e].bool()] = expert(x[router_mask[:, :, e].bool()])
    y = probs * next_states

Rewritten (``passes/top1_masks.py``, ``passes/kept_masks.py``): the op over the kept rows (a dropped row the
out-of-range id E, weight 1), then ``torch.where(router_mask.any(-1)[..., None], op, x)``, and the user's
``probs *`` as it was; forward and backward equal to eager, with rows dropped and without. Look-alikes left alone
with their reason, equal to eager: a clone of another tensor (or of the tokens detached: the same values, no gradient
through the dropped rows), the tokens changed in place after the clone, the buffer written elsewhere, ``+=`` onto the
clone (a residual), a float keep, a mask of two experts per row, a read of another expert's mask, and the clone under
plain ``idx == e`` masks of ids not provably in range(E)."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, C = 16, 24, 4, 3  # a capacity of 3 per sequence: longer inputs drop tokens


class SwitchV427Like(nn.Module):
    def __init__(self, style: str = "v427"):
        super().__init__()
        self.style = style
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{e}": nn.Sequential(nn.Linear(H, I, bias=False), nn.ReLU(),
                                                                   nn.Linear(I, H, bias=False)) for e in range(E)})

    def forward(self, x):
        s = self.style
        probs = torch.softmax(self.classifier(x), dim=-1)
        idx = torch.argmax(probs, dim=-1)
        hot = F.one_hot(idx, num_classes=E)
        keep = torch.cumsum(hot, dim=-2) <= C
        if s == "float_keep":  # NaN-capable: a NaN times one_hot's 0 would be nonzero off idx
            keep = keep.float()
        router_mask = hot + keep if s == "two_per_row" else hot * keep
        weight = torch.max(probs, dim=-1).values.unsqueeze(-1)
        if s == "other_weight":  # any scale after the loop is the user's own product on the rewritten buffer
            weight = probs[..., :1] * 3.0
        tokens = x
        if s == "tokens_changed":
            tokens = x * 1.0
        base = {"clone_of_other": x * 2.0, "detached_clone": x.detach()}.get(s, tokens)
        next_states = base.clone()
        if s == "tokens_changed":  # a dropped row keeps the old values, a kept row's expert reads the new ones
            tokens.mul_(2.0)
        if s == "written_elsewhere":
            next_states[..., 0] = 1.0
        unproven = idx % (E + 1)
        for e, expert in enumerate(self.experts.values()):
            if s == "plain_unproven":  # idx == e of ids not provably in range(E): a row may keep the clone
                mask = unproven == e
            elif s == "to_bool":
                mask = router_mask[..., e].to(torch.bool)
            else:
                mask = router_mask[:, :, e].bool() if x.dim() == 3 else router_mask[:, e].bool()
            read = mask.flip(-1) if s == "other_mask_read" else mask  # as many rows, at other positions
            if s == "guarded" and not mask.any():
                continue
            if s == "accumulate":
                next_states[mask] += expert(tokens[read])
            else:
                next_states[mask] = expert(tokens[read])
        return weight * next_states


def _tokens(T: int, batched: bool = True) -> torch.Tensor:
    return torch.randn(2, T, H) if batched else torch.randn(T, H)


@pytest.mark.parametrize("style,batched", [
    ("v427", True),  # transformers v4.27: router_mask[:, :, e].bool(), (B, T, H) tokens
    ("v427", False),  # (T, E) masks of (T, H) tokens
    ("to_bool", True),  # router_mask[..., e].to(torch.bool)
    ("guarded", True),  # each write behind if mask.any()
    ("other_weight", True),  # a scale of other values after the loop: the user's product, untouched
], ids=["v427-BT", "v427-T", "to-bool", "guarded", "other-weight"])
def test_cloned_buffer_with_drops_is_rewritten(style, batched):
    torch.manual_seed(0)
    model = SwitchV427Like(style)
    for T in (1, 11):  # 1 token a sequence: idle experts (no gradient); 11: past the capacity of 3, rows dropped
        assert_rewritten_like_eager(model, _tokens(T, batched), "unrolled_loop", f"{style} T={T}")
        assert sum(counters["graph_break"].values()) == 0


def test_a_dropped_row_is_its_token_times_the_weight():
    """Every token past the capacity passes through: eager's ``probs * x`` there, the op's result elsewhere."""
    torch.manual_seed(0)
    model = SwitchV427Like()
    x = torch.randn(2, 20, H)
    out = compile_moe(model, x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    ref = model(x)
    assert_close(out, ref, torch.float32, "forward")
    probs = torch.softmax(model.classifier(x), dim=-1).max(-1).values.unsqueeze(-1)
    passed = torch.isclose(ref, probs * x).all(-1)
    assert passed.sum() >= 2 * (20 - E * C), "the case must drop rows"
    assert torch.equal(out[passed], ref[passed])


@pytest.mark.parametrize("style,reason", [
    ("clone_of_other", "a clone of another tensor than the tokens"),
    ("detached_clone", "a clone of another tensor than the tokens"),  # same values, no gradient for dropped rows
    ("tokens_changed", "changed in place"),
    ("written_elsewhere", "changed by something other than its masked writes"),
    ("accumulate", "out[mask] += ... onto a buffer that does not start as zeros"),  # x + expert(x): a residual
    ("float_keep", "moe_region"),  # no kept one-hot: no mark of this form
    ("two_per_row", "moe_region"),  # one_hot + keep: two experts' masks share rows
    ("other_mask_read", "does not read the tokens at its own mask"),
    ("plain_unproven", "the buffer is a clone and the ids are not provably in range(E)"),
])
def test_cloned_buffer_look_alikes_are_left_alone(style, reason, caplog):
    torch.manual_seed(0)
    model, x = SwitchV427Like(style), _tokens(9)
    with caplog.at_level(logging.INFO, logger="moe_inductor"):
        out = compile_moe(model, x.clone())
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    notes = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert any(reason in n for n in notes), notes
    assert_close(out, model(x.clone()), torch.float32, style)


def test_kept_column_reads_the_cast_column():
    """``kept_column`` takes ``P[..., e].bool()`` of an integer ``one_hot * keep`` P, and refuses the cast column of a
    float product and of a product that is no one-hot."""
    from moe_inductor.passes.kept_masks import kept_choices, kept_column

    def column_of(keep_dtype, hot=True):
        g = torch.fx.Graph()
        idx = g.placeholder("idx")
        idx.meta["example_value"] = torch.zeros(5, dtype=torch.long)
        keep = g.placeholder("keep")
        keep.meta["example_value"] = torch.zeros(5, E, dtype=keep_dtype)
        if hot:
            left = g.call_function(F.one_hot, (idx,), {"num_classes": E})
        else:
            left = g.call_method("expand", (g.call_method("unsqueeze", (idx, -1)), 5, E))
        left.meta["example_value"] = torch.zeros(5, E, dtype=torch.long)
        product = g.call_function(torch.mul, (left, keep))
        product.meta["example_value"] = torch.zeros(5, E, dtype=torch.promote_types(torch.long, keep_dtype))
        column = g.call_function(__import__("operator").getitem, (product, (slice(None), 2)))
        column.meta["example_value"] = torch.zeros(5, dtype=product.meta["example_value"].dtype)
        mask = g.call_method("bool", (column,))
        mask.meta["example_value"] = torch.zeros(5, dtype=torch.bool)
        return product, mask

    product, mask = column_of(torch.bool)
    assert kept_column(mask) == (product, 2)
    assert kept_choices(product) is not None
    for dtype, hot in ((torch.float32, True), (torch.bool, False)):
        product, mask = column_of(dtype, hot)
        assert kept_column(mask) is None, (dtype, hot)
        assert kept_choices(product) is None, (dtype, hot)
