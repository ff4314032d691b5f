"""MoESpec: the one description of an MoE region that every FX matcher produces and one emitter turns into ops.

Fields are FX nodes of the Dynamo graph: ``x`` (T, H) tokens, ``ids``/``weights`` (T, k) routing, and the expert
weights as the user holds them: one stacked (E, ., .) node per projection in ``layout`` "nk" (E, out, in) or "kn"
(E, in, out), or a tuple of E per-expert (out, in) nodes (nn.Linear weights). ``weight_position`` says whether the
routing weight scales the expert output or input; ``capacity``, when set, drops assignments past it per expert in
GShard/Switch priority order (choice-major: every token's first choice before any second choice). ``gate_up``, when
set ("concat": gate then up; "interleaved": even and odd rows), says that ``gate`` holds one fused gate/up
projection of twice the width (``up`` is None); the emitter passes its halves to the op, as views. Biases, when
present, are stacked (E, N) nodes (only with stacked weights).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from torch.fx import Node

from .ops.activations import GPTOSS_ALPHA, GPTOSS_LIMIT


@dataclass(frozen=True)
class MoESpec:
    x: Node
    ids: Node
    weights: Node
    gate: Union[Node, tuple]  # the up projection, or the gate half of a gated activation
    up: Optional[Union[Node, tuple]]  # the up half of a gated activation
    down: Union[Node, tuple]
    layout: str
    activation: str
    weight_position: str = "output"
    capacity: Optional[Any] = None  # an int (or a symbolic size node): drop past it in choice-major order
    gate_up: Optional[str] = None  # "concat" / "interleaved": gate is a fused gate/up weight, split by the emitter
    b1: Optional[Node] = None  # (E, N) bias of the gate (or of the fused gate/up, split like it) projection
    b1_up: Optional[Node] = None  # (E, I) bias of a separate up projection
    b2: Optional[Node] = None  # (E, H) bias of the down projection, added before the routing weight
    alpha: float = GPTOSS_ALPHA  # gptoss_glu's parameters, as the user's code spells them
    limit: float = GPTOSS_LIMIT  # gptoss_glu's and clamped_silu_glu's bound
