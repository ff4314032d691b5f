"""Runs of contiguous slices of one tensor, ``rows[0:c0]``, ``rows[c0:c0 + c1]``, ...: the pieces a running
``start = end`` offset cuts (DeepSeek-V2's ``moe_infer``), read wherever a ``torch.split(rows, [c0, c1, ...])`` is
(split_loop.py's pieces, split_experts.py's loops), and by speculation_check.py for a skipped body's rows."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

from torch.fx import Node

from .fx_utils import is_call


@dataclass(frozen=True)
class SliceRun:
    """Contiguous slices of ``rows`` one after another from row 0, ``rows[0:c0]``, ``rows[c0:c0 + c1]``, ... (the
    bounds a running ``start = end`` makes): the pieces a ``torch.split(rows, [c0, c1, ...])`` would give, the
    sizes ``c_e`` read off the bounds. Stands for a split node wherever the loop's pieces are read."""

    rows: Node
    sizes: tuple
    slices: tuple


def slice_bounds(node) -> Optional[tuple]:
    """(start, stop) of ``rows[start:stop]`` (step 1, stop given), else None."""
    if not (is_call(node, "call_function", operator.getitem) and isinstance(node.args[1], slice)):
        return None
    s = node.args[1]
    if s.step not in (None, 1) or s.stop is None:
        return None
    return (0 if s.start is None else s.start), s.stop


def size_after(start, stop) -> Optional[Node]:
    """``c`` for ``stop = start + c`` (``c`` itself when start is 0), else None."""
    if isinstance(start, int) and start == 0 and isinstance(stop, Node) and not (
            is_call(stop, "call_function", operator.add)):
        return stop
    if is_call(stop, "call_function", operator.add) and len(stop.args) == 2:
        a, b = stop.args
        if a is start and isinstance(b, Node):
            return b
        if b is start and isinstance(a, Node):
            return a
    return None


def slice_run(rows: Node) -> Optional[SliceRun]:
    """The run of contiguous slices that every slice of ``rows`` belongs to, else None."""
    slices = {u: slice_bounds(u) for u in rows.users if slice_bounds(u) is not None and u.args[0] is rows}
    run, sizes, start = [], [], 0
    while True:
        nxt = [u for u, (a, b) in slices.items() if (a is start if isinstance(start, Node) else a == start)
               and u not in run]
        if len(nxt) != 1:
            break
        piece = nxt[0]
        size = size_after(start, slices[piece][1])
        if size is None:
            return None
        run.append(piece)
        sizes.append(size)
        start = slices[piece][1]
    if not run or len(run) != len(slices):
        return None
    return SliceRun(rows, tuple(sizes), tuple(run))
