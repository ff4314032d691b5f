"""Form "split_loop": the assignments sorted by expert, the sorted rows split by the per-expert counts
(``counts.tolist()``), one expert per split in a Python loop, ``torch.cat`` back, then scattered to the tokens
(Megatron-Core's SequentialMLP behind its token dispatcher, JetMoE's ParallelExperts). Under moe_inductor's capture
the ``.tolist()`` sizes trace as unbacked symbols and the loop unrolls into E bodies.

The user code this matches (two dispatch spellings, two loop shapes, two combines):

    # Megatron: a (T, E) routing map from topk ids, tokens gathered expert-major
    probs = zeros_like(logits).scatter(1, ids, weights); rmap = zeros_like(logits).int().scatter(1, ids, 1).bool()
    tok = arange(T).unsqueeze(0).expand(E, -1).masked_select(rmap.T.contiguous())
    xs, counts = x.index_select(0, tok), rmap.sum(dim=0)
    ws = probs.T.contiguous().masked_select(rmap.T.contiguous())
    # JetMoE: a sort of the flat ids
    order = ids.flatten().sort(0)[1]; tok = order.div(k, rounding_mode="trunc"); ws = weights.flatten()[order]
    xs, counts = x[tok], zeros(T, E).scatter(1, ids, 1).long().sum(0)
    # LLaMA-MoE (UniversalCalculator): the tokens of the sorted rows by an arange repeated k times
    tok = arange(T).repeat_interleave(k).index_select(0, order); ws = weights.flatten().index_select(0, order)
    xs, counts = x.index_select(0, tok).squeeze(1), ids.flatten().bincount(minlength=E)

    pieces = torch.split(xs, counts.tolist())
    ys = torch.cat([mlp_e(p) for mlp_e, p in zip(experts, pieces)])      # Megatron: each expert's whole MLP
    # LLaMA-MoE: [experts(pieces[i], i) for i in range(E) if pieces[i].shape[0] > 0], the skip speculated away
    # (speculation.py); the weights as torch.mul(ys, ws.reshape(-1, 1) * 1.0), its literal factor read through
    # or, per projection (JetMoE): h = cat([F.linear(p, w1[e]) ...]); g, u = h.chunk(2, -1); split again; cat
    out = zeros(T, H); out.scatter_add_(0, tok.unsqueeze(1).expand(-1, H), ys * ws.unsqueeze(-1))
    # or out = zeros(T, H).index_add(0, tok, ys * ws[:, None])
    # torchtune: the weights on the rows before the experts, rows by gather, the combine by keyword
    xs = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, H)) * ws.reshape(-1, 1)      # ... split loop ...
    out.scatter_add_(dim=0, index=tok.reshape(-1, 1).expand(-1, H), src=ys)

Every piece is checked: the ids come from ``topk`` (distinct per row, so the routing map holds exactly T*k
assignments), the sort or the mask, the counts, the weights and the combine all read the same ids, the splits are
the experts' in order 0..E-1, and every body is the same MLP but for e. Anything else is left alone.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Anchor, Form, Match
from .aliases import alias_mutations, base_of, is_view_of, view_family
from .fx_utils import arange_length, comes_before, flat_of, is_call, known_equal, val
from . import bounded_gemm, scattered_slices
from .bounded_gemm import _identity_of
from .counts import bincount_of
from .gated_reads import read_gated
from .slice_runs import SliceRun, slice_bounds, slice_run
from .sorted_grouped_mm import _sort_order
from .expert_projections import _linear, biased_linear
from .unrolled_loop import _topk_ids

FORM = "split_loop"


def _strip(node, *methods):
    while is_call(node, "call_method", *methods) and len(node.args) == 1 and not node.kwargs:
        node = node.args[0]
    return node


def _strip_transpose(node) -> Optional[Node]:
    """``m`` for ``m.T``, ``m.t()`` or ``m.transpose(0, 1)`` (2D), possibly followed by ``.contiguous()``."""
    node = _strip(node, "contiguous")
    if is_call(node, "call_function", getattr) and node.args[1] == "T":
        return node.args[0]
    if is_call(node, "call_method", "t") and len(node.args) == 1:
        return node.args[0]
    if is_call(node, "call_method", "transpose") and set(node.args[1:]) in ({0, 1}, {-1, -2}):
        return node.args[0]
    return None


def _scattered(node, ids: Node) -> Optional[object]:
    """The value scattered by ``zeros(T, E).scatter(1, ids, value)`` (a number or a (T, k) node), else None."""
    if not (is_call(node, "call_method", "scatter") and len(node.args) == 4 and node.args[1] == 1 and not node.kwargs):
        return None
    if node.args[2] is not ids:
        return None
    base = _strip(node.args[0], "int", "long", "float", "bool")
    if not (is_call(base, "call_function", torch.zeros_like, torch.zeros) and "fill_value" not in base.kwargs):
        return None
    bv, iv = val(base), val(ids)
    if bv is None or iv is None or bv.dim() != 2 or bv.shape[0] != iv.shape[0]:
        return None
    return node.args[3]


def _routing_map(node, ids: Node) -> bool:
    """``node`` is ``zeros(T, E)[.int()].scatter(1, ids, 1)[.bool()]``: True exactly at the assignments."""
    scattered = _scattered(_strip(node, "bool", "long", "int", "float"), ids)
    return isinstance(scattered, (int, float, bool)) and not isinstance(scattered, Node) and scattered == 1


@dataclass(frozen=True)
class _Dispatch:
    """The sorted assignment order: token of each sorted row, and how the rest of the region refers to the order."""

    ids: Node
    tok: Node
    order: Optional[Node] = None  # a sort of the flat ids
    rmap: Optional[Node] = None  # the (T, E) routing map whose (E, T) transpose is masked_select-ed


def _repeated_arange(node) -> Optional[tuple]:
    """(T, k) for ``arange(T).repeat_interleave(k)`` (or ``torch.repeat_interleave(arange(T), k)``, dim 0 or none:
    the arange is 1-D) at an int k: entry t*k + j is t, the token of flat choice t*k + j."""
    if not (is_call(node, "call_method", "repeat_interleave")
            or is_call(node, "call_function", torch.repeat_interleave)):
        return None
    if not isinstance(node.args[0], Node) or set(node.kwargs) - {"dim", "repeats"}:
        return None
    repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    T = arange_length(node.args[0])
    if T is None or type(repeats) is not int or repeats < 1 or dim not in (None, 0, -1):
        return None
    return T, repeats


def _sorted_pick(node) -> Optional[tuple[Node, Node]]:
    """(t, order) for ``t.index_select(0, order)`` or ``t[order]`` (a 1-D t)."""
    if is_call(node, "call_method", "index_select") and len(node.args) == 3 and node.args[1] == 0 and (
            not node.kwargs) and isinstance(node.args[0], Node) and isinstance(node.args[2], Node):
        return node.args[0], node.args[2]
    if is_call(node, "call_function", operator.getitem) and isinstance(node.args[0], Node) and isinstance(
            node.args[1], Node):
        return node.args[0], node.args[1]
    return None


def _dispatch(tok: Node) -> Optional[_Dispatch]:
    # LLaMA-MoE: tok = arange(T).repeat_interleave(k).index_select(0, order)
    picked = _sorted_pick(tok)
    repeated = _repeated_arange(picked[0]) if picked is not None else None
    if repeated is not None:
        order = picked[1]
        ids = _sort_order(order)
        iv = val(ids) if ids is not None else None
        if iv is None or iv.dim() != 2 or iv.dtype.is_floating_point or iv.shape[1] != repeated[1] or not (
                known_equal(iv.shape[0], repeated[0])):
            return None
        return _Dispatch(ids, tok, order=order)
    # JetMoE / torchtitan: tok = order // k or order.div(k, rounding_mode="trunc" | "floor")
    order, k = None, None
    if is_call(tok, "call_function", operator.floordiv) and isinstance(tok.args[1], int):
        order, k = tok.args[0], tok.args[1]
    elif is_call(tok, "call_method", "div") and len(tok.args) == 2 and isinstance(tok.args[1], int) and (
            tok.kwargs == {"rounding_mode": "trunc"} or tok.kwargs == {"rounding_mode": "floor"}):
        order, k = tok.args[0], tok.args[1]
    if order is not None:
        ids = _sort_order(order)
        iv = val(ids) if ids is not None else None
        if iv is None or iv.dim() != 2 or iv.shape[1] != k or iv.dtype.is_floating_point:
            return None
        return _Dispatch(ids, tok, order=order)
    # Megatron: tok = arange(T).unsqueeze(0).expand(E, -1).masked_select(rmap.T.contiguous())
    if not (is_call(tok, "call_method", "masked_select") and len(tok.args) == 2 and not tok.kwargs):
        return None
    rows, mask = tok.args
    rmap = _strip_transpose(mask)
    if rmap is None or not (is_call(rows, "call_method", "expand") and len(rows.args) == 3 and rows.args[2] == -1):
        return None
    ar = rows.args[0]
    if not (is_call(ar, "call_method", "unsqueeze") and ar.args[1:] == (0,)):
        return None
    ar = ar.args[0]
    if not (is_call(ar, "call_function", torch.arange) and len(ar.args) == 1 and set(ar.kwargs) <= {"device"}):
        return None
    scatter = _strip(rmap, "bool")
    ids = scatter.args[2] if is_call(scatter, "call_method", "scatter") and len(scatter.args) == 4 else None
    if not isinstance(ids, Node) or not _topk_ids(ids) or not _routing_map(rmap, ids):
        return None
    T, E, av = val(ids).shape[0], val(scatter).shape[1], val(ar)
    if av is None or av.dim() != 1 or av.shape[0] != T or rows.args[1] != E:
        return None
    return _Dispatch(ids, tok, rmap=_strip(rmap, "bool"))


def _counts(node, d: _Dispatch, num_experts: int) -> bool:
    """``node`` (casts aside) holds each expert's number of assignments: the routing map summed over tokens, a histc
    of the flat ids, or their ``bincount(minlength=E)``."""
    node = _strip(node, "long", "int", "float", "cpu")
    while is_call(node, "call_method", "to") and len(node.args) == 2 and not node.kwargs and isinstance(
            node.args[1], torch.dtype) and not node.args[1].is_floating_point:  # an integer cast of float counts
        node = _strip(node.args[0], "long", "int", "float", "cpu")
    if is_call(node, "call_method", "sum") and (node.args[1:] == (0,) and not node.kwargs or (
            len(node.args) == 1 and node.kwargs == {"dim": 0})):
        src = node.args[0]
        return _topk_ids(d.ids) and _routing_map(src, d.ids) and val(_strip(src, "bool", "long", "int", "float")).shape[
            1] == num_experts
    if is_call(node, "call_function", torch.histc):
        bins = node.kwargs.get("bins", node.args[1] if len(node.args) > 1 else None)
        lo = node.kwargs.get("min", node.args[2] if len(node.args) > 2 else None)
        hi = node.kwargs.get("max", node.args[3] if len(node.args) > 3 else None)
        return (bins == num_experts and lo == 0 and hi in (num_experts, num_experts - 1)
                and flat_of(_strip(node.args[0], "float", "int", "long")) is d.ids)
    counted = bincount_of(node, num_experts)
    return counted is not None and flat_of(counted) is d.ids


def _pieces(part: Node) -> Optional[tuple[Union[Node, SliceRun], int]]:
    """(split node, j) for ``torch.split(a, sizes)[j]`` / ``a.split(sizes, dim=0)[j]``; (its run, j) for the j-th of
    a run of contiguous slices (``SliceRun``)."""
    if slice_bounds(part) is not None:
        run = slice_run(part.args[0]) if isinstance(part.args[0], Node) else None
        return None if run is None else (run, run.slices.index(part))
    if not (is_call(part, "call_function", operator.getitem) and isinstance(part.args[1], int)):
        return None
    split = part.args[0]
    if is_call(split, "call_function", torch.split, torch.functional.split):
        dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    elif is_call(split, "call_method", "split"):
        dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    else:
        return None
    sizes = split.kwargs.get("split_size_or_sections", split.args[1] if len(split.args) > 1 else None)
    if dim != 0 or not isinstance(sizes, (list, tuple)) or set(split.kwargs) - {"dim", "split_size_or_sections"}:
        return None
    return split, part.args[1]


def _split_of(split: Union[Node, SliceRun]) -> tuple[Node, list]:
    """(the tensor split, its sizes)."""
    if isinstance(split, SliceRun):
        return split.rows, list(split.sizes)
    sizes = split.kwargs.get("split_size_or_sections", split.args[1] if len(split.args) > 1 else None)
    return split.args[0], list(sizes)


def split_nodes(split: Union[Node, SliceRun]) -> tuple:
    """The graph nodes that make the pieces (a split node, or a run's slices), whose size checks go with them."""
    return split.slices if isinstance(split, SliceRun) else (split,)


def _cat_parts(cat: Node) -> Optional[list[Node]]:
    if not (is_call(cat, "call_function", torch.cat) and cat.args and isinstance(cat.args[0], (list, tuple))):
        return None
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if dim != 0 or set(cat.kwargs) - {"dim"}:
        return None
    return list(cat.args[0])


@dataclass(frozen=True)
class _Grouped:
    """A projection (or a whole MLP) run per expert over the splits of one tensor."""

    x: Node  # the tensor that was split
    split: Node
    weights: tuple  # per expert: (gate, up, down) weights for an MLP, (w,) for a projection; stacked w for all
    layout: str
    stacked: bool


def _expert_weights(ws: list, stacked: bool) -> Optional[Union[Node, tuple]]:
    """One stacked weight (every expert's w[e] of the same node) or E distinct per-expert weights of one shape."""
    if stacked:
        return ws[0] if all(w is ws[0] for w in ws) else None
    if len({id(w) for w in ws}) != len(ws) or len({tuple(val(w).shape) for w in ws}) != 1:
        return None
    return tuple(ws)


def _grouped_projection(cat: Node) -> Optional[tuple[Node, Node, Union[Node, tuple], str]]:
    """(split input, split node, weights, layout) for ``cat([linear(pieces[e], w_e) for e])``."""
    parts = _cat_parts(cat)
    if not parts:
        return None
    got = []
    for e, part in enumerate(parts):
        lin = _linear(part, e)
        piece = _pieces(lin[0]) if lin is not None else None
        if piece is None or piece[1] != e or len(lin[0].users) != 1:
            return None
        got.append((piece[0], lin[1], lin[2], lin[3]))
    split, layout, stacked = got[0][0], got[0][2], got[0][3]
    if any((g[0], g[2], g[3]) != (split, layout, stacked) for g in got) or len(_split_of(split)[1]) != len(parts):
        return None
    weights = _expert_weights([g[1] for g in got], stacked)
    return None if weights is None else (_split_of(split)[0], split, weights, layout)


@dataclass(frozen=True)
class _Experts:
    """What the split loop computes on the sorted rows ``xs``: the E experts' MLP, as one spec's weight fields."""

    xs: Node
    splits: tuple  # the split nodes (one per projection, or one for whole-MLP bodies)
    gate: Union[Node, tuple]
    up: Optional[Union[Node, tuple]]
    down: Union[Node, tuple]
    layout: str
    activation: str
    fields: dict
    #: (gate, up, down) biases: one stacked (E, out) bias or E per-expert ones, or None
    biases: tuple = (None, None, None)


def read_experts(ys: Node) -> Union[_Experts, str, None]:
    """The experts behind the concatenated expert outputs ``ys``."""
    parts = _cat_parts(ys)
    if not parts:
        return None
    # JetMoE: the down projection itself is split + per-expert linear + cat over a glu of an earlier one
    down = _grouped_projection(ys)
    if down is not None:
        h, down_split, w_down, layout = down
        gated = read_gated(h, _grouped_projection)
        if gated is None:
            return "the hidden state is not a known activation of per-expert projections over the same splits"
        gate, up = gated.gate, gated.up
        xs = gate[0]
        if up is not None and (up[0] is not xs or up[3] != layout):
            return "the gate and up projections read different rows or layouts"
        if gate[3] != layout:
            return "the projections mix weight layouts"
        splits = (gate[1], down_split) + ((up[1],) if up is not None else ())
        if any(_split_of(s)[1] != _split_of(gate[1])[1] for s in splits):
            return "the projections split their rows by different sizes"
        if isinstance(w_down, tuple) != isinstance(gate[2], tuple):
            return "the projections mix stacked and per-expert weights"
        return _Experts(xs, splits, gate[2], up[2] if up else None, w_down, layout, gated.activation,
                        gated.spec_fields())
    # Megatron / torchtitan's for-loop: each part is one expert's whole MLP on its own piece (LLaMA-MoE's with a
    # bias per projection: F.linear(p, w_e, b_e) of its own (out,) bias, or row e of a stacked one)
    bodies = []
    for e, part in enumerate(parts):
        down = biased_linear(part, e)
        if down is None:
            return f"expert {e}'s output is not a projection on its own weights (plus its own bias)"
        h, w_down, layout, stacked, b_down = down
        gated = read_gated(h, lambda n, e=e: biased_linear(n, e))
        if gated is None:
            return f"expert {e}'s hidden state is not a known activation of its own projections"
        gate, up = gated.gate, gated.up
        piece = _pieces(gate[0])
        if piece is None or piece[1] != e or (up is not None and up[0] is not gate[0]):
            return f"expert {e} does not read its own split of the sorted rows"
        if any(p[2] != layout or p[3] != stacked for p in (gate, up) if p is not None):
            return "the projections mix weight layouts or stacked and per-expert weights"
        if up is not None and (gate[4] is None) != (up[4] is None):
            return f"expert {e}'s gate projection has a bias and its up projection none, or the other way round"
        biases = (gate[4], up[4] if up else None, b_down)
        bodies.append((piece[0], gate[1], up[1] if up else None, w_down, layout, stacked, gated.activation,
                       tuple(sorted(gated.spec_fields().items())), tuple(b is None for b in biases), biases))
    first = bodies[0]
    if any(b[0] != first[0] or b[4:9] != first[4:9] or (b[2] is None) != (first[2] is None) for b in bodies):
        return "the experts differ in more than their weights"
    if len(_split_of(first[0])[1]) != len(parts):
        return "the rows are split into another number of pieces than there are experts"
    stacked = first[5]
    gate = _expert_weights([b[1] for b in bodies], stacked)
    up = _expert_weights([b[2] for b in bodies], stacked) if first[2] is not None else None
    down = _expert_weights([b[3] for b in bodies], stacked)
    if gate is None or down is None or (first[2] is not None and up is None):
        return "the per-expert weights are not one weight per expert (or one stacked weight) of one shape"
    if not stacked and len({id(w) for ws in (gate, up or (), down) for w in ws}) != len(gate) * (3 if up else 2):
        return "a weight is shared between experts or projections"
    biases = []
    for j in range(3):
        if first[8][j]:
            biases.append(None)
            continue
        got = _expert_weights([b[9][j] for b in bodies], stacked)
        if got is None:
            return "the per-expert biases are not one bias per expert (or one stacked bias) of one shape"
        biases.append(got)
    if not stacked and len({id(b) for bs in biases if bs for b in bs}) != sum(len(bs) for bs in biases if bs):
        return "a bias is shared between experts or projections"
    return _Experts(_split_of(first[0])[0], (first[0],), gate, up, down, first[4], first[6], dict(first[7]),
                    tuple(biases))


def _sizes_are_counts(sizes: list, d: _Dispatch, num_experts: int) -> bool:
    """``sizes[e] = counts[e].item()`` (a ``.tolist()`` as Dynamo traces it) for per-expert counts of the ids."""
    source = listed_counts(sizes, num_experts)
    return source is not None and _counts(source, d, num_experts)


def listed_counts(sizes: list, num_experts: int) -> Optional[Node]:
    """``counts`` for sizes that are ``counts.tolist()`` as Dynamo traces it (``counts[e].item()`` for each e in
    order, or a NumPy copy's ``int(arr[e])``: ``counts.count_item``), E of them; else None."""
    from .counts import count_item

    if len(sizes) != num_experts:
        return None
    source = None
    for e, s in enumerate(sizes):
        read = count_item(s)
        if read is None or read[1] != e or (source is not None and read[0] is not source):
            return None
        source = read[0]
    return source


def _weights_of(scale: Node, d: _Dispatch) -> Optional[Node]:
    """The (T, k) routing weights that ``scale`` (one per sorted row) reads in the dispatch's order."""
    if d.order is not None:
        picked = _sorted_pick(scale)  # ``flat[order]`` or ``flat.index_select(0, order)``
        if picked is not None and picked[1] is d.order:
            return flat_of(picked[0])
        return None
    if not (is_call(scale, "call_method", "masked_select") and len(scale.args) == 2):
        return None
    probs, mask = _strip_transpose(scale.args[0]), _strip_transpose(scale.args[1])
    if probs is None or mask is None or _strip(mask, "bool") is not d.rmap:
        return None
    weights = _scattered(probs, d.ids)
    return weights if isinstance(weights, Node) else None


def _row_scaled(node: Node) -> Optional[tuple[Node, Node]]:
    """(ys, s) for ``ys * s.unsqueeze(-1)`` / ``ys * s[:, None]`` / ``ys * s.reshape(-1, 1)`` / ``s.unsqueeze(1) *
    ys`` (or ``torch.mul``), the column possibly times a literal 1.0 (LLaMA-MoE's ``score_scale_factor``)."""
    if not (is_call(node, "call_function", operator.mul, torch.mul) and len(node.args) == 2 and not node.kwargs):
        return None
    for ys, s in (node.args, node.args[::-1]):
        if not isinstance(ys, Node) or not isinstance(s, Node):
            continue
        s = _identity_of(s)
        if is_call(s, "call_method", "unsqueeze") and s.args[1:] in ((-1,), (1,)):
            return ys, s.args[0]
        if is_call(s, "call_function", operator.getitem) and s.args[1] == (slice(None, None, None), None):
            return ys, s.args[0]
        if is_call(s, "call_method", "reshape", "view") and s.args[1:] in ((-1, 1), ((-1, 1),)):
            return ys, s.args[0]
    return None


def _token_rows(xs: Node, tok: Node) -> Optional[Node]:
    """``x`` for the rows of x at ``tok``: ``x.index_select(0, tok)``, ``x[tok]``, or
    ``torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, H))`` (torchtune)."""
    squeezed = xs.args[0] if is_call(xs, "call_method", "squeeze") and len(xs.args) == 2 and not xs.kwargs else None
    sv = val(squeezed) if isinstance(squeezed, Node) else None
    if sv is not None and sv.dim() == 2 and xs.args[1] in (1, -1) and type(sv.shape[1]) is int and sv.shape[1] != 1:
        xs = squeezed  # LLaMA-MoE's ``.squeeze(1)`` of (n, H) rows, H > 1: the same rows
    if is_call(xs, "call_method", "index_select") and xs.args[1] == 0 and xs.args[2] is tok:
        return xs.args[0]
    if is_call(xs, "call_function", operator.getitem) and xs.args[1] is tok:
        return xs.args[0]
    if is_call(xs, "call_function", torch.gather) or is_call(xs, "call_method", "gather"):
        names = ("input", "dim", "index")
        bound = {**dict(zip(names, xs.args)), **xs.kwargs}
        if set(bound) == set(names) and bound["dim"] == 0 and isinstance(bound["index"], Node) and (
                _token_index(bound["index"]) is tok) and _full_width(bound["index"], bound["input"]):
            return bound["input"]
    return None


def _token_index(index: Node) -> Optional[Node]:
    """``tok`` for ``tok.unsqueeze(1).expand(-1, H)`` or ``tok.reshape(-1, 1).expand(-1, H)`` (a scatter index)."""
    if not (is_call(index, "call_method", "expand") and len(index.args) == 3 and index.args[1] == -1):
        return None
    inner = index.args[0]
    if is_call(inner, "call_method", "unsqueeze") and inner.args[1:] in ((1,), (-1,)):
        return inner.args[0]
    if is_call(inner, "call_method", "reshape", "view") and inner.args[1:] == (-1, 1):
        return inner.args[0]
    return None


def _full_width(index: Node, rows: Node) -> bool:
    """A (n, H) gather/scatter index as wide as ``rows``: a narrower one reads or adds only the first columns."""
    iv, rv = val(index), val(rows)
    return iv is not None and rv is not None and iv.dim() == 2 and known_equal(iv.shape[1], rv.shape[-1])


@dataclass(frozen=True)
class _Combine:
    tok: Node
    value: Node  # the weighted sorted outputs
    end: Node  # the node whose value is the (T, H) result
    write: Optional[Node]  # an in-place write to erase (scatter_add_/index_add_), else None
    acc: Node
    onto: bool = False  # the buffer holds a value of the user's (a shared expert's output), not zeros


def _combine(acc: Node) -> Optional[_Combine]:
    """``acc.scatter_add_(0, tok.unsqueeze(1).expand(-1, H), v)`` / ``acc.index_add_(0, tok, v)``, or their
    out-of-place forms, into zeros of (T, H), or into a (T, H) value of the user's (torchtune adds the routed
    outputs into its shared expert's)."""
    if not (_zeros(acc) or _added_into(acc)):
        return None
    av = val(acc)
    if av is None or av.dim() != 2:
        return None
    mutations = alias_mutations(acc)
    if mutations:
        if len(mutations) != 1:
            return None
        node, end = mutations[0], mutations[0]
        if node.target not in ("scatter_add_", "index_add_"):
            return None
    else:
        users = list(acc.users)
        if len(users) != 1 or not is_call(users[0], "call_method", "scatter_add", "index_add"):
            return None
        node = end = users[0]
    # (dim, index, value), positional or by name (torchtune writes scatter_add_(dim=0, index=..., src=...))
    names = ("dim", "index", "src") if node.target.startswith("scatter") else ("dim", "index", "source")
    bound = {**dict(zip(names, node.args[1:])), **node.kwargs}
    if node.args[0] is not acc or len(node.args) > 4 or set(bound) != set(names) or bound["dim"] != 0:
        return None
    onto = not _zeros(acc)
    if mutations and not onto and any(comes_before(u, node) for u in acc.users if u is not node):
        return None  # a read of the zeros before the write: the op's result must not reach it
    if mutations and onto and not _written_alone(acc, node):
        return None
    index = bound["index"]
    if node.target.startswith("scatter") and not _full_width(index, acc):
        return None
    tok = _token_index(index) if node.target.startswith("scatter") else index
    if not isinstance(tok, Node):
        return None
    return _Combine(tok, bound[names[2]], end, node if mutations else None, acc, onto)


def _added_into(node: Node) -> bool:
    """``node`` is the receiver of a ``scatter_add(_)`` / ``index_add(_)``: a buffer the outputs may be added into."""
    return any(is_call(u, "call_method", "scatter_add_", "index_add_", "scatter_add", "index_add") and u.args
               and u.args[0] is node for u in node.users)


def _written_alone(acc: Node, write: Node) -> bool:
    """The in-place ``write`` into a user's value ``acc`` can become ``acc + op`` for acc's later readers: acc is no
    input, parameter or buffer (or a view of one), whose change the caller would see, and nothing else that shares
    its memory (the tensor it views, another view) is read after the write or written at all. (acc's own views
    made after the write are its readers: they read ``acc + op``.)"""
    if base_of(acc).op in ("placeholder", "get_attr"):
        return False
    family = view_family(acc)
    for alias in family:
        if is_view_of(alias, acc) and (alias is acc or not comes_before(alias, write)):
            continue
        if any(not comes_before(u, write) for u in alias.users if u not in family):
            return False
    return True


def match(acc: Node) -> Union[Match, str, None]:
    """The split loop whose outputs are scattered into the zeros buffer ``acc``; or why not (a string) once the
    buffer is known to collect a split loop's experts; None when it never was. The dispatch (the sort or mask, the
    splits, the ``.item()`` sizes) goes with the region, with the size asserts Dynamo attached to it."""
    combine = _combine(acc)
    if combine is None:
        return None
    d = _dispatch(combine.tok)
    if d is None:
        return None
    scaled = _row_scaled(combine.value)
    # the routing weight on the experts' outputs, or else on their input rows (torchtune: scaled before the experts)
    position = "output" if scaled is not None else "input"
    ys, scale = scaled if scaled is not None else (combine.value, None)
    experts = read_experts(ys)
    if experts is None:
        return None
    if isinstance(experts, str):
        return experts
    xs = experts.xs
    if position == "input":
        scaled_in = _row_scaled(xs)
        if scaled_in is None:
            return "no routing weight scales the experts' rows or their outputs"
        xs, scale = scaled_in
    weights = _weights_of(scale, d)
    if weights is None:
        return "the per-row routing weights are not read in the order of the sorted rows"
    x = _token_rows(xs, d.tok)
    if x is None:
        return "the experts' rows are not x at the sorted tokens"
    num_experts = len(experts.down) if isinstance(experts.down, tuple) else val(experts.down).shape[0]
    if not _sizes_are_counts(_split_of(experts.splits[0])[1], d, num_experts):
        return "the rows are not split by each expert's number of assignments (counts of the same ids)"
    xv, av, wv, iv = val(x), val(acc), val(weights), val(d.ids)
    if xv is None or xv.dim() != 2 or tuple(av.shape) != tuple(xv.shape) or av.dtype != xv.dtype:
        return "the combine buffer does not have x's (T, H) shape and dtype"
    if wv is None or tuple(wv.shape) != tuple(iv.shape):
        return "the routing weights are not (T, k) like the ids"
    spec = MoESpec(x, d.ids, weights, experts.gate, experts.up, experts.down, experts.layout, experts.activation,
                   weight_position=position, b1=experts.biases[0], b1_up=experts.biases[1], b2=experts.biases[2],
                   **experts.fields)
    roots = [d.tok, scale, *(n for split in experts.splits for n in split_nodes(split))]
    roots += [s for split in experts.splits for s in _split_of(split)[1] if isinstance(s, Node)]
    note = f"{num_experts} .item() host syncs and data-dependent splits removed"
    onto = acc if combine.onto else None  # the result is acc + op: the outputs are added into the user's value
    if onto is not None:
        note += "; added into the buffer's own value (a shared expert's output)"
    if combine.write is None:
        return Match(spec, combine.end, note, transient=tuple(roots), onto=onto)
    if combine.write.users:  # ``return out.scatter_add_(...)``: the write's own value is the result
        if set(acc.users) != {combine.write}:
            return "both the combine buffer and the value of its in-place write are read"
        return Match(spec, combine.write, note, writes=(combine.write,), transient=tuple(roots), onto=onto)
    return Match(spec, combine.write, note, acc=acc, accumulate=combine.onto, writes=(combine.write,),
                 transient=tuple(roots))


def _zeros(node: Node) -> bool:
    return is_call(node, "call_function", torch.zeros, torch.zeros_like) or is_call(node, "call_method", "new_zeros")


rewrite = Form(FORM, (Anchor(lambda n: _zeros(n) or _added_into(n), match), Anchor(_zeros, scattered_slices.match),
                      Anchor(_zeros, bounded_gemm.match)))
"""Replace every provable split loop in a GraphModule; returns what was rewritten."""
