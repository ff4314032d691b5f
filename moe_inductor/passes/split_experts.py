"""The experts step of a sorted MoE written as a loop over per-expert chunks (torchtitan's ``_run_experts_for_loop``),
read as what ``torch._grouped_mm`` on the same offsets computes, for the "sorted_grouped_mm" form.

The user code this reads (``xs`` holds the routed rows sorted by expert, ``counts`` the rows per expert):

    sizes = counts.tolist()
    chunks = torch.split(xs[: sum(sizes)], sizes, dim=0)
    ys = torch.cat([w2[e] @ act(w1[e] @ x_e) * (w3[e] @ x_e)  for e, x_e in enumerate(chunks)], dim=0)
    ys = torch.vstack((ys, ys.new_zeros((xs.shape[0] - sum(sizes), H))))       # torchtitan's padding (optional)

Chunk e holds rows [offs[e-1], offs[e]) of ``xs`` exactly when the split sizes are the per-expert counts of the
ids ``xs`` was sorted by, in expert order, all E of them; so expert e's MLP on its own slice of the stacked weights
is the grouped GEMM's row block e. Each of those facts is checked; anything else is not this step.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
from torch.fx import Node

from .fx_utils import GatedRead, is_call, val
from .unrolled_loop import expert_mlp

_SPLITS = (torch.split, torch.functional.split, torch.Tensor.split)


def _items(sizes) -> Optional[list[Node]]:
    """The scalar nodes of ``counts.tolist()`` as Dynamo traces it: ``counts[e].item()`` for e = 0, 1, ..."""
    if not isinstance(sizes, (list, tuple)) or not sizes:
        return None
    counts = None
    for e, item in enumerate(sizes):
        if not (is_call(item, "call_method", "item") and is_call(item.args[0], "call_function", operator.getitem)):
            return None
        src, index = item.args[0].args
        if index != e or (counts is not None and src is not counts):
            return None
        counts = src
    return list(sizes)


def _summed(node, items: list[Node]) -> bool:
    """``node`` is the sum of exactly ``items`` (``torch.sym_sum([...])`` or a chain of ``+``)."""
    if is_call(node, "call_function", torch.sym_sum) and len(node.args) == 1:
        return list(node.args[0]) == items
    terms, stack = [], [node]
    while stack:
        n = stack.pop()
        if is_call(n, "call_function", operator.add) and len(n.args) == 2:
            stack.extend(n.args)
        else:
            terms.append(n)
    return sorted(map(id, terms)) == sorted(map(id, items)) and len(terms) == len(items)


def _split_of(chunk: Node, e: int) -> Optional[Node]:
    """The split node for ``chunks[e]``."""
    if is_call(chunk, "call_function", operator.getitem) and chunk.args[1] == e and isinstance(chunk.args[0], Node):
        split = chunk.args[0]
        if is_call(split, "call_function", *_SPLITS) or is_call(split, "call_method", "split"):
            return split
    return None


def _split_parts(split: Node) -> Optional[tuple[Node, list[Node]]]:
    """(the split tensor, its size items) of ``torch.split(t, sizes, dim=0)`` with sizes from ``counts.tolist()``."""
    args = list(split.args)
    kwargs = dict(split.kwargs)
    t = args.pop(0) if args else kwargs.pop("tensor", None)
    sizes = args.pop(0) if args else kwargs.pop("split_size_or_sections", kwargs.pop("split_size", None))
    dim = args.pop(0) if args else kwargs.pop("dim", 0)
    if args or kwargs or dim != 0 or not isinstance(t, Node):
        return None
    items = _items(sizes)
    return None if items is None else (t, items)


def _rows_of(t: Node, items: list[Node]) -> Node:
    """``xs`` for ``xs[: sum(sizes)]`` (the split then asserts the sizes cover it), else ``t`` itself."""
    if is_call(t, "call_function", operator.getitem) and isinstance(t.args[1], slice):
        s = t.args[1]
        if s.start is None and s.step is None and isinstance(s.stop, Node) and _summed(s.stop, items):
            return t.args[0]
    return t


def _concatenated(ys: Node) -> Optional[list[Node]]:
    """The per-expert outputs of ``torch.cat([...], 0)``, optionally stacked over torchtitan's zero padding rows
    (``torch.vstack((out, out.new_zeros((pad, H))))``: zeros add nothing to the unsort that follows)."""
    if is_call(ys, "call_function", torch.vstack) and len(ys.args) == 1 and len(ys.args[0]) == 2 and not ys.kwargs:
        out, pad = ys.args[0]
        if not (is_call(pad, "call_method", "new_zeros") and pad.args[0] is out):
            return None
        ys = out
    if not is_call(ys, "call_function", torch.cat) or not isinstance(ys.args[0], (list, tuple)):
        return None
    dim = ys.args[1] if len(ys.args) > 1 else ys.kwargs.get("dim", 0)
    if dim != 0 or set(ys.kwargs) - {"dim"}:
        return None
    return list(ys.args[0])


def split_loop_experts(ys: Node, counts_match: Callable[[Node, int], bool]) -> Optional[tuple[Node, str, GatedRead]]:
    """(stacked down weight, layout, the gated read with ``gate``/``up`` pointing at the sorted rows and the stacked
    weights) for the per-expert loop ending at ``ys``, as ``_grouped_mm`` calls would give them; None when ``ys`` is
    not such a loop. ``counts_match(counts, E)`` says whether ``counts`` are the per-expert counts of the ids the
    rows were sorted by."""
    outs = _concatenated(ys)
    if not outs:
        return None
    first = None
    split = None
    for e, out in enumerate(outs):
        got = expert_mlp(out, e)
        if isinstance(got, str):
            return None
        w_down, layout, stacked, gated = got
        if not stacked:
            return None  # per-expert modules: their weights are stacked by other forms' emitters, not this one
        ins = [gated.gate[0]] + ([gated.up[0]] if gated.up is not None else [])
        splits = {_split_of(i, e) for i in ins}
        if len(splits) != 1 or None in splits or (split is not None and splits != {split}):
            return None
        split = splits.pop()
        key = (w_down, layout, gated.activation, gated.gate_up, gated.gate[1], gated.up[1] if gated.up else None,
               gated.gate[2], gated.up[2] if gated.up else None)
        if first is None:
            first = (key, gated)
        elif key != first[0]:
            return None  # every chunk runs the same stacked weights, each at its own expert index
    parts = _split_parts(split)
    if parts is None:
        return None
    t, items = parts
    num_experts = len(outs)
    wv = val(first[0][0])
    if len(items) != num_experts or wv is None or wv.shape[0] != num_experts:
        return None
    if not counts_match(items[0].args[0].args[0], num_experts):
        return None
    if any(u.op != "call_function" or u.target is not operator.getitem for u in split.users):
        return None
    xs = _rows_of(t, items)
    gated = first[1]
    gate = (xs, *gated.gate[1:])
    up = (xs, *gated.up[1:]) if gated.up is not None else None
    return first[0][0], first[0][1], dataclasses.replace(gated, gate=gate, up=up)
