"""Tutel's index-based capacity dispatch (``passes/indexed_capacity.py``): tokens written into an (E*C, H) buffer at
row ``id * C + position`` by ``index_add_``, the experts on its (E, C, H) view, the rows read back per choice into
zeros and summed. Rewritten as padded_capacity with the same drops (forward and backward equal to eager); the
look-alikes that compute something else stay as they are, with the step that failed."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_rewritten_like_eager, compile_moe, rel_err

H, I, E = 16, 12, 5


def one_hot(ids, dtype=torch.int64):
    return torch.zeros([ids.size(0), E], dtype=dtype, device=ids.device).scatter_(1, ids.unsqueeze(-1), 1)


class TutelLike(nn.Module):
    """Tutel's extract_critical + fast_encode + fast_decode in torch, with one knob per look-alike (``variant``)."""

    def __init__(self, k=2, capacity_factor=1.0, variant="plain", layouts="mixed"):
        super().__init__()
        self.k, self.capacity_factor, self.variant, self.layouts = k, capacity_factor, variant, layouts
        self.wg = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.b1 = nn.Parameter(torch.randn(E, I) * 0.1)
        self.b2 = nn.Parameter(torch.randn(E, H) * 0.1)

    def gating(self, x):
        scores = F.softmax(self.wg(x), dim=1)
        ids = [t.view(-1) for t in torch.topk(scores, self.k, dim=1).indices.chunk(self.k, dim=1)]
        masks = [one_hot(i, torch.float32 if self.variant == "float_mask" else torch.int64) for i in ids]
        gates = [(scores * m).sum(dim=1) for m in masks]
        order = list(range(self.k))[::-1] if self.variant == "reversed_queue" else list(range(self.k))
        locs, base = [None] * self.k, None
        for j in order:
            loc = torch.cumsum(masks[j], dim=0) - 1
            if base is not None and self.variant != "no_earlier":
                loc += base
            step = torch.sum(masks[j], dim=0, keepdim=True)
            base = step if base is None else base + step
            locs[j] = torch.sum(loc * masks[j], dim=1).to(torch.int32)
        if self.k > 1:  # as Tutel: a top-1 gate stays the raw probability
            denom = torch.clamp(sum(gates), min=torch.finfo(gates[0].dtype).eps)
            gates = [g / denom for g in gates]
        T = x.size(0)
        C = self.k * int(self.capacity_factor * ((T + E - 1) // E))
        return [i.to(torch.int32) for i in ids], locs, gates, C

    def experts(self, xin):
        w1 = self.w1.permute(0, 2, 1) if self.layouts == "mixed" else self.w1.transpose(1, 2)
        h = F.relu(torch.matmul(xin, w1) + self.b1.unsqueeze(1))
        w2 = self.w2 if self.layouts == "mixed" else self.w2.permute(0, 2, 1).transpose(1, 2)
        return torch.matmul(h, w2) + self.b2.unsqueeze(1)

    def forward(self, x):
        ids, locs, gates, C = self.gating(x)
        drop = C - 1 if self.variant == "drop_below_c" else C
        buf = torch.zeros([E * C, x.size(1)], dtype=x.dtype, device=x.device)
        for j, (i, loc) in enumerate(zip(ids, locs)):
            kept = (loc < drop) if self.variant == "no_sign_test" else (loc < drop) & (i >= 0)
            row_ids = ids[1 - j] if self.variant == "other_ids" and j == 0 else i
            rows = (row_ids.long() * C + loc.long())[kept]
            buf.index_add_(0, rows, x[kept])
        slots = self.experts(buf.view(E, -1, x.size(1)))
        data = slots.reshape(E * C, -1)
        y = None
        for j, (i, loc, g) in enumerate(zip(ids, locs, gates)):
            if self.variant == "combine_first_only" and j > 0:
                continue
            kept = (loc < drop) if self.variant == "no_sign_test" else (i >= 0) & (loc < drop)
            rows = (C * i.long() + loc.long())[kept] if self.variant == "no_sign_test" else (
                i.long() * C + loc.long())[kept]
            out = torch.zeros([x.size(0), data.size(-1)], dtype=data.dtype, device=data.device)
            out[kept] = g[kept].unsqueeze(-1) * data[rows]
            y = out if y is None else y + out
        if self.variant == "slots_read_outside":  # an auxiliary read of the padded outputs
            return y, slots.sum()
        return y


def _kept_pairs(model, x) -> tuple[int, int]:
    """(pairs kept, pairs routed) of the eager gating: whether the capacity drops any."""
    ids, locs, _, C = model.gating(x)
    return sum(int((loc < C).sum()) for loc in locs), x.size(0) * model.k


@pytest.mark.parametrize("k,factor,layouts,variant,T", [
    pytest.param(2, 1.0, "mixed", "plain", 13, id="E5-k2-cf1"),
    pytest.param(1, 1.0, "mixed", "plain", 13, id="E5-k1-acc"),  # top-1: the one buffer is the result
    pytest.param(3, 0.5, "mixed", "plain", 17, id="E5-k3-cf0.5-drops"),  # few slots: many pairs dropped
    pytest.param(2, 0.5, "nk", "plain", 11, id="E5-k2-nk-drops"),  # one layout, transposed as (E, N, K)
    pytest.param(2, 4.0, "mixed", "plain", 6, id="E5-k2-cf4-none-dropped"),  # more slots than tokens
    # the second choice queued first and the first behind it: the op's choice-major order is (1, 0)
    pytest.param(2, 0.5, "mixed", "reversed_queue", 13, id="E5-k2-reversed-queue"),
    # the drop alone (no ids >= 0 test), the stride written first
    pytest.param(2, 0.5, "mixed", "no_sign_test", 13, id="E5-k2-drop-only"),
])
def test_index_dispatch_rewritten_like_eager(k, factor, layouts, variant, T):
    torch.manual_seed(0)
    model = TutelLike(k, factor, variant, layouts)
    x = torch.randn(T, H)
    if factor < 1:
        kept, routed = _kept_pairs(model, x)
        assert kept < routed, "the case must drop pairs"
    assert_rewritten_like_eager(model, x, "padded_capacity", f"{k}-{factor}-{variant}")
    assert dict(counters["moe_inductor"]) == {"padded_capacity": 1}
    assert not counters["moe_inductor_left_alone"]


def test_index_dispatch_dynamic_tokens():
    """The capacity from the token count is a symbolic size: one recompile, every graph rewritten, equal outputs."""
    torch.manual_seed(0)
    model = TutelLike(2, 0.5)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (7, 10, 13, 21):
        x = torch.randn(T, H)
        assert rel_err(compiled(x), model(x)) < 1e-5, T
    assert 1 <= counters["moe_inductor"]["padded_capacity"] <= 2
    assert set(counters["moe_inductor"]) == {"padded_capacity"}


@pytest.mark.parametrize("variant,reason", [
    # a capacity off by one: the drop at C - 1 under a row stride of C (read as another capacity than the slots')
    pytest.param("drop_below_c", "another capacity than the slots' C", id="drop-at-C-1"),
    # the second choice not queued behind the first: two pairs share a slot
    pytest.param("no_earlier", "choice-major", id="queue-ignores-earlier-choices"),
    # choice 0 written at choice 1's experts with choice 0's positions
    pytest.param("other_ids", "dispatched once and combined once", id="rows-from-other-ids"),
    # a choice dispatched and never combined
    pytest.param("combine_first_only", "dispatched once and combined once", id="choice-not-combined"),
    # the padded outputs read beside the MoE: erasing the dispatch would change what that read sees
    pytest.param("slots_read_outside", "read outside the MoE", id="slots-read-outside"),
    # a float one-hot: the cumsum positions are floats, truncated to int32
    pytest.param("float_mask", "not at a queue position", id="float-queue"),
])
def test_look_alikes_left_alone(variant, reason):
    torch.manual_seed(0)
    model = TutelLike(2, 0.5, variant)
    x = torch.randn(13, H)
    got = compile_moe(model, x)
    ref = model(x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"]["padded_capacity"] == 1, dict(counters["moe_inductor_left_alone"])
    from moe_inductor import explain

    report = explain(model, x)
    assert any(reason in a.reason for a in report.left_alone if a.form == "padded_capacity"), [
        a.reason for a in report.left_alone]
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(g, r) < 1e-5
