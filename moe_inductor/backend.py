"""The Dynamo backend ``moe_inductor``: FX graph -> MoE passes -> Inductor (or a lighter inner compiler).

Found by name through the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="moe_inductor")``
works without importing this package. Options come through ``torch.compile(..., options={...})``:

    inner:  "inductor" (default), "aot_eager" or "eager": the compiler the rewritten graph is handed to
    forms:  an iterable of form names to rewrite (default: all); an empty one turns every rewrite off
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._dynamo.utils import counters

from . import capture, hf
from .explain import log_rewrites
from .options import BackendOptions
from .passes import FX_PASSES
from .report import GraphRecord, current_report

def _moe_ops_in(gm: torch.fx.GraphModule) -> int:
    target = torch.ops.moe_inductor.experts_forward.default
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (target, torch.ops.moe_inductor.experts_forward))


def _inner_compile(name: str, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: Optional[str]) -> Callable:
    if name == "eager":
        return gm.forward
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    patches = {"triton.cudagraphs": True} if mode in ("reduce-overhead", "max-autotune") else None
    if mode == "max-autotune":
        patches = dict(patches or {}, max_autotune=True)
    return compile_fx(gm, example_inputs, config_patches=patches)


def moe_inductor_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Optional[dict] = None, mode: Optional[str] = None
) -> Callable:
    """Compile ``gm``: its MoE code was rewritten into moe_inductor ops at trace time; record it, then hand the graph
    to the inner compiler."""
    opts = BackendOptions.parse(options)
    rewrites = capture.take_rewrites()
    for form, rewrite in FX_PASSES.items():
        if form in opts.forms:
            rewrites += rewrite(gm)
    for r in rewrites:
        counters["moe_inductor"][r.form] += 1
        log_rewrites(f"moe_inductor rewrote {r.where} ({r.form}, E={r.num_experts}, k={r.top_k}, {r.activation})",
                     gm.code)
    report = current_report()
    if report is not None:
        report.graphs.append(GraphRecord(code=gm.code, rewrites=rewrites, moe_ops=_moe_ops_in(gm)))
    return _inner_compile(opts.inner, gm, example_inputs, mode)


setattr(moe_inductor_backend, capture.BACKEND_MARKER, True)
capture.install()
hf.install()
