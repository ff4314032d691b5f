"""An expert body guarded by ``if mask.any():``, the skip most public top-1 loops write:

    for e, expert in enumerate(self.experts):
        mask = ids == e
        if mask.any():                        # or torch.any(mask); or: if not mask.any(): continue
            out[mask] = expert(x[mask])

The branch is on a tensor's value, which Dynamo cannot trace. ``mask.any()`` is False exactly when expert e has no
rows, so the guard is the "no rows" skip that ``speculation.py`` answers "has rows" while tracing and proves
afterwards: the body, run on zero rows, reads and writes nothing. Here is what that proof needs of a mask: which
branch values are such a test, and which (ids, e) a mask selects the rows of.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch.fx import Node


def any_of_mask(value) -> Optional[Node]:
    """The graph node of a branch value that is ``mask.any()`` / ``torch.any(mask)`` of a boolean tensor, else None.
    Whether the mask is one expert's is checked after tracing (``counted_by``), on the canonical graph."""
    from torch._dynamo.variables import TensorVariable

    from .passes.fx_utils import is_call

    if not isinstance(value, TensorVariable):
        return None
    node = value.as_proxy().node
    out = node.meta.get("example_value")
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or out.dtype is not torch.bool:
        return None
    if not (is_call(node, "call_method", "any") or is_call(node, "call_function", torch.any)):
        return None
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], Node):
        return None  # any(dim=...) is not one answer for the whole mask
    mask = node.args[0].meta.get("example_value")
    return node if isinstance(mask, torch.Tensor) and mask.dtype is torch.bool else None


def selected_by(mask: Node) -> Optional[tuple[Node, int]]:
    """(ids, e) when ``mask`` is ``ids == e`` (either order) of integer ids and a Python int e; (M, e) when it is the
    column ``M[..., e]`` of a one-hot M with the router's drops in it (passes/kept_masks.py: the rows expert e
    keeps); else None."""
    from .passes.fx_utils import is_call, val
    from .passes.kept_masks import kept_column

    kept = kept_column(mask)
    if kept is not None:
        return kept
    if not is_call(mask, "call_function", operator.eq) or len(mask.args) != 2:
        return None
    a, b = mask.args
    ids, e = (a, b) if isinstance(a, Node) else (b, a)
    if not isinstance(ids, Node) or not isinstance(e, int) or isinstance(e, bool):
        return None
    v = val(ids)
    return (ids, e) if v is not None and not v.dtype.is_floating_point and v.dtype is not torch.bool else None


def counted_by(any_name: str) -> Callable:
    """``Speculation.counts`` for a guard ``mask.any()`` (the node's name): on check_traced's canonical graph copy,
    (ids, e, None) of the mask, or None when the mask is not one expert's."""
    def counts(graph) -> Optional[tuple[Node, int, None]]:
        node = next((n for n in graph.nodes if n.name == any_name), None)
        if node is None or not isinstance(node.args[0], Node):
            return None
        selected = selected_by(node.args[0])
        return None if selected is None else (*selected, None)

    return counts


def masks_read(node: Node) -> list[Node]:
    """The masks ``node`` selects rows by: its index in ``x[mask]`` / ``x[mask, :]`` (getitem) or ``out[mask] = v``
    (setitem)."""
    if node.op != "call_function" or node.target not in (operator.getitem, operator.setitem) or len(node.args) < 2:
        return []
    index = node.args[1]
    parts = index if isinstance(index, tuple) else (index,)  # x[mask, :] too
    return [p for p in parts if isinstance(p, Node) and selected_by(p) is not None]
