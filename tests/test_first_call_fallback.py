"""A frame whose compiled code fails on its first call is answered eagerly and recompiled as plain capture would
(backend.py, capture.py); that mark is per function, not per code object, so one failing function does not turn
rewrites off for every function a decorator made from the same code."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor import backend

H, I, E, K = 8, 6, 4, 2


class GatheredMoE(nn.Module):
    """gpt-fast's gathered experts: one graph with or without our capture settings (no data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), K, dim=-1)
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        out = torch.einsum("tao,taio->tai", h, self.w2[ids])
        return torch.einsum("tai,ta->ti", out, weights)


def wrapped(module):
    """A decorator's wrapper: every function it makes shares this code object (like transformers'
    ``can_return_tuple``), each closing over its own module."""
    def forward(x):
        return module(x)

    return forward


def test_a_first_call_failure_marks_only_that_function_plain(monkeypatch):
    torch.manual_seed(0)
    first, second = GatheredMoE(), GatheredMoE()
    f, g = wrapped(first), wrapped(second)
    assert f.__code__ is g.__code__
    real = backend._inner_compile
    failing = {"left": 1}

    def inner_compile(*args, **kwargs):
        compiled = real(*args, **kwargs)
        if failing["left"] == 0:
            return compiled
        failing["left"] -= 1

        def fails_once(*a):
            raise RuntimeError("generated code failed")
        return fails_once

    monkeypatch.setattr(backend, "_inner_compile", inner_compile)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(7, H)
    out = torch.compile(f, backend="moe_inductor", options={"inner": "eager"})(x)
    assert torch.allclose(out, first(x), atol=1e-6)  # answered eagerly
    assert counters["moe_inductor_fallback"]["first call"] == 1, dict(counters["moe_inductor_fallback"])
    rewrites = counters["moe_inductor"]["gathered_weights"]
    out = torch.compile(g, backend="moe_inductor", options={"inner": "eager"})(x)
    assert torch.allclose(out, second(x), atol=1e-6)
    assert counters["moe_inductor"]["gathered_weights"] == rewrites + 1  # the other function is still rewritten
    out = torch.compile(f, backend="moe_inductor", options={"inner": "eager"})(x)  # the failed one: plain now
    assert torch.allclose(out, first(x), atol=1e-6)
    assert counters["moe_inductor"]["gathered_weights"] == rewrites + 1


def test_a_compile_worker_error_is_named_in_the_fallback_line(caplog):
    """Inductor's compile workers raise SubprocException, whose first line only says that a subprocess failed: the
    fallback line also gives its last line, the worker's own error."""
    from moe_inductor import capture

    class SubprocException(Exception):
        pass

    error = SubprocException("An exception occurred in a subprocess:\n\nTraceback (most recent call last):\n"
                             "  File \"x.py\", line 1, in f\nValueError: the tile does not fit in shared memory\n")
    caplog.set_level("WARNING", logger="moe_inductor")
    capture.note_fallback(None, "compile", error)
    assert "subprocess: ValueError: the tile does not fit in shared memory" in caplog.text
    caplog.clear()
    capture.note_fallback(None, "compile", RuntimeError("first line\nsecond line"))
    assert "without rewrites: RuntimeError: first line\n" in caplog.text  # a first line that says what keeps its own
