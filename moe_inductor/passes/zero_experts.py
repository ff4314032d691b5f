"""Zero-computation experts in a per-expert loop (form "unrolled_loop"): bodies that add their selected tokens back,
scaled by the routing weight, with no expert MLP in between.

The user code this reads (transformers' LongCat-Flash, whose router spends part of each token's k on ``Z``
"zero-computation" experts after the ``E`` routed ones):

    for e in range(E + Z):                           # or the loop over the experts that got tokens (hit_loops.py)
        pos, tok = torch.where(expert_mask[e])       # any selection unrolled_loop reads
        xe = x[tok]
        if e >= E:
            y = xe                                   # nn.Identity(); or xe * c, c a Python number
        else:
            y = down_e(act(up_e(xe)))
        out.index_add_(0, tok, y * weights[tok, pos, None])

Body e in [E, E + Z) adds ``c * weights[t, j] * x[t]`` for each (token, choice) whose id is e (``index_add_`` adds
every selected row, repeats included), so together they add

    c * x[t] * sum_j weights[t, j] * [E <= ids[t, j] < E + Z]

to row t: plain torch ops beside the op (``passthrough``), added only to the rows with such a choice (a row with
none gets nothing, as in eager, even where x is not finite). The routed experts go to the op as range(E), their
stacked weights as views of the first E rows (the gate/up weight is sized for every choice in LongCat); the op
adds nothing for a choice outside [0, E) (``ops/routing.py``: such an id is dropped, never read; the op's tests
hold it to that for ids at and past E), so each choice counts once, in the op or in the pass-through.

Proven per body, by what it computes (``identity_body``): its contribution is a product of its own rows of the
tokens, its own routing weight (``loop_rows.routing_scaled``: the weight of each selected (token, choice)) and
Python numbers, in any order; then, over the loop (``proven``): every such body reads the routed experts' tokens,
ids and weights, scales by the same number, and their experts are the ids right after the routed ones. Anything
else is refused with its reason: a body that adds its rows unweighted while the routed ones are weighted, a bias
or any other tensor in the product (an expert that computes something), zero experts of different scales or
between the routed ones, or a loop of nothing but zero experts.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .fx_utils import is_call, val
from .loop_rows import Rows, routing_scaled, token_rows_of


@dataclass(frozen=True)
class Passthrough:
    """One body of a zero-computation expert: ``out[tok] += scale * weights[tok, pos] * x[tok]`` for expert e."""

    e: int
    x: Node
    ids: Node
    weights: Optional[Node]  # None: the rows are added unweighted
    scale: float
    where: Node
    add: Node
    read: Optional[Node] = None  # the acc[tok] read of an ``acc[tok] += c`` body


@dataclass(frozen=True)
class ZeroExperts:
    """The zero-computation experts of a loop: ids in [first, last), each adding ``scale`` times its weighted rows."""

    first: int
    last: int
    scale: float

    def note(self) -> str:
        scaled = "" if self.scale == 1 else f" times {self.scale:g}"
        return (f"; {self.last - self.first} zero-computation experts (ids {self.first}..{self.last - 1}) added back "
                f"as the tokens{scaled} times their routing weights, beside the op's {self.first} experts")


def _number(c) -> bool:
    return type(c) in (int, float)


def _peel_numbers(node: Node) -> tuple[Node, float]:
    """(v, c) for ``node`` = v times or divided by Python numbers (``v * 2``, ``0.5 * v``, ``v / 4``, nested)."""
    scale = 1.0
    while True:
        args = node.args if isinstance(node, Node) else ()
        if is_call(node, "call_function", operator.mul, torch.mul) and len(args) == 2 and not node.kwargs:
            a, b = args
            if isinstance(a, Node) and _number(b):
                node, scale = a, scale * b
                continue
            if isinstance(b, Node) and _number(a):
                node, scale = b, scale * a
                continue
        if is_call(node, "call_function", operator.truediv, torch.div) and len(args) == 2 and not node.kwargs and (
                isinstance(args[0], Node) and _number(args[1]) and args[1] != 0):
            node, scale = args[0], scale / args[1]
            continue
        return node, scale


def identity_body(contribution: Node, tok: Node, sel: Rows) -> Optional[tuple[Node, Optional[Node], float]]:
    """(x, weights, c) where a body's contribution is ``c * weights[tok, pos] * x[tok]`` (its own rows of x, its own
    routing weight or none, Python numbers; factors in any order); None where it is not (it computes something)."""
    core, outer = _peel_numbers(contribution)
    weights = None
    scaled = routing_scaled(core, tok, sel)
    if scaled is not None:
        core, weights = scaled
    core, inner = _peel_numbers(core)
    x = token_rows_of(core, tok)
    return None if x is None else (x, weights, outer * inner)


def proven(zero: list[Passthrough], routed: list, spec: MoESpec) -> Union[ZeroExperts, str]:
    """The zero-computation experts beside the routed bodies ``routed`` (unrolled_loop's, of ``spec``), or why the
    loop is not the op plus their pass-through."""
    if not routed:
        return "every body adds its own rows of the tokens back: there is no expert MLP for the op"
    unweighted = next((z for z in zero if z.weights is None), None)
    if spec.weights is None or unweighted is not None:
        e = unweighted.e if unweighted is not None else zero[0].e
        return (f"expert {e} adds its rows of the tokens back without a routing weight (zero-computation experts are "
                "taken where each body scales its rows by its own weights[tok, pos], as the routed ones do)")
    for z in zero:
        if z.x is not spec.x:
            return f"expert {z.e} adds back rows of another tensor than the routed experts read"
        if z.ids is not spec.ids or z.weights is not spec.weights:
            return f"expert {z.e} is selected by other ids, or weighted by other routing weights, than the routed ones"
    if len({z.scale for z in zero}) != 1:
        return ("the zero-computation experts scale their tokens by different numbers "
                f"({', '.join(f'{z.scale:g}' for z in sorted(zero, key=lambda z: z.e))})")
    first = len(routed)
    if sorted(b.e for b in routed) != list(range(first)):
        return (f"the routed experts are {sorted(b.e for b in routed)}, not range({first}) "
                "before the zero-computation ones")
    if sorted(z.e for z in zero) != list(range(first, first + len(zero))):
        return (f"the zero-computation experts are {sorted(z.e for z in zero)}, not the ids right after the "
                f"{first} routed ones")
    return ZeroExperts(first, first + len(zero), zero[0].scale)


def leading_rows(graph: Graph, spec: MoESpec, n: int) -> MoESpec:
    """The spec with each stacked weight and bias of more than ``n`` experts as the view of its first ``n`` (the op's
    E is the stacked gate's leading size; per-expert tuples are the routed experts' own already)."""
    if isinstance(spec.gate, tuple):
        return spec

    def first(w: Optional[Node]) -> Optional[Node]:
        if w is None or val(w) is None or val(w).shape[0] == n:
            return w
        rows = graph.call_function(operator.getitem, (w, slice(None, n)))
        rows.meta["example_value"] = val(w)[:n]  # the emitter reads the weights' shapes (a fused gate/up's split)
        return rows

    return dataclasses.replace(spec, **{f: first(getattr(spec, f)) for f in ("gate", "up", "down", "b1", "b1_up",
                                                                           "b2")})


def stacked_rows_cover(spec: MoESpec, n: int) -> bool:
    """Every stacked weight and bias of ``spec`` holds at least ``n`` experts (their first n are the op's)."""
    nodes = [getattr(spec, f) for f in ("gate", "up", "down", "b1", "b1_up", "b2")]
    return all(val(w) is not None and val(w).dim() >= 1 and val(w).shape[0] >= n for w in nodes if w is not None)


def passthrough(zeros: ZeroExperts, out_dtype: torch.dtype) -> Callable[[Graph, MoESpec], Node]:
    """``plus(graph, spec)`` for ``driver.Match.plus``: the zero-computation experts' sum for every row, in
    ``out_dtype``, from the (derived) spec's tokens, ids and weights."""
    def plus(graph: Graph, spec: MoESpec) -> Node:
        ids, weights = spec.ids, spec.weights
        chosen = graph.call_function(operator.and_, (graph.call_function(operator.ge, (ids, zeros.first)),
                                                     graph.call_function(operator.lt, (ids, zeros.last))))
        picked = graph.call_function(torch.where, (chosen, weights, 0.0))
        total = graph.call_method("sum", (picked, -1), {"keepdim": True})
        if zeros.scale != 1:
            total = graph.call_function(operator.mul, (total, zeros.scale))
        rows = graph.call_function(operator.mul, (spec.x, total))
        # a row with no zero-computation choice gets nothing (eager adds nothing there: no 0 * x, NaN at an inf)
        some = graph.call_method("any", (chosen, -1), {"keepdim": True})
        term = graph.call_function(torch.where, (some, rows, 0.0))
        return graph.call_method("to", (term, out_dtype))

    return plus
