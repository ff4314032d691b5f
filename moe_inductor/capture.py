"""Scoped capture: Dynamo settings and trace-time substitutions that apply only while moe_inductor compiles.

``torch.compile`` wraps a backend and drops its ``backend_ctx_ctor``, so "this compile is ours" is decided at the
start of each Dynamo compile instead: a compile-start callback walks the stack to the frame converter, unwraps its
backend chain and checks for our marker. Only then are ``capture_dynamic_output_shape_ops`` and
``capture_scalar_outputs`` patched on (once per compile, not per call), and only then do the substitutions
registered here take their rewriting branch. ``backend="inductor"`` never sees any of it.
"""
from __future__ import annotations

import functools
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .report import LeftAlone, Rewrite

BACKEND_MARKER = "_is_moe_inductor_backend"


@dataclass
class _CompileState:
    ours: bool = False
    forms: frozenset = frozenset()
    patch: Any = None
    rewrites: list[Rewrite] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)


_local = threading.local()


def _stack() -> list[_CompileState]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> _CompileState | None:
    stack = _stack()
    return stack[-1] if stack else None


def _unwrap_backend(fn: Any) -> tuple[Any, dict]:
    """(innermost backend, the options torch.compile passed to it)."""
    options: dict = {}
    for _ in range(16):
        if getattr(fn, BACKEND_MARKER, False):
            break
        if hasattr(fn, "_torchdynamo_orig_backend"):
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn"):  # torch.compile's _TorchCompileWrapper holds the options in .kwargs
            options = dict(getattr(fn, "kwargs", {}).get("options") or {})
            fn = fn.compiler_fn
        elif isinstance(fn, functools.partial):
            options = dict(fn.keywords.get("options") or options)
            fn = fn.func
        else:
            break
    return fn, options


def _backend_of_this_compile() -> tuple[Any, dict]:
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "_torchdynamo_orig_backend"):
            return _unwrap_backend(owner)
        frame = frame.f_back
    return None, {}


def _on_compile_start(_args: Any) -> None:
    from .options import BackendOptions

    backend, options = _backend_of_this_compile()
    state = _CompileState(ours=bool(getattr(backend, BACKEND_MARKER, False)))
    if state.ours:
        try:
            state.forms = BackendOptions.parse(options).forms
        except ValueError:
            state.forms = frozenset()  # the backend raises the error itself, once tracing is done
        _register_known_substitutions()
        state.patch = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
        state.patch.__enter__()
    _stack().append(state)


def _on_compile_end(_args: Any) -> None:
    stack = _stack()
    if not stack:
        return
    state = stack.pop()
    if state.patch is not None:
        state.patch.__exit__(None, None, None)


def install() -> None:
    """Register the compile callbacks (idempotent); called when the backend module is imported.

    ``torch._dynamo.reset()`` clears every compile callback; the handler's ``clear`` is wrapped so that ours come
    back right after, or the next compile would silently not be scoped.
    """
    handler = torch._dynamo.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
        handler.register_end_callback(_on_compile_end)
    if not getattr(handler.clear, "_keeps_moe_inductor", False):
        plain_clear = handler.clear

        def clear() -> None:
            plain_clear()
            install()

        clear._keeps_moe_inductor = True
        handler.clear = clear


@torch._dynamo.assume_constant_result
def rewriting_enabled(form: str) -> bool:
    """True while Dynamo traces for a moe_inductor compile that rewrites ``form``. Read at trace time, unguarded."""
    state = current()
    return bool(state and state.ours and form in state.forms)


@torch._dynamo.assume_constant_result
def record_rewrite(form: str, where: str, num_experts: int, top_k: int, activation: str, weight_shapes: tuple,
                   note: str = "") -> bool:
    """Note a trace-time rewrite for the backend's report and counters. Runs once, at trace time (constant args)."""
    state = current()
    if state is not None and state.ours:
        state.rewrites.append(Rewrite(form, where, num_experts, top_k, activation, weight_shapes, note))
    return True


@torch._dynamo.assume_constant_result
def record_left_alone(form: str, where: str, reason: str) -> bool:
    """Note, at trace time, a module a substitution would have rewritten but could not prove (explain() says why)."""
    state = current()
    if state is not None and state.ours:
        state.left_alone.append(LeftAlone(form, where, reason))
    return True


def take_trace_time_records() -> tuple[list[Rewrite], list[LeftAlone]]:
    """The rewrites and left-alone modules recorded while tracing the graph now being compiled; clears them."""
    state = current()
    if state is None:
        return [], []
    out = state.rewrites, state.left_alone
    state.rewrites, state.left_alone = [], []
    return out


# --- trace-time substitutions ---------------------------------------------------------------------------------------

_substituted: set[int] = set()
_substitution_sources: list[Callable[[], list[tuple[Callable, Callable]]]] = []


def clone_function(fn: types.FunctionType) -> types.FunctionType:
    """A copy of ``fn`` that a substitution of ``fn`` does not catch (so a fallback does not recurse)."""
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    return out


def add_substitution_source(source: Callable[[], list[tuple[Callable, Callable]]]) -> None:
    """``source()`` lists (original, make_polyfill) pairs; it is asked at the start of each moe_inductor compile, so
    classes imported late (a model built after the backend) are still covered."""
    _substitution_sources.append(source)


def _register_known_substitutions() -> None:
    for source in _substitution_sources:
        for original, make_polyfill in source():
            if id(original) in _substituted:
                continue
            _substituted.add(id(original))
            polyfill = make_polyfill(clone_function(original))
            torch.compiler.substitute_in_graph(original, skip_signature_check=True)(polyfill)
