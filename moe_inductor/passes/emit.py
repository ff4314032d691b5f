"""The one emitter: an MoESpec becomes a ``moe_inductor::experts_forward`` call in the graph."""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional, Union

import torch
from torch.fx import Graph, GraphModule, Node

from ..ops.call import Activation, ExpertsCall, ExpertWeights, Routing, op_call
from ..report import Rewrite, note_left_alone
from ..spec import MoESpec
from .fx_utils import mutated_alias, source_function, source_line, val, eliminate_dead_code


def emit_experts(graph: Graph, spec: MoESpec, before: Node, out_dtype: torch.dtype) -> Node:
    """Insert the op before ``before``; returns the node of its (T, H) output in ``out_dtype``.

    The weights enter as views in the op's (E, K, N) form: nothing is copied. The call is described once
    (``ops.call.ExpertsCall``, with nodes for values) and ``ops.call.op_call`` gives the op and its arguments.
    """
    x_dtype = val(spec.x).dtype
    per_expert = isinstance(spec.gate, tuple)
    weight_nodes = [spec.x, spec.weights, *((spec.gate + (spec.up or ()) + spec.down) if per_expert
                                             else (spec.gate, spec.up, spec.down, spec.b1, spec.b1_up, spec.b2))]
    if spec.gate_up is not None:
        with graph.inserting_before(before):
            spec = _split_fused(graph, spec)
    # Dynamo compiles under the grad mode it traced in (and guards on it), so it is the mode the op will run in
    save_pre = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in map(val, weight_nodes))
    with graph.inserting_before(before):
        weights = graph.call_method("to", (spec.weights, x_dtype))
        if per_expert:  # nn.Linear weights: the list op stacks them at each call
            experts = ExpertWeights(spec.gate, spec.up, spec.down, spec.b1, spec.b1_up, spec.b2, spec.layout)
        else:
            views = [None if w is None else graph.call_method("transpose", (w, 1, 2)) if spec.layout == "nk" else w
                     for w in (spec.gate, spec.up, spec.down)]
            experts = ExpertWeights(*views, spec.b1, spec.b1_up, spec.b2)
        call = ExpertsCall(spec.x, Routing(spec.ids, weights, spec.capacity), experts,
                           Activation(spec.activation, spec.alpha, spec.limit), spec.weight_position, save_pre)
        op = graph.call_function(*op_call(call))
        out = graph.call_function(operator.getitem, (op, 0))
        if out_dtype != x_dtype:
            out = graph.call_method("to", (out, out_dtype))
    return out


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


def inputs_unchanged(spec: MoESpec) -> bool:
    """No input of the region (tokens, routing, expert weights) is changed in place anywhere in the graph, through
    any view. The op reads its inputs where the region's output was, so a change between the user's reads and that
    point would give it other values than the user's code saw."""
    nodes = [spec.x, spec.ids, spec.weights, spec.b1, spec.b1_up, spec.b2]
    for w in (spec.gate, spec.up, spec.down):
        nodes += list(w) if isinstance(w, tuple) else [w]
    return not any(isinstance(n, Node) and mutated_alias(n) for n in nodes)


def replace_matches(gm: GraphModule, match: Callable[[Node], Union[MoESpec, str, None]],
                    describe: Callable[[Node, MoESpec], Rewrite], form: str) -> tuple[list[Rewrite], list[Node]]:
    """For passes whose match ends at the node that yields the MoE output: replace each matched node by the op and
    drop what only fed it. ``match`` gives the spec, or why the node is a candidate it cannot prove (a string, noted
    as left alone under ``form``), or None.

    Returns:
        the rewrites, described by ``describe(node, spec)``, and the nodes noted as left alone.
    """
    done, left_alone = [], []
    for node in list(gm.graph.nodes):
        spec = match(node)
        if isinstance(spec, str):
            note_left_alone(form, source_line(node), spec)
            left_alone.append(node)
            continue
        if spec is None or not inputs_unchanged(spec):
            continue
        out_val = val(node) if val(node) is not None else val(spec.x)
        node.replace_all_uses_with(emit_experts(gm.graph, spec, node, out_val.dtype))
        done.append(describe(node, spec))
    if done:
        eliminate_dead_code(gm.graph)
        gm.recompile()
    return done, left_alone


#: transformers' own experts code: when it is still in the graph, the HF substitution left that module alone and
#: said why (hf.py); the FX passes do not report it a second time
_HF_EXPERTS_SOURCE = "transformers/integrations/moe.py"


def region_of(node: Node, fallback: object = None) -> object:
    """The user-level region a node belongs to, for left-alone notes: its innermost module's path; outside any
    submodule, the function of the user's source; else ``fallback``."""
    modules = node.meta.get("nn_module_stack") or {}
    return next(reversed(modules)) if modules else (source_function(node) or fallback)


def note_unmatched(gm: GraphModule, form: str, marker: Callable[[Node], Optional[Node]], reason: str,
                   already: Optional[set] = None) -> None:
    """After a pass: each region still holding its form's marker (a grouped GEMM, a weight gathered by routing ids)
    was MoE-looking code the pass could not prove; note it for explain() and the log, once per ``region_of`` (with
    the node ``marker`` returns, such as the shared ids or offsets, as the fallback). Regions in ``already`` got a
    more specific note from the pass itself."""
    seen = set(already or ())
    for node in gm.graph.nodes:
        group = marker(node)
        if group is None or _HF_EXPERTS_SOURCE in (node.meta.get("stack_trace") or ""):
            continue
        region = region_of(node, group)
        if region in seen:
            continue
        seen.add(region)
        note_left_alone(form, source_line(node), reason)
