"""Shape tensors: a 0-d tensor computed only from Python numbers, ``torch.tensor(literal)`` and the frame's sizes is
a shape expression, not data, and during a moe_inductor compile its truth value, its ``int()`` / ``float()`` /
``.item()`` and its use as ``one_hot``'s ``num_classes`` are evaluated symbolically instead of graph-breaking.

The user code this is for (DeepSpeed's ``_capacity`` and ``top2gating``):

    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(2.0)).to(torch.int64)
    if capacity < min_capacity:                       # min_capacity = torch.tensor(4)
        capacity = min_capacity.to(torch.int64)
    mask1 *= torch.lt(locations1, capacity)
    slot1 = F.one_hot(locations1_s, num_classes=capacity)

Dynamo cannot branch on a tensor, so every backend breaks the graph there. Here the tensor's value is rebuilt as an
exact rational ``N / D`` over the frame's size symbols (N an integer SymInt expression or int, D a power of two)
by reading its FX node and those above it. Only these ops are read: ``torch.tensor`` / ``as_tensor`` /
``scalar_tensor`` of a number; add, sub, mul, true division by a number, integer floor division by a number,
negation; ceil, floor, trunc; casts to integer, float32/float64 and bool dtypes; the six comparisons; clamp,
maximum, minimum; and, for Python scalars, SymInts (any backed one: an exact integer) and the ``+ - * /`` of
SymFloats. Any other op, any tensor that is not 0-d, any unbacked symbol (a count read from data), an input tensor,
or a tensor written in place anywhere up its ancestry, and the tensor is left to Dynamo as before.

Rounding: eager computes ``(T / E) * tensor(2.0)`` in float32 (the Python double T / E cast to float32, then
multiplied and rounded to float32), where a SymFloat would compute in float64. The two agree whenever every value
on the way, each operand cast to the op's dtype included, is exactly representable in the dtype it is held in:
then no op rounds, on any device, whatever the kernel's internal precision. So each such value is checked: a
dyadic N / 2^k is exact in a float of p mantissa bits when |N| <= 2^p, and in an integer dtype when it is an
integer in range. Where N is symbolic the check is a shape guard (``2*s0 <= 2**24``: a recompile if it fails, and
that compile leaves the tensor to Dynamo); where it fails, or D is not a power of two (a division by 3), nothing is
evaluated. Branching on the resulting SymBool installs the guard Dynamo would install for a size test.

``SHAPE_VALUE`` on an integer-valued node holds its exact value (a SymInt or int) for the passes: the padded-capacity
proof reads ``lt(positions, capacity_tensor)`` as ``lt(positions, C)`` through ``shape_value``, which also checks
that nothing writes the tensor in place.

The hooks are Dynamo internals (the branch handlers of the bytecode dispatch tables, ``BuiltinVariable``,
``TensorVariable.method_item``, ``TorchInGraphFunctionVariable``), each looked up with getattr; where one is missing
nothing is installed and those tensors graph-break as they did without it. Nothing changes for other backends.
"""
from __future__ import annotations

import dis
import math
import operator
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

#: on an integer-valued 0-d tensor node that was evaluated: its exact value (SymInt or int)
SHAPE_VALUE = "moe_inductor_shape_value"

_MANTISSA = {torch.float32: 24, torch.float64: 53, float: 53}
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_MAX_SCALE = 2 ** 100  # far from float32's subnormals: N / D with D up to this is normal when N != 0

_BINARY = {operator.add: "add", torch.add: "add", "add": "add", "__add__": "add",
           operator.sub: "sub", torch.sub: "sub", "sub": "sub", "__sub__": "sub",
           operator.mul: "mul", torch.mul: "mul", "mul": "mul", "__mul__": "mul",
           operator.truediv: "div", torch.div: "div", torch.true_divide: "div", "div": "div", "true_divide": "div",
           "__truediv__": "div", operator.floordiv: "floordiv", torch.floor_divide: "floordiv",
           "floor_divide": "floordiv", "__floordiv__": "floordiv"}
_REVERSED = {"__radd__": "add", "__rsub__": "sub", "__rmul__": "mul", "__rtruediv__": "div",
             "__rfloordiv__": "floordiv"}
_COMPARE = {operator.lt: operator.lt, torch.lt: operator.lt, "lt": operator.lt, "__lt__": operator.lt,
            operator.le: operator.le, torch.le: operator.le, "le": operator.le, "__le__": operator.le,
            operator.gt: operator.gt, torch.gt: operator.gt, "gt": operator.gt, "__gt__": operator.gt,
            operator.ge: operator.ge, torch.ge: operator.ge, "ge": operator.ge, "__ge__": operator.ge,
            operator.eq: operator.eq, torch.eq: operator.eq, "eq": operator.eq, "__eq__": operator.eq,
            operator.ne: operator.ne, torch.ne: operator.ne, "ne": operator.ne, "__ne__": operator.ne}
_ROUND = {torch.ceil: "ceil", "ceil": "ceil", torch.floor: "floor", "floor": "floor", torch.trunc: "trunc",
          "trunc": "trunc"}
_NEG = (operator.neg, torch.neg, "neg", "__neg__")
_CAST_METHODS = {"long": torch.int64, "int": torch.int32, "float": torch.float32, "double": torch.float64,
                 "bool": torch.bool}
_CLAMP = {torch.clamp: (True, True), torch.clip: (True, True), "clamp": (True, True), "clip": (True, True),
          torch.clamp_min: (True, False), "clamp_min": (True, False), torch.clamp_max: (False, True),
          "clamp_max": (False, True)}
_MINMAX = {torch.maximum: torch.sym_max, "maximum": torch.sym_max, torch.max: torch.sym_max, "max": torch.sym_max,
           torch.minimum: torch.sym_min, "minimum": torch.sym_min, torch.min: torch.sym_min, "min": torch.sym_min}
_LITERALS = (torch.tensor, getattr(getattr(torch, "_refs", None), "tensor", torch.tensor), torch.as_tensor,
             torch.scalar_tensor)
_SCALAR_OPS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div"}
_ALIASING_CASTS = {"to", "type_as", "long", "int", "float", "double", "bool", "type"}


class _Refused(Exception):
    """The tensor is not a shape expression this module reads (it is left to Dynamo)."""


@dataclass(frozen=True)
class _Num:
    """The exact value ``num / den`` held in ``dtype`` (a torch dtype, or ``int`` / ``float`` for Python numbers);
    ``num`` is an int or a SymNodeVariable (for torch.bool, a bool or a SymBool's), ``den`` a power of two."""

    num: Any
    den: int
    dtype: Any


def _active() -> bool:
    from . import capture

    return capture.capturing()


def _raw(x: Any) -> Any:
    """The int / SymInt / SymBool a numerator stands for."""
    return x if isinstance(x, (int, bool)) else x.sym_num


def _free_of_data(sym: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return not free_unbacked_symbols(sym)


def _guard(cond: Any) -> bool:
    """A Python bool, or the SymBool's value at this frame's sizes under a shape guard (as ``if size < 4:``)."""
    return bool(cond)


def _category(dtype: Any) -> int:
    if dtype is torch.bool:
        return 0
    return 2 if dtype is float or (isinstance(dtype, torch.dtype) and dtype.is_floating_point) else 1


def _promote(a: Any, b: Any) -> Any:
    """torch's result dtype of an op on two 0-d operands (tensors of torch dtypes, or Python int / float)."""
    python_a, python_b = not isinstance(a, torch.dtype), not isinstance(b, torch.dtype)
    if python_a and python_b:
        return float if float in (a, b) else int
    if python_a or python_b:
        tensor, scalar = (b, a) if python_a else (a, b)
        if _category(scalar) > _category(tensor):
            return torch.get_default_dtype() if scalar is float else torch.int64
        return tensor
    return torch.promote_types(a, b)


class _Evaluator:
    """Reads 0-d tensor nodes of the graph being traced as exact values; emits the SymInt arithmetic it needs into
    that graph (Dynamo drops what nothing uses)."""

    def __init__(self, tx: Any):
        from torch._dynamo.variables import ConstantVariable, SymNodeVariable

        self.tx = tx
        self.tracer = tx.output.current_tracer
        self.sym_vt, self.const_vt = SymNodeVariable, ConstantVariable
        self.memo: dict = {}
        self.tensors: list[Node] = []

    # --- SymInt arithmetic -------------------------------------------------------------------------------------

    def emit(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on ints and SymNodeVariables: a Python value when every argument is one, else a
        SymNodeVariable over a new graph node."""
        value = fn(*(_raw(a) for a in args))
        if all(isinstance(a, (int, bool)) for a in args):
            return value
        proxy = self.tx.output.create_proxy("call_function", fn, tuple(
            a if isinstance(a, (int, bool)) else a.as_proxy() for a in args), {})
        out = self.sym_vt.create(self.tx, proxy, value)
        return out.as_python_constant() if out.is_python_constant() else out

    def reduce(self, v: _Num) -> _Num:
        """``v`` with the common power-of-two factor of num and den divided out (a tighter exactness check)."""
        if v.den == 1 or v.dtype is torch.bool:
            return v
        if isinstance(v.num, int):
            g = math.gcd(v.num, v.den)
        else:
            content = v.num.sym_num.node.expr.as_content_primitive()[0]
            g = math.gcd(int(content), v.den) if getattr(content, "is_Integer", False) else 1
        if g == 1:
            return v
        return _Num(self.emit(operator.floordiv, v.num, g), v.den // g, v.dtype)

    def check_fits(self, v: _Num, dtype: Any) -> _Num:
        """``v`` held in ``dtype``, refused unless it is exactly representable there (a shape guard if symbolic)."""
        if dtype is torch.bool or v.dtype is torch.bool:
            if dtype is not v.dtype:
                raise _Refused("bool arithmetic")
            return v
        v = self.reduce(v)
        n = _raw(v.num)
        if dtype in _MANTISSA:
            bound = 2 ** _MANTISSA[dtype]
            if v.den > _MAX_SCALE or not (_guard(n <= bound) and _guard(n >= -bound)):
                raise _Refused(f"not exact in {dtype}")
        elif dtype is int or dtype in _INTS:
            if v.den != 1:
                raise _Refused("a fraction in an integer dtype")
            if dtype is not int:
                info = torch.iinfo(dtype)
                if not (_guard(n <= info.max) and _guard(n >= info.min)):
                    raise _Refused(f"out of range of {dtype}")
        else:
            raise _Refused(f"dtype {dtype}")
        return _Num(v.num, v.den, dtype)

    def scaled(self, v: _Num, den: int) -> Any:
        """v's numerator over the larger power-of-two denominator ``den``."""
        return v.num if v.den == den else self.emit(operator.mul, v.num, den // v.den)

    # --- reading nodes ------------------------------------------------------------------------------------------

    def value(self, arg: Any) -> _Num:
        if isinstance(arg, bool) or not isinstance(arg, (int, float, Node)):
            raise _Refused(f"argument {arg!r}")
        if isinstance(arg, int):
            return _Num(arg, 1, int)
        if isinstance(arg, float):
            if not math.isfinite(arg):
                raise _Refused("not finite")
            f = Fraction(arg)
            return _Num(f.numerator, f.denominator, float)
        if arg not in self.memo:
            self.memo[arg] = self._node(arg)
        return self.memo[arg]

    def _node(self, node: Node) -> _Num:
        if node.graph is not self.tracer.graph:
            raise _Refused("a node of another graph")
        ev = node.meta.get("example_value")
        if isinstance(ev, torch.SymInt) or (isinstance(ev, int) and not isinstance(ev, bool)):
            if not _free_of_data(ev):
                raise _Refused("a count read from data")
            return _Num(self.sym_vt.create(self.tx, torch.fx.Proxy(node, self.tracer), ev), 1, int)
        if isinstance(ev, torch.SymFloat):
            return self._scalar_float(node)
        if not isinstance(ev, torch.Tensor) or ev.dim() != 0 or node.op not in ("call_function", "call_method"):
            raise _Refused(f"node {node.name}")
        self.tensors.append(node)
        out = self._tensor(node, ev.dtype)
        if out.dtype is not ev.dtype:
            raise _Refused("dtype differs from the traced one")
        return out

    def _scalar_float(self, node: Node) -> _Num:
        """A Python float that Dynamo computed from sizes (``num_tokens / num_experts``), in float64."""
        if node.op != "call_function" or node.kwargs:
            raise _Refused("a float input")
        if node.target is torch.sym_float and len(node.args) == 1:
            return self.check_fits(self.value(node.args[0]), float)
        if node.target in _SCALAR_OPS and len(node.args) == 2:
            return self.arith(_SCALAR_OPS[node.target], self.value(node.args[0]), self.value(node.args[1]), float)
        raise _Refused(f"float from {node.target}")

    def _tensor(self, node: Node, dtype: torch.dtype) -> _Num:
        target, args, kwargs = node.target, node.args, dict(node.kwargs)
        if node.op == "call_method":
            if target in _REVERSED and len(args) == 2 and not kwargs:
                return self.arith(_REVERSED[target], self.value(args[1]), self.value(args[0]), dtype)
            if target == "to":
                to = kwargs.pop("dtype", args[1] if len(args) == 2 else None)
                if kwargs or len(args) > 2 or (len(args) == 2 and "dtype" in node.kwargs) or to is None:
                    raise _Refused(".to with more than a dtype")
                return self.cast(self.value(args[0]), to)
            if target in _CAST_METHODS and len(args) == 1 and not kwargs:
                return self.cast(self.value(args[0]), _CAST_METHODS[target])
        if node.op == "call_function" and target in _LITERALS:
            return self.literal(args, kwargs, dtype)
        if target in _BINARY and len(args) == 2:
            mode = kwargs.pop("rounding_mode", None) if _BINARY[target] == "div" else None
            if kwargs or mode not in (None, "floor"):
                raise _Refused("alpha, out or a rounding mode")
            return self.arith("floordiv" if mode else _BINARY[target], self.value(args[0]), self.value(args[1]),
                              dtype)
        if target in _COMPARE and len(args) == 2 and not kwargs:
            a, b = self.value(args[0]), self.value(args[1])
            compute = _promote(a.dtype, b.dtype)
            a, b = self.check_fits(a, compute), self.check_fits(b, compute)
            den = max(a.den, b.den)
            return _Num(self.emit(_COMPARE[target], self.scaled(a, den), self.scaled(b, den)), 1, torch.bool)
        if target in _ROUND and len(args) == 1 and not kwargs:
            return self.round(self.value(args[0]), _ROUND[target])
        if target in _NEG and len(args) == 1 and not kwargs:
            v = self.value(args[0])
            return self.check_fits(_Num(self.emit(operator.neg, v.num), v.den, v.dtype), dtype)
        if target in _CLAMP:
            return self.clamp(node, dtype)
        if target in _MINMAX and len(args) == 2 and not kwargs and isinstance(args[1], Node) and isinstance(
                args[1].meta.get("example_value"), torch.Tensor):
            return self.extremum(_MINMAX[target], [self.value(a) for a in args], dtype)
        raise _Refused(f"op {target}")

    def literal(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> _Num:
        """``torch.tensor(c)``: c rounded to the tensor's dtype as torch rounds it (a C cast, which struct's
        float32 packing also is)."""
        if len(args) != 1 or set(kwargs) - {"dtype", "device"} or isinstance(args[0], bool):
            raise _Refused("a tensor of more than a number")
        c = args[0]
        if isinstance(c, Node):  # torch.tensor(num_tokens): a size, held exactly or refused
            v = self.value(c)
            if v.dtype not in (int, float) or (v.dtype is float and dtype in _INTS):
                raise _Refused("a tensor of a non-number")
            return self.check_fits(v, dtype)
        if not isinstance(c, (int, float)) or (isinstance(c, float) and not math.isfinite(c)):
            raise _Refused("a tensor of a non-literal")
        if dtype in _INTS and isinstance(c, int):
            return self.check_fits(_Num(c, 1, int), dtype)
        if dtype is torch.float32:
            c = struct.unpack("f", struct.pack("f", float(c)))[0]
        elif dtype is not torch.float64:
            raise _Refused(f"a literal of {dtype}")
        f = Fraction(float(c))
        return self.check_fits(_Num(f.numerator, f.denominator, float), dtype)

    def arith(self, op: str, a: _Num, b: _Num, dtype: Any) -> _Num:
        """``a op b`` computed in ``dtype`` (the op's result dtype, which is also its compute dtype here)."""
        if op == "div" and _category(dtype) != 2:
            raise _Refused("true division into an integer dtype")
        a, b = self.check_fits(a, dtype), self.check_fits(b, dtype)
        if op in ("add", "sub"):
            den = max(a.den, b.den)
            fn = operator.add if op == "add" else operator.sub
            return self.check_fits(_Num(self.emit(fn, self.scaled(a, den), self.scaled(b, den)), den, dtype), dtype)
        if op == "mul":
            return self.check_fits(_Num(self.emit(operator.mul, a.num, b.num), a.den * b.den, dtype), dtype)
        if not isinstance(b.num, int) or b.num == 0:
            raise _Refused("division by a symbolic or zero value")
        if op == "floordiv":
            if a.den != 1 or b.den != 1 or _category(dtype) != 1:
                raise _Refused("floor division of floats")
            return self.check_fits(_Num(self.emit(operator.floordiv, a.num, b.num), 1, dtype), dtype)
        num = self.emit(operator.mul, a.num, b.den if b.num > 0 else -b.den)
        den = a.den * abs(b.num)
        if den & (den - 1):
            raise _Refused("division by a value that is not a power of two")
        return self.check_fits(_Num(num, den, dtype), dtype)

    def round(self, v: _Num, how: str) -> _Num:
        if v.den == 1 or v.dtype is torch.bool:
            return v
        if how == "trunc":
            how = "floor" if _guard(_raw(v.num) >= 0) else "ceil"
        if how == "floor":
            return _Num(self.emit(operator.floordiv, v.num, v.den), 1, v.dtype)
        return _Num(self.emit(operator.neg, self.emit(operator.floordiv, self.emit(operator.neg, v.num), v.den)), 1,
                    v.dtype)

    def cast(self, v: _Num, dtype: Any) -> _Num:
        if not isinstance(dtype, torch.dtype):
            raise _Refused(f"cast to {dtype!r}")
        if dtype is torch.bool:
            if v.dtype is torch.bool:
                return v
            return _Num(self.emit(operator.ne, v.num, 0), 1, torch.bool)
        if v.dtype is torch.bool:
            raise _Refused("a cast from bool")
        if dtype in _INTS:
            v = self.round(v, "trunc")
        return self.check_fits(_Num(v.num, v.den, dtype), dtype)

    def clamp(self, node: Node, dtype: torch.dtype) -> _Num:
        takes_min, takes_max = _CLAMP[node.target]
        names = [n for n, taken in (("min", takes_min), ("max", takes_max)) if taken]
        args = dict(zip(names, node.args[1:]))
        if len(node.args) > 1 + len(names) or set(node.kwargs) - set(names) or set(args) & set(node.kwargs):
            raise _Refused("clamp arguments")
        args.update(node.kwargs)
        out = self.value(node.args[0])
        if args.get("min") is not None:
            out = self.extremum(torch.sym_max, [out, self.value(args["min"])], dtype)
        if args.get("max") is not None:
            out = self.extremum(torch.sym_min, [out, self.value(args["max"])], dtype)
        return self.check_fits(out, dtype)

    def extremum(self, fn: Callable, values: list[_Num], dtype: Any) -> _Num:
        values = [self.check_fits(v, dtype) for v in values]
        den = max(v.den for v in values)
        return _Num(self.emit(fn, *(self.scaled(v, den) for v in values)), den, dtype)


# --- what the hooks ask ---------------------------------------------------------------------------------------------


def _cast_aliases(node: Node) -> list[Node]:
    """``node`` and every cast of it, recursively: ``t.to(t.dtype)`` returns ``t`` itself, so a write through a
    cast may write ``t``."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.append(n)
        stack.extend(u for u in n.users if u.op == "call_method" and u.target in _ALIASING_CASTS and u.args
                     and u.args[0] is n)
    return out


def written(nodes: list[Node]) -> bool:
    """Whether any of ``nodes``, or a view or cast of one, is written in place in its graph (so far)."""
    from .passes.aliases import alias_mutations

    return any(alias_mutations(a) for n in nodes for a in _cast_aliases(n))


def _ancestry(node: Node) -> list[Node]:
    """The tensor nodes ``node``'s value is read from (itself included)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n in out or not isinstance(n.meta.get("example_value"), torch.Tensor):
            continue
        out.append(n)
        stack.extend(a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node))
    return out


def shape_value(node: Any) -> Any:
    """The exact integer value (int or SymInt) of a 0-d tensor node that tracing evaluated as a shape expression,
    when nothing in the graph writes it or what it is computed from in place; else None."""
    if not isinstance(node, Node) or SHAPE_VALUE not in node.meta:
        return None
    return None if written(_ancestry(node)) else node.meta[SHAPE_VALUE]


def _evaluate(tx: Any, vt: Any) -> Optional[tuple[_Evaluator, _Num]]:
    """The exact value of the 0-d tensor ``vt`` when it is a shape expression, during a moe_inductor compile."""
    from torch._dynamo.variables import TensorVariable

    if not _active() or not isinstance(vt, TensorVariable):
        return None
    try:
        node = vt.as_proxy().node
        evaluator = _Evaluator(tx)
        result = evaluator.value(node)
        if written(evaluator.tensors):
            return None
    except Exception:  # noqa: BLE001  (_Refused, or anything unforeseen: the tensor is left to Dynamo)
        return None
    for n, v in evaluator.memo.items():
        if isinstance(n.meta.get("example_value"), torch.Tensor) and v.dtype in _INTS and v.den == 1:
            n.meta[SHAPE_VALUE] = _raw(v.num)
    return evaluator, result


def _convert(tx: Any, vt: Any, kind: str) -> Any:
    """What Python's ``bool`` / ``int`` / ``float`` / ``.item()`` of the shape tensor ``vt`` returns, as a
    VariableTracker (a constant, or a SymInt / SymFloat over the sizes; a truth value is guarded); "index" is
    ``__index__`` (integer dtypes only, as one_hot's num_classes). None where ``vt`` is not a shape tensor."""
    found = _evaluate(tx, vt)
    if found is None:
        return None
    evaluator, v = found
    if kind == "item":
        kind = "bool" if v.dtype is torch.bool else "int" if v.dtype in _INTS else "float"
    try:
        if kind == "bool":
            out = _guard(_raw(v.num) if v.dtype is torch.bool else _raw(v.num) != 0)
        elif v.dtype is torch.bool or (kind == "index" and v.dtype not in _INTS):
            return None
        elif kind == "float":
            v = evaluator.check_fits(v, float)
            out = evaluator.emit(operator.truediv, v.num, v.den)
        else:
            out = evaluator.round(v, "trunc").num
    except Exception:  # noqa: BLE001  (_Refused, or anything unforeseen: left to Dynamo)
        return None
    return out if isinstance(out, evaluator.sym_vt) else evaluator.const_vt.create(out)


# --- hooks ----------------------------------------------------------------------------------------------------------

_installed = False


def _jump_hook(handler: Callable) -> Callable:
    def jump(self, inst):
        truth = _convert(self, self.stack[-1], "bool") if self.stack else None
        if truth is not None:
            self.stack[-1] = truth
        return handler(self, inst)

    jump._moe_inductor_shape_tensors = True
    return jump


def _hook_tables(base: type) -> None:
    from .speculation import dispatch_tables

    for table in dispatch_tables(base):
        for opname, op in dis.opmap.items():
            # only the popping jumps: JUMP_IF_*_OR_POP would push back the replaced value, not the tensor
            if (opname.startswith("POP_JUMP") and opname.endswith(("_IF_TRUE", "_IF_FALSE")) and 0 <= op < len(table)
                    and table[op] is not None and not getattr(table[op], "_moe_inductor_shape_tensors", False)):
                table[op] = _jump_hook(table[op])


def install() -> None:
    """Hook Dynamo's tensor branches, ``int`` / ``float`` / ``bool`` of a tensor, ``Tensor.item`` and
    ``one_hot(num_classes=tensor)`` (idempotent); each hook does nothing outside a moe_inductor compile."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        _install()
    except Exception as error:  # an optional hook into Dynamo internals must never stop the backend from loading
        import warnings

        warnings.warn(f"moe_inductor: shape-tensor evaluation is off on this torch ({error!r}); branches on such "
                      "tensors graph-break as under other backends")


def _install() -> None:
    from torch._dynamo import symbolic_convert, variables
    from torch._dynamo.variables.tensor import TensorVariable

    base = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    builtin = getattr(variables, "BuiltinVariable", None)
    in_graph = getattr(variables, "TorchInGraphFunctionVariable", None)
    item = getattr(TensorVariable, "method_item", None)
    call_builtin = getattr(builtin, "call_function", None)
    call_torch = getattr(in_graph, "call_function", None)
    if base is None or not hasattr(base, "dispatch_table") or None in (item, call_builtin, call_torch):
        return
    _hook_tables(base)
    kinds = {bool: "bool", int: "int", float: "float"}

    def builtin_call(self, tx, args, kwargs):
        kind = kinds.get(getattr(self, "fn", None))
        if kind is not None and len(args) == 1 and not kwargs:
            out = _convert(tx, args[0], kind)
            if out is not None:
                return out
        return call_builtin(self, tx, args, kwargs)

    def method_item(self, tx, *args, **kwargs):
        if not args and not kwargs:
            out = _convert(tx, self, "item")
            if out is not None:
                return out
        return item(self, tx, *args, **kwargs)

    def torch_call(self, tx, args, kwargs):
        if getattr(self, "value", None) is F.one_hot:
            args, kwargs, built = _one_hot(tx, list(args), dict(kwargs))
            if built is not None:
                return built
        return call_torch(self, tx, args, kwargs)

    builtin.call_function = builtin_call
    TensorVariable.method_item = method_item
    in_graph.call_function = torch_call


def _one_hot(tx: Any, args: list, kwargs: dict) -> tuple[list, dict, Any]:
    """one_hot with a shape-tensor ``num_classes`` (eager takes an integer 0-d tensor through ``__index__``):
    (args, kwargs) with the width as an int, or the one_hot's VariableTracker when the width is symbolic.

    A symbolic width is traced without running one_hot's fake impl: its schema takes an ``int``, so the fake impl
    would specialise the width to this call's size (a recompile per token count). The example value is what eager
    returns, a contiguous int64 (*x.shape, C) tensor; a width that may be -1 (one_hot's "infer it from the data"),
    or a non-int64 ``x`` (an error in eager), is left as it is."""
    in_args = len(args) > 1
    width = args[1] if in_args else kwargs.get("num_classes")
    out = _convert(tx, width, "index") if width is not None else None
    if out is None or not _guard((out.as_python_constant() if out.is_python_constant() else out.sym_num) >= 0):
        return args, kwargs, None
    if in_args:
        args[1] = out
    else:
        kwargs["num_classes"] = out
    if out.is_python_constant() or len(args) > 2 or set(kwargs) - {"num_classes"} or not args:
        return args, kwargs, None
    from torch._dynamo.variables import TensorVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy

    x = args[0]
    fake = x.as_proxy().node.meta.get("example_value") if isinstance(x, TensorVariable) else None
    if not isinstance(fake, torch.Tensor) or fake.dtype is not torch.int64:
        return args, kwargs, None
    proxy = tx.output.create_proxy("call_function", F.one_hot, (x.as_proxy(),), {"num_classes": out.as_proxy()})
    with tx.output.fake_mode:
        example = fake.new_empty((*fake.shape, out.sym_num), dtype=torch.int64)
    return args, kwargs, wrap_fx_proxy(tx, proxy, example_value=example)
