"""An in-place op's result is its receiver: ``r = x.scatter_(1, ids, v)`` (``add_``, ``mul_``, ``masked_fill_``,
``torch.relu_``, ``out=``) returns ``x`` itself, so a write through ``r`` writes ``x`` and a write to ``x`` changes
what ``r`` reads (``passes/aliases.py``: ``base_of``, ``view_family``, ``alias_mutations``, ``is_impure``).

Each look-alike below writes a tensor a pass proves unchanged through such a second name, so the naive rewrite
differs from eager; each is equal to eager and not rewritten. Beside each, the same code without the write is
still rewritten. Passes covered: dense_experts (Llama 4's token-replicated scores), sorted_grouped_mm (DeepSeek-V2's
marked counts), split_loop (torchtune's shared-expert buffer), gathered_weights and unrolled_loop (tokens read by
the experts), and the dead-code removal after a rewrite (a buffer update chained on an in-place result)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, compile_moe

H, I, E, K = 16, 8, 4, 2


def _left_alone_like_eager(model: nn.Module, x: torch.Tensor, what: str) -> None:
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert not counters["moe_inductor"], (what, dict(counters["moe_inductor"]))
    assert_close(out, ref, torch.float32, what)


def _rewritten_like_eager(model: nn.Module, x: torch.Tensor, form: str, what: str) -> None:
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"][form] == 1, (what, dict(counters["moe_inductor"]))
    assert_close(out, ref, torch.float32, what)


class ReplicatedScores(nn.Module):
    """Llama 4's reference MoE: (E, T) scores ``sigmoid(full_like(logits, -inf).scatter_(1, ids, top).T)``, zero off
    the top-k, on every token copied once per expert. ``edited`` writes the scatter_'s result afterwards
    (``scores[:, 0] = 0``: expert 0 then weighs every token by sigmoid(0) = 0.5, which no top-k op computes)."""

    def __init__(self, edited: bool):
        super().__init__()
        self.edited = edited
        self.router = nn.Parameter(torch.randn(H, E) * H ** -0.5)
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        T = x.shape[0]
        logits = x @ self.router
        top, ids = torch.topk(logits, K, dim=1)
        masked = torch.full_like(logits, float("-inf")).scatter_(1, ids, top)
        if self.edited:
            masked[:, 0] = 0.0
        scores = torch.sigmoid(masked.transpose(0, 1))
        idx = torch.arange(T).view(1, -1).expand(E, -1).reshape(-1, 1).expand(-1, H)
        xs = (torch.gather(x, dim=0, index=idx) * scores.reshape(-1, 1)).view(E, -1, H)
        ys = torch.bmm(F.silu(torch.bmm(xs, self.w1)) * torch.bmm(xs, self.w3), self.w2)
        out = self.shared(x)
        out.scatter_add_(dim=0, index=idx, src=ys.view(-1, H))
        return out


@pytest.mark.parametrize("edited", [False, True], ids=["genuine", "scores-edited"])
def test_token_replicated_scores_written_through_the_scatter_result(edited):
    torch.manual_seed(0)
    model, x = ReplicatedScores(edited), torch.randn(9, H)
    if edited:
        _left_alone_like_eager(model, x, "scores-edited")
    else:
        _rewritten_like_eager(model, x, "dense_experts", "genuine")


class MarkedCounts(nn.Module):
    """DeepSeek-V2's ``moe_infer``: counts from ``zeros(T, E).scatter_(1, ids, 1).sum(0)``, walked on the host over
    the rows sorted by expert. ``edited`` swaps experts 0 and 1's columns through the scatter_'s result, so the
    walk gives each of them the other's number of rows (the total is kept: eager runs, on other rows)."""

    def __init__(self, edited: bool):
        super().__init__()
        self.edited = edited
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        marks = ids.new_zeros((ids.shape[0], E))
        marked = marks.scatter_(1, ids, 1)
        if self.edited:
            marked[:, :2] = marked[:, :2].flip(1)
        order = ids.view(-1).argsort()
        rows = x[order // K]
        outputs, start = [], 0
        for e, n in enumerate(marks.sum(dim=0).tolist()):
            if n == 0:
                continue
            end = start + n
            h = F.linear(rows[start:end], self.w13[e])
            outputs.append(F.linear(F.silu(h[..., :I]) * h[..., I:], self.w2[e]))
            start = end
        out = torch.cat(outputs, dim=0)
        placed = torch.empty_like(out)
        placed[order] = out
        return (placed.view(*ids.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("edited", [False, True], ids=["genuine", "counts-edited"])
def test_marked_counts_written_through_the_scatter_result(edited):
    torch.manual_seed(0)
    model, x = MarkedCounts(edited), torch.randn(11, H)
    if edited:
        marks = torch.zeros(11, E).scatter_(1, torch.topk(model.gate(x), K, dim=-1)[1], 1).sum(0)
        assert marks[0] != marks[1], "the swap must change the walk for the look-alike to tell"
        _left_alone_like_eager(model, x, "counts-edited")
    else:
        _rewritten_like_eager(model, x, "sorted_grouped_mm", "genuine")


class SharedScaledInPlace(nn.Module):
    """torchtune's routed outputs added in place into the shared expert's output, which is first scaled in place
    (``out = base.mul_(0.5)``: ``out`` is ``base``). ``base_read`` reads ``base`` after the add, which in eager holds
    the routed outputs too; a rewrite that turns the add into ``out + op`` for ``out``'s readers would miss them."""

    def __init__(self, base_read: bool):
        super().__init__()
        self.base_read = base_read
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.shared = nn.Linear(H, H, bias=False)

    def forward(self, x):
        top, ids = torch.topk(self.router(x), K, dim=1)
        order = torch.argsort(ids.view(-1), stable=True)
        counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E).to(ids.dtype)
        index = (order // K).reshape(-1, 1).expand(-1, H)
        xs = torch.gather(x, dim=0, index=index) * torch.sigmoid(top).view(-1)[order].reshape(-1, 1)
        sizes = counts.tolist()
        h = torch.cat([F.linear(p, self.w1[e]) for e, p in enumerate(xs.split(sizes, dim=0))], dim=0)
        g, u = h.chunk(2, dim=-1)
        ys = torch.cat([F.linear(p, self.w2[e]) for e, p in enumerate((F.silu(g) * u).split(sizes, dim=0))], dim=0)
        base = self.shared(x)
        out = base.mul_(0.5)
        out.scatter_add_(dim=0, index=index, src=ys)
        return out + base if self.base_read else out


@pytest.mark.parametrize("base_read", [False, True], ids=["genuine", "receiver-read-after"])
def test_shared_buffer_scaled_in_place_then_read_through_its_receiver(base_read):
    """With gradients the shared expert's output requires grad and ``base.mul_(0.5)`` stays in place: the second
    name is left alone. Without them the write is respelled ``out = base * 0.5`` (``passes/private_writes.py``:
    ``base`` is the linear's own fresh result), every later reader of ``base`` then reads ``out``, and the rewrite
    that adds the op to ``out``'s readers covers both names: rewritten, equal to eager."""
    torch.manual_seed(0)
    model, x = SharedScaledInPlace(base_read), torch.randn(9, H)
    if base_read:
        out, ref = compile_moe(model, x), model(x)
        assert not counters["moe_inductor"], dict(counters["moe_inductor"])
        assert_close(out, ref, torch.float32, "receiver-read-after, with gradients")
    _rewritten_like_eager(model, x, "split_loop", "receiver-read-after" if base_read else "genuine")


class GatheredScaledTokens(nn.Module):
    """gpt-fast's gathered experts on tokens scaled in place (``h = xs.mul_(2)``: ``h`` is ``xs``). ``changed``
    writes ``xs`` between the gate's and the up projection's reads of ``h``, so they read two values; an op that
    reads ``h`` once, where the region ends, gives both the second."""

    def __init__(self, changed: bool):
        super().__init__()
        self.changed = changed
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        xs = x.clone()
        h = xs.mul_(2.0)
        gate = F.silu(torch.einsum("ti,taoi->tao", h, self.w1[ids]))
        if self.changed:
            xs.add_(1.0)
        up = torch.einsum("ti,taoi->tao", h, self.w3[ids])
        out = torch.einsum("tao,taio->tai", gate * up, self.w2[ids])
        return torch.einsum("tai,ta->ti", out, weights)


@pytest.mark.parametrize("changed", [False, True], ids=["genuine", "receiver-written-between-reads"])
def test_gathered_tokens_read_through_an_inplace_result(changed):
    torch.manual_seed(0)
    model, x = GatheredScaledTokens(changed), torch.randn(9, H)
    if changed:
        _left_alone_like_eager(model, x, "receiver-written-between-reads")
    else:
        _rewritten_like_eager(model, x, "gathered_weights", "genuine")


class LoopScaledTokens(nn.Module):
    """An unrolled expert loop on tokens made by an in-place op (``h = torch.relu_(xs)``). ``changed`` writes ``xs``
    after expert 0, so the later experts read other tokens than the first."""

    def __init__(self, changed: bool):
        super().__init__()
        self.changed = changed
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False)) for _ in range(E))

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        xs = x.clone()
        h = torch.relu_(xs)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * weights[tok, pos, None])
            if self.changed and e == 0:
                xs.mul_(3.0)
        return out


@pytest.mark.parametrize("changed", [False, True], ids=["genuine", "receiver-written-between-experts"])
def test_loop_tokens_read_through_an_inplace_result(changed):
    torch.manual_seed(0)
    model, x = LoopScaledTokens(changed), torch.randn(9, H)
    if changed:
        _left_alone_like_eager(model, x, "receiver-written-between-experts")
    else:
        _rewritten_like_eager(model, x, "unrolled_loop", "genuine")


class ChainedBufferUpdate(nn.Module):
    """gpt-fast's gathered experts beside a running average of the routing, updated in a chain of in-place ops
    (``self.load.mul_(0.5).add_(hist)``) whose last result nobody reads: the ``add_`` writes the buffer through
    ``mul_``'s result, and the dead-code removal after the rewrite must keep it."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.register_buffer("load", torch.zeros(E))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        self.load.mul_(0.5).add_(torch.histc(ids.view(-1).float(), bins=E, min=0, max=E))
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        out = torch.einsum("tao,taio->tai", h, self.w2[ids])
        return torch.einsum("tai,ta->ti", out, weights)


def test_a_buffer_written_through_an_inplace_result_keeps_its_write():
    torch.manual_seed(0)
    model, ref_model = ChainedBufferUpdate(), ChainedBufferUpdate()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(9, H)
    with torch.no_grad():
        out, ref = compile_moe(model, x), ref_model(x)
    assert counters["moe_inductor"]["gathered_weights"] == 1, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, "forward")
    assert torch.equal(model.load, ref_model.load), (model.load, ref_model.load)
