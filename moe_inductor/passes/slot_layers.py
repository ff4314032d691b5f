"""Readers of the experts' layers on padded capacity slots (``padded_capacity.py``): per-expert biases broadcast
over the slots, and dropouts that are the identity.

The user code this reads (biases as in nanoMoE's ``MLPExperts`` and GShard-style stacked experts):

    h = torch.bmm(xin, w1) + b1[:, None, :]        # b1 (E, I); or a parameter (E, 1, I); ``+=`` or torch.add
    out = torch.bmm(act(h), w2) + b2.unsqueeze(1)   # or b2.view(E, 1, H), b2[:, None]

Every slot of expert e gets b[e], as every row that the op runs through expert e does: a kept (token, choice) gets
``act(x W1 + b1[e]) W2 + b2[e]`` either way. An empty slot's output, bias and all, meets a zero combine weight, so it
reaches no token, and in the backward its output's gradient (that zero weight times the token's) adds nothing to a
bias; a dropped token has no slot, no bias in eager and no row in the op. A bias of (E, C, N) differs per slot, a
value the op has no slot to read at, and is left alone; so is one of another dtype (the sum's dtype would change).

Dropouts: ``F.dropout(t, p, training, inplace)`` (``nn.Dropout``) or ``torch.dropout(t, p, train)`` with p == 0 or
training False, both literals in the graph, is the identity: ATen returns its input before drawing from the
generator, so reading through it changes neither a value nor the random stream. With p > 0 in training it draws a
random mask over the padded slots: another computation, left alone with that reason.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Node

from .capacity_gating import call, same_traced, shape
from .fx_utils import val

_DROPOUTS = (F.dropout, torch.dropout)
_VIEWS = ("view", "reshape", torch.reshape)


def _dropout_args(node: Node) -> Optional[tuple[Any, Any, Any]]:
    """(p, training, inplace) of a dropout call as the graph holds them (defaults filled in), or None."""
    names = ("p", "training", "inplace") if node.target is F.dropout else ("p", "train")
    defaults = (0.5, True, False) if node.target is F.dropout else (None, None)
    given = list(node.args[1:])
    if len(given) > len(names) or set(node.kwargs) - set(names[len(given):]):
        return None
    got = [given[i] if i < len(given) else node.kwargs.get(n, defaults[i]) for i, n in enumerate(names)]
    return (got[0], got[1], got[2] if len(got) > 2 else False)


def dropout(node: Any) -> Optional[tuple[Node, Optional[str]]]:
    """(its input, None) for a dropout that is the identity; (its input, why not) for one that is not (or may not
    be: p or training not literals, in place); None when ``node`` is no dropout."""
    if not (call(node, *_DROPOUTS) and node.args and isinstance(node.args[0], Node)):
        return None
    args = _dropout_args(node)
    if args is None:
        return node.args[0], "a dropout of the experts' is called in a way this form does not read"
    p, training, inplace = args
    if inplace is not False:
        return node.args[0], "a dropout of the experts' works in place"
    if training is False or (type(p) in (int, float) and p == 0):
        return node.args[0], None
    if type(p) in (int, float) and training is True:
        return node.args[0], (f"a dropout with p={p} in training runs on the experts' padded slots: a random mask "
                              "over the slots, which the op does not draw")
    return node.args[0], "a dropout of the experts' has a p or training flag that is not a literal of the graph"


def through_dropouts(node: Any) -> tuple[Any, Optional[str]]:
    """``node`` under every identity dropout; and why not, when a dropout under it is not the identity."""
    while (d := dropout(node)) is not None:
        if d[1] is not None:
            return node, d[1]
        node = d[0]
    return node, None


@dataclass(frozen=True)
class Bias:
    """A per-expert bias: ``node`` is (E, N) or (E, 1, N) (``squeezed`` says which), as the graph holds it."""

    node: Node
    squeezed: bool


#: why a term added to a slot projection is not taken
PER_SLOT = ("a bias added to an expert projection varies per slot (E, C, N): the op runs each token's row, with no "
            "slot to read a per-slot bias at")
NOT_A_BIAS = ("a term added to an expert projection is not a per-expert bias (an (E, 1, N) input or parameter, or "
              "an (E, N) one with a new axis 1), of the projection's dtype")


def _input_base(node: Any) -> bool:
    return isinstance(node, Node) and node.op in ("placeholder", "get_attr")


def per_expert_bias(b: Any, w: Node, layout: str, C) -> Union[Bias, str]:
    """The bias ``b`` added to the projection of the (E, C, K) slots by ``w`` (stacked, in ``layout``): (E, 1, N)
    as an input or parameter of the graph, or an (E, N) one under ``[:, None, :]`` / ``[:, None]`` /
    ``unsqueeze(1)`` / ``view(E, 1, N)`` (a reshape keeps (e, n) at (e, 0, n)); else why not."""
    wv, bv = val(w), val(b)
    if wv is None or bv is None or wv.dim() != 3:
        return NOT_A_BIAS
    E, N = wv.shape[0], wv.shape[1 if layout == "nk" else 2]
    s = tuple(bv.shape)
    if len(s) == 3 and same_traced(s[0], E) and same_traced(s[2], N) and s[1] != 1 and same_traced(s[1], C):
        return PER_SLOT
    if len(s) != 3 or not (same_traced(s[0], E) and s[1] == 1 and same_traced(s[2], N)) or bv.dtype != wv.dtype:
        return NOT_A_BIAS
    if _input_base(b):
        return Bias(b, squeezed=False)
    base = b.args[0] if call(b, operator.getitem, "unsqueeze", torch.unsqueeze, *_VIEWS) and b.args else None
    index = b.args[1:] if base is not None else ()
    new_axis = (call(b, operator.getitem) and index in (((slice(None), None, slice(None)),), ((slice(None), None),))
                ) or (call(b, "unsqueeze", torch.unsqueeze) and index in ((1,), (-2,))) or call(b, *_VIEWS)
    if not (new_axis and not b.kwargs and _input_base(base) and shape(base) is not None and len(shape(base)) == 2):
        return NOT_A_BIAS
    return Bias(base, squeezed=True)


def biased(node: Any) -> list[tuple[Node, Any]]:
    """(product, bias term) readings of ``product + b`` (either order), ``torch.add(product, b)`` or
    ``product += b``; the in-place one only where the product has no other reader (no one sees it unbiased)."""
    if not (call(node, operator.add, torch.add, operator.iadd) and len(node.args) == 2 and not node.kwargs):
        return []
    a, b = node.args
    if node.target is operator.iadd:
        return [(a, b)] if isinstance(a, Node) and len(a.users) == 1 else []
    return [(p, q) for p, q in ((a, b), (b, a)) if isinstance(p, Node)]


def op_bias(graph, bias: Optional[Bias]) -> Optional[Node]:
    """The (E, N) view the op takes of a read bias (a new node for an (E, 1, N) one)."""
    if bias is None:
        return None
    return bias.node if bias.squeezed else graph.call_method("squeeze", (bias.node, 1))
