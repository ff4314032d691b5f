"""The split loop: sorted rows split by ``counts.tolist()``, one expert per split, ``torch.cat`` back, scattered
to the tokens (Megatron's SequentialMLP, JetMoE's ParallelExperts; torchtune's rows gathered and scaled before the
experts). Rewritten and equal to eager, forward and
backward; look-alikes (another split order, sizes from other counts, unsorted weights, an expert that differs,
scattered to other rows) left alone, with a note for explain()."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class SplitLoopMoE(nn.Module):
    def __init__(self, style):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.fc1 = nn.ModuleList([nn.Linear(H, 2 * I, bias=False) for _ in range(E)])
        self.fc2 = nn.ModuleList([nn.Linear(I, H, bias=False) for _ in range(E)])
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        s = self.style
        T = x.shape[0]
        logits = self.router(x)
        top, ids = torch.topk(logits, K, dim=1)
        top = torch.softmax(top, dim=-1)
        if s.startswith("mask"):  # Megatron's dispatcher
            probs = torch.zeros_like(logits).scatter(1, ids, top)
            rmap = torch.zeros_like(logits).int().scatter(1, ids, 1).bool()
            tok = torch.arange(T).unsqueeze(0).expand(E, -1).masked_select(rmap.T.contiguous())
            counts = rmap.sum(dim=0)
            if s == "mask_other_counts":  # counts of the next expert's assignments: wrong splits
                counts = counts.roll(1)
            ws = probs.T.contiguous().masked_select(rmap.T.contiguous())
            xs = x.index_select(0, tok)
        elif s.startswith("gather"):  # torchtune: histc counts, a stable argsort, rows by gather scaled before
            order = torch.argsort(ids.view(-1), stable=True)
            tok = order // K
            if s == "gather_bincount":  # the counts by bincount(minlength=E)
                counts = torch.bincount(ids.view(-1), minlength=E)
            elif s == "gather_bincount_other_ids":  # look-alike: the counts of the next expert's ids
                counts = ((ids.view(-1) + 1) % E).bincount(minlength=E)
            else:
                counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E).to(ids.dtype)
            ws = top.flatten() if s == "gather_unsorted_weights" else top.view(-1)[order]
            index = tok.reshape(-1, 1).expand(-1, H)
            xs = torch.gather(x, dim=0, index=index)
            xs = xs if s == "gather_no_weights" else xs * ws.reshape(-1, 1)
        else:  # JetMoE's sort
            order = ids.flatten().sort(0)[1]
            tok = order.div(K, rounding_mode="trunc")
            counts = torch.zeros(T, E).scatter(1, ids, 1).long().sum(0)
            ws = top.flatten() if s == "sort_unsorted_weights" else top.flatten()[order]
            xs = x[tok]
        sizes = counts.tolist()
        if s in ("mask", "mask_other_counts", "mask_reversed_pieces", "mask_one_expert_differs", "mask_read_before"):
            pieces = torch.split(xs, sizes)
            outs = []
            for e in range(E):  # each expert's whole MLP on its own piece
                p = pieces[E - 1 - e] if s == "mask_reversed_pieces" else pieces[e]
                g, u = torch.chunk(self.fc1[e](p), 2, dim=-1)
                act = F.gelu if (s == "mask_one_expert_differs" and e == 2) else F.silu
                outs.append(self.fc2[e](act(g) * u))
            ys = torch.cat(outs, dim=0)
        else:  # per projection over the splits (stacked (E, out, in) weights)
            h = torch.cat([F.linear(p, self.w1[e]) for e, p in enumerate(xs.split(sizes, dim=0))], dim=0)
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
            ys = torch.cat([F.linear(p, self.w2[e]) for e, p in enumerate(h.split(sizes, dim=0))], dim=0)
        if s.startswith("gather"):  # the weights went in before the experts
            out = torch.zeros(T, H)
            out.scatter_add_(dim=0, index=index, src=ys)
            return out
        if s.startswith("mask"):
            out = torch.zeros(T, H)
            early = out.clone() + 1.0 if s == "mask_read_before" else None  # reads the zeros before the write
            width = H // 2 if s == "mask_narrow_index" else H  # adds the first half of each row only
            out.scatter_add_(0, tok.unsqueeze(1).expand(-1, width), ys * ws.unsqueeze(-1))
            return out if early is None else out * early
        rows = torch.flip(tok, [0]) if s == "sort_other_rows" else tok
        return torch.zeros((T, H)).index_add(0, rows, ys * ws[:, None])


@pytest.mark.parametrize("style", ["mask", "sort", "gather", "gather_bincount"])
def test_split_loop_is_rewritten_and_equal(style):
    torch.manual_seed(0)
    model = SplitLoopMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "split_loop", f"{style} T={T}")
        assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("style", ["mask_other_counts", "mask_reversed_pieces", "mask_one_expert_differs",
                                   "sort_unsorted_weights", "sort_other_rows", "mask_read_before",
                                   "gather_unsorted_weights", "gather_no_weights"])
def test_split_loop_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = SplitLoopMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert sum(counters["moe_inductor_left_alone"].values()) == 1, dict(counters["moe_inductor_left_alone"])
    assert_close(out, model(x), torch.float32, style)


def test_bincount_of_other_ids_is_not_rewritten():
    """Look-alike: the pieces sized by the bincount of the next expert's ids. Those sizes cannot be proven to add up
    to the rows while traced, so the frame is compiled as plain capture would; either way nothing is rewritten and
    the result is eager's."""
    torch.manual_seed(0)
    model = SplitLoopMoE("gather_bincount_other_ids")
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, "gather_bincount_other_ids")


class NumelTestMoE(SplitLoopMoE):
    """torchtune's spelling with its ``if routed_output.numel() > 0`` before the combine; ``shifted`` counts the
    ids shifted by one expert, which the capture cannot prove add up to the rows (and which split them wrongly)."""

    def forward(self, x):
        T = x.shape[0]
        top, ids = torch.topk(self.router(x), K, dim=1)
        top = torch.softmax(top, dim=-1)
        order = torch.argsort(ids.view(-1), stable=True)
        tok = order // K
        counted = (ids + 1) % E if self.style == "shifted" else ids
        counts = torch.histc(counted.view(-1).float(), bins=E, min=0, max=E).to(ids.dtype)
        index = tok.reshape(-1, 1).expand(-1, H)
        xs = torch.gather(x, dim=0, index=index) * top.view(-1)[order].reshape(-1, 1)
        sizes = counts.tolist()
        h = torch.cat([F.linear(p, self.w1[e]) for e, p in enumerate(xs.split(sizes, dim=0))], dim=0)
        g, u = h.chunk(2, dim=-1)
        ys = torch.cat([F.linear(p, self.w2[e]) for e, p in enumerate((F.silu(g) * u).split(sizes, dim=0))], dim=0)
        out = torch.zeros(T, H)
        if ys.numel() > 0:
            out.scatter_add_(dim=0, index=index, src=ys)
        return out


def test_a_test_of_the_outputs_size_is_decided_by_the_counts_total():
    """The counts are a histogram of the top-k ids, so the split outputs' rows add up to T*k and ``numel() > 0`` is
    decided while tracing: one graph, rewritten, equal to eager (forward and backward)."""
    torch.manual_seed(0)
    model = NumelTestMoE("histogram")
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "split_loop", f"T={T}")
        assert sum(counters["graph_break"].values()) == 0


def test_counts_not_proven_to_add_up_leave_the_size_test_undecided():
    """Counts of other values than the top-k ids: nothing is assumed about their sum, the size test breaks the
    graph as it does without moe_inductor, nothing is rewritten, and the result is eager's."""
    torch.manual_seed(0)
    model = NumelTestMoE("shifted")
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, "shifted")


class SharedExpertMoE(SplitLoopMoE):
    """torchtune's MoE with a shared expert: the routed outputs are added into the shared expert's output (a view of
    it) rather than into zeros, in place or out of place. The look-alikes read memory the in-place add changed
    through another name after it (the tensor the buffer views, or a view made before the add), which sees the
    routed outputs too in eager."""

    def __init__(self, style):
        super().__init__(style)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        s, T = self.style, x.shape[0]
        top, ids = torch.topk(self.router(x), K, dim=1)
        order = torch.argsort(ids.view(-1), stable=True)
        counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E).to(ids.dtype)
        index = (order // K).reshape(-1, 1).expand(-1, H)
        xs = torch.gather(x, dim=0, index=index) * torch.sigmoid(top).view(-1)[order].reshape(-1, 1)
        sizes = counts.tolist()
        h = torch.cat([F.linear(p, self.w1[e]) for e, p in enumerate(xs.split(sizes, dim=0))], dim=0)
        g, u = h.chunk(2, dim=-1)
        ys = torch.cat([F.linear(p, self.w2[e]) for e, p in enumerate((F.silu(g) * u).split(sizes, dim=0))], dim=0)
        base = self.shared(x.unsqueeze(0))  # (1, T, H)
        if s == "shared_out_of_place":
            return base.view(T, H).scatter_add(0, index, ys)
        out = base.reshape(T, H)
        early = base[0, :2] if s == "shared_view_read_after" else None
        if ys.numel() > 0:
            out.scatter_add_(dim=0, index=index, src=ys)
        if s == "shared_base_read_after":
            return out + base[0]
        if early is not None:
            return out[:2] + early
        return out.reshape(1, T, H)


@pytest.mark.parametrize("style", ["shared_in_place", "shared_out_of_place"])
def test_outputs_added_into_a_shared_experts_output_are_rewritten(style):
    """The op's result is added to the buffer's value: shared + routed, forward and backward (the shared expert's
    gradients too)."""
    torch.manual_seed(0)
    model = SharedExpertMoE(style)
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "split_loop", f"{style} T={T}")
        assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("style", ["shared_base_read_after", "shared_view_read_after"])
def test_an_add_into_memory_read_through_another_name_is_left_alone(style):
    torch.manual_seed(0)
    model = SharedExpertMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)


def test_a_scatter_index_narrower_than_the_buffer_is_not_rewritten():
    torch.manual_seed(0)
    model = SplitLoopMoE("mask_narrow_index")
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, "mask_narrow_index")
