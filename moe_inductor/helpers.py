"""One-call entry points for the common jobs: the backend with options baked in, compiled generation, and HF experts
on the op without compiling."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from .backend import moe_inductor_backend


def with_options(**options: Any) -> Callable:
    """The moe_inductor backend with ``options`` baked in, for where ``options=`` cannot be given.

    torch.compile refuses ``mode=`` together with ``options=``, and HF's ``CompileConfig`` passes a mode; a backend
    that carries its options needs neither::

        torch.compile(model, backend=moe_inductor.with_options(max_autotune=True), mode="reduce-overhead")

    Args:
        options: the backend's options: ``inner``, ``forms``, and Inductor config settings (``max_autotune``, ...).

    Returns:
        a backend callable for ``torch.compile(backend=...)`` (moe_inductor's capture recognises it as ours).
    """
    from .options import BackendOptions

    BackendOptions.parse(options)  # a bad option fails here, not at the first compile
    backend = functools.partial(moe_inductor_backend, options=dict(options))
    backend.reset = moe_inductor_backend.reset  # type: ignore[attr-defined]  (torch._dynamo.reset() calls it)
    return backend


def compile_generate(model: torch.nn.Module, *, dynamic: Optional[bool] = None, mode: Optional[str] = None,
                     fullgraph: bool = False, **options: Any) -> torch.nn.Module:
    """Make ``model.generate()`` (and every other call of ``model``) run compiled by moe_inductor, on CPU or GPU.

    ``torch.compile(model).generate(...)`` compiles nothing: ``generate`` belongs to the module inside the wrapper
    and calls that module's own, uncompiled ``forward``. So this compiles the model's ``forward`` in place, which
    every prefill and decode step of ``generate`` calls, whatever the cache.

    Args:
        model: an HF ``GenerationMixin`` model (or any module whose callers go through ``forward``).
        dynamic, mode, fullgraph: as for ``torch.compile``.
        options: the backend's options (``inner``, ``forms``, Inductor settings); given with ``mode`` too.

    Returns:
        ``model`` itself, with ``model.forward`` compiled (calling this again recompiles from the original forward).
    """
    forward = getattr(model.forward, "_torchdynamo_orig_callable", model.forward)
    model.forward = torch.compile(forward, backend=with_options(**options), dynamic=dynamic, mode=mode,
                                  fullgraph=fullgraph)
    return model


def apply(model: torch.nn.Module) -> list[str]:
    """Run every HF experts module of ``model`` through moe_inductor's op, eagerly, with no compile.

    This is HF's own switch, ``model.set_experts_implementation("moe_inductor")``, after checking that the op can
    run each experts module exactly (a variant it cannot read is refused here, with the reason, rather than failing
    at the first forward).

    Returns:
        the names of the experts modules that now run the op (``model.layers.0.mlp.experts``, ...).

    Raises:
        ImportError: transformers (>= 5, with its experts registry) is not installed.
        ValueError: the model has no HF experts module, or one the op cannot run.
    """
    from . import hf

    if not hf.register_experts_interface():
        raise ImportError("moe_inductor.apply needs transformers >= 5 (its experts registry)")
    experts = {name: m for name, m in model.named_modules() if hf._is_decorated_experts_forward(type(m).forward)}
    if not experts:
        raise ValueError(f"moe_inductor.apply: {type(model).__name__} has no HF experts module (a class decorated "
                         "with transformers' use_experts_implementation); compile it instead: "
                         "torch.compile(model, backend='moe_inductor')")
    problems = {name: hf.experts_spec_or_reason(m) for name, m in experts.items()}
    problems = {name: why for name, why in problems.items() if isinstance(why, str)}
    if problems:
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise ValueError(f"moe_inductor.apply: the op cannot run these experts exactly ({lines}); "
                         "torch.compile(model, backend='moe_inductor') leaves them as they are and rewrites the rest")
    model.set_experts_implementation("moe_inductor")
    return list(experts)
