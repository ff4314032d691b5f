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

Autocast matters where the op itself runs, too: the op is no autocast op, so under ``torch.autocast(dtype=bf16)``
around fp32 weights (mixed-precision training: transformers' Trainer with ``bf16=True``) it would compute the experts
in fp32 where the user's matmuls ran in bf16: other numbers, and a slower, larger path than the user had. Where
autocast to a dtype other than its tokens' and weights' is on at the op's place (in the graph, or around the
compiled call, which Dynamo guards on) for the tokens' device, ``autocast_compute`` reads the region's matmuls: when
every one of them computes in autocast's dtype (they are autocast ops: ``F.linear``, ``@``, ``bmm``, ``einsum``), the
op runs in that dtype too, its inputs cast as autocast casts the user's (``passes/emit.py``); when none does
(``torch._grouped_mm``, no autocast op, on the weights' own dtype) it runs as it would without autocast; a region
with both is left alone.
"""
from __future__ import annotations

import operator
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
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


def _region(inputs: Iterable[Node], end: Node, writes: Iterable[Node]) -> set[Node]:
    """What the region computes from its ``inputs`` toward ``end`` and its ``writes``, the inputs' own makers left
    out."""
    inputs = [n for n in inputs if isinstance(n, Node)]
    return (reach([end, *writes], lambda n: n.all_input_nodes)
            & reach(inputs, lambda n: n.users)) - reach(inputs, lambda n: n.all_input_nodes)


def mode_change(inputs: Iterable[Node], end: Node, writes: Iterable[Node]) -> Optional[str]:
    """The reason a floating-point value the region computes from its ``inputs`` runs under another grad mode or
    autocast state than ``end``, before which the op goes; or None. What makes the inputs (the router, under a
    ``no_grad`` or not) is outside the region.

    Where the op runs without grad, so does ``end``, the step that makes the region's result, and a gradient that
    eager's region carries past it can only come through an earlier write into the result's buffer (``writes``)
    made with grad enabled: only those count then (DeepSeek's ``@torch.no_grad()`` ``moe_infer`` reads a view of the
    routing weights made outside it)."""
    writes = set(writes)
    region = _region(inputs, end, writes)
    at = modes(end.graph)
    (grad, casts) = at[end]
    counted: dict = {}
    for n in (n for n in end.graph.nodes if n in region):
        v = val(n)
        if not (isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())):
            continue
        if at[n][1] != casts or at[n][0] != grad and (grad is not False or n in writes) and not _of_integers(
                n, counted):
            return f"{OTHER_MODE} ({n.name})"
    return None


def _floating(node: Node) -> bool:
    """Whether ``node`` holds a floating-point or complex tensor, alone or in a tuple (``topk``'s values)."""
    v = node.meta.get("val", node.meta.get("example_value"))
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in (v if isinstance(v, (tuple, list)) else (v,)))


def _of_integers(node: Node, seen: dict) -> bool:
    """``node``'s value is made from integer and bool tensors only (Unsloth's ``histc(ids.float(), ...)`` counts under
    ``torch.no_grad()``): a float made so never requires grad, in any grad mode, so its mode does not matter. A
    graph input, or a call asked for ``requires_grad``, is not."""
    if node in seen:
        return seen[node]
    seen[node] = False  # (a cycle cannot happen in a graph; this only stops a walk back through a deep chain)
    v = val(node)
    if node.op in ("placeholder", "get_attr") or node.kwargs.get("requires_grad"):
        found = isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())
    else:
        found = all(not _floating(a) or _of_integers(a, seen) for a in node.all_input_nodes)
    seen[node] = found
    return found


def _autocast_state(device_type: str, enter: Optional[Node]) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast for ``device_type``: the ``_enter_autocast`` node's, whose dtype None is the
    device's default (``torch.autocast("cuda")``), else the caller's."""
    if enter is None:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    return bool(enter.args[2]), enter.args[1] or torch.get_autocast_dtype(device_type)


def autocast_reason(device_type: str, dtypes: Iterable[torch.dtype],
                    enter: Optional[Node] = None) -> Optional[str]:
    """Why the op cannot run where autocast to a dtype other than ``dtypes`` (the tokens' and expert weights') is on
    for ``device_type``, or None. ``enter`` is the innermost ``_enter_autocast`` of the graph open at the op's place
    for that device (its arguments: device, dtype, enabled, cache), else the caller's state counts; read at compile
    (or trace) time, which Dynamo's guards on the global autocast state make the state at run time."""
    enabled, dtype = _autocast_state(device_type, enter)
    if not enabled or all(d == dtype for d in dtypes):
        return None
    return (f"autocast to {dtype} is on where the op would run: the user's matmuls compute in {dtype}, the op "
            "(no autocast op) in the tokens' and weights' dtype")


#: the matmuls a proven region computes its experts with: autocast ops (on its lower-precision list on CPU and CUDA,
#: or composed of them: einsum, matmul) and ``torch._grouped_mm``, which autocast leaves alone
_MATMULS = frozenset(f for f in (torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.functional.einsum, F.linear,
                                 torch._C._nn.linear, torch.addmm, torch.baddbmm, torch.addbmm, operator.matmul,
                                 getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None)
_MATMUL_METHODS = frozenset({"matmul", "mm", "bmm", "__matmul__", "addmm", "baddbmm", "addbmm"})

#: what ``autocast_compute`` says where the region's matmuls compute in more than one dtype
MIXED_MATMULS = ("autocast to {dtype} is on where the op would run, and the region's matmuls compute in {dtypes} "
                 "(some are no autocast op): the op computes every one in one dtype")


def _matmul(n: Node) -> bool:
    return n.op == "call_function" and n.target in _MATMULS or n.op == "call_method" and n.target in _MATMUL_METHODS


def autocast_compute(inputs: Iterable[Node], end: Node, writes: Iterable[Node], x: Node,
                     weights: Iterable[Node]) -> Union[torch.dtype, str, None]:
    """The dtype the op computes the region in, where autocast is on at ``end`` (before which the op goes) for the
    tokens ``x``'s device, to a dtype other than ``x``'s and the expert ``weights``': that dtype when every matmul
    the region computes from its ``inputs`` computes in it (the op's inputs are then cast to it, as autocast casts
    the user's); None where autocast casts nothing the region computes (no autocast, autocast to the tokens' and
    weights' own dtype, or only ``torch._grouped_mm`` on them: the op runs in their dtype, as the user's code did);
    else the reason the region is left alone (its matmuls in more than one dtype, or autocast's dtype with no matmul
    to show it)."""
    xv = val(x)
    if not isinstance(xv, torch.Tensor):
        return None
    device_type = xv.device.type
    casts = [c for c in modes(end.graph)[end][1] if len(c.args) >= 3 and c.args[0] == device_type]
    dtypes = {v.dtype for v in map(val, (x, *weights)) if isinstance(v, torch.Tensor)}
    reason = autocast_reason(device_type, dtypes, casts[-1] if casts else None)
    if reason is None:
        return None
    dtype = _autocast_state(device_type, casts[-1] if casts else None)[1]
    region = [n for n in end.graph.nodes if n in _region(inputs, end, writes)]
    computed = {v.dtype for v in map(val, region) if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if dtype not in computed:
        return None
    made = {v.dtype for v in map(val, filter(_matmul, region)) if isinstance(v, torch.Tensor)}
    if made == {dtype}:
        return dtype
    return reason if not made else MIXED_MATMULS.format(dtype=dtype, dtypes=sorted(map(str, made)))


def autocast_note(dtype: torch.dtype) -> str:
    """What explain() says of a rewrite that computes in autocast's ``dtype``."""
    return f"under autocast: the op computes in {dtype}, its inputs cast as autocast casts the user's matmuls'"
