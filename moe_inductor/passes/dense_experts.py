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

The experts may also be modules of their own, each run on every token and stacked (column e is expert e):

    out = torch.stack([expert(x) for expert in self.experts], dim=1)  # (T, E, H), then the same mix

More spellings of the same computation (``match_token_replicated``, ``match_dense_loop`` have the details):

    # Llama 4's reference: tokens replicated per expert, scaled by (E, T) scores zero off the top-k, bmm over E
    xs = torch.gather(x, 0, idx) * scores_ET.reshape(-1, 1)
    out.scatter_add_(0, idx, torch.bmm(F.silu(torch.bmm(xs.view(E, -1, H), w1)) * ..., w2).view(-1, H))

    # vLLM's torch-native loop: every expert on every token, each scaled by its column of the routing
    for e in range(E):
        y = y + expert_e(x) * (weights * (ids == e)).sum(-1, keepdim=True)

    # vLLM's Gaudi loop: the columns of a scatter_-made (T, E) table, through views, += into a zeros buffer
    # (passes/dense_tables.py)
    for e in range(E):
        y += expert_e(x) * table.reshape(-1, T, E).permute(2, 0, 1).unsqueeze(-1)[e]

    # transformers v4.55-4.57's GPT-OSS and Qwen3-VL-MoE: tokens repeated per expert, bmm, summed over E
    out = torch.bmm(act(torch.bmm(x.repeat(E, 1).view(E, -1, H), w_gate_up)), w_down)
    y = (out.view(E, B, -1, H) * routing.transpose(0, 1).view(E, B, -1)[..., None]).sum(0)

    # transformers v4.52-4.57's Llama 4: the same with the score on the repeated input (v4.51: gathered as above)
    xs = x.repeat(E, 1) * torch.sigmoid(table.float()).to(dtype).transpose(0, 1).reshape(-1, 1)

The (E, T) score tables of the two Llama 4 spellings, casts included, are read by passes/score_tables.py.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match, every_node, num_experts
from .aliases import alias_mutations
from .dense_tables import match_table_loop
from .fx_utils import (ONE_HOT, comes_before, einsum_parts, is_call, made_fresh, single_use, unsqueezed_last, val,
                       weighted_sum)
from .gated_reads import GatedRead, read_gated
from .score_tables import expert_major_scores

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


def _one_hot_sum(routing: Node) -> Optional[tuple[Node, Node]]:
    """(ids, values) for ``(one_hot(ids, E) * values[..., None]).sum(1)`` (the one-hot cast to any float dtype):
    row t is the sum over k of values[t, j] at column ids[t, j], what the op sums over k, repeated ids or not."""
    if not (is_call(routing, "call_method", "sum") and not routing.kwargs.get("keepdim", False)):
        return None
    if (routing.args[1:] or (routing.kwargs.get("dim"),))[0] != 1 or set(routing.kwargs) - {"dim", "keepdim"}:
        return None
    prod = routing.args[0]
    if not (is_call(prod, "call_function", operator.mul) and len(prod.args) == 2 and single_use(prod)):
        return None
    for hot, scaled in (prod.args, prod.args[::-1]):
        if is_call(hot, "call_method", "to", "float", "type_as", "half", "bfloat16") and isinstance(hot.args[0], Node):
            hot = hot.args[0]
        if not (is_call(hot, "call_function", *ONE_HOT)
                and isinstance(scaled, Node)):
            continue
        values = unsqueezed_last(scaled)
        ids = hot.args[0]
        iv, vv, rv = val(ids), val(values) if values is not None else None, val(routing)
        classes = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else None)
        if iv is None or vv is None or rv is None or iv.dim() != 2 or tuple(iv.shape) != tuple(vv.shape) or (
                rv.dim() != 2 or classes != rv.shape[1] or not vv.is_floating_point()):
            return None
        if alias_mutations(routing):  # the routing matrix stays as made
            return None
        return ids, values
    return None


def _joined_from_experts(out: Node) -> bool:
    """``out`` is ``torch.cat([...], dim=1)`` of pieces cut from every expert's (T, E, H) outputs (a dense
    projection or a stack of expert modules), maybe scaled by a number or zeroed (``zeros_like``)."""
    if not is_call(out, "call_function", torch.cat, torch.concat) or not out.args:
        return False
    if out.kwargs.get("dim", out.args[1] if len(out.args) > 1 else 0) not in (1, -2):
        return False
    parts = out.args[0] if isinstance(out.args[0], (list, tuple)) else ()
    for part in parts:
        while isinstance(part, Node):
            if is_call(part, "call_function", operator.mul) and len(part.args) == 2:
                part = next((a for a in part.args if isinstance(a, Node)), None)
            elif is_call(part, "call_function", operator.getitem, torch.zeros_like):
                part = part.args[0]
            else:
                break
        if isinstance(part, Node) and (_dense_projection(part, 3) is not None or _stacked_outputs(part) is not None):
            return True
    return False


def _topk_scatter(routing: Node) -> Optional[tuple[Node, Node]]:
    """(ids, values) when ``routing`` is zeros scattered along dim 1 with distinct ids from ``topk``."""
    if (summed := _one_hot_sum(routing)) is not None:
        return summed
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
    if alias_mutations(routing):  # and the routing matrix stays as made (``zeros.scatter_(...)[:, 0] = 0`` too)
        return None
    if routing.target == "scatter_" and _inplace_scatter_of(base) is not routing:  # and it runs before any read
        return None
    if not (ids.op == "call_function" and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    from .unrolled_loop import max_ids

    topk = ids.args[0]
    is_topk = (topk.op == "call_function" and topk.target is torch.topk) or (
        topk.op == "call_method" and topk.target == "topk")
    if not max_ids(ids) and (
            not is_topk or topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1) not in (-1, 1)):
        return None
    iv, vv, rv = val(ids), val(values), val(routing)
    if iv is None or vv is None or rv is None or iv.shape != vv.shape or rv.dim() != 2 or iv.dim() != 2:
        return None
    return ids, values


@dataclass
class _Experts:
    """E experts on one input, read from their own per-expert MLPs (``_every_expert``)."""

    x: Node
    gate: Union[Node, tuple]
    up: Union[Node, tuple, None]
    down: Union[Node, tuple]
    layout: str
    activation: str
    fields: dict

    def spec(self, ids: Node, weights: Node) -> MoESpec:
        return MoESpec(self.x, ids, weights, self.gate, self.up, self.down, self.layout, self.activation,
                       **self.fields)


def _every_expert(outs: list, hidden: Optional[Callable[[Node], Union[Node, str]]] = None,
                  tokens: Callable[[Node], Node] = lambda n: n) -> Union[_Experts, str]:
    """The experts whose outputs are ``outs[e]`` for each e of range(E): each a bias-free MLP on the same input
    (``expert_projections.expert_mlp``), alike in all but their weights, on ``w[e]`` of one stacked weight per projection
    or one distinct per-expert weight per projection (nn.Linear modules, the e-th in expert e's place); or why not.
    ``hidden`` is handed to ``expert_mlp``; ``tokens`` maps each expert's input to the node whose values it is (a
    proof that reads ``x.reshape(-1, H)`` per expert as ``x``: ``dense_tables.same_tokens``)."""
    from .expert_projections import expert_mlp

    read = []
    for e, out in enumerate(outs):
        mlp = expert_mlp(out, e, hidden)
        if isinstance(mlp, str):
            return mlp
        w_down, layout, stacked, gated = mlp
        gate, up = gated.gate, gated.up
        if up is not None and tokens(up[0]) is not tokens(gate[0]):
            return f"expert {e}'s gate and up projections read different inputs"
        if any(p[2] != layout or p[3] != stacked for p in (gate, up) if p is not None):
            return "the projections mix weight layouts or stacked and per-expert weights"
        read.append((e, tokens(gate[0]), gate[1], up[1] if up else None, w_down, layout, stacked, gated.activation,
                     tuple(sorted(gated.spec_fields().items()))))
    first = read[0]
    if any(r[1] is not first[1] or r[5:] != first[5:] or (r[3] is None) != (first[3] is None) for r in read):
        return "the experts differ in more than their weights, or read different inputs"
    stacked, num_experts = first[6], len(read)
    if stacked:
        gate, up, down = first[2], first[3], first[4]
        if any((r[2], r[3], r[4]) != (gate, up, down) for r in read) or val(gate).shape[0] != num_experts:
            return "the experts do not read one stacked weight per projection, w[e] for each e of range(E)"
    else:
        gate, down = tuple(r[2] for r in read), tuple(r[4] for r in read)
        up = tuple(r[3] for r in read) if first[3] is not None else None
        ws = [w for group in (gate, up or (), down) for w in group]
        if len({id(w) for w in ws}) != len(ws) or len({tuple(val(w).shape) for w in gate}) != 1:
            return "the per-expert weights are not one distinct weight per expert and projection, of one shape"
    return _Experts(first[1], gate, up, down, first[5], first[7], dict(first[8]))


_PROJECTIONS = (torch._C._nn.linear, torch.nn.functional.linear, operator.matmul, torch.matmul)


def _stacked_outputs(out: Node) -> Optional[list]:
    """[o_0, ..., o_{E-1}] for ``torch.stack([o_0, ..., o_{E-1}], dim=1)`` (T, E, H) of (T, H) projections: each
    expert's module run on every token, its output in column e. The form's mark; the proof reads each o_e."""
    if not is_call(out, "call_function", torch.stack) or set(out.kwargs) - {"dim"} or len(out.args) > 2:
        return None
    items = out.args[0] if out.args else None
    dim = out.kwargs.get("dim", out.args[1] if len(out.args) > 1 else 0)
    if not isinstance(items, (list, tuple)) or not items or dim not in (1, -2):
        return None
    if not all(is_call(o, "call_function", *_PROJECTIONS) for o in items):
        return None
    vals = [val(o) for o in items]
    if any(v is None or v.dim() != 2 for v in vals):
        return None
    return list(items)


def _fewer_flops(spec: MoESpec) -> str:
    E, k = num_experts(spec), int(val(spec.ids).shape[-1])
    return f"runs k={k} of E={E} experts per token: {E / k:.1f}x fewer expert FLOPs"


def match_or_reason(y: Node) -> Union[Match, str, None]:
    """The MoE ending at ``y``; or why not (a string) when ``y`` mixes every expert's down projection by a (T, E)
    matrix, the form's mark; None when ``y`` is no such mix."""
    combined = weighted_sum(y)
    if combined is None:
        return None
    out, routing = combined
    down = _dense_projection(out, 3)
    outs = _stacked_outputs(out) if down is None else None
    if down is None and outs is None:
        if _joined_from_experts(out):
            return ("the (T, E, H) expert outputs are sliced and joined again (torch.cat) before the mix: column e "
                    "is not expert e's output as its MLP computed it")
        return None
    routed = _topk_scatter(routing)
    if routed is None:
        return ("the (T, E) mixing matrix is not zeros scattered with topk ids (a soft mixture of every expert is "
                "not sparse: nothing to skip)")
    if not single_use(out):
        return "the experts' (T, E, H) outputs are used elsewhere too"
    if outs is not None:
        return _stacked_match(y, outs, routing, *routed)
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
    spec = MoESpec(gate.x, ids, values, gate.weight, up.weight if up else None, down.weight, gate.layout, activation,
                   **gated.spec_fields())
    return Match(spec, y, note=_fewer_flops(spec))


def _stacked_match(y: Node, outs: list, routing: Node, ids: Node, values: Node) -> Union[Match, str]:
    """Every expert's own module on every token, ``torch.stack``-ed into (T, E, H) and mixed by the top-k routing
    matrix: column e of the stack is expert e's MLP on x (``_every_expert``), so column e of the matrix is its
    weight, and the mix is the op's weighted sum over k."""
    experts = _every_expert(outs)
    if isinstance(experts, str):
        return experts
    xv, rv = val(experts.x), val(routing)
    if xv is None or xv.dim() != 2 or val(ids).shape[0] != xv.shape[0] or rv.shape[1] != len(outs):
        return "the tokens, routing matrix and stacked experts do not agree in T and E"
    spec = experts.spec(ids, values)
    return Match(spec, y, note=_fewer_flops(spec))


def _token_rows(index: Node, num_tokens, num_experts) -> Optional[Node]:
    """The (E, T) row map R for ``R.reshape(-1, 1).expand(-1, H)`` with ``R = arange(T).view(1, -1).expand(E, -1)``
    (or ``.unsqueeze(0)``): row e*T + t of the index is token t."""
    if not (is_call(index, "call_method", "expand") and len(index.args) == 3 and index.args[1] == -1):
        return None
    flat = index.args[0]
    if not (is_call(flat, "call_method", "reshape", "view") and flat.args[1:] == (-1, 1)):
        return None
    rows = flat.args[0]
    if not (is_call(rows, "call_method", "expand") and len(rows.args) == 3 and rows.args[2] == -1
            and rows.args[1] == num_experts):
        return None
    ar = rows.args[0]
    if not ((is_call(ar, "call_method", "view") and ar.args[1:] == (1, -1))
            or (is_call(ar, "call_method", "unsqueeze") and ar.args[1:] == (0,))):
        return None
    ar = ar.args[0]
    av = val(ar)
    if not (is_call(ar, "call_function", torch.arange) and len(ar.args) == 1 and set(ar.kwargs) <= {"device"}
            and av is not None and av.dim() == 1 and av.shape[0] == num_tokens):
        return None
    return rows


def match_token_replicated(add: Node) -> Union[Match, str, None]:
    """Llama 4's reference MoE: every token copied once per expert, scaled by its (zero off the top-k) score before
    the experts, bmm over (E, T, H), ``scatter_add_`` back by token::

        rows = arange(T).view(1, -1).expand(E, -1); idx = rows.reshape(-1, 1).expand(-1, H)
        xs = torch.gather(x, 0, idx) * scores_ET.reshape(-1, 1)
        h = F.silu(torch.bmm(xs.view(E, -1, H), w1)) * torch.bmm(xs.view(E, -1, H), w3)
        out.scatter_add_(0, idx, torch.bmm(h, w2).view(-1, H))

    A zero score gives a zero input, and every expert we run maps zero to zero (no bias, act(0) = 0), so only the
    top-k contribute: the op with the weight on the input, its result added to the shared output."""
    if not is_call(add, "call_method", "scatter_add_"):
        return None
    args = list(add.args[1:]) + [add.kwargs.get(k) for k in ("dim", "index", "src")[len(add.args) - 1:]]
    if len(args) != 3 or set(add.kwargs) - {"dim", "index", "src"}:
        return None
    acc, (dim, index, src) = add.args[0], args
    av = val(acc)
    if dim != 0 or av is None or av.dim() != 2 or not isinstance(src, Node) or not isinstance(index, Node):
        return None
    while is_call(src, "call_method", "view", "reshape") and src.args[1:] == (-1, av.shape[1]):
        src = src.args[0]
    down = _bmm_projection(src)
    if down is None:
        return None
    h, w_down, layout = down
    num_experts = val(w_down).shape[0]
    rows = _token_rows(index, av.shape[0], num_experts)
    if rows is None:
        return None
    gated = read_bmm_experts(h, _bmm_projection, layout)
    if isinstance(gated, str):
        return gated
    gate, up = gated.gate, gated.up
    xs = gate[0]
    if not (is_call(xs, "call_method", "view", "reshape") and xs.args[1:] in ((num_experts, -1, av.shape[1]),)):
        return "the experts' input is not the replicated tokens viewed (E, T, H)"
    xs = xs.args[0]
    if not (is_call(xs, "call_function", operator.mul) and len(xs.args) == 2):
        return "the replicated tokens are not scaled by their scores before the experts"
    refused = None
    for gathered, scale in (xs.args, xs.args[::-1]):
        routed = expert_major_scores(scale) if isinstance(scale, Node) else None
        if isinstance(routed, str):
            refused = routed
            continue
        if routed is None or not is_call(gathered, "call_function", torch.gather):
            continue
        g_args = list(gathered.args) + [gathered.kwargs.get(k) for k in ("input", "dim", "index")[len(
            gathered.args):]]
        x, g_dim, g_index = g_args[:3]
        if g_dim != 0 or _token_rows(g_index, av.shape[0], num_experts) is not rows:
            return "the tokens are gathered in another order than they are scattered back"
        ids, values = routed.ids, routed.values
        xv, iv = val(x), val(ids)
        if xv is None or tuple(xv.shape) != tuple(av.shape) or iv.shape[0] != xv.shape[0]:
            return "the tokens, scores and output do not agree in T and H"
        if val(routed.expert_major).shape[0] != num_experts:
            return "the score matrix is not (E, T)"
        spec = MoESpec(x, ids, values, gate[1], up[1] if up else None, w_down, layout, gated.activation,
                       weight_position="input", **gated.spec_fields())
        if alias_mutations(acc) != [add] or any(comes_before(u, add) for u in acc.users if u is not add):
            return "the output buffer is changed or read around the scatter"
        return Match(spec, add, note=_fewer_flops(spec) + "; routing weight on the input", acc=acc, accumulate=True,
                     writes=(add,), derive=routed.derive())
    return refused or "the replicated tokens are not scaled by scores that are zero off the top-k"


def read_bmm_experts(h: Node, read: Callable, layout: str) -> Union[GatedRead, str]:
    """The gated activation over every expert's bmm projections under ``h`` (``read`` reads one projection as
    (input, weight, layout, ...)): gate and up on one input, in the down projection's ``layout``; or why not."""
    gated = read_gated(h, read)
    if gated is None:
        return "the hidden state is not a known activation of bmm projections over every expert"
    gate, up = gated.gate, gated.up
    if up is not None and up[0] is not gate[0]:
        return "the gate and up projections read different inputs"
    if any(p[2] != layout for p in (gate, up) if p is not None):
        return "the projections mix weight layouts"
    return gated


def _bmm_projection(node: Node) -> Optional[tuple[Node, Node, str]]:
    """(input (E, T, K), weight, layout) for ``torch.bmm(a, w)`` with w (E, K, N) ("kn"), or
    ``torch.bmm(a, w.transpose(1, 2))`` ("nk")."""
    if not (is_call(node, "call_function", torch.bmm) and len(node.args) == 2 and not node.kwargs):
        return None
    a, w = node.args
    layout = "kn"
    if is_call(w, "call_method", "transpose") and set(w.args[1:]) in ({1, 2}, {-1, -2}):
        w, layout = w.args[0], "nk"
    wv = val(w)
    if wv is None or wv.dim() != 3 or not wv.is_floating_point() or w.op not in ("placeholder", "get_attr"):
        return None
    return a, w, layout


def _add_chain(y: Node) -> Optional[list[Node]]:
    """The terms of ``((t0 + t1) + t2) + ...`` with every partial sum used once (by the next add)."""
    terms, node = [], y
    while is_call(node, "call_function", operator.add) and len(node.args) == 2 and not node.kwargs and all(
            isinstance(a, Node) for a in node.args):
        terms.append(node.args[1])
        node = node.args[0]
        if is_call(node, "call_function", operator.add) and len(node.users) != 1:
            return None
    terms.append(node)
    return terms[::-1] if len(terms) >= 2 else None


def _expert_column(ew: Node) -> Optional[tuple[Node, Node, int]]:
    """(weights, ids, e) for ``(weights * (ids == e)).sum(dim=-1, keepdim=True)``: expert e's routing weight per
    token (0 where no choice picked e)."""
    if not (is_call(ew, "call_method", "sum") and len(ew.args) == 1 and ew.kwargs == {"dim": -1, "keepdim": True}):
        return None
    prod = ew.args[0]
    if not (is_call(prod, "call_function", operator.mul) and len(prod.args) == 2):
        return None
    for w, mask in (prod.args, prod.args[::-1]):
        if is_call(mask, "call_function", operator.eq) and isinstance(mask.args[1], int) and isinstance(w, Node):
            return w, mask.args[0], mask.args[1]
    return None


def _scaled_term(term: Node) -> bool:
    """``out * (weights * (ids == e)).sum(-1, keepdim=True)`` in either order."""
    return is_call(term, "call_function", operator.mul) and len(term.args) == 2 and any(
        isinstance(a, Node) and _expert_column(a) is not None for a in term.args)


def match_dense_loop(y: Node) -> Union[Match, str, None]:
    """vLLM's torch-native iterative MoE: every expert on every token, each scaled by its column of the routing::

        for e in range(E):
            out_e = F.linear(act(F.linear(x, w1[e]) halves), w2[e]) * (weights * (ids == e)).sum(-1, keepdim=True)
            y = out_e if y is None else y + out_e

    Exact: summed over e, expert e's column weights[t, c] * [ids[t, c] == e] gives every choice its own expert,
    whenever the ids lie in range(E) (they come from topk over E columns)."""
    terms = _add_chain(y)
    if terms is None or not all(_scaled_term(t) for t in terms):
        return None
    continued = [u for u in y.users if is_call(u, "call_function", operator.add) and len(u.args) == 2
                 and u.args[0] is y and isinstance(u.args[1], Node) and _scaled_term(u.args[1])]
    if continued:  # a partial sum: the chain goes on, and is matched where it ends
        return None
    bodies = []
    for term in terms:
        if not (is_call(term, "call_function", operator.mul) and len(term.args) == 2):
            return None
        for out, ew in (term.args, term.args[::-1]):
            col = _expert_column(ew) if isinstance(ew, Node) else None
            if col is not None:
                break
        else:
            return None
        bodies.append((out, *col))
    if len({(b[1], b[2]) for b in bodies}) != 1:
        return "the experts are scaled by columns of different routing weights or ids"
    _, weights, ids, _ = bodies[0]
    if sorted(b[3] for b in bodies) != list(range(len(bodies))):
        return f"the loop runs over experts {sorted(b[3] for b in bodies)}, not each of range(E) once"
    experts = _every_expert([b[0] for b in sorted(bodies, key=lambda b: b[3])])
    if isinstance(experts, str):
        return experts
    num_experts = len(bodies)
    from .unrolled_loop import _topk_ids

    if not _topk_ids(ids):
        return "the ids are not from topk"
    top = ids.args[0]
    scores = val(top.args[0]) if top.args else None
    iv, wv, xv = val(ids), val(weights), val(experts.x)
    if scores is None or scores.shape[-1] != num_experts:
        return "the ids are chosen among another number of experts than the loop runs"
    if wv is None or xv is None or tuple(wv.shape) != tuple(iv.shape) or xv.dim() != 2 or xv.shape[0] != iv.shape[0]:
        return "the tokens, ids and weights do not have (T, H), (T, k) and (T, k) shapes"
    spec = experts.spec(ids, weights)
    return Match(spec, y, note=_fewer_flops(spec))


def _match_repeated(y: Node) -> Union[Match, str, None]:
    """The expert-major spelling (passes/dense_repeated.py: tokens repeated per expert, bmm, summed over E)."""
    from .dense_repeated import match_repeated

    return match_repeated(y)


rewrite = Form(FORM, (Anchor(every_node, match_or_reason),
                     Anchor(lambda n: is_call(n, "call_method", "scatter_add_"), match_token_replicated),
                     Anchor(every_node, match_dense_loop),
                     Anchor(lambda n: is_call(n, "call_method", "sum"), _match_repeated),
                     Anchor(made_fresh, match_table_loop)))
"""Replace every provable dense all-experts MoE in a GraphModule; returns what was rewritten."""
