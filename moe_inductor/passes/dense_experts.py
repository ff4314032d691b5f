"""Form "dense_experts": every expert runs on every token, then a routing matrix that is zero off the top-k mixes
them (Llama4-style user code, GPT-OSS in transformers 4.55-4.57, many research MoEs).

The user code this matches (letters, spacing, operand order and the two combines may vary):

    weights, ids = torch.topk(probs, k, dim=-1)
    routing = torch.zeros_like(probs).scatter(1, ids, weights)       # (T, E), zero off the top-k
    h = F.silu(torch.einsum("th,eih->tei", x, w1)) * torch.einsum("th,eih->tei", x, w3)
    out = torch.einsum("tei,ehi->teh", h, w2)                        # (T, E, H): E times the needed work
    y = torch.einsum("teh,te->th", out, routing)                     # or (out * routing[..., None]).sum(1)

It becomes one ``moe_inductor::experts_forward`` over the top-k only. That is exact because the routing matrix is
built by scattering into zeros with ids from ``topk`` (distinct per row, so no write is lost), and an expert's output
enters ``y`` only through its routing entry. Anything else is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import GraphModule, Node

from ..report import Rewrite
from ..spec import MoESpec
from .emit import replace_matches
from .fx_utils import alias_mutations, einsum_parts, read_gated, single_use, source_line, val, weighted_sum

FORM = "dense_experts"


@dataclass
class _DenseProjection:
    weight: Node
    x: Node
    layout: str


def _dense_projection(node: Node, x_rank: int) -> Optional[_DenseProjection]:
    """``einsum("th,eih->tei", x, w)`` (x_rank 2) or ``einsum("tei,ehi->teh", h, w)`` (x_rank 3), either layout."""
    parsed = einsum_parts(node)
    if parsed is None or len(parsed[2]) != 2:
        return None
    subs, out, ops = parsed
    for xi, wi in ((0, 1), (1, 0)):
        wv = val(ops[wi])
        if wv is None or wv.dim() != 3 or not wv.is_floating_point() or len(subs[wi]) != 3 or len(subs[xi]) != x_rank:
            continue
        e, p, q = subs[wi]
        xs = subs[xi]
        if len(set(subs[wi])) != 3 or xs[0] == e:
            continue
        if x_rank == 3 and xs[1] != e:
            continue
        contracted = xs[-1]
        if contracted not in (p, q) or out != xs[0] + e + (q if contracted == p else p):
            continue
        return _DenseProjection(ops[wi], ops[xi], "kn" if contracted == p else "nk")
    return None


def _inplace_scatter_of(base: Node) -> Optional[Node]:
    """``base.scatter_(...)`` when that is the one mutation of ``base`` and it runs before every read of ``base``.

    Dynamo records ``routing.scatter_(1, ids, v)`` as a node, while later reads of ``routing`` point at ``base``.
    """
    mutations = alias_mutations(base)
    if len(mutations) != 1 or mutations[0].target != "scatter_":
        return None
    scatter = mutations[0]
    for node in base.graph.nodes:
        if node is scatter:
            return scatter
        if node in base.users:  # a read before the scatter sees zeros: not the routing matrix
            return None
    return None


def _topk_scatter(routing: Node) -> Optional[tuple[Node, Node]]:
    """(ids, values) when ``routing`` is zeros scattered along dim 1 with distinct ids from ``topk``."""
    if routing.op != "call_method" or routing.target not in ("scatter", "scatter_"):
        routing = _inplace_scatter_of(routing) or routing
    if routing.op == "call_method" and routing.target in ("scatter", "scatter_") and len(routing.args) == 4:
        base, dim, ids, values = routing.args
    elif routing.op == "call_function" and routing.target is torch.scatter and len(routing.args) == 4:
        base, dim, ids, values = routing.args
    else:
        return None
    if routing.kwargs or dim not in (1, -1) or not all(isinstance(n, Node) for n in (base, ids, values)):
        return None
    zeros = (base.op == "call_function" and base.target in (torch.zeros_like, torch.zeros)) or (
        base.op == "call_method" and base.target == "new_zeros")
    if not zeros or "fill_value" in base.kwargs:
        return None
    mutations = alias_mutations(base)  # through any view of it, too
    if mutations != ([routing] if routing.target == "scatter_" else []):  # zeros stay zeros until the scatter
        return None
    if routing.target == "scatter" and alias_mutations(routing):  # and the routing matrix stays as made
        return None
    if routing.target == "scatter_" and _inplace_scatter_of(base) is not routing:  # and it runs before any read
        return None
    if not (ids.op == "call_function" and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    topk = ids.args[0]
    is_topk = (topk.op == "call_function" and topk.target is torch.topk) or (
        topk.op == "call_method" and topk.target == "topk")
    if not is_topk or topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1) not in (-1, 1):
        return None
    iv, vv, rv = val(ids), val(values), val(routing)
    if iv is None or vv is None or rv is None or iv.shape != vv.shape or rv.dim() != 2 or iv.dim() != 2:
        return None
    return ids, values


def match_or_reason(y: Node) -> Union[MoESpec, str, None]:
    """The MoE ending at ``y``; or why not (a string) when ``y`` mixes every expert's down projection by a (T, E)
    matrix, the form's mark; None when ``y`` is no such mix."""
    combined = weighted_sum(y)
    if combined is None:
        return None
    out, routing = combined
    down = _dense_projection(out, 3)
    if down is None:
        return None
    routed = _topk_scatter(routing)
    if routed is None:
        return ("the (T, E) mixing matrix is not zeros scattered with topk ids (a soft mixture of every expert is "
                "not sparse: nothing to skip)")
    if not single_use(out):
        return "the experts' (T, E, H) outputs are used elsewhere too"
    gated = read_gated(down.x, lambda n: _dense_projection(n, 2))
    if gated is None:
        return "the hidden state is not a known activation of an all-experts up projection"
    activation, gate, up = gated.activation, gated.gate, gated.up
    if up is not None and up.x is not gate.x:
        return "the gate and up projections read different inputs"
    if any(p.layout != gate.layout for p in (up, down) if p is not None):
        return "the projections mix weight layouts"
    ids, values = routed
    xv, wv = val(gate.x), val(down.weight)
    if xv is None or xv.dim() != 2 or val(ids).shape[0] != xv.shape[0] or val(routing).shape[1] != wv.shape[0]:
        return "the tokens, routing matrix and expert weights do not agree in T and E"
    return MoESpec(gate.x, ids, values, gate.weight, up.weight if up else None, down.weight, gate.layout, activation,
                   gate_up=gated.gate_up)


def _describe(node: Node, spec: MoESpec) -> Rewrite:
    E, k = int(val(spec.gate).shape[0]), int(val(spec.ids).shape[-1])
    return Rewrite(FORM, source_line(node), E, k, spec.activation,
                   (tuple(val(spec.gate).shape), tuple(val(spec.down).shape)),
                   note=f"runs k={k} of E={E} experts per token: {E / k:.1f}x fewer expert FLOPs")


def rewrite(gm: GraphModule) -> list[Rewrite]:
    """Replace every provable dense all-experts MoE in ``gm``; returns what was rewritten."""
    return replace_matches(gm, match_or_reason, _describe, FORM)[0]
