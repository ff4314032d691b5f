"""The errors a rewrite keeps: eager's error on bad index values, where the rewrite removed the op that raised it.

User MoE code often holds an op that raises on routing ids out of range: ``one_hot(ids, num_classes=E)`` (HF v4's
expert mask, GShard's dispatch), ``w[ids]`` (gathered weights), ``zeros(T, E).scatter(1, ids, ...)`` (a dense
routing matrix). A rewrite into the experts op makes such an op dead, and dead-code removal would then take eager's
error away with it: the rewritten layer would return values where eager raises (a router wider than the expert list
is the common cause). So every such op that a pass removed is kept as a device-side check of the same bounds,
``torch._assert_async(all(0 <= index < n))``, which Inductor fuses into a kernel of its own: no host sync, safe under
CUDA graphs. Code that never raised on them (selection by ``ids == e``, which skips ids outside [0, E)) gets no
check, because it has no such op: eager's behaviour, not the form, decides.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Graph, Node

from ..ops.routing import device_assert_message
from .fx_utils import ONE_HOT, is_call, source_line, val

#: ops whose ``(dim, index)`` arguments must index within ``self.shape[dim]``
_INDEXED_BY_DIM = ("scatter", "scatter_", "scatter_add", "scatter_add_", "gather", "index_select", "index_add",
                   "index_add_", "index_copy", "index_copy_")
#: ops that keep the set of values of their input (an index walked back through them is checked as its source)
_SAME_VALUES = ("view", "reshape", "flatten", "permute", "transpose", "contiguous", "unsqueeze", "squeeze", "clone",
                "detach", "t")


@dataclass(frozen=True)
class IndexBound:
    """``index`` must lie in [0, size) or ``op`` (at ``where``) raises."""

    node: str  # the name of the raising op's node
    index: Node
    size: int
    op: str
    where: str


def _int_tensor(node: object) -> bool:
    v = val(node) if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and v.dtype != torch.bool


def _static(size: object) -> Optional[int]:
    return size if isinstance(size, int) else None


def index_bound(node: Node) -> Optional[IndexBound]:
    """The bound that ``node`` enforces on an integer index tensor by raising, if it is one of the ops above."""
    if node.op not in ("call_function", "call_method"):
        return None
    if is_call(node, "call_function", *ONE_HOT) and node.args and _int_tensor(node.args[0]):
        size = _static(node.kwargs.get("num_classes", node.args[1] if len(node.args) > 1 else -1))
        return IndexBound(node.name, node.args[0], size, "one_hot", source_line(node)) if size and size > 0 else None
    if is_call(node, "call_function", operator.getitem) and len(node.args) == 2:
        base, index = node.args
        first = index[0] if isinstance(index, tuple) and index else index
        if isinstance(base, Node) and _int_tensor(first) and isinstance(val(base), torch.Tensor):
            size = _static(val(base).shape[0]) if val(base).dim() else None
            return IndexBound(node.name, first, size, "indexing", source_line(node)) if size else None
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in _INDEXED_BY_DIM:
        args = node.args
        if len(args) >= 3 and isinstance(args[1], int) and _int_tensor(args[2]):
            self_val = val(args[0])
            if isinstance(self_val, torch.Tensor) and self_val.dim() > 0:
                size = _static(self_val.shape[args[1]])
                return IndexBound(node.name, args[2], size, name, source_line(node)) if size else None
    return None


def index_bounds(graph: Graph) -> list[IndexBound]:
    return [b for b in map(index_bound, graph.nodes) if b is not None]


def _alive_source(index: Node, alive: set[str]) -> Optional[Node]:
    """``index``, or the node it was reshaped from, that is still in the graph."""
    for _ in range(16):
        if index.name in alive:
            return index
        if index.op in ("call_method", "call_function") and index.args and isinstance(index.args[0], Node) and (
                (index.target if index.op == "call_method" else getattr(index.target, "__name__", ""))
                in _SAME_VALUES):
            index = index.args[0]
            continue
        return None
    return None


def keep_removed_checks(graph: Graph, bounds: list[IndexBound]) -> int:
    """For each of ``bounds`` whose op is no longer in ``graph``, insert its check after the index it bounds (or
    the node it was reshaped from). Returns how many checks were inserted."""
    alive = {n.name: n for n in graph.nodes}
    done: set[tuple[str, int]] = set()
    for bound in bounds:
        if bound.node in alive:
            continue
        source = _alive_source(bound.index, set(alive))
        if source is None or (source.name, bound.size) in done:
            continue
        done.add((source.name, bound.size))
        index = alive[source.name]
        message = device_assert_message(
            f"moe_inductor: index values must lie in [0, {bound.size}) as eager's {bound.op} requires (routing ids "
            f"out of range, or a router wider than the expert list) at {bound.where}")
        with graph.inserting_after(index):
            low = graph.call_function(torch.ge, (index, 0))
        with graph.inserting_after(low):
            high = graph.call_function(torch.lt, (index, bound.size))
        with graph.inserting_after(high):
            both = graph.call_function(torch.logical_and, (low, high))
        with graph.inserting_after(both):
            ok = graph.call_method("all", (both,))
        with graph.inserting_after(ok):
            graph.call_function(torch._assert_async, (ok, message))
    return len(done)
