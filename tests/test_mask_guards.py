"""Top-1 expert loops guarded by ``if mask.any():`` (moe_inductor/mask_guards.py): the guard is answered "has rows"
while tracing and kept only where the rewrite takes the body it guards; anything else falls back to plain capture,
equal to eager."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.corpus import hf_docs_sequential_experts as docs
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E = 16, 8, 5


class GuardedTop1(nn.Module):
    """A softmax top-1 router and nn.Sequential experts; each expert's masked write behind ``if mask.any():``.
    Each spelling is its own class: the trace-time check reads the bytecode after the branch."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I), nn.SiLU(), nn.Linear(I, H)) for _ in range(E))

    def start(self, x):
        """The routing weight and id of each token (softmax top-1) and the zeroed output."""
        w, idx = F.softmax(self.router(x), dim=-1).max(dim=-1)
        return w, idx, torch.zeros_like(x)

    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():
                out[mask] = expert(x[mask])
        return out * w[:, None]


class TorchAny(GuardedTop1):
    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if torch.any(mask):
                out[mask, :] = expert(x[mask, :])
        return out * w[:, None]


class Continue(GuardedTop1):
    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if not mask.any():
                continue
            out[mask] = expert(x[mask])
        return out * w[:, None]


class KeptList(GuardedTop1):
    """The body appends to a list made before the loop: Python state the skip changes (len(ran) counts the experts
    that got tokens), which no graph node shows."""

    def forward(self, x):
        w, idx, out = self.start(x)
        ran = []
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():
                out[mask] = expert(x[mask])
                ran.append(e)
        return out * w[:, None] * len(ran)


class LayersLoop(GuardedTop1):
    """The body runs its expert's layers in a loop of its own: an iterator made and stepped inside the skipped
    body is the body's own state (as nn.Sequential's ``for module in self``, which torch 2.11 records as a
    mutation)."""

    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():
                h = x[mask]
                for layer in iter([expert[0], expert[1], expert[2]]):
                    h = layer(h)
                out[mask] = h
        return out * w[:, None]


class SteppedBefore(GuardedTop1):
    """The body steps an iterator made before the loop: what it yields after the loop counts the experts that got
    tokens, which no graph node shows."""

    def forward(self, x):
        w, idx, out = self.start(x)
        ticks = iter(range(1, 2 * E))
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():
                out[mask] = expert(x[mask])
                next(ticks)
        return out * w[:, None] * next(ticks)


class GuardedTop2(nn.Module):
    """A top-2 loop in transformers v4's manner (``torch.where`` of the (T, k) mask, ``index_add_``), each expert
    behind ``if mask.any():``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.up = nn.ModuleList(nn.Linear(H, I, bias=False) for _ in range(E))
        self.down = nn.ModuleList(nn.Linear(I, H, bias=False) for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = ids == e
            if mask.any():
                tok, pos = torch.where(mask)
                out.index_add_(0, tok, self.down[e](F.silu(self.up[e](x[tok]))) * w[tok, pos, None])
        return out


class OtherExpert(GuardedTop1):
    """The guard tests the next expert's rows."""

    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if (idx == (e + 1) % E).any():
                out[mask] = expert(x[mask])
        return out * w[:, None]


class MoreThanOne(GuardedTop1):
    """Not "no rows": an expert with one row is skipped."""

    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.sum() > 1:
                out[mask] = expert(x[mask])
        return out * w[:, None]


class AndMore(GuardedTop1):
    """The guard also skips a write that the op would not make (a count of the experts that ran)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ran", torch.zeros(E))

    def forward(self, x):
        w, idx, out = self.start(x)
        for e, expert in enumerate(self.experts):
            mask = idx == e
            if mask.any():
                out[mask] = expert(x[mask])
                self.ran[e] += 1
        return out * w[:, None]


@pytest.mark.parametrize("cls", [GuardedTop1, TorchAny, Continue, GuardedTop2, LayersLoop],
                         ids=["mask.any", "torch.any", "continue", "top2-where", "layers-loop"])
@pytest.mark.parametrize("T", [1, 9], ids=["T1-most-experts-empty", "T9"])
def test_guarded_loop_is_rewritten_like_eager(cls, T):
    """Forward and every gradient as eager's: at T = 1 four of the five experts get no token, and their weights
    get no gradient in either run."""
    torch.manual_seed(0)
    assert_rewritten_like_eager(cls(), torch.randn(T, H), "unrolled_loop", cls.__name__)


@pytest.mark.parametrize("cls", [OtherExpert, MoreThanOne, AndMore, KeptList, SteppedBefore],
                         ids=["other-expert", "more-than-one", "and-more", "kept-list", "stepped-before"])
def test_guards_that_are_not_the_no_rows_skip_fall_back(cls):
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    x = torch.randn(9, H)
    with torch.no_grad():
        got = compile_moe(model, x)
        assert_close(got, ref(x), torch.float32, cls.__name__)
    for a, b in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_fallback"]["compile"] >= 1, dict(counters["moe_inductor_fallback"])


@pytest.mark.parametrize("T", [1, 7], ids=["T1-most-experts-empty", "T7"])
def test_transformers_docs_sequential_experts_is_rewritten_in_training(T):
    """The corpus's mirror of transformers' model-patching guide (the argmax recomputed in every iteration):
    rewritten, with eager's gradients; at T = 1 the experts eager skips keep no gradient (the gate tests the one
    argmax the rewrite keeps, which computes the same ids as the others)."""
    torch.manual_seed(0)
    assert_rewritten_like_eager(docs.Block(), torch.randn(T, docs.H), "unrolled_loop", "SequentialExperts")
