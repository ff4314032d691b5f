"""Scoped capture: Dynamo settings and trace-time substitutions that apply only while moe_inductor compiles, and the
per-frame fallback that keeps them from ever breaking a model.

Dynamo compiles each frame through ``torch._dynamo.convert_frame._compile``, which is handed the frame's backend.
``install()`` wraps that function once: when the backend is ours (seen through torch.compile's wrappers, partials,
``CompileCounterWithBackend`` and plain functions that name it), ``capture_dynamic_output_shape_ops`` and
``capture_scalar_outputs`` are patched on for that frame only (once per compile, not per call), and the
substitutions registered here take their rewriting branch. ``backend="inductor"`` never sees any of it.

The settings turn a model's own graph breaks (``.tolist()``, ``.item()``, ``one_hot(num_classes=tensor)``) into hard
errors. So a frame that fails to trace or compile under them is compiled again at once as plain capture would
(settings off, no rewrites: what ``backend="inductor"`` does), and a frame whose compiled code fails on its first
call is recompiled the same way (backend.py). Each fallback is recorded through ``report.record_fallback`` (logged
once per frame, counted in ``counters["moe_inductor_fallback"]``, reported by explain()). A frame compile of ours
opens the ``report.recording()`` block that the substitutions record into at trace time; a failed attempt's filed
records are rolled back (``report.roll_back``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from . import list_indices, report

try:
    from torch._dynamo.comptime import comptime as _comptime
except ImportError:  # a torch without it: token counts are never read while traced (speed_rule.mode_of)
    _comptime = None

BACKEND_MARKER = "_is_moe_inductor_backend"
BACKEND_NAME = "moe_inductor"


@dataclass
class _CompileState:
    ours: bool = False
    forms: frozenset = frozenset()
    #: the frame is being compiled as plain capture would (a fallback): no capture settings, no rewrites
    plain: bool = False
    inner: str = "inductor"  # the compiler the rewritten graph goes to (the speed rule compares with Inductor only)
    code: Optional[types.CodeType] = None
    #: what tells apart frames of one code object (``closure_key``)
    closure: tuple = ()
    #: the skips of empty experts assumed away while tracing (speculation.Trace), made on first use
    speculation: Optional[Any] = None
    #: the tensor variables traced in place of row lists (list_indices.py), by id
    lists: dict = dataclasses.field(default_factory=dict)
    #: whether moe_inductor's backend saw every graph of this compile that such a variable reached (list_indices)
    lists_checked: bool = False
    #: whether Inductor may launch our kernels itself in this compile (``config.visible_kernels``' ops): the inner
    #: compiler is Inductor and the mode and options replay no CUDA graphs (``backend.visible_ops_run``)
    visible_ops: bool = True


_local = threading.local()


def _stack() -> list[_CompileState]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> _CompileState | None:
    stack = _stack()
    return stack[-1] if stack else None


def capturing() -> bool:
    """True while Dynamo traces a frame of a moe_inductor compile that is not a plain fallback: the scope of the
    capture settings and of every trace-time hook."""
    state = current()
    return bool(state is not None and state.ours and not state.plain)


@torch._dynamo.assume_constant_result
def capturing_at_trace_time() -> bool:
    """``capturing()``, read while Dynamo traces, as a constant of the graph: the guard of the trace-time
    substitutions (hf_masks, hf_attention), which run the original function outside our compiles."""
    return capturing()


def _names_our_backend(fn: Callable) -> bool:
    """Whether a plain function that wraps a backend refers to ours: by name (``lookup_backend("moe_inductor")``), or
    through a global or closure cell holding our backend."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    if BACKEND_NAME in code.co_consts:
        return True
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_is_set(c)]
    globals_ = getattr(fn, "__globals__", {})
    held = cells + [globals_.get(name) for name in code.co_names]
    # ``package.backend(...)``: attributes of the modules it names
    held += [getattr(m, name, None) for m in held if isinstance(m, types.ModuleType) for name in code.co_names]
    return any(getattr(v, BACKEND_MARKER, False) or (isinstance(v, str) and v == BACKEND_NAME) for v in held)


def _cell_is_set(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _unwrap_backend(fn: Any) -> tuple[bool, dict, Optional[str]]:
    """(whether ``fn`` is our backend or wraps it, the options and the mode torch.compile passed to it)."""
    options: dict = {}
    mode: Optional[str] = None
    for _ in range(16):
        if getattr(fn, BACKEND_MARKER, False):
            return True, options, mode
        if hasattr(fn, "_torchdynamo_orig_backend"):
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn"):  # torch.compile's _TorchCompileWrapper holds the options in .kwargs
            options = dict(getattr(fn, "kwargs", {}).get("options") or {})
            mode = getattr(fn, "kwargs", {}).get("mode") or mode
            fn = fn.compiler_fn
        elif isinstance(fn, functools.partial):
            options = dict(fn.keywords.get("options") or options)
            fn = fn.func
        elif hasattr(fn, "backend"):
            # CompileCounterWithBackend and the like keep the backend (or its name) as .backend
            fn = fn.backend
            if fn == BACKEND_NAME:
                return True, options, mode
        elif isinstance(fn, types.FunctionType):
            return _names_our_backend(fn), options, mode
        else:
            return False, options, mode
    return False, options, mode


#: frames whose compiled code failed on its first call, by code object and ``closure_key``: their next compile is
#: plain. One code object serves every function a decorator makes (transformers' ``can_return_tuple`` wraps every
#: model's forward), so the code alone would turn rewrites off for all of them
_plain_frames: "weakref.WeakKeyDictionary[types.CodeType, set]" = weakref.WeakKeyDictionary()


def closure_key(closure: Optional[tuple]) -> tuple:
    """What a frame's closure holds, by identity: the functions of one code object that close over different
    objects (the wrapped forward, say) get different keys."""
    return tuple(id(c.cell_contents) if _cell_is_set(c) else None for c in (closure or ()))


@contextlib.contextmanager
def _compiling(state: _CompileState) -> Iterator[_CompileState]:
    stack = _stack()
    stack.append(state)
    with contextlib.ExitStack() as scope:
        if state.ours:  # what the substitutions record while tracing, until the backend files it with the graph
            scope.enter_context(report.recording())
        if state.ours and not state.plain:
            _register_known_substitutions()
            scope.enter_context(torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                                           capture_scalar_outputs=True))
            scope.enter_context(_is_exporting_as_eager_reads_it())
        try:
            yield state
        finally:
            stack.pop()


@contextlib.contextmanager
def _is_exporting_as_eager_reads_it() -> Iterator[None]:
    """While we trace, ``torch.compiler.is_exporting()`` answers what eager reads (False outside torch.export).

    Dynamo before torch 2.13 answers it from a cached table that holds a constant True (pytorch#176347, fixed by
    pytorch#176499). transformers asks it before leaving the causal mask to SDPA's ``is_causal``: told True, it
    builds the (T, T) mask, and SDPA with a mask cannot take its flash kernel, so every compiled prefill pays for a
    slower attention than eager's. The table entry is set for our compile and restored after it, so plain frames
    and other backends see Dynamo's own answer; where the table differs from the one described, nothing changes."""
    try:
        from torch._dynamo.variables.torch import tracing_state_functions

        table = tracing_state_functions()
    except Exception:  # noqa: BLE001  (another torch: its own answer stands)
        table = None
    fn = getattr(torch.compiler, "is_exporting", None)
    if not isinstance(table, dict) or fn is None or table.get(fn) is not True:
        yield
        return
    table[fn] = bool(getattr(torch.compiler, "_is_exporting_flag", False))
    try:
        yield
    finally:
        table[fn] = True


def _no_retry_errors() -> tuple[type, ...]:
    """Dynamo's own control flow through ``_compile``: skipping a frame or hitting the recompile limit is the same
    whatever the settings, so it is never retried."""
    exc = torch._dynamo.exc
    names = ("SkipFrame", "RecompileLimitExceeded", "CacheLimitExceeded", "ResumePrologueTracingError")
    return tuple(getattr(exc, n) for n in names if isinstance(getattr(exc, n, None), type))


def describe_frame(code: Optional[types.CodeType]) -> str:
    if code is None:
        return "<unknown frame>"
    return f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"


_logged_fallbacks: "weakref.WeakSet[types.CodeType]" = weakref.WeakSet()


def note_fallback(code: Optional[types.CodeType], stage: str, error: BaseException, also: Iterable[str] = ()) -> None:
    """Record that a frame is compiled as plain capture would (``report.record_fallback``), logged once per frame;
    ``also`` adds what the attempt saw and did not assume away (speculation.py)."""
    while getattr(error, "inner_exception", None) is not None:  # BackendCompilerFailed holds what the compiler raised
        error = error.inner_exception
    # the first line, bounded: a speculation's line carries the pass's own reason (its source line included); an
    # error raised in a compile worker (SubprocException) says only where on its first line, and what on its last
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first_line = lines[0][:1000] if lines else ""
    if len(lines) > 1 and first_line.endswith(":"):
        first_line = f"{first_line} {lines[-1][:1000]}"
    reason = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    cause = user_cause(error)
    reason = "; ".join([*([cause] if cause else []), reason, *dict.fromkeys(also)])
    if getattr(_quiet, "on", False):  # explain()'s rewrites-off pass: recorded for its report, never logged
        report.record_fallback(describe_frame(code), stage, reason, log_it=False)
        return
    first_time = code is None or code not in _logged_fallbacks
    if code is not None:
        _logged_fallbacks.add(code)
    report.record_fallback(describe_frame(code), stage, reason, log_it=first_time)


def user_cause(error: BaseException) -> Optional[str]:
    """What in the user's code failed, in plain words: the innermost line of theirs that Dynamo was tracing (its
    file, line and source) and, for a guard on a data-dependent value, what the capture settings did to it. None
    where the error names no user frame (a compile error inside Inductor, a torch without the attributes)."""
    stack = getattr(error, "real_stack", None) or ()
    frame = getattr(error, "innermost_user_frame_summary", None) or (stack[-1] if stack else None)
    if frame is None or not getattr(frame, "filename", None):
        return None
    source = (frame.line or "").strip()
    at = f"{frame.filename}:{frame.lineno} in {frame.name}" + (f", `{source}`," if source else ",")
    if isinstance(error, _GuardOnDataDependentSymNode):
        return (f"{at} uses a value that depends on a tensor's data (a number read by `.tolist()` or `.item()`, or "
                "the size of a `nonzero()` result) as a Python int or bool (an index, a size or a branch); "
                "moe_inductor's capture settings (capture_scalar_outputs, capture_dynamic_output_shape_ops) trace "
                "such a value as an unknown instead of breaking the graph there, and this use of it cannot be traced")
    return f"{at} failed to trace under moe_inductor's capture settings"


try:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode as _GuardOnDataDependentSymNode
except ImportError:  # a torch without it: no error is one
    _GuardOnDataDependentSymNode = ()

_quiet = threading.local()


@contextlib.contextmanager
def quiet_fallbacks() -> Iterator[None]:
    """Fallbacks of the compiles inside are recorded but not logged, and do not count as a frame's one logged
    fallback: explain()'s rewrites-off pass, whose fallbacks (a loop the rewrites would prove is data-dependent
    there) are not the user's compile's."""
    was = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = was


def _wrap_compile(original: Callable) -> Callable:
    params = list(inspect.signature(original).parameters)
    index = params.index("compiler_fn")
    closure_at = params.index("closure") if "closure" in params else None

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        compiler_fn = args[index] if len(args) > index else kwargs.get("compiler_fn")
        ours, options, mode = _unwrap_backend(compiler_fn)
        code = args[0] if args else kwargs.get("code")
        closure = closure_key(args[closure_at] if closure_at is not None and len(args) > closure_at
                              else kwargs.get("closure"))
        if not ours:
            with _compiling(_CompileState()):
                return original(*args, **kwargs)
        if getattr(_quiet, "on", False):  # explain()'s rewrites-off pass: an aid, never a cause of later skips
            try:
                return _unsticky(_ours(args, kwargs, options, code, closure, mode))
            except Exception:  # noqa: BLE001  (Dynamo gave up on the frame: run it as it is, this once)
                once = _run_once()
                if once is None:
                    raise
                return once
        return _ours(args, kwargs, options, code, closure, mode)

    def _ours(args: tuple, kwargs: dict, options: Any, code: Any, closure: tuple, mode: Optional[str]) -> Any:
        from .backend import visible_ops_run
        from .options import BackendOptions
        from .speed_rule import judged_inner

        try:
            parsed = BackendOptions.parse(options)
            forms, inner = parsed.forms, parsed.inner
        except ValueError:  # the backend raises the error itself, once tracing is done
            forms, inner, parsed = frozenset(), "inductor", None
        try:  # as the rule judges it: explain() compiles with a light inner compiler but judges as Inductor would
            visible_ops = parsed is not None and visible_ops_run(judged_inner(inner), mode, parsed.inductor)
        except Exception:  # noqa: BLE001  (options Inductor refuses: the backend's compile raises them itself)
            visible_ops = False
        if code is not None and closure in _plain_frames.get(code, ()):
            with _compiling(_CompileState(ours=True, plain=True, code=code, closure=closure)):
                return original(*args, **kwargs)
        before = report.checkpoint()
        attempt = _CompileState(ours=True, forms=forms, code=code, inner=inner, closure=closure,
                                visible_ops=visible_ops)
        try:
            with _compiling(attempt):
                result = original(*args, **kwargs)
            if attempt.speculation is not None:
                attempt.speculation.require_checked()
            list_indices.require_checked(attempt)
            return result
        except _no_retry_errors():
            raise
        except Exception as error:
            report.roll_back(before)  # what the failed attempt filed did not happen: the plain compile below runs
            note_fallback(code, "compile", error, also=attempt.speculation.refusals if attempt.speculation else ())
        with _compiling(_CompileState(ours=True, plain=True, code=code, closure=closure)):
            return original(*args, **kwargs)

    _compile._moe_inductor_original = original
    return _compile


def _unsticky(result: Any) -> Any:
    """In explain()'s rewrites-off pass, a frame Dynamo gives up on (no compiled code: under torch 2.11, a graph break
    in a loop) is run as it is this once, but not marked to be skipped for good: Dynamo would otherwise skip every
    later frame of that code object, the user's own moe_inductor compile included, which would then run the frame
    eagerly where it rewrites it."""
    if getattr(result, "guarded_code", True) is not None or not getattr(result, "apply_to_code", False):
        return result
    try:
        return dataclasses.replace(result, apply_to_code=False)
    except (TypeError, ValueError):  # not the dataclass this torch is known to return: leave it
        return result


def _run_once() -> Any:
    """Dynamo's answer "run this frame as it is, this time only", where this torch has one (else None)."""
    try:
        from torch._dynamo.types import ConvertFrameReturn
    except ImportError:
        return None
    try:
        return ConvertFrameReturn(apply_to_code=False)
    except TypeError:
        return None


def mark_plain(code: Optional[types.CodeType], closure: tuple = ()) -> None:
    """Compile the frames of ``code`` with this ``closure_key`` as plain capture would from now on (their compiled
    code failed on its first call), and drop the code's compiled entries so that the next call recompiles it (the
    frames of other closures recompile with rewrites, as before)."""
    if code is None:
        return
    _plain_frames.setdefault(code, set()).add(closure)
    reset = getattr(torch._C._dynamo.eval_frame, "reset_code", None)
    if reset is not None:
        reset(code)


def install() -> None:
    """Wrap Dynamo's per-frame compile (idempotent); called when the backend module is imported."""
    from torch._dynamo import convert_frame

    if not hasattr(convert_frame._compile, "_moe_inductor_original"):
        convert_frame._compile = _wrap_compile(convert_frame._compile)
    from . import data_widths, hit_lists, hit_loops, list_indices, shape_tensors, speculation

    try:
        speculation.install()
    except Exception as error:  # an optional hook into Dynamo internals must never stop the backend from loading
        import warnings

        warnings.warn(f"moe_inductor: skip-of-empty-expert speculation is off on this torch ({error!r}); such "
                      "loops fall back to plain capture")
    try:
        list_indices.install()  # after speculation's: it wraps that tolist hook, and hands it every tolist it leaves
    except Exception as error:  # noqa: BLE001  (as above: the backend loads, the list loops fall back)
        import warnings

        warnings.warn(f"moe_inductor: row lists as indices are off on this torch ({error!r}); such loops fall back "
                      "to plain capture")
    hit_loops.install()  # after speculation's hooks: it opens iterations that those hooks close and tag
    hit_lists.install()  # after list_indices' and hit_loops': its tolist and GET_ITER hooks come first
    shape_tensors.install()  # warns, rather than raises, where this torch lacks a hook it needs
    data_widths.install()  # after shape_tensors': it wraps the one_hot hook that one installs


@torch._dynamo.assume_constant_result
def rewriting_enabled(form: str) -> bool:
    """True while Dynamo traces for a moe_inductor compile that rewrites ``form``. Read at trace time, unguarded."""
    state = current()
    return bool(state and state.ours and form in state.forms)


#: what ``_probe_tokens`` last found, read back by ``_probed_tokens`` (Dynamo compiles one frame at a time)
_probed: list = [-1]


def _probe_tokens(ctx: Any) -> None:
    """Run by Dynamo's ``comptime`` while it traces ``static_token_count``: the token count of its local ``x`` from the
    fake tensor itself, where every leading dimension is a plain int, else -1. Read here, a symbolic size is neither
    specialised nor guarded on, as it would be by Python code that Dynamo traces (even ``type()`` of it)."""
    _probed[0] = -1
    try:
        dims = ctx.get_local("x").as_fake().shape[:-1]
    except Exception:  # noqa: BLE001  (another torch's comptime: the count stays unknown, the mode "inference")
        return
    _probed[0] = _count_of(dims)


def _count_of(dims: Iterable) -> int:
    """The product of ``dims`` where every one is a plain int, else -1 (run as plain Python, never traced)."""
    count = 1
    for d in dims:
        if type(d) is not int:
            return -1
        count *= d
    return count


@torch._dynamo.assume_constant_result
def _probed_tokens() -> int:
    return _probed[0]


def static_token_count(x: torch.Tensor) -> Optional[int]:
    """The number of tokens (the product of all dimensions but the last) of ``x`` where it is static, None where it
    is symbolic (a graph traced with dynamic shapes); no guard is added either way."""
    if not torch.compiler.is_compiling():
        count = _count_of(x.shape[:-1])
    elif _comptime is None:
        return None
    else:
        _comptime(_probe_tokens)
        count = _probed_tokens()
    return None if count < 0 else count


@torch._dynamo.assume_constant_result
def speed_rule_verdict(form: str, activation: str, gate_up: str, bias: bool, shape: tuple, device: str,
                       mode: str, dtype: Optional[torch.dtype] = None) -> str:
    """The speed rule's word on this layer in the compile being traced (``speed_rule.verdict``: it starts with
    ``speed_rule.KEPT`` where the layer is left to Inductor); read at trace time, unguarded (the answer depends on
    shapes and settings the graph is specialised on already)."""
    from .speed_rule import LayerKind, verdict

    state = current()
    inner = state.inner if state is not None else "inductor"
    return verdict(LayerKind(activation, gate_up, bias, shape, dtype), torch.device(device), mode, inner, form)


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
