"""Helpers shared by the FX matchers: node values, einsum parsing, combines, source lines (views and in-place writes:
aliases.py; how an expert's activation is read: gated_reads.py)."""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional

import torch
from torch.fx import Node


def is_call(node, op: str, *targets) -> bool:
    """``node`` is an FX node of kind ``op`` ("call_function", "call_method") with one of ``targets``."""
    return isinstance(node, Node) and node.op == op and node.target in targets


# Tensor dunder methods and the operator functions they equal. Dynamo in torch 2.11 records ``ids == e`` as
# ``call_method __eq__``, 2.13 as ``call_function operator.eq``; the matchers are written for the latter.
_DUNDER_OPERATORS = {
    "__eq__": operator.eq, "__ne__": operator.ne, "__lt__": operator.lt, "__le__": operator.le,
    "__gt__": operator.gt, "__ge__": operator.ge, "__add__": operator.add, "__sub__": operator.sub,
    "__mul__": operator.mul, "__truediv__": operator.truediv, "__floordiv__": operator.floordiv,
    "__matmul__": operator.matmul, "__pow__": operator.pow, "__and__": operator.and_, "__or__": operator.or_,
    "__xor__": operator.xor, "__getitem__": operator.getitem, "__setitem__": operator.setitem,
    "__neg__": operator.neg, "__invert__": operator.invert,
}
_OPERATOR_ARITY = {operator.neg: 1, operator.invert: 1, operator.setitem: 3}  # 2 for every other one


def reach(roots: Iterable[Any], step: Callable[[Node], Iterable[Node]]) -> set[Node]:
    """The nodes among ``roots`` and every node reached from them by ``step`` (``lambda n: n.all_input_nodes``:
    ancestors; ``lambda n: n.users``: descendants). Roots that are not nodes (constants) are skipped."""
    seen, stack = set(), [r for r in roots if isinstance(r, Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def canonicalize_operators(graph: torch.fx.Graph) -> int:
    """Respell ``call_method __eq__(a, b)`` (and the other tensor dunders) as ``call_function operator.eq(a, b)``.

    The two mean the same thing when the receiver is a tensor, which is the only case changed. Returns how many
    nodes were respelled."""
    changed = 0
    for node in list(graph.nodes):
        fn = _DUNDER_OPERATORS.get(node.target) if node.op == "call_method" else None
        arity = _OPERATOR_ARITY.get(fn, 2)
        if fn is None or node.kwargs or len(node.args) != arity or not isinstance(node.args[0], Node):
            continue
        if val(node.args[0]) is None:  # only a tensor receiver makes the two spellings equal
            continue
        with graph.inserting_before(node):
            new = graph.call_function(fn, node.args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed += 1
    return changed


def drop_identity_casts(graph: torch.fx.Graph) -> int:
    """Replace ``t.to(...)`` by ``t`` where it converts nothing: its traced value has ``t``'s dtype and device, and
    no ``copy=True`` or ``memory_format`` is asked. Eager's ``Tensor.to`` then returns ``t`` itself, so the uses
    see the same tensor either way (user code moves the routing weight to the expert output's device, or casts it to
    the dtype it already has). Returns how many were dropped."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "to" or not node.args or not isinstance(node.args[0], Node):
            continue
        if node.kwargs.get("copy", False) or "memory_format" in node.kwargs or len(node.args) > 3:
            continue
        if any(a is True for a in node.args[2:]):  # to(dtype, non_blocking, copy) spelled positionally
            continue
        before, after = val(node.args[0]), val(node)
        if before is None or after is None or before.dtype != after.dtype or before.device != after.device:
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        dropped += 1
    return dropped


#: the in-place combines (each returns its receiver) whose result user code may read instead of the buffer. The
#: writes that build a routing matrix (``scatter_``, ``masked_fill_``) are left as they are: the proofs read the
#: matrix through them
_COMBINES_RETURNING_SELF = {"index_add_", "index_put_", "index_copy_", "scatter_add_"}


def read_receivers_of_inplace_results(graph: torch.fx.Graph) -> int:
    """Point the readers of an in-place combine's result at its receiver: ``out = out.index_add_(...)`` then reads
    ``out`` as ``out.index_add_(...); ... out``. The result is the receiver itself, so every reader sees the same
    tensor; the matchers then meet one accumulator whichever way the user wrote it. Returns how many readers moved."""
    moved = 0
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target in _COMBINES_RETURNING_SELF and node.args
                and isinstance(node.args[0], Node) and val(node.args[0]) is not None):
            continue
        for user in list(node.users):
            user.replace_input_with(node, node.args[0])
            moved += 1
    return moved


def comes_before(node: Node, other: Node) -> bool:
    """``node`` comes before ``other`` in graph order (a walk forward from ``node``)."""
    cur = node.next
    while cur.op != "root":
        if cur is other:
            return True
        cur = cur.next
    return False


def redirect_later_readers(node: Node, after: Node, new: Node) -> None:
    """Point the readers of ``node`` that come after ``after`` in graph order at ``new`` (``new`` itself aside): a
    rewrite's result, or a node made from it, takes ``node``'s place for what the graph does after ``after``."""
    later, cur = set(), after.next
    while cur.op != "root":
        later.add(cur)
        cur = cur.next
    for reader in [u for u in node.users if u in later and u is not new]:
        reader.replace_input_with(node, new)


#: ops that give the same values from the same inputs, as routers' ids are recomputed in loop bodies
#: (``logits.argmax(-1) == e`` in every iteration, or ``x[idx == e]`` and ``out[idx == e]`` as two masks)
_SAME_VALUE_METHODS = {"argmax", "max", "topk", "squeeze", "view", "reshape", "flatten"}
_SAME_VALUE_FUNCTIONS = {torch.argmax, torch.max, torch.topk, torch.squeeze, torch.flatten, operator.getitem}


def same_value_key(node: Node, top: Optional[Node] = None) -> Any:
    """A key that two nodes share when they compute the same values: the same ops of ``_SAME_VALUE_*`` on the same
    inputs, none of which is changed in place anywhere in the graph (a changed input may give another value at each
    read, so a node reading one is keyed by itself alone). ``top``: the node the key is for, when recursing."""
    from .aliases import alias_mutations  # aliases.py reads values and calls through this module

    top = node if top is None else top
    known = (node.op == "call_method" and node.target in _SAME_VALUE_METHODS) or (
        node.op == "call_function" and node.target in _SAME_VALUE_FUNCTIONS)
    if not known:
        return top if alias_mutations(node) else node

    def arg(a: Any) -> Any:
        return same_value_key(a, top) if isinstance(a, Node) else repr(a)  # slices are unhashable
    return node.target, tuple(map(arg, node.args)), tuple(sorted((k, arg(v)) for k, v in node.kwargs.items()))


def scale_of_rows(buf: Node, readers: set, lead: tuple) -> Optional[tuple[Node, Node]]:
    """(the product, s) when the loop's result is read once, as ``buf * s`` (either order) with s a float tensor of
    the ids' shape plus a trailing 1 ((T, 1), or (B, T, 1)): each row's one expert output scaled by its own s (Switch
    scales the combined result by the chosen probability); a broadcast s of any other shape is no routing weight.
    ``readers`` are buf's readers other than the loop's own writes and reads."""
    if len(readers) != 1:
        return None
    (mul,) = readers
    if not (is_call(mul, "call_function", operator.mul) and len(mul.args) == 2 and not mul.kwargs):
        return None
    s = mul.args[1] if mul.args[0] is buf else mul.args[0] if mul.args[1] is buf else None
    sv = val(s) if isinstance(s, Node) else None
    if sv is None or not sv.is_floating_point() or tuple(sv.shape) != lead + (1,):
        return None
    return mul, s


_LIKE_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full")
_LIKE_FUNCTIONS = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like)

#: factories whose result is memory of its own: its values are whatever is written into it, never an op's result
#: a proof reads from the dataflow
_FRESH_FUNCTIONS = (torch.zeros, torch.ones, torch.empty, torch.full, *_LIKE_FUNCTIONS)


def made_fresh(node: Node) -> bool:
    """Whether ``node`` is a tensor made fresh (zeros, ones, empty, full, their ``*_like`` and ``new_*``), not
    written into an ``out=`` tensor."""
    return (is_call(node, "call_function", *_FRESH_FUNCTIONS) or is_call(node, "call_method", *_LIKE_METHODS)) and (
        "out" not in node.kwargs)


def same_view(node):
    """``t`` for ``t.view(...)`` / ``t.reshape(...)`` / ``t.view_as(u)`` of t's own shape (Unsloth's
    ``X.view(-1, X.shape[-1])`` of a 2-d X): the same tensor."""
    while (is_call(node, "call_method", "view", "reshape", "view_as") and isinstance(node.args[0], Node)
           and not node.kwargs):
        inner, outer = val(node.args[0]), val(node)
        if inner is None or outer is None or inner.dim() != outer.dim() or not all(
                map(known_equal, inner.shape, outer.shape)):
            break
        node = node.args[0]
    return node


def reads_metadata_only(user: Node, node: Node) -> bool:
    """Whether ``user`` reads nothing of ``node`` but its shape, dtype and device: ``node.new_zeros(...)`` (and the
    other ``new_*`` methods) or ``torch.zeros_like(node, ...)`` (and the other ``*_like``), with ``node`` as the
    template only. Such a reader sees the same thing whatever values ``node`` holds, so a rewrite that replaces how
    those values are computed leaves it as it was."""
    template = user.op == "call_method" and user.target in _LIKE_METHODS or (
        user.op == "call_function" and user.target in _LIKE_FUNCTIONS)
    if not template or not user.args or user.args[0] is not node:
        return False
    rest: list = []
    torch.fx.node.map_arg((user.args[1:], user.kwargs), rest.append)
    return node not in rest


def val(node) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo traced for ``node`` (``example_value`` in Dynamo graphs, ``val`` after aot)."""
    if not isinstance(node, Node):
        return None
    v = node.meta.get("val", node.meta.get("example_value"))
    return v if isinstance(v, torch.Tensor) else None


def einsum_parts(node: Node) -> Optional[tuple[list[str], str, list[Node]]]:
    """(input subscripts, output subscripts, operands) of an einsum node with an explicit output."""
    if node.op != "call_function" or node.target is not torch.functional.einsum and node.target is not torch.einsum:
        return None
    if not node.args or not isinstance(node.args[0], str) or node.kwargs:
        return None
    eq = node.args[0].replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(subs) != len(operands) or not all(isinstance(o, Node) for o in operands):
        return None
    if "." in eq:
        return _expand_ellipsis(subs, out, operands)
    return subs, out, operands


def _expand_ellipsis(subs: list[str], out: str, operands: list[Node]):
    """The einsum with each ``...`` spelled as fresh letters, where every operand's ``...`` covers the same sizes
    (no broadcasting) and the output keeps them: then it is the same einsum."""
    terms = [*subs, out]
    if any(t.count("...") > 1 or t.replace("...", "").count(".") for t in terms) or "..." not in out:
        return None
    sizes = []
    for t, o in zip(subs, operands):
        v = val(o)
        if v is None:
            return None
        if "..." in t:
            rank = v.dim() - len(t.replace("...", ""))
            if rank < 0:
                return None
            sizes.append(tuple(v.shape[t.index("..."):t.index("...") + rank]))
    if not sizes or any(len(s) != len(sizes[0]) or any(
            not (a is b or (type(a) is int and type(b) is int and a == b) or str(a) == str(b))
            for a, b in zip(s, sizes[0])) for s in sizes):
        return None
    used = set("".join(terms))
    fresh = "".join([c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used][
        :len(sizes[0])])
    if len(fresh) != len(sizes[0]):
        return None
    return [t.replace("...", fresh) for t in subs], out.replace("...", fresh), operands


def single_use(*nodes: Node) -> bool:
    return all(len(n.users) == 1 for n in nodes)


def weighted_sum(y: Node) -> Optional[tuple[Node, Node]]:
    """(outputs (T, n, H), weights (T, n)) of ``einsum("tai,ta->ti", o, w)`` or ``(o * w[..., None]).sum(1)``."""
    parsed = einsum_parts(y)
    if parsed is not None:
        subs, out, ops = parsed
        if len(ops) != 2:
            return None
        for oi, wi in ((0, 1), (1, 0)):
            if len(subs[oi]) == 3 and len(subs[wi]) == 2 and subs[wi] == subs[oi][:2] and out == subs[oi][0] + subs[oi][2]:
                return ops[oi], ops[wi]
        return None
    if y.op == "call_method" and y.target == "sum" and len(y.args) >= 1:
        dim = y.args[1] if len(y.args) > 1 else y.kwargs.get("dim")
        if dim != 1 or y.kwargs.get("keepdim", False) or isinstance(y.args[0], Node) is False:
            return None
        prod = y.args[0]
        if prod.op != "call_function" or prod.target is not operator.mul or not single_use(prod):
            return None
        for o, w in (prod.args, prod.args[::-1]):
            base = unsqueezed_last(w)
            if isinstance(o, Node) and base is not None and single_use(w):
                return o, base
        return None
    # torch.bmm(w.unsqueeze(1), o).squeeze(1): (T, 1, n) @ (T, n, H), the same sum over n
    if is_call(y, "call_method", "squeeze") and tuple(y.args[1:]) in ((1,), (-2,)) and not y.kwargs:
        bmm = y.args[0]
        if not (is_call(bmm, "call_function", torch.bmm) and len(bmm.args) == 2 and not bmm.kwargs
                and single_use(bmm)):
            return None
        w3, o = bmm.args
        row = (is_call(w3, "call_method", "unsqueeze") and tuple(w3.args[1:]) in ((1,), (-2,))) or (
            is_call(w3, "call_function", operator.getitem) and w3.args[1] == (slice(None, None, None), None))
        if not (row and single_use(w3) and isinstance(o, Node)):
            return None
        wv, ov = val(w3.args[0]), val(o)
        if wv is not None and ov is not None and wv.dim() == 2 and ov.dim() == 3 and tuple(ov.shape[:2]) == tuple(
                wv.shape):
            return o, w3.args[0]
    return None


def known_equal(a, b) -> bool:
    """``a == b`` for sizes that may be symbolic: True only where it holds for every value the sizes may take. It adds
    no guard, and an unbacked size (a nonzero's) gives False where a plain ``==`` would raise."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


_ALL = slice(None, None, None)
#: the two callables Dynamo records ``F.one_hot`` under
ONE_HOT = (torch.nn.functional.one_hot, torch._C._nn.one_hot)


def same_traced(a: Any, b: Any) -> bool:
    """Two traced sizes are the same size (equal ints, or one symbolic expression)."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return str(a.node.expr) == str(b.node.expr)
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        # a plain int size made from a symbolic one: Dynamo specialised it (one_hot's num_classes), under a guard
        s, i = (a, b) if isinstance(a, torch.SymInt) else (b, a)
        return isinstance(i, int) and s.node.hint == i
    return isinstance(a, int) and isinstance(b, int) and a == b


def _new_axes_only(index: Any) -> bool:
    """An index of Nones, full slices and an Ellipsis only: it adds size-1 axes and selects nothing."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or p == _ALL for p in parts)


def column_of(node, dims: int = 1) -> Optional[Node]:
    """``w`` for a ``dims``-d ``w`` read with a trailing size-1 axis: a view, reshape, unsqueeze (method or function)
    or index of Nones and full slices whose result has ``w``'s shape and then a 1. Such a result holds w's values in
    w's order whatever the spelling (``w.unsqueeze(-1)``, ``torch.unsqueeze(w, 1)``, ``w[..., None]``,
    ``w[:, None]``, ``w.view(-1, 1)``, ``w.reshape(T, 1)``, ``w.view(*w.shape, 1)``): only size-1 axes differ."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    w = node.args[0]
    if not (is_call(node, "call_method", "unsqueeze", "view", "reshape")
            or is_call(node, "call_function", torch.unsqueeze, torch.reshape)
            or (is_call(node, "call_function", operator.getitem) and len(node.args) == 2
                and _new_axes_only(node.args[1]))):
        return None
    src, out = val(w), val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.dim() != dims \
            or out.dim() != dims + 1 or out.dtype != src.dtype:
        return None
    want = (*src.shape, 1)
    return w if all(same_traced(a, b) for a, b in zip(out.shape, want)) else None


def unsqueezed_last(node) -> Optional[Node]:
    """``w`` for ``w[..., None]`` or ``w.unsqueeze(-1)`` of a 2-d w."""
    return column_of(node, 2)


def rounding_cast(node) -> Optional[tuple[str, str]]:
    """(from, to) dtype names for a cast (``.to(dtype)``, ``.half()``, ``.float()``, ``.bfloat16()``, ``.type(..)``)
    to a floating dtype narrower than its floating input's: one that rounds the values; else None."""
    if not (is_call(node, "call_method", "to", "half", "float", "bfloat16", "type", "type_as") and node.args
            and isinstance(node.args[0], Node)):
        return None
    src, dst = val(node.args[0]), val(node)
    if src is None or dst is None or not (src.is_floating_point() and dst.is_floating_point()):
        return None
    if torch.finfo(dst.dtype).bits >= torch.finfo(src.dtype).bits and not (
            {src.dtype, dst.dtype} == {torch.float16, torch.bfloat16}):
        return None
    return str(src.dtype).removeprefix("torch."), str(dst.dtype).removeprefix("torch.")


def flat_of(node) -> Optional[Node]:
    """``t`` for ``t.view(-1)``, ``t.reshape(-1)`` or ``t.flatten()``."""
    if is_call(node, "call_method", "view", "reshape") and tuple(node.args[1:]) in ((-1,), ((-1,),)) and not node.kwargs:
        return node.args[0]
    if is_call(node, "call_method", "flatten") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


def arange_length(node):
    """n for ``torch.arange(n)`` (or ``arange(0, n)``, ``arange(0, n, 1)``) of an integer dtype: the values 0, 1, ...,
    n-1. n is an int, or a traced size (a SymInt) in a dynamic graph; callers that need an int check for one."""
    if not (is_call(node, "call_function", torch.arange) and set(node.kwargs) <= {"device", "dtype"}):
        return None
    args = tuple(node.args)
    if not 1 <= len(args) <= 3:
        return None
    start, step = (0 if len(args) == 1 else args[0]), (args[2] if len(args) == 3 else 1)
    if not (type(start) is int and start == 0 and type(step) is int and step == 1):
        return None
    av = val(node)
    if av is None or av.dim() != 1 or av.dtype.is_floating_point or av.dtype == torch.bool:
        return None
    return av.shape[0]


def size_is(arg, size) -> bool:
    """A view's size argument that is ``size``: -1 (inferred), or an int or a traced size (``x.size(0)`` of a
    dynamic graph) equal to it for every value."""
    if isinstance(arg, Node):
        traced = arg.meta.get("val", arg.meta.get("example_value"))
        return isinstance(traced, (int, torch.SymInt)) and known_equal(traced, size)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return False
    return arg == -1 or known_equal(arg, size)


def _user_frame(node: Node) -> Optional[tuple[str, str, str, str]]:
    """(path, line number, function, code line) of the innermost frame in a node's stack trace (Dynamo's)."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].strip()
        if head.startswith('File "') and ", line " in head:
            path = head[len('File "'):head.index('"', len('File "'))]
            lineno = head.split(", line ")[1].split(",")[0]
            function = head.rsplit(", in ", 1)[1] if ", in " in head else ""
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return path, lineno, function, code
    return None


def source_function(node: Node) -> Optional[str]:
    """``file:function`` of the innermost user frame in a node's stack trace, else None."""
    frame = _user_frame(node)
    return f"{frame[0]}:{frame[2]}" if frame is not None else None


def source_line(node: Node) -> str:
    """``file:line: code`` of the user's source for a node, from Dynamo's stack trace, else the node name."""
    frame = _user_frame(node)
    if frame is None:
        return node.name
    path, lineno, _, code = frame
    return f"{path.rsplit('/', 1)[-1]}:{lineno}: {code}"
