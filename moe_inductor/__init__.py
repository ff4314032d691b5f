"""moe_inductor: a torch.compile backend that runs Mixture-of-Experts layers as fused Triton grouped GEMMs.

    model = torch.compile(model, backend="moe_inductor")   # found through the torch_dynamo_backends entry point
"""
from __future__ import annotations

from . import config
from .ops import fused_experts, grouped_mm, route

__version__ = "0.1.0"
__all__ = ["config", "fused_experts", "grouped_mm", "route", "__version__"]
