"""The one emitter: an MoESpec becomes a ``moe_inductor::experts_forward`` call in the graph."""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
from torch.fx import Graph, Node

from ..ops.activations import GPTOSS_ALPHA, GPTOSS_LIMIT
from ..ops.call import Activation, ExpertsCall, ExpertWeights, Routing, op_call
from ..spec import MoESpec
from .fx_utils import val


def emit_experts(graph: Graph, spec: MoESpec, before: Node, out_dtype: torch.dtype,
                 traced_x: Optional[Node] = None, compute_dtype: Optional[torch.dtype] = None) -> Node:
    """Insert the op before ``before``; returns the node of its (T, H) output in ``out_dtype``. ``traced_x`` stands
    for ``spec.x`` where that is a new node (a group's rows), which has no traced value: its dtype and grad.
    ``compute_dtype``: the dtype autocast computes the region's matmuls in, where it is not the tokens' and
    weights' own: the tokens, expert weights and biases enter cast to it (``_autocast_inputs``).

    The weights enter as views in the op's (E, K, N) form: nothing is copied. The call is described once
    (``ops.call.ExpertsCall``, with nodes for values) and ``ops.call.op_call`` gives the op and its arguments.
    """
    traced_x = traced_x if traced_x is not None else spec.x
    x_dtype = val(traced_x).dtype
    _check_capacity(spec.capacity)
    per_expert = isinstance(spec.gate, tuple)
    weight_nodes = [traced_x, spec.weights, *((spec.gate + (spec.up or ()) + spec.down) if per_expert
                                             else (spec.gate, spec.up, spec.down, spec.b1, spec.b1_up, spec.b2))]
    # Dynamo compiles under the grad mode it traced in (and guards on it), so it is the mode the op will run in
    save_pre = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in map(val, weight_nodes))
    if compute_dtype is not None and compute_dtype != x_dtype:
        with graph.inserting_before(before):
            spec = _autocast_inputs(graph, spec, compute_dtype)
        x_dtype = compute_dtype
    # In training a stacked fused gate/up weight goes to the op whole (op_call's gate_up; an interleaved one as its
    # pairs_view), for one gradient of it
    fused = spec.gate if spec.gate_up is not None and not per_expert and save_pre else None
    interleaved = spec.gate_up == "interleaved"
    if spec.gate_up is not None:
        with graph.inserting_before(before):
            spec = _split_fused(graph, spec)
    if per_expert:
        with graph.inserting_before(before):
            spec = per_expert_for_op(graph, spec)
        per_expert = isinstance(spec.gate, tuple)

    def kn(w: Optional[Node]) -> Optional[Node]:
        """A stacked weight as the op's (E, K, N) view, with its traced value: the visible-kernel swap reads the
        down weight's shape for the engine's size rule (lowerings/visible.py)."""
        if w is None or spec.layout != "nk":
            return w
        view = graph.call_method("transpose", (w, 1, 2))
        if isinstance(val(w), torch.Tensor):
            view.meta["example_value"] = val(w).transpose(1, 2)
        return view

    with graph.inserting_before(before):
        weights = graph.call_method("to", (spec.weights, x_dtype))
        if per_expert:  # nn.Linear weights, as lists: the list op reads them where they lie
            experts = ExpertWeights(spec.gate, spec.up, spec.down, spec.b1, spec.b1_up, spec.b2, spec.layout)
        else:
            experts = ExpertWeights(kn(spec.gate), kn(spec.up), kn(spec.down), spec.b1, spec.b1_up, spec.b2)
        call = ExpertsCall(spec.x, Routing(spec.ids, weights, spec.capacity), experts,
                           Activation(spec.activation, spec.alpha, spec.limit), spec.weight_position, save_pre)
        whole = kn(fused)
        if whole is not None and interleaved:
            width = val(fused).shape[1 if spec.layout == "nk" else 2]
            whole = graph.call_method("unflatten", (whole, 2, (width // 2, 2)))
        op = graph.call_function(*op_call(call, gate_up=whole))
        out = graph.call_function(operator.getitem, (op, 0))
        if out_dtype != x_dtype:
            out = graph.call_method("to", (out, out_dtype))
    return out


def list_op_runs(spec: MoESpec) -> bool:
    """Whether the per-expert list op runs ``spec``'s activation: every one but a clamped glu (gptoss_glu,
    clamped_silu_glu) of other than the default alpha and limit, which the list op's schema does not take."""
    return (spec.alpha, spec.limit) == (GPTOSS_ALPHA, GPTOSS_LIMIT)


def per_expert_for_op(graph: Graph, spec: MoESpec) -> MoESpec:
    """A per-expert spec (weights and biases, capacity or not) as the op takes it: as it is where the list op runs
    its activation (it takes each expert's weights and biases, and reads the weights where they lie); else its
    weights and biases stacked (``stacked_weights``, inserted where the graph inserts now) for the op with stacked
    weights. The layout stays the per-expert one. A spec of stacked weights is returned as it is."""
    if not isinstance(spec.gate, tuple) or list_op_runs(spec):
        return spec
    return stacked_weights(graph, spec)


def stacked_weights(graph: Graph, spec: MoESpec) -> MoESpec:
    """A per-expert spec with its weights and biases stacked (``torch.stack``, at each call, inserted where the
    graph inserts now) for the op with stacked weights, where the list op cannot run it (``list_op_runs``). The
    stack of E (out, in) weights is (E, out, in) and of E (in, out) ones (E, in, out): the layout stays."""
    def stack(t):
        return None if t is None else graph.call_function(torch.stack, (list(t),))

    return dataclasses.replace(spec, gate=stack(spec.gate), up=stack(spec.up), down=stack(spec.down),
                               b1=stack(spec.b1), b1_up=stack(spec.b1_up), b2=stack(spec.b2))


def _autocast_inputs(graph: Graph, spec: MoESpec, dtype: torch.dtype) -> MoESpec:
    """The spec with its tokens, expert weights and biases cast to ``dtype`` (inserted where the graph inserts
    now), as autocast casts the operands of the user's matmuls (a bias of ``F.linear`` or ``addmm`` too). Each cast
    keeps a traced value: the emitter and the visible-kernel swap read the weights' shapes. The routing weights
    are the emitter's own cast to the tokens' dtype."""
    def cast(t):
        if t is None:
            return None
        if isinstance(t, tuple):
            return tuple(cast(p) for p in t)
        node = graph.call_method("to", (t, dtype))
        traced = val(t)
        if traced is not None:
            node.meta["example_value"] = traced.to(dtype)
        return node

    return dataclasses.replace(spec, x=cast(spec.x), gate=cast(spec.gate), up=cast(spec.up), down=cast(spec.down),
                               b1=cast(spec.b1), b1_up=cast(spec.b1_up), b2=cast(spec.b2))


def _check_capacity(capacity) -> None:
    """The op's capacity is an int or the node of a symbolic size. A tensor (a 0-d capacity tensor's node) would be
    read as an int by the compiled graph, which gives garbage; a raw SymInt is no node of this graph. Either is a
    pass's bug: raising here leaves the graph as it was (passes/driver.py)."""
    if capacity is None or type(capacity) is int:
        return
    traced = capacity.meta.get("val", capacity.meta.get("example_value")) if isinstance(capacity, Node) else capacity
    if not (isinstance(capacity, Node) and isinstance(traced, torch.SymInt)):
        raise TypeError(f"the op's capacity must be an int or a size node, got {capacity!r} ({type(traced).__name__})")


def _split_fused(graph: Graph, spec: MoESpec) -> MoESpec:
    """The spec with a fused gate/up weight (``spec.gate_up``) as two views, gate and up, of its output dimension:
    (E, 2I, K) -> [:, :I] and [:, I:] ("nk"), (E, K, 2I) -> [..., :I] and [..., I:] ("kn"), each nn.Linear's (2I, K)
    -> [:I] and [I:]; even and odd rows (columns) when interleaved."""
    def halves(w: Node) -> tuple[Node, Node]:
        shape = val(w).shape
        out_dim = (0 if len(shape) == 2 else 1) if spec.layout == "nk" else len(shape) - 1
        n = shape[out_dim]
        if spec.gate_up == "concat":
            parts = (slice(None, n // 2), slice(n // 2, None))
        elif spec.gate_up == "interleaved":
            parts = (slice(0, None, 2), slice(1, None, 2))
        else:
            raise ValueError(f"gate_up={spec.gate_up!r}")
        lead = (slice(None),) * out_dim
        return tuple(graph.call_function(operator.getitem, (w, lead + (part,))) for part in parts)

    if spec.up is not None:
        raise ValueError("a fused gate/up spec has no separate up weight; a matcher must not produce this spec")
    def bias_halves(b: Node) -> tuple[Node, Node]:  # (E, 2I) -> its two halves or even/odd columns, like the weight
        n = val(b).shape[-1]
        parts = (slice(None, n // 2), slice(n // 2, None)) if spec.gate_up == "concat" else (slice(0, None, 2),
                                                                                             slice(1, None, 2))
        return tuple(graph.call_function(operator.getitem, (b, (slice(None), part))) for part in parts)

    if spec.b1_up is not None:
        raise ValueError("a fused gate/up spec has one fused bias; a matcher must not produce this spec")
    if isinstance(spec.gate, tuple):
        split = [halves(w) for w in spec.gate]
        gate, up = tuple(g for g, _ in split), tuple(u for _, u in split)
    else:
        gate, up = halves(spec.gate)
    b1, b1_up = bias_halves(spec.b1) if spec.b1 is not None else (None, None)
    return dataclasses.replace(spec, gate=gate, up=up, gate_up=None, b1=b1, b1_up=b1_up)
