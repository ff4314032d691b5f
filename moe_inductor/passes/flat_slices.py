"""Experts stored as row blocks of flat weights (DBRX: each projection one (E*n, m) parameter), a spelling the
per-expert loops take (``unrolled_loop``, ``masked_writes``). The user code this reads:

    rows = slice(e * I, (e + 1) * I)
    h = F.silu(F.linear(xe, w1[rows])) * F.linear(xe, w3[rows])   # or xe @ w1[rows].T: w1 (E*I, H), (out, in)
    y = h @ w2[rows]                                              # w2 (E*I, H) used as (in, out)

Row block e of a flat (E*n, m) weight is ``w.view(E, n, m)[e]``, so the E bodies, once each is shown to read block e
of the same flat weights, are one MoE on those (E, n, m) views: nothing is copied. Each projection keeps its own
layout (DBRX's up is (out, in), its down (in, out)); the op gets every view as (E, out, in).

Shapes: a flat weight (E*n, m); a block (n, m); its view (E, n, m).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .fx_utils import is_call, val


def row_block(node) -> Optional[tuple[Node, int, int]]:
    """(w, start, stop) for ``w[start:stop]`` or ``w[start:stop, :]`` of a 2-D floating weight the module holds."""
    if not is_call(node, "call_function", operator.getitem) or not isinstance(node.args[0], Node):
        return None
    w, index = node.args
    if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None, None, None):
        index = index[0]
    wv = val(w)
    if not isinstance(index, slice) or w.op not in ("placeholder", "get_attr") or wv is None or wv.dim() != 2 or (
            not wv.is_floating_point()):
        return None
    start = 0 if index.start is None else index.start  # w[:n] is expert 0's block
    stop, step = wv.shape[0] if index.stop is None else index.stop, index.step
    if not (isinstance(start, int) and isinstance(stop, int) and step in (None, 1)
            and 0 <= start < stop <= wv.shape[0]):
        return None
    return w, start, stop


def _untransposed(node) -> tuple[Node, bool]:
    """(m, True) for ``m.T`` / ``m.t()`` / ``m.transpose(0, 1)``, else (node, False)."""
    if is_call(node, "call_function", getattr) and node.args[1] == "T":
        return node.args[0], True
    if is_call(node, "call_method", "t") and len(node.args) == 1:
        return node.args[0], True
    if is_call(node, "call_method", "transpose") and set(node.args[1:]) in ({0, 1}, {-1, -2}):
        return node.args[0], True
    return node, False


def block_linear(node) -> Optional[tuple[Node, Node, str, bool]]:
    """(input, the block node, layout, False) for a bias-free projection on a row block: ``F.linear(a, w[s])`` or
    ``a @ w[s].T`` ("nk": the block is (out, in)), or ``a @ w[s]`` ("kn": (in, out)); the tuple ``_linear`` gives
    for a per-expert weight."""
    if is_call(node, "call_function", torch._C._nn.linear, torch.nn.functional.linear):
        if len(node.args) != 2 or node.kwargs:
            return None
        block, transposed = _untransposed(node.args[1])
        return (node.args[0], block, "nk", False) if not transposed and row_block(block) else None
    if is_call(node, "call_function", operator.matmul, torch.matmul) and len(node.args) == 2 and not node.kwargs:
        block, transposed = _untransposed(node.args[1])
        return (node.args[0], block, "nk" if transposed else "kn", False) if row_block(block) else None
    return None


@dataclass(frozen=True)
class Block:
    """One projection of one body: rows [start, stop) of the flat weight, used in ``layout``."""

    flat: Node
    start: int
    stop: int
    layout: str

    @property
    def width(self) -> int:
        return self.stop - self.start


def blocks(projections: Sequence[Optional[tuple[Node, str]]]) -> Union[tuple, str, None]:
    """The row blocks of one body's (gate, up, down) projections, each given as (weight, layout) or None (no up):
    None when no projection reads a row block, the Blocks (None for a missing up) when every one does, else why
    not."""
    got = [None if p is None else (row_block(p[0]), p[1]) for p in projections]
    present = [g for g in got if g is not None]
    if not any(g[0] is not None for g in present):
        return None
    if any(g[0] is None for g in present):
        return "some projections read row blocks of a flat weight and others not"
    return tuple(None if g is None else Block(*g[0], g[1]) for g in got)


def sliced_spec(bodies: Sequence[tuple[int, tuple, MoESpec]]) -> Union[MoESpec, str]:
    """One spec for E bodies (e, the body's Blocks, its spec on the block nodes) that read row blocks: body e reads
    block e of each projection's flat (E*n, m) weight, the same flat weights and layouts in every body, every e of
    range(E) once, and the bodies agree on everything else.

    The spec holds each projection's E block nodes (what the driver reads of it before ``views``: E, and I from the
    down projection), in the down projection's layout; ``views`` gives the op its (E, n, m) views."""
    first_e, first_blocks, first = bodies[0]
    shared = dataclasses.replace(first, gate=None, up=None, down=None)
    spans = [tuple(None if b is None else (b.flat, b.width, b.layout) for b in bl) for _, bl, _ in bodies]
    for (_, _, spec), span in zip(bodies, spans):
        if dataclasses.replace(spec, gate=None, up=None, down=None) != shared:
            return "the loop bodies differ in more than the expert index"
        if span != spans[0]:
            return "the experts read blocks of other flat weights, or of other widths or layouts"
    num = len(bodies)
    if sorted(e for e, _, _ in bodies) != list(range(num)):
        return f"the loop runs over experts {sorted(e for e, _, _ in bodies)}, not each of range(E) once"
    for e, bl, _ in bodies:
        if any(b is not None and (b.start != e * b.width or val(b.flat).shape[0] != num * b.width) for b in bl):
            return f"expert {e} does not read rows [e*n, (e+1)*n) of flat (E*n, m) weights"
    flats = [b.flat for b in first_blocks if b is not None]
    if len({id(f) for f in flats}) != len(flats):
        return "a flat weight serves two projections"
    ordered = sorted(bodies, key=lambda b: b[0])
    per_expert = {f: (None if getattr(first, f) is None else tuple(getattr(s, f) for _, _, s in ordered))
                  for f in ("gate", "up", "down")}
    return dataclasses.replace(first, layout=first_blocks[2].layout, **per_expert)


def views(blocks_of_a_body: tuple) -> Callable[[Graph, MoESpec], MoESpec]:
    """The derive step for ``sliced_spec``'s spec: each flat weight as its (E, n, m) view, in (E, out, in) (an
    (in, out) projection's view transposed), layout "nk"."""
    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        num = len(spec.down)

        def view(b: Optional[Block]) -> Optional[Node]:
            if b is None:
                return None
            v = graph.call_method("view", (b.flat, num, b.width, val(b.flat).shape[1]))
            return v if b.layout == "nk" else graph.call_method("transpose", (v, 1, 2))

        gate, up, down = (view(b) for b in blocks_of_a_body)
        return dataclasses.replace(spec, gate=gate, up=up, down=down, layout="nk")

    return derive
