"""Data widths: ``F.one_hot(x, N)`` whose width ``N`` is read from ``x``'s own maximum, traced during a moe_inductor
compile instead of graph-breaking.

The user code this is for (lucidrains' ``safe_one_hot``, a one-hot that tolerates positions past the capacity):

    max_index = indexes.max() + 1
    return F.one_hot(indexes, max(max_index + 1, max_length))[..., :max_length]

one_hot's schema takes an ``int``, so a width that depends on data cannot be fake-run, and every backend breaks the
graph there. Where the width ``N`` is provably larger than ``x.max()`` (it is ``x.max()`` plus integer literals
summing to at least 1, then raised by ``max``/``clamp(min=)`` against ints or sizes, all int64, with nothing
written in place), eager's one_hot cannot raise its "smaller than num_classes" error, and its value is
``(x[..., None] == arange(N)).long()``: an int64 (*x.shape, N) tensor, 1 exactly at x. That is what is traced, with
``N`` an unbacked SymInt rebuilt from ``x.max().item()``, so ``N >= C`` is a fact of the shape environment and
``[..., :C]`` has the static size C. What eager still checks is kept: a negative class raises eager's error, by an
``_assert_async`` on ``(x >= 0).all()`` (marked ``NONNEGATIVE``, so a pass that proves x >= 0 may drop it with
its region). An empty ``x`` (where eager's own ``x.max()`` raises) or any other width is left to Dynamo.

The hook wraps ``TorchInGraphFunctionVariable.call_function`` (looked up with getattr; missing, nothing is
installed) and does nothing outside a moe_inductor compile.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

#: marks the ``_assert_async((x >= 0).all(), ...)`` node of a traced data-width one_hot (True)
NONNEGATIVE = "moe_inductor_one_hot_nonnegative"
#: eager's message for a negative class (CPU)
NEGATIVE_MESSAGE = "Class values must be non-negative."

_MAX = (torch.max, torch.amax, "max", "amax")
_ADD = (operator.add, torch.add, "add", "__add__", "__radd__")
_RAISE = (torch.clamp, torch.clip, torch.clamp_min, "clamp", "clip", "clamp_min")
_MAXIMUM = (torch.maximum, "maximum", torch.max, "max")


def _active() -> bool:
    from . import capture

    return capture.capturing()


def _raise_value(arg: Any) -> Any:
    """An int, or the node of a backed SymInt (a size expression), that a width is raised to; else None."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from .shape_tensors import shape_value

    if isinstance(arg, int) and not isinstance(arg, bool):
        return arg
    if not isinstance(arg, Node):
        return None
    ev = arg.meta.get("example_value")
    if isinstance(ev, torch.SymInt) and not free_unbacked_symbols(ev):
        return arg
    exact = shape_value(arg) if isinstance(ev, torch.Tensor) else None
    return exact if type(exact) is int else None


def _is_max_of(node: Any, x: Node) -> bool:
    """``node`` is the whole-tensor maximum of ``x`` (``x.max()``, ``torch.max(x)``, ``amax`` over all dims)."""
    if not isinstance(node, Node) or node.op not in ("call_function", "call_method") or node.target not in _MAX:
        return False
    return len(node.args) == 1 and node.args[0] is x and not node.kwargs


def read_width(width: Node, x: Node) -> Optional[tuple[Node, int, list]]:
    """(the max node, k, raises) when ``width`` is ``max(x.max() + k, *raises)`` (0-d int64 tensors, k an int);
    else None. Its value is then at least ``x.max() + k``."""
    offset, raises, node = 0, [], width
    for _ in range(16):
        ev = node.meta.get("example_value") if isinstance(node, Node) else None
        if not isinstance(ev, torch.Tensor) or ev.dim() != 0 or ev.dtype is not torch.int64:
            return None
        if _is_max_of(node, x):
            return node, offset, raises
        if node.op not in ("call_function", "call_method"):
            return None
        args, kwargs = node.args, dict(node.kwargs)
        if node.target in _ADD and len(args) == 2 and not kwargs:
            a, b = args
            if isinstance(b, Node) and not isinstance(a, Node):
                a, b = b, a
            if type(b) is not int:
                return None
            offset, node = offset + b, a
        elif node.target in _RAISE and not set(kwargs) - {"min"} and (
                (len(args) == 2 and not kwargs) or (len(args) == 1 and "min" in kwargs)):
            low = _raise_value(args[1] if len(args) == 2 else kwargs["min"])
            if low is None:
                return None
            raises.append(low)
            node = args[0]
        elif node.target in _MAXIMUM and len(args) == 2 and not kwargs and isinstance(args[0], Node):
            low = _raise_value(args[1])
            if low is None or not isinstance(args[1], Node):
                return None
            raises.append(low)
            node = args[0]
        else:
            return None
    return None


def _one_hot(tx: Any, args: list, kwargs: dict) -> Any:
    """The traced one_hot's VariableTracker, or None when it is not a provable data width."""
    from torch._dynamo.variables import SymNodeVariable, TensorVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

    from .shape_tensors import written

    if len(args) + len(kwargs) != 2 or set(kwargs) - {"num_classes"} or not args:
        return None
    x_vt, width_vt = args[0], (args[1] if len(args) == 2 else kwargs.get("num_classes"))
    if not isinstance(x_vt, TensorVariable) or not isinstance(width_vt, TensorVariable):
        return None
    x, width = x_vt.as_proxy().node, width_vt.as_proxy().node
    fake = x.meta.get("example_value")
    if not isinstance(fake, torch.Tensor) or fake.dtype is not torch.int64 or free_unbacked_symbols(fake.shape):
        return None
    if not statically_known_true(fake.numel() >= 1):  # eager's x.max() raises on an empty x
        return None
    read = read_width(width, x)
    if read is None or read[1] < 1:
        return None
    top, k, raises = read
    from .shape_tensors import _ancestry

    if written([x, *_ancestry(width)]):
        return None
    out = tx.output

    def symint(fn, *operands):
        value = fn(*(o.sym_num if isinstance(o, SymNodeVariable) else o for o in operands))
        proxy = out.create_proxy("call_function", fn, tuple(
            o.as_proxy() if isinstance(o, SymNodeVariable) else o for o in operands), {})
        return SymNodeVariable.create(tx, proxy, value)

    biggest = wrap_fx_proxy(tx, out.create_proxy("call_method", "item", (torch.fx.Proxy(top, out.current_tracer),),
                                                  {}))
    if not isinstance(biggest, SymNodeVariable):
        return None
    n_vt = symint(operator.add, biggest, k)
    for low in raises:
        if isinstance(low, Node):
            low = SymNodeVariable.create(tx, torch.fx.Proxy(low, out.current_tracer), low.meta["example_value"])
        n_vt = symint(torch.sym_max, n_vt, low)
    x_proxy = x_vt.as_proxy()
    arange = wrap_fx_proxy(tx, out.create_proxy("call_function", torch.arange, (n_vt.as_proxy(),),
                                                 {"device": fake.device}))
    column = wrap_fx_proxy(tx, out.create_proxy("call_method", "unsqueeze", (x_proxy, -1), {}))
    hot = wrap_fx_proxy(tx, out.create_proxy("call_function", operator.eq, (column.as_proxy(), arange.as_proxy()),
                                             {}))
    result = wrap_fx_proxy(tx, out.create_proxy("call_method", "long", (hot.as_proxy(),), {}))
    nonneg = wrap_fx_proxy(tx, out.create_proxy("call_function", operator.ge, (x_proxy, 0), {}))
    every = wrap_fx_proxy(tx, out.create_proxy("call_method", "all", (nonneg.as_proxy(),), {}))
    check = out.create_proxy("call_function", torch._assert_async, (every.as_proxy(), NEGATIVE_MESSAGE), {})
    check.node.meta[NONNEGATIVE] = True
    return result


def _max_of_size(tx: Any, a: Any, b: Any) -> Any:
    """Python's ``max(t, n)`` of a 0-d int64 tensor and a size: ``torch.clamp(t, min=n)``, as Dynamo already traces
    it for an int ``n`` (for a SymInt it would run Python's ``max`` on the fake tensor, a data-dependent branch);
    None otherwise."""
    from torch._dynamo.variables import SymNodeVariable, TensorVariable, TorchInGraphFunctionVariable
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(a, SymNodeVariable):
        a, b = b, a
    if not isinstance(a, TensorVariable) or not isinstance(b, SymNodeVariable):
        return None
    fake = a.as_proxy().node.meta.get("example_value")
    if not isinstance(fake, torch.Tensor) or fake.dim() != 0 or fake.dtype is not torch.int64:
        return None
    if not isinstance(b.sym_num, torch.SymInt) or free_unbacked_symbols(b.sym_num):
        return None
    return TorchInGraphFunctionVariable(torch.clamp).call_function(tx, [a], {"min": b})


_installed = False


def install() -> None:
    """Hook ``F.one_hot`` with a width read from its own input's maximum (idempotent); the hook does nothing
    outside a moe_inductor compile."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._dynamo import variables

    in_graph = getattr(variables, "TorchInGraphFunctionVariable", None)
    builtin = getattr(variables, "BuiltinVariable", None)
    call_torch = getattr(in_graph, "call_function", None)
    call_builtin = getattr(builtin, "call_function", None)
    if call_torch is None or call_builtin is None:
        return

    def builtin_call(self, tx, args, kwargs):
        if getattr(self, "fn", None) is max and len(args) == 2 and not kwargs and _active():
            clamped = _max_of_size(tx, *args)
            if clamped is not None:
                return clamped
        return call_builtin(self, tx, args, kwargs)

    def torch_call(self, tx, args, kwargs):
        if getattr(self, "value", None) is F.one_hot and _active():
            try:
                built = _one_hot(tx, list(args), dict(kwargs))
            except Exception:  # noqa: BLE001  (anything unforeseen: the one_hot is left to Dynamo)
                built = None
            if built is not None:
                return built
        return call_torch(self, tx, args, kwargs)

    in_graph.call_function = torch_call
    builtin.call_function = builtin_call
