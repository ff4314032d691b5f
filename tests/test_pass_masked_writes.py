"""DeepSeek-V2/DeepSeek-MoE's training loop: the tokens repeated k times, ``buf[flat_ids == e] = expert(xr[flat_ids
== e])`` into ``torch.empty_like``, then ``(buf.view(T, k, H) * w.unsqueeze(-1)).sum(1)``, or the weight on each
expert's input (``xr[flat == e] * w.reshape(-1, 1)[flat == e]``) and a plain ``.sum(1)``. Rewritten and equal to
eager forward and backward; look-alikes (a skipped expert, ``repeat`` instead of ``repeat_interleave``, a mask of
other ids, ids that are not from topk, the weights of other rows) left alone. Then a top-1 router's
``out[idx == e] = expert_e(x[idx == e])``, over (T,) ids and, with the batch dimension kept, over (B, T) ids of
(B, T, H) tokens: rewritten where exact, look-alikes left alone with their reason."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class MaskedWritesMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.gate = nn.Linear(H, E, bias=False)
        self.up = nn.ModuleList([nn.Linear(H, I, bias=False) for _ in range(E)])
        self.down = nn.ModuleList([nn.Linear(I, H, bias=False) for _ in range(E)])
        self.w_up = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        scores = self.gate(x).softmax(dim=-1)
        weights, ids = torch.topk(scores, K, dim=-1)
        if s == "ids_not_topk":  # may repeat an expert within a token: still every row written, but not proven
            ids = torch.argsort(scores, dim=-1)[:, -K:].contiguous()
        flat = ids.view(-1)
        other = torch.roll(flat, 1)
        xr = x.repeat(K, 1) if s == "repeat_not_interleave" else x.repeat_interleave(K, dim=0)
        buf = torch.empty_like(xr)
        experts = range(E - 1) if s == "skipped_expert" else range(E)  # expert E-1's rows stay garbage
        wf = weights.reshape(-1, 1)
        for e in experts:
            rows = xr[other == e] if s == "mask_of_other_ids" else xr[flat == e]
            if s in ("weight_on_input", "weight_of_other_mask"):  # the routing weight inside, the combine a sum
                rows = rows * (wf[other == e] if s == "weight_of_other_mask" else wf[flat == e])
            if s == "stacked":
                out = F.linear(F.gelu(F.linear(rows, self.w_up[e])), self.w_down[e])
            else:
                out = self.down[e](F.relu(self.up[e](rows)))
            buf[flat == e] = out
        if s == "skipped_expert":
            buf[flat == E - 1] = 0.0  # defined, so eager is deterministic; still not an MoE over all experts
        if s in ("weight_on_input", "weight_of_other_mask"):
            return buf.view(*weights.shape, -1).sum(dim=1)
        return (buf.view(*weights.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("style", ["per_expert", "stacked", "weight_on_input"])
def test_masked_writes_are_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = MaskedWritesMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


@pytest.mark.parametrize("style", ["skipped_expert", "repeat_not_interleave", "mask_of_other_ids", "ids_not_topk",
                                   "weight_of_other_mask"])  # rows of expert e scaled by the weights of other rows
def test_masked_write_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = MaskedWritesMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert sum(counters["moe_inductor_left_alone"].values()) >= 1  # explain() says something
    assert_close(out, model(x), torch.float32, style)


class Top1MasksMoE(nn.Module):
    """A top-1 router's boolean-mask writes, ``out[idx == e] = expert_e(x[idx == e])`` over (T,) ids, in the spelling
    ``style`` names (the first group is rewritten, the second left alone)."""

    def __init__(self, style, E=4):
        super().__init__()
        self.style, self.E = style, E
        width = E + 1 if style == "wider_router" else E
        self.router = nn.Linear(H, width, bias=False)
        bias = style == "biased_accumulate"
        self.gate_proj = nn.ModuleList([nn.Linear(H, I, bias=False) for _ in range(E)])
        self.up = nn.ModuleList([nn.Linear(H, I, bias=bias) for _ in range(E)])
        self.down = nn.ModuleList([nn.Linear(I, H, bias=bias) for _ in range(E)])
        self.w_up = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def expert(self, e, rows):
        if self.style in ("stacked_inside", "weight_on_input", "skipped_expert", "mismatched_expert"):
            return F.linear(F.gelu(F.linear(rows, self.w_up[e])), self.w_down[e])
        if self.style == "unweighted":
            return self.down[e](F.silu(self.gate_proj[e](rows)) * self.up[e](rows))
        return self.down[e](F.relu(self.up[e](rows)))

    def forward(self, x):
        s, E = self.style, self.E
        p = self.router(x).softmax(dim=-1)
        w = p.max(dim=-1).values
        idx = p.argmax(dim=-1)
        if s == "stacked_inside":
            w, idx = p.topk(1, dim=-1)  # w (T, 1), read as w[m]
            idx = idx.squeeze(-1)
        elif s == "unweighted":
            idx = p.max(dim=-1).indices
        elif s in ("hashed", "hashed_weight_after"):  # ids of no router: -1 and E come up, rows no expert writes
            idx = (x.detach().sum(-1) * 3).floor().long() % (E + 2) - 1
        elif s == "empty_unproven":
            idx = idx % E  # in range(E), but not provably so
        other = idx.flip(0)  # the same count per expert, other rows
        if s in ("stacked_inside", "weight_on_input", "mismatched_expert", "empty_unproven"):
            out = torch.empty_like(x)
        elif s == "unweighted":
            out = x.new_zeros(x.shape)
        elif s == "clone_accumulate":
            out = x.clone()
        else:
            out = torch.zeros_like(x)
        second = torch.zeros_like(x)
        kept = None
        experts = reversed(range(E)) if s == "after" else range(E - 1) if s == "skipped_expert" else range(E)
        for e in experts:
            m = idx == e
            if s == "after":  # the mask written out twice
                out[idx == e] = self.expert(e, x[idx == e])
            elif s == "stacked_inside":
                out[m] = w[m] * self.expert(e, x[m])
            elif s == "weight_on_input":
                out[m] = self.expert(e, x[m] * w[m, None])
            elif s in ("biased_accumulate", "clone_accumulate"):
                out[m] += w[m].unsqueeze(-1) * self.expert(e, x[m])
            elif s == "hashed" or (s == "weight_on_some" and e < E // 2):
                out[m] = self.expert(e, x[m]) * w[m, None]
            elif s == "two_buffers":
                (out if e < E // 2 else second)[m] = self.expert(e, x[m])
            elif s == "mismatched_expert":  # expert e's weights at the rows of expert e + 1
                m = idx == (e + 1) % E
                out[m] = self.expert(e, x[m])
            elif s == "weight_of_other_rows":
                out[m] = self.expert(e, x[m]) * w[other == e, None]
            elif s == "rows_of_other_ids":
                out[m] = self.expert(e, x[other == e])
            elif s == "writes_of_two_id_tensors":  # rows written twice or never
                m = m if e < E // 2 else other == e
                out[m] = self.expert(e, x[m])
            elif s in ("recomputed_ids", "recomputed_after_a_change"):  # the ids' argmax written out in each mask
                out[p.argmax(-1) == e] = self.expert(e, x[p.argmax(-1) == e])
                if s == "recomputed_after_a_change":  # the next argmax reads other scores
                    p[:, e] -= 1.0
            elif s in ("recomputed_weight", "recomputed_weight_after_a_change"):  # the weight written out in each write
                out[m] = self.expert(e, x[m]) * p.max(dim=-1).values[m, None]
                if s == "recomputed_weight_after_a_change":  # the next write's weight reads other scores
                    p[:, (e + 1) % E] += 1.0
            elif s == "ge_mask":
                out[idx >= e] = self.expert(e, x[idx >= e])
            else:
                out[m] = self.expert(e, x[m])
            if s == "read_between" and e == 0:
                kept = out.sum(0, keepdim=True)
        if s == "written_twice":
            out[idx == 0] = 2.0 * self.expert(0, x[idx == 0])
        if s in ("unweighted", "biased_accumulate", "hashed", "stacked_inside", "weight_on_input", "weight_on_some",
                 "recomputed_weight", "recomputed_weight_after_a_change"):
            return out
        if s == "two_buffers":
            return (out + second) * w[:, None]
        if s == "read_between":
            return out * w.unsqueeze(-1) + kept
        return out * w[:, None]


@pytest.mark.parametrize("style,E,T", [
    ("after", 3, 7),  # per-expert nn.Linear, the weight on the combined result, experts written in reverse order
    ("after", 3, 1),  # one token: every expert but one empty
    ("stacked_inside", 5, 9),  # w[e] of stacked weights, topk(1) ids, the (T, 1) weight on each output; empty_like
    ("weight_on_input", 5, 6),
    ("unweighted", 3, 8),  # a gated MLP per expert and no routing weight: the op scales by 1
    ("biased_accumulate", 4, 9),  # nn.Linear biases, out[m] += w[m].unsqueeze(-1) * expert(x[m]) onto zeros
    ("hashed", 4, 12),  # ids of no router: those outside range(E) leave zero rows, as the op skips them
    ("recomputed_ids", 4, 7),  # p.argmax(-1) == e computed afresh for each read and write: the same ids
    ("recomputed_weight", 4, 7),  # p.max(-1).values computed afresh in each write: the same weight
])
def test_top1_masked_writes_are_rewritten_and_equal(style, E, T):
    torch.manual_seed(0)
    model = Top1MasksMoE(style, E)
    x = torch.randn(T, H)
    if style == "hashed":  # the case is only worth its name when some ids fall outside range(E)
        ids = (x.sum(-1) * 3).floor().long() % (E + 2) - 1
        assert ((ids < 0) | (ids >= E)).any() and ((ids >= 0) & (ids < E)).any()
    assert_rewritten_like_eager(model, x, "unrolled_loop", f"{style} E={E} T={T}")
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("style,reason", [
    ("two_buffers", "the router chooses among 4 experts and the loop writes 2"),
    ("skipped_expert", "not each of range(4) once"),
    ("written_twice", "written twice"),
    ("mismatched_expert", "expert 1's output is not a projection on its own weights"),
    ("clone_accumulate", "out[mask] += ... onto a buffer that does not start as zeros"),  # x + expert(x)
    ("read_between", "read before the loop's last write"),
    ("weight_of_other_rows", "expert 0's output is not a projection"),
    ("rows_of_other_ids", "does not read the tokens at its own mask"),
    ("writes_of_two_id_tensors", "masks of different id tensors"),
    ("weight_on_some", "do not all apply one routing weight"),
    ("recomputed_after_a_change", "masks of different id tensors"),
    ("recomputed_weight_after_a_change", "do not all apply one routing weight"),
    ("ge_mask", "moe_region"),  # overlapping masks are no mark of this form; the router's note says it
    ("wider_router", "the router chooses among 5 experts and the loop writes 4"),
    ("empty_unproven", "torch.empty_like and the ids are not provably in range(E)"),
    ("hashed_weight_after", "scales the whole buffer and the ids are not provably in range(E)"),
])
def test_top1_masked_write_look_alikes_are_left_alone(style, reason, caplog):
    torch.manual_seed(0)
    model, x = Top1MasksMoE(style), torch.randn(10, H)
    with caplog.at_level(logging.INFO, logger="moe_inductor"):
        out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    notes = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert any(reason in n for n in notes), notes
    assert_close(out, model(x), torch.float32, style)


def test_a_masked_fill_of_one_id_is_no_expert_loop(caplog):
    """``t[ids == c] = v`` at one id is how a model masks labels or padding: nothing to say about it."""
    def masked_fill(x):
        ids = x.argmax(dim=-1)
        y = torch.zeros_like(x)
        y[ids == 0] = x[ids == 0] * 2.0
        return y.sum(0) * 3.0

    x = torch.randn(6, H)
    with caplog.at_level(logging.INFO, logger="moe_inductor"):
        out = compile_moe(masked_fill, x)
    assert not counters["moe_inductor"] and not counters["moe_inductor_left_alone"]
    assert_close(out, masked_fill(x), torch.float32)


class BatchedTop1MoE(nn.Module):
    """The top-1 masked writes with the batch dimension kept: x (B, T, H), (B, T) ids, each write
    ``out[mask] = expert(x[mask])`` through a (B, T) mask, in the spelling ``style`` names (the first group is
    rewritten, the second left alone)."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        bias = style == "biased_accumulate"
        self.router = nn.Linear(H, E + 1 if style == "wider_router" else E, bias=False)
        width = H + 2 if style == "wider_out" else H  # experts that map H to another width
        drop = [nn.Dropout(0.5)] if style in ("dropout_eval", "dropout_train") else []
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I, bias=bias), nn.ReLU(), *drop,
                                                   nn.Linear(I, width, bias=bias)) for _ in range(E))
        self.w_up = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.train(style != "dropout_eval")  # in eval mode the experts' dropout is the identity

    def expert(self, e, rows):
        if self.style in ("stacked_inside", "mismatched_expert"):
            return F.linear(F.gelu(F.linear(rows, self.w_up[e])), self.w_down[e])
        return self.experts[e](rows)

    def forward(self, x):
        s = self.style
        if s == "seq_first":  # the tokens a transposed (T, B, H) view: the masks index its leading dims as they are
            x = x.transpose(0, 1)
        p = self.router(x).softmax(dim=-1)
        w, idx = p.max(dim=-1)  # (B, T) weights and ids
        if s == "stacked_inside":
            w, idx = p.topk(1, dim=-1)  # w (B, T, 1), read as w[m]
            idx = idx.squeeze(-1)
        elif s == "hashed":  # ids of no router: -1 and E come up, rows no expert writes
            idx = (x.detach().sum(-1) * 3).floor().long() % (E + 2) - 1
        elif s == "empty_unproven":
            idx = idx % E  # in range(E), but not provably so
        elif s == "batch_mask":  # one expert per sequence: (B,) ids, each mask selects whole sequences
            w, idx = p.mean(dim=1).max(dim=-1)
        other = idx.flip(-1)  # the same count per expert, other rows
        if s in ("stacked_inside", "empty_unproven", "mismatched_expert"):
            out = torch.empty_like(x)
        elif s == "wider_out":
            out = x.new_zeros(*x.shape[:2], H + 2)
        elif s == "weight_on_input":
            out = x.new_zeros(x.shape)
        elif s == "clone":
            out = x.clone()
        elif s == "slice_write":  # a buffer one position longer, the experts writing its last T positions
            whole = torch.zeros(x.shape[0], x.shape[1] + 1, x.shape[2])
            out = whole[:, 1:]
        elif s == "flat_buffer":  # (B*T, H) written at the flat ids: the same rows, through two id tensors
            out = x.new_zeros(x.shape[0] * x.shape[1], x.shape[2])
        else:
            out = torch.zeros_like(x)
        for e in range(E):
            m = idx == e
            if s == "stacked_inside":
                out[m] = w[m] * self.expert(e, x[m])
            elif s == "weight_on_input":
                out[m] = self.expert(e, x[m] * w[m, None])
            elif s == "column_weight":
                out[m] = self.expert(e, x[m]) * w[..., None][m]
            elif s == "biased_accumulate":
                out[m] += w[m].unsqueeze(-1) * self.expert(e, x[m])
            elif s == "mismatched_expert":  # expert e's weights at the rows of expert e + 1
                m = idx == (e + 1) % E
                out[m] = self.expert(e, x[m])
            elif s == "rows_of_other_ids":
                out[m] = self.expert(e, x[other == e])
            elif s == "flat_buffer":
                out[idx.reshape(-1) == e] = self.expert(e, x[m])
            else:
                out[m] = self.expert(e, x[m])
        if s == "slice_write":
            return whole * 2.0
        if s == "flat_buffer":
            return out.view_as(x)
        if s in ("hashed", "stacked_inside", "weight_on_input", "biased_accumulate", "column_weight"):
            return out
        if s == "broadcast_weight":  # one weight per position, shared by the batch: no routing weight of a row
            return out * w.mean(dim=0, keepdim=True).unsqueeze(-1)
        if s == "batch_mask":
            return out * w[:, None, None]
        return out * w.unsqueeze(-1)


@pytest.mark.parametrize("style,B,T", [
    ("after", 2, 5),  # argmax ids of (B, T, E) scores, zeros_like, the weight w.unsqueeze(-1) on the result
    ("after", 3, 1),  # one token per sequence
    ("stacked_inside", 2, 6),  # topk(1) ids squeezed, w (B, T, 1) on each output, stacked weights, empty_like
    ("weight_on_input", 1, 7),
    ("biased_accumulate", 2, 4),  # nn.Linear biases, out[m] += w[m].unsqueeze(-1) * expert(x[m]) onto zeros
    ("hashed", 2, 6),  # ids of no router: those outside range(E) leave zero rows, as the op skips them
    ("seq_first", 3, 4),  # the (T, B, H) transposed view of x indexed by its own (T, B) masks: read by reshape
    ("column_weight", 2, 5),  # w[..., None][m]: a (B, T) weight made a column, then masked
    ("broadcast_weight", 2, 5),  # a (1, T, 1) weight after the loop is the user's own product on the op's result
    ("dropout_eval", 2, 5),  # nn.Dropout(0.5) between the experts' layers, in eval mode: read as the identity
    ("clone", 2, 5),  # x.clone() under ids provably in range(E): every row is written, the clone's values never show
])
def test_batched_top1_masked_writes_are_rewritten_and_equal(style, B, T):
    torch.manual_seed(0)
    model = BatchedTop1MoE(style)
    x = torch.randn(B, T, H)
    if style == "hashed":  # the case is only worth its name when some ids fall outside range(E)
        ids = (x.sum(-1) * 3).floor().long() % (E + 2) - 1
        assert ((ids < 0) | (ids >= E)).any() and ((ids >= 0) & (ids < E)).any()
    assert_rewritten_like_eager(model, x, "unrolled_loop", f"{style} B={B} T={T}")
    assert sum(counters["graph_break"].values()) == 0
    assert not counters["moe_inductor_fallback"], dict(counters["moe_inductor_fallback"])  # the rewrite ran as is


def test_batched_top1_masked_writes_follow_new_shapes():
    """One compiled model over other batch sizes and sequence lengths (Dynamo's dynamic graph after the first): every
    graph rewritten, each output equal to eager's."""
    torch.manual_seed(0)
    model = BatchedTop1MoE("after")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for B, T in ((2, 5), (3, 7), (4, 3)):
        x = torch.randn(B, T, H)
        assert_close(compiled(x), model(x), torch.float32, f"B={B} T={T}")
    graphs = counters["stats"]["unique_graphs"]
    assert counters["moe_inductor"]["unrolled_loop"] == graphs == 2, (dict(counters["moe_inductor"]), graphs)


@pytest.mark.parametrize("style,reason", [
    ("batch_mask", "expert 0's write is not whole rows"),  # (B,) masks select whole (T, H) sequences
    ("slice_write", "does not start as zeros, empty"),  # the buffer is a slice of another tensor
    ("flat_buffer", "moe_region"),  # reads at (B, T) ids, writes at their flat view: no mark of this form
    ("mismatched_expert", "expert 1's output is not a projection on its own weights"),
    ("rows_of_other_ids", "does not read the tokens at its own mask"),
    ("empty_unproven", "torch.empty_like and the ids are not provably in range(E)"),
    ("wider_router", "the router chooses among 5 experts and the loop writes 4"),
    ("wider_out", "the buffer and the tokens are not (B, T, H) of one dtype"),  # experts map H to H + 2
    ("dropout_train", "expert 0's dropout may drop"),  # nn.Dropout(0.5) in training: a random mask per row
])
def test_batched_top1_look_alikes_are_left_alone(style, reason, caplog):
    torch.manual_seed(0)
    model, x = BatchedTop1MoE(style), torch.randn(2, 6, H)
    with caplog.at_level(logging.INFO, logger="moe_inductor"):
        torch.manual_seed(1)  # the same dropout masks in both runs
        out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    notes = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert any(reason in n for n in notes), notes
    torch.manual_seed(1)
    assert_close(out, model(x), torch.float32, style)
