"""Form "gathered_weights": expert weights gathered per token, then einsum (gpt-fast's ConditionalFeedForward).

The user code this matches (subscript letters, spacing and operand order may differ):

    w1_sel, w3_sel, w2_sel = w1[ids], w3[ids], w2[ids]              # (T, k, I, H): T*k copies of expert weights
    h = F.silu(torch.einsum("ti,taoi->tao", x, w1_sel)) * torch.einsum("ti,taoi->tao", x, w3_sel)
    out = torch.einsum("tao,taio->tai", h, w2_sel)
    y = torch.einsum("tai,ta->ti", out, weights)                     # or (out * weights[..., None]).sum(1)

It becomes one ``moe_inductor::experts_forward`` on the un-gathered weights. The gate factor may be absent (a plain
activation) and the weights may be stored (E, out, in) or (E, in, out). The gate and up weights may be the two halves
of one stacked gate/up weight, split after the gather (SGLang's torch-native path)::

    w1_sel, w3_sel = torch.chunk(w13[ids], 2, dim=2)                 # (T, k, 2I, H) -> two (T, k, I, H)
 Anything that does not line up exactly
(another user of an intermediate, a different contraction, mismatched ids) is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match, Unmatched, every_node
from .fx_utils import einsum_parts, is_call, read_gated, single_use, val, weighted_sum

FORM = "gathered_weights"


@dataclass(frozen=True)
class _Half:
    """Half ``index`` (0 or 1) of the stacked weight ``whole``, split along dimension ``dim`` of its gathered
    (T, k, ., .) copy: ``torch.chunk(whole[ids], 2, dim=dim)[index]``."""

    whole: Node
    index: int
    dim: int


def _half_of_gathered(node: Node) -> Optional[tuple[_Half, Node]]:
    """(half, ids) for ``torch.chunk(w[ids], 2, dim=d)[j]`` (or ``w[ids].chunk(2, d)[j]``), d one of the gathered
    copy's last two dimensions, which are even."""
    if not (is_call(node, "call_function", operator.getitem) and len(node.args) == 2 and node.args[1] in (0, 1)):
        return None
    split = node.args[0]
    if not (is_call(split, "call_function", torch.chunk) or is_call(split, "call_method", "chunk")):
        return None
    args = list(split.args[1:])
    chunks = args.pop(0) if args else split.kwargs.get("chunks")
    dim = args.pop(0) if args else split.kwargs.get("dim", 0)
    if chunks != 2 or args or set(split.kwargs) - {"chunks", "dim"} or not isinstance(split.args[0], Node):
        return None
    g = _gathered(split.args[0])
    gv = val(split.args[0])
    if g is None or gv is None or not isinstance(dim, int):
        return None
    dim = dim % 4
    if dim not in (2, 3) or gv.shape[dim] % 2:
        return None
    return _Half(g[0], node.args[1], dim), g[1]


def _gathered(node: Node, rank: int = 3) -> Optional[tuple[Node, Node]]:
    """(weight, ids) if ``node`` is ``weight[ids]`` (or ``weight[ids, ...]``) with a float weight of ``rank`` dims
    (3 for weights, 2 for biases) and (T, k) integer ids."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    w, ids = node.args
    if isinstance(ids, tuple) and len(ids) == 2 and ids[1] is Ellipsis:
        ids = ids[0]
    wv, iv = val(w), val(ids)
    if wv is None or iv is None or wv.dim() != rank or not wv.is_floating_point() or iv.dtype.is_floating_point:
        return None
    if iv.dtype == torch.bool or iv.dim() != 2:
        return None
    return w, ids


@dataclass
class _Projection:
    weight: Node
    ids: Node
    x: Node
    layout: str  # "nk": (E, out, in); "kn": (E, in, out)
    bias: Optional[Node] = None  # the (E, out) bias gathered by the same ids and added (GPT-OSS)
    product: Optional[Node] = None  # the einsum, when a bias is added to it


def _projection(node: Node, x_subs_len: int = 2) -> Optional[_Projection]:
    """``einsum("ti,taoi->tao", x, w[ids])`` (either layout, either operand order), optionally ``+ b[ids]`` (or
    ``+=``), the bias gathered by the same ids -> its parts."""
    if is_call(node, "call_function", operator.add, operator.iadd) and len(node.args) == 2 and not node.kwargs:
        for product, bias in (node.args, node.args[::-1]):
            p = _projection(product, x_subs_len) if isinstance(product, Node) else None
            b = _gathered(bias, rank=2) if isinstance(bias, Node) else None
            if p is None or b is None or p.bias is not None or b[1] is not p.ids or not single_use(product, bias):
                continue
            if isinstance(p.weight, _Half):  # (a bias on half a weight: not a spelling seen in the wild)
                continue
            bv, wv = val(b[0]), val(p.weight)
            if bv.shape[0] != wv.shape[0] or bv.shape[1] != wv.shape[1 if p.layout == "nk" else 2]:
                continue
            return _Projection(p.weight, p.ids, p.x, p.layout, b[0], product)
        return None
    parsed = einsum_parts(node)
    if parsed is None:
        return None
    subs, out, ops = parsed
    if len(ops) != 2:
        return None
    for xi, wi in ((0, 1), (1, 0)):
        g = _gathered(ops[wi]) or _half_of_gathered(ops[wi])
        if g is None or len(subs[xi]) != x_subs_len or len(subs[wi]) != 4:
            continue
        t, a, p, q = subs[wi]
        xs = subs[xi]
        if len(set(subs[wi])) != 4 or xs[0] != t:
            continue
        contracted = xs[-1]
        if x_subs_len == 2 and contracted in (p, q) and out == t + a + (q if contracted == p else p):
            return _Projection(g[0], g[1], ops[xi], "kn" if contracted == p else "nk")
        if x_subs_len == 3 and xs[1] == a and contracted in (p, q) and out == t + a + (q if contracted == p else p):
            return _Projection(g[0], g[1], ops[xi], "kn" if contracted == p else "nk")
    return None


def match_or_reason(y: Node) -> Union[Match, str, None]:
    """The MoE ending at ``y``; or why not (a string) when ``y`` is a weighted sum over k of a down projection on
    gathered weights, the form's mark; None when it is no such sum."""
    combined = weighted_sum(y)
    if combined is None:
        return None
    out, weights = combined
    down = _projection(out, x_subs_len=3)
    if down is None:
        return None
    if not single_use(out):
        return "the per-choice expert outputs are used elsewhere too"
    if down.product is not None and not single_use(down.product):
        return "the down projection's product is used elsewhere too"
    h = down.x
    gated = read_gated(h, _projection)
    if gated is None:
        return "the hidden state is not a known activation of up projection(s) on weights gathered by the same ids"
    gate, up = gated.gate, gated.up
    projections = [p for p in (gate, up, down) if p is not None]
    if any(p.ids is not gate.ids for p in projections):
        return "the projections gather their weights with different ids"
    if any(p.layout != gate.layout for p in projections):
        return "the projections mix weight layouts"
    if up is not None and up.x is not gate.x:
        return "the gate and up projections read different inputs"
    chain = [out, h, gated.act, gated.gate_in] + ([gated.up_in] if gated.up_in is not None else [])
    if not single_use(*{id(n): n for n in chain}.values()):
        return "an intermediate of the experts (hidden state, activation, projection) is used elsewhere too"
    ids_val, w_val, x_val = val(gate.ids), val(weights), val(gate.x)
    if ids_val is None or w_val is None or x_val is None or x_val.dim() != 2 or tuple(w_val.shape) != tuple(ids_val.shape):
        return "the tokens, ids and routing weights do not have (T, H), (T, k) and (T, k) shapes"
    if (up is not None and (gate.bias is None) != (up.bias is None)):
        return "one of the gate and up projections has a bias and the other has none"
    gate_w, up_w, fields = gate.weight, up.weight if up else None, gated.spec_fields()
    if any(isinstance(p.weight, _Half) for p in projections):
        halves = _fused_halves(gate, up, down)
        if isinstance(halves, str):
            return halves
        gate_w, up_w, fields = halves, None, {**fields, "gate_up": "concat"}
    spec = MoESpec(gate.x, gate.ids, weights, gate_w, up_w, down.weight, gate.layout, gated.activation, **fields,
                   b1=gate.bias, b1_up=up.bias if up else None, b2=down.bias)
    per_choice = sum(v[0].numel() * v.element_size() for v in map(val, (spec.gate, spec.up, spec.down)) if v is not None)
    return Match(spec, y, note=f"avoids gathering T*k x {per_choice / 2**10:.1f} KiB of expert weights per call")


def _fused_halves(gate: _Projection, up: Optional[_Projection], down: _Projection) -> Union[Node, str]:
    """The stacked gate/up weight when the gate projection reads its first half and the up projection its second,
    both split along the projection's output width (the emitter's "concat" split); else why not."""
    if isinstance(down.weight, _Half) or up is None:
        return "the projections read halves of a gathered weight other than as the gate and up projections"
    g, u = gate.weight, up.weight
    if not (isinstance(g, _Half) and isinstance(u, _Half) and g.whole is u.whole and g.dim == u.dim):
        return "the gate and up projections read different gathered weights, one of them split"
    if (g.index, u.index) != (0, 1):
        return "the gate projection reads the second half of the gathered gate/up weight"
    if g.dim != (2 if gate.layout == "nk" else 3):
        return "the gathered gate/up weight is split along its input width, not its output width"
    return g.whole


rewrite = Form(FORM, (Anchor(every_node, match_or_reason),), Unmatched(
    lambda n: (_gathered(n) or (None, None))[1],
    "expert weights gathered by routing ids (w[ids]), but the einsums around them are not the gated/plain up, down "
    "and weighted sum over k this form proves, each used once"))
"""Replace every provable gathered-weights MoE in a GraphModule; returns what was rewritten."""
