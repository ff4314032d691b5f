"""Review session 49: look-alikes of MoE code that differ where the dataflow does not show it, each compiled beside
eager (forward and, where a gradient is what differs, backward)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from helpers import rel_err

LIGHT = {"inner": "aot_eager"}
T, H, I, E, K = 12, 16, 24, 4, 2


class GradModeLoop(nn.Module):
    """An unrolled top-k loop over stacked experts; ``where`` says which part runs under ``torch.no_grad()``:
    expert 1's MLP (a look-alike: that expert's weights and its tokens get no gradient), its routing weights (the
    router gets none through expert 1), the router (a genuine MoE: no gradient to the gate at all), or the
    selection mask, or each body's rows, as transformers v4's GPT-OSS does, its weights read from a table scattered
    before the first ``no_grad`` (integers: a genuine MoE); the last expert's write into the buffer (a look-alike:
    the buffer keeps the gradient of the writes before it, which the op, run where that write was, would not); or
    the whole loop, in a ``@torch.no_grad()`` method (DeepSeek's ``moe_infer``) given a view of the routing weights
    made outside it (a genuine MoE without gradient, beside the residual)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.2)

    def forward(self, x):
        if self.where == "router":
            with torch.no_grad():
                w, ids = self.gate(x).softmax(-1).topk(K, -1)
        else:
            w, ids = self.gate(x).softmax(-1).topk(K, -1)
        if self.where == "mask":
            with torch.no_grad():
                mask = F.one_hot(ids, E).permute(2, 1, 0)
        else:
            mask = F.one_hot(ids, E).permute(2, 1, 0)
        if self.where == "experts":
            return x + self._experts(x, ids, w.view(-1, K))
        table = torch.zeros(x.shape[0], E).scatter(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(E):
            if self.where == "rows":
                with torch.no_grad():
                    pos, tok = torch.where(mask[e])
            else:
                pos, tok = torch.where(mask[e])
            xe = x[tok]
            if self.where == "expert" and e == 1:
                with torch.no_grad():
                    h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            else:
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            if self.where == "weight" and e == 1:
                with torch.no_grad():
                    rw = w[tok, pos, None]
            elif self.where == "rows":
                rw = table[tok, e, None]
            else:
                rw = w[tok, pos, None]
            if self.where == "last_write" and e == E - 1:
                with torch.no_grad():
                    out.index_add_(0, tok, (h @ self.w2[e].T) * rw)
            else:
                out.index_add_(0, tok, (h @ self.w2[e].T) * rw)
        return out

    @torch.no_grad()
    def _experts(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            xe = x[tok]
            h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            out.index_add_(0, tok, (h @ self.w2[e].T) * w[tok, pos, None])
        return out


def _forward_backward(m: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = m(x)
    (y * dy).sum().backward()
    return [y, x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("where,rewritten", [
    pytest.param("expert", False, id="no_grad-around-one-expert"),  # look-alike: expert 1 gets no gradient
    pytest.param("weight", False, id="no_grad-around-one-weight"),  # look-alike: no gradient to the router via e=1
    pytest.param("router", True, id="no_grad-router"),  # a genuine MoE whose gate is not trained
    pytest.param("mask", True, id="no_grad-mask"),  # integers only under no_grad: a genuine MoE
    # Dynamo records a grad-mode switch only where it changes the mode: the table before the first one is computed
    # with grad enabled, as the bodies after each switch back are
    pytest.param("rows", True, id="no_grad-rows-per-body"),
    pytest.param("last_write", False, id="no_grad-last-write"),
    pytest.param("experts", True, id="no_grad-method"),
])
def test_no_grad_inside_the_region(where, rewritten):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = GradModeLoop(where)
    x, dy = torch.randn(T, H), torch.randn(T, H)
    compiled = copy.deepcopy(m)
    expected = _forward_backward(m, x, dy)
    got = _forward_backward(torch.compile(compiled, backend="moe_inductor", options=LIGHT), x, dy)
    assert counters["moe_inductor"]["unrolled_loop"] == (1 if rewritten else 0)
    if not rewritten:
        assert counters["moe_inductor_left_alone"]["unrolled_loop"] == 1
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if b is not None:
            assert rel_err(a, b) <= 2e-5


class AutocastLoop(nn.Module):
    """The unrolled loop with the experts' projections by ``F.linear`` (an autocast op); ``inside`` puts expert 1's
    MLP (``"one"``) or every expert's (``"all"``) under ``torch.autocast(bf16)`` in the layer, its output cast back
    for the fp32 buffer, or the whole loop, its writes too, under ``torch.autocast("cpu")`` (``"loop"``: the op
    would run inside it)."""

    def __init__(self, inside: str = "none"):
        super().__init__()
        self.inside = inside
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * 0.2)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.2)

    def _mlp(self, xe, e):
        return F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e])

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(K, -1)
        if self.inside == "loop":  # CPU autocast's default dtype is bf16
            with torch.autocast("cpu"):
                return self._loop(x, ids, w)
        return self._loop(x, ids, w)

    def _loop(self, x, ids, w):
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            if self.inside == "all" or self.inside == "one" and e == 1:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    c = self._mlp(x[tok], e) * w[tok, pos, None]
            else:
                c = self._mlp(x[tok], e) * w[tok, pos, None]
            out.index_add_(0, tok, c.to(out.dtype))
        return out


def _compiled_beside_eager(m: nn.Module, x: torch.Tensor, autocast: bool):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="moe_inductor", options=LIGHT)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return compiled(x), m(x)


@pytest.mark.parametrize("inside,around,dtype", [
    # autocast to the weights' own dtype casts nothing; the loop in bf16 and fp32 autocast are in
    # test_autocast_rewrites.py
    pytest.param("none", True, torch.bfloat16, id="autocast-to-the-weights-dtype"),
    pytest.param("none", False, torch.float32, id="no-autocast"),
])
def test_autocast(inside, around, dtype):
    torch.manual_seed(0)
    m = AutocastLoop(inside).to(dtype)
    got, expected = _compiled_beside_eager(m, torch.randn(T, H, dtype=dtype), around)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert got.dtype == expected.dtype
    assert rel_err(got, expected) <= (2e-2 if dtype == torch.bfloat16 else 2e-5)


def test_autocast_hf_grouped_mm():
    """transformers' grouped_mm casts the tokens to the weights' dtype itself (``_grouped_mm`` is no autocast op):
    under bf16 autocast with fp32 weights its experts compute in fp32, and so does the op."""
    from hf_models import tiny

    block = tiny("qwen3_moe", "grouped_mm").model.layers[0].mlp
    got, expected = _compiled_beside_eager(block, torch.randn(2, 5, 32), True)
    assert counters["moe_inductor"]["hf_grouped_mm"] == 1
    assert rel_err(got, expected) <= 2e-5
