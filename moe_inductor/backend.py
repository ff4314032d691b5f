"""The Dynamo backend ``moe_inductor``: FX graph -> MoE passes -> Inductor.

It is found by name through the ``torch_dynamo_backends`` entry point, so ``torch.compile(m, backend="moe_inductor")``
works without importing this package.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def moe_inductor_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **options: Any) -> Callable:
    """Compile ``gm``: rewrite its MoE code into moe_inductor ops, then hand the graph to Inductor."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=options or None)
