"""The Dynamo backend ``moe_inductor``: FX graph -> MoE passes -> Inductor (or a lighter inner compiler).

Found by name through the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="moe_inductor")``
works without importing this package. Options come through ``torch.compile(..., options={...})``:

    inner:  "inductor" (default), "aot_eager" or "eager": the compiler the rewritten graph is handed to
    forms:  an iterable of form names to rewrite (default: all); an empty one turns every rewrite off
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import (capture, chunked_rows, grad_gate, hf, hf_attention, hf_masks, input_mutations, list_indices, report,
               speculation, speculation_check)
from .options import BackendOptions
from .passes import FX_PASSES
from .passes.driver import Layer, run_passes

log = logging.getLogger("moe_inductor")
_MOE_OPS = ("experts_forward", "experts_forward_list", "experts_forward_visible")


def _moe_ops_in(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and getattr(n.target, "namespace", None) == "moe_inductor" and n.target._opname in _MOE_OPS)


def _inner_compile(name: str, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: Optional[str],
                   inductor_options: Optional[dict] = None) -> Callable:
    """Hand the rewritten graph to the inner compiler. Inductor gets it through the wrapper that
    ``torch.compile(backend="inductor", mode=mode, options=inductor_options)`` builds, so that each mode's settings,
    the options' checks and the CUDA-graph side effects (the profiler's CUPTI settings) are Inductor's own."""
    if name == "eager":
        return gm.forward
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    inductor = _inductor_wrapper(mode, _with_our_passes(inductor_options))
    if inductor not in _state.wrappers:  # one per distinct setting (the wrappers compare by their config)
        _state.wrappers.append(inductor)
    with torch.compiler.config.patch(cache_key_tag=cache_tag()):
        return inductor(gm, example_inputs)


def _with_our_passes(inductor_options: Optional[dict]) -> Optional[dict]:
    """The Inductor options with our post-grad pass (``config.unshared_buffers``) added, where the user's options
    and Inductor's config name no such pass of their own (theirs is left as it is)."""
    from . import config

    options = dict(inductor_options or {})
    if (config.unshared_buffers and options.get("post_grad_custom_pre_pass") is None
            and torch._inductor.config.post_grad_custom_pre_pass is None):
        from .lowerings.unshared_buffers import UNSHARED_BUFFERS

        options["post_grad_custom_pre_pass"] = UNSHARED_BUFFERS
    return options or None


def cache_tag() -> str:
    """The tag our Inductor compiles add to torch's compile-cache keys: what decides the compiled code beyond the
    graph the caches key on. AOTAutograd's cache keys a compiled graph by the graph Dynamo traced, not by what our
    ops' autograd formulas trace it into, so after an upgrade that changes them (a backward op, its arguments) a
    cached graph would run the old ones: the package's source. The visible kernels' launches are chosen while
    Inductor traces them, from the tuned tables (shipped, and the user's, which autotune adds to) and from the
    settings in ``config`` (the engine, TMA, tail split), so a cached graph would keep the choices it was compiled
    with: the package's data, the user's table and the settings."""
    return f"moe_inductor-{_source_digest()}-{_settings_digest()}"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    return _package_digest(Path(__file__).parent)


def _package_digest(root: Path) -> str:
    """A hash of the ``.py`` and ``.json`` files under ``root``, by path and content."""
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.json")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _settings_digest() -> str:
    """A hash of ``config``'s settings and of this GPU's tuned table in the user's cache, read at each compile: a
    setting may change between compiles, and the table grows as autotune runs."""
    from . import config
    from .kernels import configs

    digest = hashlib.sha256()
    for name, value in config.settings():
        digest.update(f"{name}={value!r};".encode())
    try:
        digest.update(configs.TABLE.user_path().read_bytes())
    except OSError:  # no table tuned here yet
        pass
    return digest.hexdigest()[:8]


def _inductor_wrapper(mode: Optional[str], inductor_options: Optional[dict]) -> Any:
    """What ``torch.compile(backend="inductor", mode=mode, options=inductor_options)`` builds: a compiler whose
    ``config`` is the mode's settings with the options on top, and whose ``reset`` frees what it recorded."""
    return torch._TorchCompileInductorWrapper(mode, inductor_options or None, None)


class _BackendState:
    def __init__(self) -> None:
        #: the Inductor compilers (one per setting) of our compiles since the last ``torch._dynamo.reset()``
        self.wrappers: list = []


_state = _BackendState()


def _reset() -> None:
    """What ``torch._dynamo.reset()`` does for ``backend="inductor"``: each of our Inductor compilers is reset as
    Inductor's own is (the CUDA-graph trees recorded under a CUDA-graph mode are freed, with their memory pools)."""
    for wrapper in _state.wrappers:
        wrapper.reset()
    _state.wrappers.clear()


def moe_inductor_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Optional[dict] = None, mode: Optional[str] = None
) -> Callable:
    """Compile ``gm``: its MoE code was rewritten into moe_inductor ops at trace time; record it, then hand the graph
    to the inner compiler."""
    opts = BackendOptions.parse(options)
    state = capture.current()
    if state is not None and state.plain:  # a fallback: exactly what the inner compiler does with the graph
        return _inner_compile(opts.inner, gm, example_inputs, mode, opts.inductor)
    if state is None or not state.ours:
        _warn_unseen_wrapper()
    traced = report.take_records()  # what the substitutions recorded while Dynamo traced this graph
    original = gm
    chunked_rows.unmark(gm)  # an expert's rows traced in one pass: each chunk is the whole
    # the skips of empty experts assumed away while tracing: proven, or we raise
    speculated = speculation_check.of_graph(gm)
    speculation_check.check_traced(gm, speculated)
    list_indices.check_graph(gm, state)
    gm, rewrites, left_alone = run_passes(gm, FX_PASSES, opts.forms, speed=functools.partial(_speed_rule, opts.inner))
    speculation_check.discharge(gm, speculated, left_alone)
    record = report.file_graph(gm.code, _moe_ops_in(gm), traced.rewrites + rewrites, traced.left_alone + left_alone)
    from . import config

    if config.visible_kernels and visible_ops_run(opts.inner, mode, opts.inductor):
        from .lowerings.visible import swap_in_visible_ops

        record.visible_ops = swap_in_visible_ops(gm)
    if opts.inner == "inductor":
        from .lowerings.cpu import swap_in_cpu_lowering

        swap_in_cpu_lowering(gm)
    try:  # a skipped expert's own weights get no gradient, as in eager (grad_gate.py)
        gated = grad_gate.add_hit_flags(gm, speculated) if gm is not original else []
    except LookupError as error:
        raise speculation.SpeculationNotDischarged(f"the gradient gate cannot be built: {error}") from error
    if opts.inner != "eager":  # AOTAutograd's limit on inputs changed in place (input_mutations.py)
        input_mutations.clone_mutated_grad_inputs(gm, example_inputs)
    compiled = _inner_compile(opts.inner, gm, example_inputs, mode, opts.inductor)
    if gated:
        compiled = grad_gate.wrap(compiled, gated)
    if opts.inner == "eager" and gm is original:
        return compiled  # the graph as traced, run as it is: nothing of ours can fail in it
    return _first_call_guarded(compiled, original, state.code if state is not None else None,
                               state.closure if state is not None else ())


def _speed_rule(inner: str, layer: Layer) -> tuple[bool, str]:
    """The speed rule (speed_rule.py) on a region an FX pass proved: keep Inductor's path, and what to say."""
    from .speed_rule import KEPT, LayerKind, backward_visible, fx_route, mode_from, verdict

    # the list op (per-expert weights) has no visible backward
    visible = not layer.per_expert and backward_visible(layer.tokens, layer.shape, layer.bias, layer.dtype,
                                                        layer.device)
    mode = mode_from(layer.train, layer.tokens, visible)
    route, note = fx_route(layer.form, layer.per_expert)
    said = verdict(LayerKind(layer.activation, layer.gate_up, layer.bias, layer.shape), layer.device, mode, inner,
                   layer.form, route=route)
    if "ran at" in said:  # the verdict read a measurement: say whose
        said += note
    return said.startswith(KEPT), said


def _first_call_guarded(compiled: Callable, original: torch.fx.GraphModule, code: Any, closure: tuple = ()) -> Callable:
    """``compiled``, except that a failure on its first call falls back: the call is answered by the graph as Dynamo
    traced it, run eagerly (whose error, if it raises too, is the user's own and is raised), and the frame is
    recompiled as plain capture would on its next call. Inductor can generate code that fails at run time for
    graphs traced under our capture settings (an unbacked size left unbound), which ``backend="inductor"`` never
    traces. After the first call this costs one Python call and a flag check."""
    checked = False

    def run(*args: Any) -> Any:
        nonlocal checked
        if checked:
            return compiled(*args)
        try:
            out = compiled(*args)
        except Exception as error:
            out = original(*args)  # where eager raises too, the error is the user's own: eager's is raised
            capture.note_fallback(code, "first call", error)
            capture.mark_plain(code, closure)
            return out
        checked = True
        return out

    return run


_warned_unseen_wrapper = False


def _warn_unseen_wrapper() -> None:
    """Our backend was reached through a wrapper that hides it (a callable we cannot see into): the graph was traced
    without our capture settings, so data-dependent expert loops were not captured. Said once, with the fix."""
    global _warned_unseen_wrapper
    if _warned_unseen_wrapper:
        return
    _warned_unseen_wrapper = True
    log.warning("moe_inductor was called through a backend wrapper it cannot see into, so this compile traced without "
                "its capture settings and data-dependent expert loops stay uncaptured. Mark the wrapper: "
                "moe_inductor.mark_backend(your_backend), or call torch.compile(..., backend='moe_inductor') directly.")
    report.record_note("moe_inductor was reached through a backend wrapper it cannot see into: traced without "
                       "its capture settings (fix: moe_inductor.mark_backend(your_backend))")


def visible_ops_run(inner: str, mode: Optional[str], inductor_options: Optional[dict] = None) -> bool:
    """Whether a compile with this inner compiler, mode and Inductor options may swap in the visible ops (the
    experts forward and backward launched from Inductor's wrapper): Inductor, replaying no CUDA graphs."""
    return inner == "inductor" and not _uses_cuda_graphs(mode, inductor_options)


def _uses_cuda_graphs(mode: Optional[str], inductor_options: Optional[dict] = None) -> bool:
    """Whether Inductor will replay this graph as CUDA graphs (by the mode's settings, the options, or Inductor's own
    config). The visible kernels exist to cut host time per call, which graph replay removes anyway; there the
    opaque op keeps its per-call choices (routing path, GEMM config from the real token count). Measured once on the
    H200: the visible op under reduce-overhead decoded at batch 16 at 957 new tokens/s against 2834 for
    torch.compile and 4988 for the opaque op a session earlier (RESULTS.md); the cause is not known yet."""
    import torch._inductor.config as inductor_config

    settings = _inductor_wrapper(mode, inductor_options).config
    return bool(settings.get("triton.cudagraphs", inductor_config.triton.cudagraphs))


def mark_backend(fn: Callable) -> Callable:
    """Declare that ``fn``, a backend of the user's, hands its graphs to moe_inductor, so that frames compiled
    through it get moe_inductor's capture settings. Returns ``fn``; usable as a decorator."""
    setattr(fn, capture.BACKEND_MARKER, True)
    return fn


mark_backend(moe_inductor_backend)
moe_inductor_backend.reset = _reset  # type: ignore[attr-defined]  (torch._dynamo.reset() calls a backend's reset)
capture.install()
hf.install()
hf_masks.install()
hf_attention.install()
