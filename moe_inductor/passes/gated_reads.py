"""How an expert's hidden activation is read off the graph: ``act(gate) [* up]`` (``split_gated``, ``read_gated``), the
gate and up inputs as halves of one fused projection (``fused_gate_up``), GPT-OSS's clamped glu (``gptoss_glu``) and
Step-3.7's clamped silu-glu (``clamped_silu_glu``)."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..ops.activations import GPTOSS_ALPHA, GPTOSS_LIMIT
from .fx_utils import is_call, val


_UNARY = {F.silu: "silu", F.relu: "relu", torch.relu: "relu"}


def activation_of(node: Node) -> Optional[tuple[str, Node]]:
    if node.op != "call_function":
        return None
    if node.target is F.gelu:
        approx = node.kwargs.get("approximate", "none")
        if set(node.kwargs) - {"approximate"} or approx not in ("none", "tanh"):
            return None
        return ("gelu" if approx == "none" else "gelu_tanh"), node.args[0]
    name = _UNARY.get(node.target)
    if name is None or len(node.args) != 1 or set(node.kwargs) - {"inplace"} or node.kwargs.get("inplace"):
        return None
    return name, node.args[0]


def split_gated(h: Node) -> Optional[tuple[str, Node, Node, Optional[Node]]]:
    """(activation name, activation node, its input, the up factor or None) for ``act(a) * b``, ``b * act(a)`` or
    ``act(a)``; the name gets "_glu" when there is an up factor."""
    if isinstance(h, Node) and h.op == "call_function" and h.target is operator.mul and len(h.args) == 2:
        for a, b in (h.args, h.args[::-1]):
            act = activation_of(a) if isinstance(a, Node) and isinstance(b, Node) else None
            if act is not None:
                return f"{act[0]}_glu", a, act[1], b
    act = activation_of(h) if isinstance(h, Node) else None
    return (act[0], h, act[1], None) if act is not None else None


@dataclass
class GatedRead:
    """``h = act(gate_in) [* up_in]`` with both projections read (see ``read_gated``)."""

    activation: str
    act: Node
    gate_in: Node
    up_in: Optional[Node]
    gate: Any  # what ``read`` returned for gate_in (for a fused gate/up, for the one projection of both)
    up: Any  # and for up_in; None for a plain activation or a fused gate/up
    #: "concat" or "interleaved" when gate and up are the two halves of one projection (``gate`` read it); the
    #: MoESpec then holds the fused weight and the emitter splits it, as views
    gate_up: Optional[str] = None
    alpha: float = GPTOSS_ALPHA  # gptoss_glu's, as the user's code has them
    limit: float = GPTOSS_LIMIT

    def spec_fields(self) -> dict:
        """The MoESpec fields this reading fixes besides the weights: every pass hands them on."""
        return {"gate_up": self.gate_up, "alpha": self.alpha, "limit": self.limit}


def _last_dim(node: Node, dim) -> bool:
    v = val(node)
    return v is not None and isinstance(dim, int) and dim in (-1, v.dim() - 1)


def _part_of(node, index: int) -> Optional[Node]:
    """``c`` for ``c[index]`` (a getitem of a chunk/split result)."""
    if is_call(node, "call_function", operator.getitem) and node.args[1] == index and isinstance(node.args[0], Node):
        return node.args[0]
    return None


def _last_dim_slice(node) -> Optional[tuple[Node, slice]]:
    """(p, s) for ``p[..., s]`` (or ``p[:, s]`` on a 2D p) with a slice s."""
    if not is_call(node, "call_function", operator.getitem) or not isinstance(node.args[0], Node):
        return None
    p, index = node.args
    pv = val(p)
    if pv is None or not isinstance(index, tuple) or len(index) != 2 or not isinstance(index[1], slice):
        return None
    if index[0] is Ellipsis or (pv.dim() == 2 and index[0] == slice(None)):
        return p, index[1]
    return None


def fused_gate_up(gate_in: Node, up_in: Node) -> Optional[tuple[Node, str]]:
    """(p, "concat" | "interleaved") when ``gate_in`` and ``up_in`` are the first and second halves of one
    projection p's last dimension, or its even and odd columns:

        gate, up = p.chunk(2, dim=-1)             # or torch.chunk(p, 2, -1), p.split(I, -1), torch.split(p, [I, I], -1)
        gate, up = p[..., :I], p[..., I:]         # slices; interleaved: p[..., ::2], p[..., 1::2]

    The activation must be on the first half (the gate): the other order is not a spelling this proves."""
    whole = _part_of(gate_in, 0)
    if whole is not None and _part_of(up_in, 1) is whole and len(whole.users) == 2:
        p, args = (whole.args[0], whole.args[1:]) if whole.args else (None, ())
        dim = whole.kwargs.get("dim", args[1] if len(args) > 1 else 0)
        pv = val(p) if isinstance(p, Node) else None
        if pv is None or set(whole.kwargs) - {"dim"} or len(args) < 1 or not _last_dim(p, dim):
            return None
        width = pv.shape[-1]
        if not isinstance(width, int) or width % 2:
            return None
        parts = args[0]
        if is_call(whole, "call_method", "chunk") or is_call(whole, "call_function", torch.chunk):
            ok = parts == 2
        elif is_call(whole, "call_method", "split") or is_call(whole, "call_function", torch.split):
            ok = parts == width // 2 or (isinstance(parts, (list, tuple)) and list(parts) == [width // 2] * 2)
        else:
            ok = False
        return (p, "concat") if ok else None
    gate_slice, up_slice = _last_dim_slice(gate_in), _last_dim_slice(up_in)
    if gate_slice is None or up_slice is None or gate_slice[0] is not up_slice[0]:
        return None
    p, g, u = gate_slice[0], gate_slice[1], up_slice[1]
    width = val(p).shape[-1]
    if not isinstance(width, int) or width % 2:
        return None
    half = width // 2
    if (g.start in (None, 0) and g.stop == half and g.step in (None, 1) and u.start == half
            and u.stop in (None, width) and u.step in (None, 1)):
        return p, "concat"
    if g.start in (None, 0) and g.stop in (None, width) and g.step == 2 and u.start == 1 and u.stop in (
            None, width) and u.step == 2:
        return p, "interleaved"
    return None


def _number(x) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _clamp(node, lo_needed: bool) -> Optional[tuple[Node, Optional[float], Optional[float]]]:
    """(input, min, max) of ``t.clamp(min=..., max=...)`` / ``torch.clamp(t, ...)``."""
    if not (is_call(node, "call_method", "clamp") or is_call(node, "call_function", torch.clamp)):
        return None
    args = list(node.args[1:])
    lo = node.kwargs.get("min", args[0] if args else None)
    hi = node.kwargs.get("max", args[1] if len(args) > 1 else None)
    if set(node.kwargs) - {"min", "max"} or len(args) > 2 or not isinstance(node.args[0], Node):
        return None
    lo_v, hi_v = _number(lo), _number(hi)
    if (lo is not None and lo_v is None) or hi_v is None or (lo_needed != (lo is not None)):
        return None
    return node.args[0], lo_v, hi_v


def _scaled_const(node) -> Optional[tuple[Node, float]]:
    """(t, c) for ``c * t`` or ``t * c`` with a Python number c."""
    if is_call(node, "call_function", operator.mul) and len(node.args) == 2:
        for t, c in (node.args, node.args[::-1]):
            if isinstance(t, Node) and _number(c) is not None:
                return t, _number(c)
    return None


def gptoss_glu(h: Node) -> Optional[tuple[Node, Node, Node, float, float]]:
    """(the gate product node, gate input, up input, alpha, limit) for GPT-OSS's clamped glu:

        g = g.clamp(min=None, max=limit); u = u.clamp(min=-limit, max=limit)
        h = (g * torch.sigmoid(alpha * g)) * (u + 1)          # factors in either order
    """
    if not (is_call(h, "call_function", operator.mul) and len(h.args) == 2):
        return None
    for glu, lin in (h.args, h.args[::-1]):
        if not (is_call(lin, "call_function", operator.add) and len(lin.args) == 2 and 1 in lin.args[1:]):
            continue
        up = _clamp(lin.args[0], lo_needed=True)
        if not (is_call(glu, "call_function", operator.mul) and len(glu.args) == 2) or up is None:
            continue
        for g, sig in (glu.args, glu.args[::-1]):
            gate = _clamp(g, lo_needed=False)
            if gate is None or not is_call(sig, "call_function", torch.sigmoid) or len(sig.args) != 1:
                continue
            scaled = _scaled_const(sig.args[0])
            if scaled is None or scaled[0] is not g:
                continue
            limit = gate[2]
            if up[1] != -limit or up[2] != limit:
                return None
            return glu, gate[0], up[0], scaled[1], limit
    return None


def clamped_silu_glu(h: Node) -> Optional[tuple[str, Node, Node, Node, float]]:
    """(activation name, the clamped silu node, gate input, up input, limit) for Step-3.7's clamped silu-glu:

        g = F.silu(g).clamp(max=limit); u = u.clamp(min=-limit, max=limit)
        h = g * u                                              # factors in either order

    with one bound ``limit > 0`` on both: the clamp after the silu, from above only, and up's from both sides. At
    ``limit = inf`` both clamps return their input, every value (NaN and the infinities too), so the reading is
    plain "silu_glu"; else "clamped_silu_glu". Any other clamp (bounds of their own, the clamp before the silu, a
    bound below on the silu or one side only on up) is another function and is not read."""
    if not (is_call(h, "call_function", operator.mul) and len(h.args) == 2):
        return None
    for g, u in (h.args, h.args[::-1]):
        gate, up = _clamp(g, lo_needed=False), _clamp(u, lo_needed=True)
        if gate is None or up is None:
            continue
        act = activation_of(gate[0])
        limit = gate[2]
        if act is None or act[0] != "silu" or not isinstance(act[1], Node) or not limit > 0:
            continue
        if up[1] != -limit or up[2] != limit:
            continue
        return ("silu_glu" if math.isinf(limit) else "clamped_silu_glu"), g, act[1], up[0], limit
    return None


def read_gated(h: Node, read: Callable[[Node], Any]) -> Optional[GatedRead]:
    """``split_gated(h)`` with the projection(s) under the activation read by the pass's own ``read`` (None when it
    does not recognise one). The checks between the readings (same input, same layout) stay with each pass.

    When gate and up are the two halves of one projection (``fused_gate_up``), ``read`` reads that projection and
    the result says how the halves lie (``gate_up``); the pass hands it on to its MoESpec."""
    params = {}
    glu, clamped = gptoss_glu(h), clamped_silu_glu(h)
    if glu is not None:
        act, gate_in, up_in, alpha, limit = glu
        activation, params = "gptoss_glu", {"alpha": alpha, "limit": limit}
    elif clamped is not None:
        activation, act, gate_in, up_in, limit = clamped
        params = {"limit": limit} if activation == "clamped_silu_glu" else {}
    else:
        split = split_gated(h)
        if split is None:
            return None
        activation, act, gate_in, up_in = split
    fused = fused_gate_up(gate_in, up_in) if up_in is not None else None
    if fused is not None:
        gate = read(fused[0])
        return GatedRead(activation, act, gate_in, up_in, gate, None, fused[1], **params) if gate is not None else None
    gate = read(gate_in)
    up = read(up_in) if up_in is not None else None
    if gate is None or (up_in is not None and up is None):
        return None
    return GatedRead(activation, act, gate_in, up_in, gate, up, **params)
