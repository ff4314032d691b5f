"""Views by ops beyond view/reshape/transpose/permute/...: ``t.T``, ``t.mT``, ``t.swapaxes``, ``torch.movedim``,
``t.moveaxis``, ``torch.t``, ``t.diagonal``, ``torch.as_strided``, ``t.tensor_split``, ``torch.chunk`` /
``torch.split`` / ``torch.unbind`` parts, ``t.unfold``, ``torch.broadcast_to``. A write through any of them
changes the tensor they view, so ``passes/aliases.py`` counts it (the op's name, or its traced value being a view
of its one tensor input) and a proof that needs the tensor unchanged leaves the code alone.

Each look-alike writes a tensor a rewrite reads later than the user's code did, through such a view:
- NLLB-MoE's routing table (``passes/table_writes.py``), its column 0 doubled after expert 0 used it: eager's expert
  0 has the old weights, the op would read the new;
- transformers v4.27 Switch's tokens (``passes/top1_masks.py``), doubled after the buffer's ``x.clone()``: a dropped
  row keeps the old token, the op would pass the new one through;
- a top-1 loop's ids (``passes/unrolled_loop.py``), moved by one after expert 0 read them: the op would route every
  row by the new ids.
Each is equal to eager and not rewritten; the same code with a plain ``t.mul_`` write was already left alone. So are
writes by no view op at all that were missed the same way: an activation's ``inplace`` passed by position
(``F.relu(t, True)``: ``aliases._inplace_by_position``), ``t.data.mul_(2)`` and an aten overload
(``torch.ops.aten.mul_.Scalar``); and Switch's padded-capacity combine written through a view op after the proof
reads it (``capacity_gating.versions_sound``)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.helpers import assert_close, compile_moe

H, I, E, C = 16, 24, 4, 3

# views of the (T, E) table, each selecting its column 0; then of the (B, T, H) tokens and of the (T,) ids, whole
_TABLE_VIEWS = {
    "T": lambda t: t.T[0],
    "mT": lambda t: t.mT[0],
    "swapaxes": lambda t: t.swapaxes(0, 1)[0],
    "movedim": lambda t: torch.movedim(t, 1, 0)[0],
    "moveaxis": lambda t: t.moveaxis(1, 0)[0],
    "torch.t": lambda t: torch.t(t)[0],
    "as_strided": lambda t: torch.as_strided(t, t.shape, t.stride())[:, 0],
    "tensor_split": lambda t: t.tensor_split(1)[0][:, 0],
    "unfold": lambda t: t.unfold(0, 1, 1)[:, 0, 0],
}
_TOKEN_VIEWS = {
    "swapaxes": lambda t: t.swapaxes(0, 1),
    "movedim": lambda t: torch.movedim(t, 0, 1),
    "diagonal": lambda t: t.diagonal(0, 0, 1),
    "as_strided": lambda t: torch.as_strided(t, t.shape, t.stride()),
    "tensor_split": lambda t: t.tensor_split(1)[0],
}
_ID_VIEWS = {
    "chunk": lambda t: torch.chunk(t, 1)[0],
    "split": lambda t: torch.split(t, t.shape[0])[0],
    "unbind": lambda t: torch.unbind(t.unsqueeze(0))[0],
    "tensor_split": lambda t: t.tensor_split(1)[0],
    "moveaxis": lambda t: t.moveaxis(0, 0),
    "as_strided": lambda t: torch.as_strided(t, t.shape, t.stride()),
}


class TableLoop(nn.Module):
    """NLLB-MoE's loop (tests/test_table_writes.py), the table's column 0 doubled through ``view(table)`` after
    expert 0's write."""

    def __init__(self, view):
        super().__init__()
        self.view = view
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H)) for _ in range(E)])

    def forward(self, x):
        logits = self.classifier(x)
        probs = torch.softmax(logits, dim=-1)
        hot1 = F.one_hot(torch.argmax(probs, dim=-1), num_classes=E)
        hot2 = F.one_hot(torch.argmax(logits.masked_fill(hot1.bool(), float("-inf")), dim=-1), num_classes=E)
        m1 = hot1 * torch.lt(torch.cumsum(hot1, dim=0) - 1, C)
        m2 = hot2 * torch.lt(torch.cumsum(hot2, dim=0) - 1 + hot1.sum(dim=0, keepdim=True), C)
        table = (probs * m1).sum(dim=1)[:, None] * m1 + (probs * m2).sum(dim=1)[:, None] * m2
        mask = table.bool()
        buf = torch.einsum("bm,be->ebm", x, mask)
        for e, expert in enumerate(self.experts):
            rows = mask[:, e]
            buf[e, rows] = torch.einsum("b,be->be", table[rows, e], expert(buf[e, rows]))
            if e == 0 and self.view is not None:
                self.view(table).mul_(2.0)
        return buf.sum(dim=0)


class ClonedTokens(nn.Module):
    """transformers v4.27 Switch (tests/test_kept_rows_pass_through.py), the tokens doubled through ``view(tokens)``
    after the buffer's clone."""

    def __init__(self, view):
        super().__init__()
        self.view = view
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, I, bias=False), nn.ReLU(),
                                                    nn.Linear(I, H, bias=False)) for _ in range(E)])

    def forward(self, x):
        probs = torch.softmax(self.classifier(x), dim=-1)
        hot = F.one_hot(torch.argmax(probs, dim=-1), num_classes=E)
        router_mask = hot * (torch.cumsum(hot, dim=-2) <= C)
        tokens = x * 1.0
        next_states = tokens.clone()
        if self.view is not None:
            self.view(tokens).mul_(2.0)
        for e, expert in enumerate(self.experts):
            mask = router_mask[:, :, e].bool()
            next_states[mask] = expert(tokens[mask])
        return torch.max(probs, dim=-1).values.unsqueeze(-1) * next_states


class MovedIds(nn.Module):
    """A Switch-style top-1 loop (tests/test_pass_unrolled_loop.py), its ids moved by one through ``view(ids)``
    after expert 0 read them."""

    def __init__(self, view):
        super().__init__()
        self.view = view
        self.router = nn.Linear(H, E)
        self.fc1 = nn.ModuleList([nn.Linear(H, I) for _ in range(E)])
        self.fc2 = nn.ModuleList([nn.Linear(I, H) for _ in range(E)])

    def forward(self, x):
        p, ids = torch.max(F.softmax(self.router(x), dim=-1), dim=-1)
        ids = ids.clone()  # max's backward keeps its indices
        out = x.new_zeros(x.shape)
        for e in range(E):
            tok = torch.eq(ids, e).nonzero(as_tuple=True)[0]
            out[tok, :] = self.fc2[e](F.relu(self.fc1[e](x[tok, :])))
            if e == 0 and self.view is not None:
                self.view(ids).add_(1)
        return out * p.view(-1, 1)


def _left_alone_like_eager(model: nn.Module, x: torch.Tensor, what: str) -> None:
    with torch.no_grad():
        out, ref = compile_moe(model, x.clone()), model(x.clone())
    assert not counters["moe_inductor"], (what, dict(counters["moe_inductor"]))
    assert_close(out, ref, torch.float32, what)


@pytest.mark.parametrize("name", sorted(_TABLE_VIEWS))
def test_table_written_through_a_view_is_left_alone(name):
    torch.manual_seed(0)
    _left_alone_like_eager(TableLoop(_TABLE_VIEWS[name]), torch.randn(9, H), name)


@pytest.mark.parametrize("name", sorted(_TOKEN_VIEWS))
def test_cloned_tokens_written_through_a_view_are_left_alone(name):
    torch.manual_seed(0)
    _left_alone_like_eager(ClonedTokens(_TOKEN_VIEWS[name]), torch.randn(2, 9, H), name)


@pytest.mark.parametrize("name", sorted(_ID_VIEWS))
def test_ids_written_through_a_view_are_left_alone(name):
    torch.manual_seed(0)
    _left_alone_like_eager(MovedIds(_ID_VIEWS[name]), torch.randn(9, H), name)


@pytest.mark.parametrize("model", [TableLoop, ClonedTokens, MovedIds], ids=["table", "cloned", "ids"])
def test_without_the_write_each_is_rewritten(model):
    torch.manual_seed(0)
    module, x = model(None), torch.randn(2, 9, H) if model is ClonedTokens else torch.randn(9, H)
    with torch.no_grad():
        out, ref = compile_moe(module, x), module(x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, model.__name__)



_COMBINE_WRITES = {
    "swapaxes-setitem": lambda c: c.swapaxes(0, 1).__setitem__(0, 0.0),  # expert 0's column zeroed
    "movedim-zero_": lambda c: torch.movedim(c, 1, 0)[0].zero_(),
    "mT-foreach": lambda c: torch._foreach_mul_([c.mT[:, 0]], 0.0),  # slot 0 of every expert zeroed
}


class WrittenCombine(nn.Module):
    """Switch's top-1 gating with capacity (tests/test_capacity_inplace_results.py), its (T, E, C) combine changed
    by ``write`` after the dispatch is read from it."""

    def __init__(self, write):
        super().__init__()
        self.write = write
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        mask = F.one_hot(torch.argmax(gates, dim=-1), num_classes=E)
        loc = torch.cumsum(mask, dim=0) - 1
        mask = mask * torch.lt(loc, C)
        gate = (gates * mask).sum(dim=1)
        slot = F.one_hot(torch.sum(loc * mask, dim=1), num_classes=C)
        combine = gate[:, None, None] * mask[:, :, None] * slot[:, None, :]
        dispatch = combine.bool().to(x.dtype)
        if self.write is not None:
            self.write(combine)
        h = F.silu(torch.einsum("ech,eih->eci", torch.einsum("tec,th->ech", dispatch, x), self.w1))
        return torch.einsum("tec,ech->th", combine, torch.einsum("eci,ehi->ech", h, self.w2))


@pytest.mark.parametrize("name", sorted(_COMBINE_WRITES))
def test_a_combine_written_through_a_view_op_is_left_alone(name):
    """``capacity_gating.versions_sound`` sees the write through the view op, and the padded_capacity proof
    refuses."""
    torch.manual_seed(0)
    _left_alone_like_eager(WrittenCombine(_COMBINE_WRITES[name]), torch.randn(13, H), name)


def test_the_combine_unwritten_is_rewritten():
    torch.manual_seed(0)
    model, x = WrittenCombine(None), torch.randn(13, H)
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
    assert counters["moe_inductor"]["padded_capacity"] == 1, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, "unwritten")


# writes no view op's name shows: an activation's ``inplace`` passed by position, ``t.data``'s in-place change, and
# an aten overload's
_POSITIONAL_TABLE_WRITES = {
    "hardtanh-positional": lambda t: F.hardtanh(t, 0.0, 0.1, True),  # the weights clipped to 0.1
    "data-mul_": lambda t: t.data.mul_(2.0),
    "aten-overload": lambda t: torch.ops.aten.mul_.Scalar(t, 2.0),  # named "mul_.Scalar"
}
_POSITIONAL_TOKEN_WRITES = {
    "leaky_relu-positional": lambda t: F.leaky_relu(t, 0.1, True),
    "relu-positional": lambda t: F.relu(t, True),
    "data-mul_": lambda t: t.data.mul_(2.0),
}


@pytest.mark.parametrize("name", sorted(_POSITIONAL_TABLE_WRITES))
def test_table_written_in_place_without_a_view_op_is_left_alone(name):
    torch.manual_seed(0)
    _left_alone_like_eager(TableLoop(_POSITIONAL_TABLE_WRITES[name]), torch.randn(9, H), name)


@pytest.mark.parametrize("name", sorted(_POSITIONAL_TOKEN_WRITES))
def test_cloned_tokens_written_in_place_without_a_view_op_are_left_alone(name):
    torch.manual_seed(0)
    _left_alone_like_eager(ClonedTokens(_POSITIONAL_TOKEN_WRITES[name]), torch.randn(2, 9, H), name)
