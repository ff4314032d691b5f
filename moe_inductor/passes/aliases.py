"""Which nodes of a Dynamo FX graph share memory, and which ops write it in place.

A node's result is, or views, ``alias_source``'s tensor: a view op's input, a cast's that returns it, or the tensor
an in-place op writes, which the op returns (``r = x.mul_(2)`` is ``x``). An op may write several tensors:
``torch.topk(s, k, out=(v, i))`` (``torch.sort``, ``torch.max(s, dim)``) writes ``v`` and ``i`` and returns them as
its result's parts, ``torch._foreach_mul_([a, b], c)`` writes ``a`` and ``b``. ``tensors_written`` names every one,
so ``alias_mutations`` sees a change through any name, and ``is_impure`` keeps such a write through the dead-code
removal after a rewrite.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Optional, Sequence

import torch
from torch.fx import Node

from .fx_utils import is_call, val


#: in-place operators Dynamo records as functions (``x += y`` is ``operator.iadd`` when ``x`` is a view it cannot
#: rebind)
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.imatmul,
                      operator.ilshift, operator.irshift}


def inplace_users(node: Node) -> list[Node]:
    """The users of ``node`` that write it in place (``tensors_written``)."""
    return [u for u in node.users if node in tensors_written(u)]


def tensors_written(user: Node) -> tuple[Node, ...]:
    """Every tensor ``user`` writes in place, in argument order; empty where it writes none. The receiver of an
    in-place method (``x.index_add_(...)``), the first argument of an in-place operator (``x += y``) or function
    (``torch.relu_(x)``, ``F.relu(x, inplace=True)``), an ``out=x``, or each tensor of a tuple an op writes
    (``written_parts``: ``torch.topk(x, k, out=(v, i))``, ``torch._foreach_mul_([a, b], s)``)."""
    parts = written_parts(user)
    if parts is not None:
        return tuple(dict.fromkeys(p for p in parts if isinstance(p, Node)))
    out = user.kwargs.get("out")
    if isinstance(out, Node):
        return (out,)
    first = user.args[0] if user.args else None
    if not isinstance(first, Node):
        return ()
    return (first,) if _writes_its_first_argument(user) else ()


def written_parts(node: Node) -> Optional[Sequence]:
    """The tuple of tensors ``node`` writes in place and returns as its result's parts, else None: an ``out=`` tuple
    (``torch.topk``, ``torch.sort``, ``torch.max(x, dim)``: ``res[1]`` is the ``indices`` tensor passed), or the list
    an in-place function changes (``torch._foreach_mul_([a, b], s)``)."""
    out = node.kwargs.get("out")
    if isinstance(out, (tuple, list)):
        return out
    first = node.args[0] if node.args else None
    if node.op == "call_function" and isinstance(first, (tuple, list)) and _writes_its_first_argument(node):
        return first
    return None


#: the dunder methods that write their receiver (a graph before the driver's canonical form may hold them)
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__imatmul__", "__ilshift__", "__irshift__", "__setitem__"}


#: Dynamo traces NumPy code through torch._numpy, each function recorded as ``wrapped_<name>``
_NUMPY_WRAPPED = "wrapped_"
#: the ones that write their first argument: ``a[i] = v`` and the in-place operators (``a += 1`` on an ndarray
#: changes it where it lies, a view of another array included)
_NUMPY_WRITES = {"__setitem__"} | {op.__name__ for op in _INPLACE_OPERATORS}


def _writes_its_first_argument(node: Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        if name.startswith("__") and name.endswith("__"):  # ``__getitem__`` ends in "_" and writes nothing
            return name in _INPLACE_DUNDERS
        return name.endswith("_") or node.kwargs.get("inplace") is True
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "").split(".")[0]  # an aten overload's "mul_.Scalar" is mul_'s
        if name.startswith(_NUMPY_WRAPPED):  # a NumPy array's in-place operator or item assignment, as Dynamo
            return name[len(_NUMPY_WRAPPED):] in _NUMPY_WRITES  # traces it (``a[1] += 1``: getitem, iadd, setitem)
        return (node.target in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
                or node.kwargs.get("inplace") is True or _inplace_by_position(node))
    return False


def _inplace_by_position(node: Node) -> bool:
    """``inplace=True`` passed by position (``F.relu(x, True)``, ``F.hardtanh(x, 0.0, 1.0, True)``,
    ``F.dropout(x, p, training, True)``), read off the function's own signature."""
    try:
        params = _parameters(node.target)
    except TypeError:  # an unhashable target: no signature cached
        return False
    if params is None or "inplace" not in params:
        return False
    at = params.index("inplace")
    return len(node.args) > at and node.args[at] is True


@functools.lru_cache(maxsize=None)
def _parameters(target) -> Optional[list[str]]:
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _part_written(node: Node) -> Optional[Node]:
    """The tensor ``node`` is where it is part ``k`` of an op's result that wrote it (``res[k]`` of
    ``written_parts``), else None."""
    if not (is_call(node, "call_function", operator.getitem) and isinstance(node.args[0], Node)
            and type(node.args[1]) is int):
        return None
    parts = written_parts(node.args[0])
    if parts is None or not -len(parts) <= node.args[1] < len(parts):
        return None
    part = parts[node.args[1]]
    return part if isinstance(part, Node) else None


_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "transpose", "permute", "t", "flatten",
          "unflatten", "narrow", "select", "as_strided", "contiguous", "detach", "split", "chunk", "unbind", "view_as",
          "swapaxes", "swapdims", "movedim", "moveaxis", "diagonal", "unfold", "tensor_split", "split_with_sizes",
          "hsplit", "vsplit", "dsplit", "broadcast_to"}
#: the same views as functions (Dynamo records ``torch.movedim(x, ...)``, ``torch.chunk(x, n)`` as such)
_VIEW_FUNCTIONS = {operator.getitem, torch.unsqueeze, torch.squeeze, torch.transpose, torch.permute, torch.reshape,
                   torch.flatten, torch.narrow, torch.select, torch.swapaxes, torch.swapdims, torch.movedim,
                   torch.moveaxis, torch.t, torch.diagonal, torch.as_strided, torch.broadcast_to, torch.chunk,
                   torch.split, torch.unbind, torch.tensor_split, torch.hsplit, torch.vsplit, torch.dsplit,
                   torch.unflatten, torch.detach}
#: functions by name that return their argument's memory under a second name (``t.data``, as Dynamo records it)
_VIEW_FUNCTION_NAMES = {"_get_data_attr"}
#: attributes that are views (``x.T``, ``x.mT``: Dynamo records ``getattr(x, "T")``)
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag"}


#: casts that return their input itself when its dtype and device already are the asked ones
_CASTS = {"to", "type_as", "type", "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "cpu",
          "cuda"}


def _returns_its_input(node: Node) -> bool:
    """A cast (``x.float()``, ``x.to(dtype)``) whose traced result has its input's dtype and device: ``x`` itself,
    so a write through it writes ``x``. Where either value is unknown it counts as ``x`` too."""
    if not (node.op == "call_method" and node.target in _CASTS and node.args and isinstance(node.args[0], Node)):
        return False
    a, b = val(node.args[0]), val(node)
    return a is None or b is None or (a.dtype == b.dtype and a.device == b.device)


def _is_view(node: Node) -> bool:
    if _returns_its_input(node):
        return True
    if is_call(node, "call_function", operator.getitem) and _advanced_index(node.args[1]):
        return False  # ``x[idx]`` with a tensor index copies: ``x[idx] += y`` writes that copy, then x by setitem
    if is_call(node, "call_function", operator.getitem) and isinstance(node.args[0], Node) and isinstance(
            node.args[0].meta.get("example_value", node.args[0].meta.get("val")), (tuple, list)):
        # an element of a multi-output op: a view of the op's input only for split/chunk/unbind (views
        # themselves); topk's values and indices, say, are two tensors of their own
        return _is_view(node.args[0])
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) == 2 and node.args[1] in _VIEW_ATTRIBUTES
    if node.op == "call_function" and getattr(node.target, "__name__", None) == _NUMPY_WRAPPED + "getitem":
        return len(node.args) == 2 and not _advanced_index(node.args[1])  # a basic index of an ndarray views it
    return (node.op == "call_method" and node.target in _VIEWS) or (
        node.op == "call_function" and (node.target in _VIEW_FUNCTIONS or getattr(
            node.target, "__name__", None) in _VIEW_FUNCTION_NAMES)) or _traced_view_of(node) is not None


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _traced_view_of(node: Node) -> Optional[Node]:
    """The argument whose memory ``node``'s traced value views, by the traced values themselves: for a view op no
    name above lists (``torch.einsum("ij->ji", x)``, and whatever torch adds), every tensor the op returns is a view
    whose base is that argument's base. None where that is not so or not known."""
    if node.op not in ("call_function", "call_method"):
        return None
    got = node.meta.get("val", node.meta.get("example_value"))
    parts = got if isinstance(got, (tuple, list)) else (got,)
    if not parts or not all(isinstance(p, torch.Tensor) and p._is_view() for p in parts):
        return None
    roots = {id(_root(p)) for p in parts}
    sources = [a for a in node.args if isinstance(a, Node) and isinstance(val(a), torch.Tensor)
               and id(_root(val(a))) in roots]
    return sources[0] if len(sources) == 1 else None


def _advanced_index(index) -> bool:
    """An index with a tensor in it (torch's advanced indexing, which always returns a copy)."""
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, Node) and isinstance(val(p), torch.Tensor) for p in parts)


def alias_source(node: Node) -> Optional[Node]:
    """The tensor whose memory ``node``'s result is, or views, else None (a tensor of its own): the input of a view op
    or of a cast that returns it (``_is_view``), or the tensor an in-place op writes (``tensors_written``), which
    the op returns: ``r = x.scatter_(1, i, v)``, ``x += y``, ``torch.relu_(x)``, ``torch.mul(a, b, out=x)`` are all
    ``x``, so a write through ``r`` writes ``x`` and a write to ``x`` changes what ``r``'s readers see. Of an op
    that writes several (``written_parts``), each part of the result is its tensor: ``torch.topk(s, k,
    out=(v, i))[1]`` is ``i``."""
    part = _part_written(node)
    if part is not None:
        return part
    if _is_view(node):
        first = node.args[0] if node.args else None
        traced = _traced_view_of(node)  # the traced values name the viewed argument where the op's name does not
        return traced if traced is not None else first if isinstance(first, Node) else None
    written = tensors_written(node)
    return written[0] if len(written) == 1 else None  # an op that writes several returns them as parts


def base_of(node: Node) -> Node:
    """The tensor ``node`` shares its memory with at the root: through views, casts that return their input and
    in-place ops' results (``alias_source``); ``node`` itself when it is none of those."""
    base = node
    while (source := alias_source(base)) is not None:
        base = source
    return base


def view_family(node: Node) -> list[Node]:
    """Every node that may share ``node``'s memory: its base, then every view of that base and every in-place op's
    result on one (``alias_source``), in the order they are reached (base first)."""
    seen, stack = {}, [base_of(node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen[n] = None
            stack.extend(_aliases_below(n))
    return list(seen)


def _aliases_below(node: Node) -> list[Node]:
    """The nodes whose ``alias_source`` is ``node``: its views and in-place results, and the parts that ops which
    write ``node`` among others return for it (``res[1]`` of ``torch.topk(s, k, out=(v, node))``)."""
    found = [u for u in node.users if alias_source(u) is node]
    writers = [u for u in node.users if node in (written_parts(u) or ())]
    return found + [p for w in writers for p in w.users if alias_source(p) is node]


def is_view_of(node: Node, base: Node) -> bool:
    """``node`` is ``base``, a view of it, or an in-place op's result on one (``alias_source``), or a part of
    ``base``'s result where ``base`` writes several tensors (``written_parts``)."""
    while node is not base:
        if _part_written(node) is not None and node.args[0] is base:
            return True
        source = alias_source(node)
        if source is None:
            return False
        node = source
    return True


def alias_mutations(node: Node) -> list[Node]:
    """Every in-place change (an ``x.op_(...)`` method or function, ``x += y``, ``out=x``, ``out=(v, x)``, or
    ``x[i] = v``) of ``node`` or of any tensor that may share its memory (``view_family``: views, and in-place
    results, so a write through ``r = x.scatter_(...)`` is a change of ``x``). Conservative: a getitem without a
    tensor index counts as a view. The in-place ops ``node`` itself is made by (``s.masked_fill_(m, v).flatten(1)``:
    the ``masked_fill_``; the op whose result's part ``node`` is) are left out: ``node``'s readers see the values
    they made."""
    made_by, n = set(), node
    while n is not None:
        made_by.add(n)
        if _part_written(n) is not None:  # ``res[1]`` is made by the ``topk(..., out=(v, i))`` that wrote it
            made_by.add(n.args[0])
        n = alias_source(n)
    found = []
    for n in view_family(node):
        found += inplace_users(n)
        found += [u for u in n.users if is_call(u, "call_function", operator.setitem) and u.args[0] is n]
    return [m for m in dict.fromkeys(found) if m not in made_by]


def _registers_hook(node: Node) -> bool:
    """``t.register_hook(fn)`` on an intermediate, as Dynamo records it from torch 2.13 (the ``register_hook``
    higher-order op): its result is never read, but the hook changes ``t``'s gradient (ArcticTraining's
    load-balancing hook on the router's probabilities)."""
    target = node.target if node.op == "call_function" else None
    return isinstance(target, torch._ops.HigherOrderOperator) and target.name() == "register_hook"


def is_impure(node: Node) -> bool:
    """FX's purity, plus what it misses in Dynamo graphs: an in-place write (``tensors_written``: ``buf.add_(c)``,
    ``m.scatter_(...)``, ``t += u``, ``torch.relu_(t)``, ``out=t``) whose result nobody reads is still a write. It
    must stay when it changes the user's state (an input, parameter or buffer, or a view of one, or an in-place
    result on one: ``self.load.mul_(d).add_(c)``) or a tensor read after it (through any ``view_family`` name); a
    write to a tensor of the graph's own that nothing reads any more may go with it."""
    if node.is_impure() or _registers_hook(node):
        return True
    targets = tensors_written(node)
    if not targets:
        return False
    if any(base_of(t).op in ("placeholder", "get_attr") for t in targets):
        return True
    readers = {u for t in targets for a in view_family(t) for u in a.users if u is not node}
    cur = node.next
    while cur.op != "root":
        if cur in readers:
            return True
        cur = cur.next
    return False


def eliminate_dead_code(graph: torch.fx.Graph) -> bool:
    """``graph.eliminate_dead_code()`` that keeps the user's in-place writes (``is_impure``). FX's own takes every
    ``call_method`` as pure, so after a rewrite it would drop, say, a ``self.counts.add_(...)`` buffer update or
    the ``mask.scatter_(...)`` that a router's later reads depend on."""
    return graph.eliminate_dead_code(is_impure_node=is_impure)


def mutated_alias(node: Node) -> bool:
    """Whether ``node`` or a view-alias of it is changed in place anywhere in the graph (see ``alias_mutations``)."""
    return bool(alias_mutations(node))
