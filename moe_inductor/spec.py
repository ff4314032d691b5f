"""MoESpec: the one description of an MoE region that every FX matcher produces and one emitter turns into ops.

Fields are FX nodes of the Dynamo graph: ``x`` (T, H) tokens, ``ids``/``weights`` (T, k) routing, and the expert
weights as the user holds them, stacked (E, ., .) in ``layout`` "nk" (E, out, in) or "kn" (E, in, out). The routing
weight multiplies the expert output (``weight_position`` "output"), as in every form matched so far.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.fx import Node


@dataclass(frozen=True)
class MoESpec:
    x: Node
    ids: Node
    weights: Node
    gate: Node  # the up projection, or the gate half of a gated activation
    up: Optional[Node]  # the up half of a gated activation
    down: Node
    layout: str
    activation: str
    weight_position: str = "output"
