"""The experts step of a sorted MoE written as a loop over per-expert chunks (torchtitan's ``_run_experts_for_loop``),
read as what ``torch._grouped_mm`` on the same offsets computes, for the "sorted_grouped_mm" form.

The user code this reads (``xs`` holds the routed rows sorted by expert, ``counts`` the rows per expert):

    sizes = counts.tolist()
    chunks = torch.split(xs[: sum(sizes)], sizes, dim=0)    # or contiguous slices: xs[start:start + n] (SliceRun)
    ys = torch.cat([w2[e] @ act(w1[e] @ x_e) * (w3[e] @ x_e)  for e, x_e in enumerate(chunks)], dim=0)
    ys = torch.vstack((ys, ys.new_zeros((xs.shape[0] - sum(sizes), H))))       # torchtitan's padding (optional)

Chunk e holds rows [offs[e-1], offs[e]) of ``xs`` exactly when the split sizes are the per-expert counts of the
ids ``xs`` was sorted by, in expert order, all E of them; so expert e's MLP on its own slice of the stacked weights
is the grouped GEMM's row block e. Each of those facts is checked; anything else is not this step.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch.fx import Node

from .fx_utils import is_call, val
from .gated_reads import GatedRead
from .slice_runs import SliceRun


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


def _rows_of(t: Node, items: list[Node]) -> Node:
    """``xs`` for ``xs[: sum(sizes)]`` (the split then asserts the sizes cover it), else ``t`` itself."""
    if is_call(t, "call_function", operator.getitem) and isinstance(t.args[1], slice):
        s = t.args[1]
        if s.start is None and s.step is None and isinstance(s.stop, Node) and _summed(s.stop, items):
            return t.args[0]
    return t


def _unpadded(ys: Node) -> Node:
    """``out`` for torchtitan's ``torch.vstack((out, out.new_zeros((pad, H))))`` (zeros add nothing to the unsort
    that follows), else ``ys``."""
    if is_call(ys, "call_function", torch.vstack) and len(ys.args) == 1 and len(ys.args[0]) == 2 and not ys.kwargs:
        out, pad = ys.args[0]
        if is_call(pad, "call_method", "new_zeros") and pad.args[0] is out:
            return out
    return ys


def split_loop_experts(ys: Node, counts_match: Callable[[Node, int], bool]
                       ) -> Optional[tuple[Node, str, GatedRead, tuple]]:
    """(stacked down weight, layout, the gated read with ``gate``/``up`` pointing at the sorted rows and the stacked
    weights, the nodes whose data-dependent size checks go with the loop: the split or slices and the sizes) for the
    per-expert loop ending at ``ys``, as ``_grouped_mm`` calls would give them; None when ``ys`` is not such a loop.
    The loop is read by the split_loop form's ``read_experts`` (one whole MLP per chunk, the form's other spelling,
    a split per projection, is not taken here); ``counts_match(counts, E)`` says whether ``counts``
    are the per-expert counts of the ids the rows were sorted by."""
    from .split_loop import _split_of, listed_counts, read_experts, split_nodes  # (split_loop imports this module)

    got = read_experts(_unpadded(ys))
    if got is None or isinstance(got, str) or len(got.splits) != 1 or any(b is not None for b in got.biases):
        return None  # (the grouped-GEMM reading has no place for a bias)
    split = got.splits[0]
    _, sizes = _split_of(split)
    # stacked weights, or one module per expert (DeepSeek-V2's ModuleList: the spec takes the E weights as a tuple)
    num_experts = len(got.down) if isinstance(got.down, tuple) else int(val(got.down).shape[0])
    counts = listed_counts(sizes, num_experts)
    if counts is None or not counts_match(counts, num_experts):
        return None
    if not isinstance(split, SliceRun) and any(
            u.op != "call_function" or u.target is not operator.getitem for u in split.users):
        return None
    xs = _rows_of(got.xs, sizes)
    gate = (xs, got.gate, got.layout, not isinstance(got.gate, tuple))
    up = (xs, got.up, got.layout, not isinstance(got.up, tuple)) if got.up is not None else None
    gated = GatedRead(got.activation, None, xs, xs if got.up is not None else None, gate, up, **got.fields)
    return got.down, got.layout, gated, (*split_nodes(split), *sizes)
