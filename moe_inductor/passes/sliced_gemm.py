"""A projection of the sorted rows written expert by expert into zeros at running slices, read as the grouped GEMM it
is, for the "sorted_grouped_mm" form.

The user code this reads (Unsloth's ``torch_grouped_gemm``, the torch reference its Triton grouped GEMM is tested
against):

    result = torch.zeros((M, N))
    m_start = 0
    for g in range(E):
        m_size = m_sizes[g]                        # a per-expert count of the ids X was sorted by
        if m_size > 0:                             # speculation.py: a skip of an expert with no rows
            m_end = m_start + m_size
            result[m_start:m_end] = X[m_start:m_end] @ W[g].T      # or W[g] for (E, K, N) weights
            m_start = m_end

Why it is the grouped GEMM of X's rows by their experts: the writes are E slices one after another from row 0 (a
``slice_runs`` run), slice e of ``count_e`` rows, and each is ``X``'s same rows times ``W[e]``, expert e's own
weight, every e in 0..E-1 once and in order. The counts are the per-expert counts of the ids X was sorted by
(``counts_ok``), so they add up to the T*k rows of X and of the buffer: every row is written once, by its own
expert, and nothing of the zeros is left. The buffer is read only after its last write. Anything else is not this
step (the caller says why the region is left alone).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Node

from .aliases import alias_mutations
from .counts import count_item
from .fx_utils import comes_before, is_call, known_equal, val
from .slice_runs import size_after

_MATMULS = (operator.matmul, torch.matmul, torch.mm)


@dataclass(frozen=True)
class SlicedProjection:
    """``buf`` holds ``rows`` times each expert's ``weight`` (stacked, in ``layout``), written by ``writes``;
    ``transient`` are its slices and count reads, whose size checks go with the region."""

    rows: Node
    weight: Node
    layout: str
    writes: tuple
    transient: tuple


def _bounds(index) -> Optional[tuple]:
    """(start, stop) of a ``slice(start, stop)`` index (step 1, stop given)."""
    if not isinstance(index, slice) or index.step not in (None, 1) or index.stop is None:
        return None
    return (0 if index.start is None else index.start), index.stop


def _expert_weight(w) -> Optional[tuple[Node, int, str]]:
    """(stacked W, e, layout) for ``W[e]`` ("kn") or ``W[e].T`` / ``.t()`` / ``.transpose(0, 1)`` ("nk")."""
    layout = "kn"
    if is_call(w, "call_function", getattr) and len(w.args) == 2 and w.args[1] == "T":
        w, layout = w.args[0], "nk"
    elif is_call(w, "call_method", "t") and len(w.args) == 1 and not w.kwargs:
        w, layout = w.args[0], "nk"
    elif is_call(w, "call_method", "transpose") and not w.kwargs and set(w.args[1:]) in ({0, 1}, {-1, -2}):
        w, layout = w.args[0], "nk"
    if not (is_call(w, "call_function", operator.getitem) and isinstance(w.args[0], Node) and type(w.args[1]) is int):
        return None
    wv = val(w.args[0])
    return (w.args[0], w.args[1], layout) if wv is not None and wv.dim() == 3 else None


def _same_bounds(a: tuple, b: tuple) -> bool:
    return all(x is y if isinstance(x, Node) else x == y for x, y in zip(a, b))


def sliced_projection(buf: Node, counts_ok: Callable[[Node, int], bool]) -> Optional[SlicedProjection]:
    """The grouped GEMM ``buf`` holds (see the module docstring), else None. ``counts_ok(counts, E)``: the count
    vector holds, for e in 0..E-1, the number of the sorted ids equal to e."""
    if not (is_call(buf, "call_function", torch.zeros) or is_call(buf, "call_method", "new_zeros")):
        return None
    bv = val(buf)
    writes = alias_mutations(buf)
    if bv is None or bv.dim() != 2 or not writes:
        return None
    pieces = {}
    for w in writes:
        if not (is_call(w, "call_function", operator.setitem) and w.args[0] is buf and isinstance(w.args[2], Node)):
            return None
        bounds = _bounds(w.args[1])
        if bounds is None:
            return None
        pieces[w] = bounds
    # the run from row 0: each write starts where the one before stopped
    run, start = [], 0
    while len(run) < len(pieces):
        nxt = [w for w, (a, _) in pieces.items() if w not in run and (a is start if isinstance(start, Node)
                                                                     else type(a) is int and a == start)]
        if len(nxt) != 1:
            return None
        run.append(nxt[0])
        start = pieces[nxt[0]][1]
    rows = weight = layout = counts = None
    transient = []
    for e, w in enumerate(run):
        size = size_after(*pieces[w])
        counted = count_item(size) if isinstance(size, Node) else None
        if counted is None or counted[1] != e or (counts is not None and counted[0] is not counts):
            return None
        counts = counted[0]
        product = w.args[2]
        if not (is_call(product, "call_function", *_MATMULS) and len(product.args) == 2 and not product.kwargs):
            return None
        if val(product) is None or val(product).dtype != bv.dtype:  # a write that casts rounds (or widens) the rows
            return None
        piece, expert = product.args
        read = _expert_weight(expert)
        if not (is_call(piece, "call_function", operator.getitem) and isinstance(piece.args[0], Node)
                and _bounds(piece.args[1]) is not None and _same_bounds(_bounds(piece.args[1]), pieces[w])):
            return None
        if read is None or read[1] != e or (weight is not None and (read[0] is not weight or read[2] != layout)):
            return None
        if rows is not None and piece.args[0] is not rows:
            return None
        rows, (weight, _, layout) = piece.args[0], read
        transient += [piece, size]
    E = len(run)
    rv, wv = val(rows), val(weight)
    if rv is None or rv.dim() != 2 or wv.shape[0] != E or not counts_ok(counts, E):
        return None
    if not known_equal(rv.shape[0], bv.shape[0]) or not known_equal(wv.shape[1 if layout == "nk" else 2],
                                                                      bv.shape[1]):
        return None
    if any(not comes_before(run[-1], u) for u in buf.users if u not in run):
        return None  # a read of the buffer before it is whole
    return SlicedProjection(rows, weight, layout, tuple(run), tuple(transient))
