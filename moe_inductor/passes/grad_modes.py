"""A region must compute under the grad mode and autocast state the op runs in.

Dynamo records ``with torch.no_grad():`` inside a traced function as ``torch._C._set_grad_enabled(False)`` /
``(True)`` calls in the graph, and ``with torch.autocast(...):`` as ``_enter_autocast`` / ``_exit_autocast``. The
dataflow a proof reads does not show them:

    for e in range(E):
        tok, pos = torch.where(ids == e)
        if e == 1:
            with torch.no_grad():                         # expert 1's weights get no gradient, nor x through it
                h = F.silu(x[tok] @ w1[e].T) * (x[tok] @ w3[e].T)
        ...

is the same dataflow as the loop without the ``with``, yet the op, which runs where the region's result was (one
grad mode, one autocast state), would give expert 1's weights a gradient that eager does not. So a region whose
floating-point values are computed under another mode than the op's is left alone. Integer and bool values (the
rows, masks and counts a ``no_grad`` often wraps, transformers v4's ``one_hot`` mask) carry no gradient and are not
cast by autocast, so their mode does not matter.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.fx import Graph, Node

from .fx_utils import reach, val

#: what ``mode_change`` says
OTHER_MODE = ("part of the region is computed under another grad mode or autocast state (a torch.no_grad(), "
              "enable_grad() or autocast inside it) than the op would run in")

_ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", None)


def modes(graph: Graph) -> dict[Node, tuple]:
    """Each node's (grad mode, the autocast regions open around it). Dynamo records a ``_set_grad_enabled`` only
    where it changes the mode (it coalesces the others), so the mode before the first one is its opposite; in a
    graph without one, every node runs in the caller's mode (None)."""
    toggles = [n for n in graph.nodes if _toggle(n)]
    grad, casts, at = (not toggles[0].args[0]) if toggles else None, (), {}
    for n in graph.nodes:
        at[n] = (grad, casts)
        if n.op != "call_function":
            continue
        if _toggle(n):
            grad = n.args[0]
        elif _ENTER_AUTOCAST is not None and n.target is _ENTER_AUTOCAST:
            casts = casts + (n,)
        elif _EXIT_AUTOCAST is not None and n.target is _EXIT_AUTOCAST and n.args:
            casts = tuple(c for c in casts if c is not n.args[0])
    return at


def _toggle(n: Node) -> bool:
    return n.op == "call_function" and n.target is torch._C._set_grad_enabled and len(n.args) == 1 and isinstance(
        n.args[0], bool)


def mode_change(inputs: Iterable[Node], end: Node, writes: Iterable[Node]) -> Optional[str]:
    """The reason a floating-point value the region computes from its ``inputs`` runs under another grad mode or
    autocast state than ``end``, before which the op goes; or None. What makes the inputs (the router, under a
    ``no_grad`` or not) is outside the region.

    Where the op runs without grad, so does ``end``, the step that makes the region's result, and a gradient that
    eager's region carries past it can only come through an earlier write into the result's buffer (``writes``)
    made with grad enabled: only those count then (DeepSeek's ``@torch.no_grad()`` ``moe_infer`` reads a view of the
    routing weights made outside it)."""
    inputs, writes = [n for n in inputs if isinstance(n, Node)], set(writes)
    region = (reach([end, *writes], lambda n: n.all_input_nodes)
              & reach(inputs, lambda n: n.users)) - reach(inputs, lambda n: n.all_input_nodes)
    at = modes(end.graph)
    (grad, casts) = at[end]
    for n in (n for n in end.graph.nodes if n in region):
        v = val(n)
        if not (isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())):
            continue
        if at[n][1] != casts or at[n][0] != grad and (grad is not False or n in writes):
            return f"{OTHER_MODE} ({n.name})"
    return None
