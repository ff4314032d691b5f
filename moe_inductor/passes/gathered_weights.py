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

(or split in two, sliced, or taken as even and odd rows). transformers v5's ``batched_mm`` writes the same MoE on
flat rows, each (token, choice) row through ``torch.bmm`` with its own gathered weight (``match_flat_rows``)::

    rows = x.repeat_interleave(k, dim=0); flat = ids.reshape(-1)      # row t*k + j: token t's choice j
    h = act(torch.bmm(w13[flat], rows.unsqueeze(-1)).squeeze(-1))     # (or gate and up apart)
    ys = torch.bmm(w2[flat], h.unsqueeze(-1)).squeeze(-1)
    y = (ys * weights.reshape(-1).unsqueeze(-1)).view(T, k, H).sum(dim=1)

Anything that does not line up exactly (another user of an intermediate, a different contraction, mismatched ids,
rows tiled rather than repeated) is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match, Unmatched, every_node
from .fx_utils import column_of, einsum_parts, flat_of, is_call, single_use, size_is, val, weighted_sum
from .gated_reads import read_gated

FORM = "gathered_weights"


@dataclass(frozen=True)
class _Half:
    """Half ``index`` (0 or 1) of the stacked weight ``whole``, split along dimension ``dim`` of its gathered
    (T, k, ., .) copy: its first and second halves (``split`` "concat": ``torch.chunk(whole[ids], 2, dim=dim)``,
    ``torch.split`` in two equal parts, ``[..., :n, :]`` / ``[..., n:, :]``), or its even and odd entries
    ("interleaved": ``[..., ::2, :]`` / ``[..., 1::2, :]``)."""

    whole: Node
    index: int
    dim: int
    split: str = "concat"


def _half_of_gathered(node: Node) -> Optional[tuple[_Half, Node]]:
    """(half, ids) for one half of a gathered (T, k, ., .) weight copy ``w[ids]``, split along one of its last two
    dimensions, which is even: see ``_Half`` for the spellings."""
    if not (is_call(node, "call_function", operator.getitem) and len(node.args) == 2):
        return None
    base, index = node.args
    if isinstance(index, int) and index in (0, 1):  # a piece of chunk / split
        parts = _two_parts(base)
        if parts is None:
            return None
        source, dim = parts
        return _half(source, dim, index, "concat")
    sliced = _one_slice(index)
    if sliced is None or not isinstance(base, Node):
        return None
    dim, part = sliced
    bv = val(base)
    if bv is None or bv.dim() != 4:
        return None
    dim = dim % 4
    n = bv.shape[dim]
    if not isinstance(n, int) or n % 2:
        return None
    kinds = {(None, n // 2, None): (0, "concat"), (n // 2, None, None): (1, "concat"),
             (0, n // 2, None): (0, "concat"), (n // 2, n, None): (1, "concat"),
             (None, None, 2): (0, "interleaved"), (0, None, 2): (0, "interleaved"), (1, None, 2): (1, "interleaved")}
    found = kinds.get((part.start, part.stop, part.step))
    return None if found is None else _half(base, dim, *found)


def _two_parts(split: Node) -> Optional[tuple[Node, int]]:
    """(source, dim) for ``torch.chunk(source, 2, dim)`` or ``torch.split(source, n // 2, dim)`` (functions or
    methods), n the size of that dimension."""
    chunk = is_call(split, "call_function", torch.chunk) or is_call(split, "call_method", "chunk")
    if not (chunk or is_call(split, "call_function", torch.split) or is_call(split, "call_method", "split")):
        return None
    if not split.args or not isinstance(split.args[0], Node):
        return None
    args = list(split.args[1:])
    size_name = "chunks" if chunk else "split_size_or_sections"
    size = args.pop(0) if args else split.kwargs.get(size_name, split.kwargs.get("split_size"))
    dim = args.pop(0) if args else split.kwargs.get("dim", 0)
    sv = val(split.args[0])
    if args or set(split.kwargs) - {size_name, "split_size", "dim"} or sv is None or not isinstance(dim, int):
        return None
    n = sv.shape[dim % sv.dim()] if sv.dim() else None
    if not isinstance(n, int) or n % 2:
        return None
    if isinstance(size, (list, tuple)) and not chunk:  # sections: two equal ones
        size = n // 2 if list(size) == [n // 2, n // 2] else None
    if size != (2 if chunk else n // 2):
        return None
    return split.args[0], dim


def _one_slice(index) -> Optional[tuple[int, slice]]:
    """(dim, the slice) for an index of a 4-D tensor that takes every entry but along one dimension: a tuple of
    slices, with at most one leading ``...``."""
    if not isinstance(index, tuple):
        return None
    full = slice(None, None, None)
    if index and index[0] is Ellipsis:
        rest = index[1:]
        if not rest or any(x is Ellipsis or not isinstance(x, slice) for x in rest):
            return None
        picked = [i for i, x in enumerate(rest) if x != full]
        # the rest index the last len(rest) dimensions: a negative dimension
        return (picked[0] - len(rest), rest[picked[0]]) if len(picked) == 1 else None
    if len(index) > 4 or any(not isinstance(x, slice) for x in index):
        return None
    picked = [i for i, x in enumerate(index) if x != full]
    return (picked[0], index[picked[0]]) if len(picked) == 1 else None


def _half(source: Node, dim: int, index: int, split: str) -> Optional[tuple[_Half, Node]]:
    g = _gathered(source)
    if g is None or dim % 4 not in (2, 3):
        return None
    return _Half(g[0], index, dim % 4, split), g[1]


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
        gate_w, up_w, fields = halves[0], None, {**fields, "gate_up": halves[1]}
    spec = MoESpec(gate.x, gate.ids, weights, gate_w, up_w, down.weight, gate.layout, gated.activation, **fields,
                   b1=gate.bias, b1_up=up.bias if up else None, b2=down.bias)
    per_choice = sum(v[0].numel() * v.element_size() for v in map(val, (spec.gate, spec.up, spec.down)) if v is not None)
    return Match(spec, y, note=f"avoids gathering T*k x {per_choice / 2**10:.1f} KiB of expert weights per call")


def _fused_halves(gate: _Projection, up: Optional[_Projection], down: _Projection) -> Union[tuple[Node, str], str]:
    """(the stacked gate/up weight, how it splits) when the gate projection reads its first half (its even entries)
    and the up projection its second (its odd ones), both split along the projection's output width, as the
    emitter splits a fused weight ("concat", "interleaved"); else why not."""
    if isinstance(down.weight, _Half) or up is None:
        return "the projections read halves of a gathered weight other than as the gate and up projections"
    g, u = gate.weight, up.weight
    if not (isinstance(g, _Half) and isinstance(u, _Half) and g.whole is u.whole and g.dim == u.dim
            and g.split == u.split):
        return "the gate and up projections read different gathered weights, one of them split"
    if (g.index, u.index) != (0, 1):
        return "the gate projection reads the second half of the gathered gate/up weight"
    if g.dim != (2 if gate.layout == "nk" else 3):
        return "the gathered gate/up weight is split along its input width, not its output width"
    return g.whole, g.split


def _row_projection(node: Node) -> Optional[_Projection]:
    """transformers v5's batched_mm projection of flat rows, each by its own gathered expert weight:
    ``torch.bmm(w[flat_ids], rows.unsqueeze(-1)).squeeze(-1)`` ((E, out, in) weights, "nk"), or
    ``torch.bmm(rows.unsqueeze(1), w[flat_ids]).squeeze(1)`` ((E, in, out), "kn"). Its ids are the flat ids."""
    if not (is_call(node, "call_method", "squeeze") and len(node.args) == 2 and not node.kwargs):
        return None
    bmm = node.args[0]
    if not (is_call(bmm, "call_function", torch.bmm) and len(bmm.args) == 2 and not bmm.kwargs and single_use(bmm)):
        return None
    a, b = bmm.args
    if node.args[1] in (-1, 2) and is_call(b, "call_method", "unsqueeze") and b.args[1:] in ((-1,), (2,)):
        gathered, rows, layout = a, b.args[0], "nk"
    elif node.args[1] == 1 and is_call(a, "call_method", "unsqueeze") and a.args[1:] == (1,):
        gathered, rows, layout = b, a.args[0], "kn"
    else:
        return None
    if not (is_call(gathered, "call_function", operator.getitem) and len(gathered.args) == 2 and single_use(gathered)):
        return None
    w, ids = gathered.args
    wv, iv, rv = val(w), val(ids), val(rows)
    if wv is None or iv is None or rv is None or wv.dim() != 3 or not wv.is_floating_point() or iv.dim() != 1:
        return None
    if iv.dtype.is_floating_point or iv.dtype == torch.bool or rv.dim() != 2:
        return None
    return _Projection(w, ids, rows, layout)


def match_flat_rows(y: Node) -> Union[Match, str, None]:
    """transformers v5's batched_mm experts: every (token, choice) a row of ``x.repeat_interleave(k, 0)``, projected
    by its expert's gathered weights (``_row_projection``), the down projection's rows scaled by the flat routing
    weights and summed over k: ``(ys * weights.reshape(-1).unsqueeze(-1)).view(T, k, H).sum(dim=1)`` (or the weights
    applied after the view, ``weighted_sum``). Row t*k + j is token t's choice j in every flattening, as in the
    (T, k) ids and weights."""
    combined = weighted_sum(y)
    if combined is not None:  # (ys.view(T, k, H) * weights[..., None]).sum(1)
        grouped, weights = combined
        scaled = None
    else:
        if not (is_call(y, "call_method", "sum") and (y.args[1:] == (1,) and not y.kwargs or (
                len(y.args) == 1 and y.kwargs == {"dim": 1}))):
            return None
        grouped, weights, scaled = y.args[0], None, None
    if not (is_call(grouped, "call_method", "view", "reshape") and len(grouped.args) == 4 and single_use(grouped)):
        return None
    flat_out = grouped.args[0]
    if weights is None:  # the weights on the flat rows, before the view
        if not (is_call(flat_out, "call_function", operator.mul) and len(flat_out.args) == 2 and single_use(flat_out)):
            return None
        for ys, col in (flat_out.args, flat_out.args[::-1]):
            flat_w = column_of(col, 1) if isinstance(col, Node) else None
            if flat_w is not None and isinstance(ys, Node) and flat_of(flat_w) is not None:
                weights, scaled = flat_of(flat_w), ys
                break
        if scaled is None:
            return None
    else:
        scaled = flat_out
    down = _row_projection(scaled)
    if down is None:
        return None
    gated = read_gated(down.x, _row_projection)
    if gated is None:
        return "the hidden state is not a known activation of up projection(s) on rows by their gathered weights"
    gate, up = gated.gate, gated.up
    projections = [p for p in (gate, up, down) if p is not None]
    ids = flat_of(gate.ids)
    if ids is None or any(flat_of(p.ids) is not ids for p in projections):
        return "the projections gather their weights with different ids"
    if any(p.layout != gate.layout for p in projections) or (up is not None and up.x is not gate.x):
        return "the projections mix weight layouts or read different rows"
    chain = [scaled, down.x, gated.act, gated.gate_in] + ([gated.up_in] if gated.up_in is not None else [])
    if not single_use(*{id(n): n for n in chain}.values()):
        return "an intermediate of the experts (hidden state, activation, projection) is used elsewhere too"
    rows = gate.x
    repeated = _repeated_rows(rows)
    if repeated is None:
        return "the rows are not the tokens repeated k times (x.repeat_interleave(k, dim=0))"
    x, repeats = repeated
    iv, wv, xv = val(ids), val(weights), val(x)
    if iv is None or wv is None or xv is None or iv.dim() != 2 or xv.dim() != 2 or tuple(wv.shape) != tuple(iv.shape):
        return "the tokens, ids and routing weights do not have (T, H), (T, k) and (T, k) shapes"
    k, width = iv.shape[1], val(scaled).shape[1]
    size = grouped.args[1]
    if repeats != k or tuple(grouped.args[2:]) != (k, width) or not (
            size_is(size, xv.shape[0])):
        return "the rows, their flattening and the sum over k do not group each token's k choices"
    fields = gated.spec_fields()
    spec = MoESpec(x, ids, weights, gate.weight, up.weight if up else None, down.weight, gate.layout,
                   gated.activation, **fields)
    return Match(spec, y, note="avoids gathering T*k expert weight copies per call (batched_mm)")


def _repeated_rows(rows) -> Optional[tuple[Node, int]]:
    """(x, k) for ``x.repeat_interleave(k, dim=0)`` (or ``torch.repeat_interleave(x, k, 0)``) at an int k: each row of
    x k times in a row. (Without a dim it flattens x: not these rows.)"""
    if not (is_call(rows, "call_method", "repeat_interleave") or is_call(rows, "call_function", torch.repeat_interleave)):
        return None
    if not isinstance(rows.args[0], Node) or set(rows.kwargs) - {"dim", "repeats"}:
        return None
    repeats = rows.kwargs.get("repeats", rows.args[1] if len(rows.args) > 1 else None)
    dim = rows.kwargs.get("dim", rows.args[2] if len(rows.args) > 2 else None)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or dim not in (0, -2):
        return None
    return rows.args[0], repeats


rewrite = Form(FORM, (Anchor(every_node, match_or_reason), Anchor(every_node, match_flat_rows)), Unmatched(
    lambda n: (_gathered(n) or (None, None))[1],
    "expert weights gathered by routing ids (w[ids]), but the einsums around them are not the gated/plain up, down "
    "and weighted sum over k this form proves, each used once"))
"""Replace every provable gathered-weights MoE in a GraphModule; returns what was rewritten."""
