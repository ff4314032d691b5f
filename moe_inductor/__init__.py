"""moe_inductor: a torch.compile backend that runs Mixture-of-Experts layers as fused Triton grouped GEMMs.

    model = torch.compile(model, backend="moe_inductor")   # found through the torch_dynamo_backends entry point

Layers, each importing only those below it (tests/test_layers.py checks the imports):
    explain, __main__         what users call and read; nothing imports them
    backend                   the Dynamo backend: passes, then the inner compiler
    capture, hf, speed_rule   scoped capture and the per-frame fallback; transformers' experts; the speed rule
    passes/                   FX matchers -> MoESpec -> the one emitter (never kernels/)
    lowerings/                how our ops reach Inductor (never passes/)
    report, rewrites          what was done, and its log channel
    ops/                      torch.library ops, references, host-side launch preparation (never passes/ or above)
    kernels/                  Triton kernels and their launchers (nothing of ours beyond kernels/)
"""
from __future__ import annotations

from . import config
from .backend import mark_backend, moe_inductor_backend
from .bucketing import bucketed
from .explain import _register_logging, explain
from .helpers import apply, compile_generate, with_options
from .ops import fused_experts, grouped_mm, route
from .report import Report

_register_logging()

__version__ = "0.1.0"
__all__ = ["Report", "apply", "bucketed", "compile_generate", "config", "explain", "fused_experts", "grouped_mm",
           "mark_backend", "moe_inductor_backend", "route", "with_options", "__version__"]
