"""In-place arithmetic on a tensor the graph has just made, read as the out-of-place op it equals.

Real MoE code writes into its own intermediates: MiniMax-M2's port weights each expert's output in place
(``expert_output.mul_(weights)``), multiplies its MLP's gate in place (``gate = act(w1(x)); gate.mul_(w3(x))``), adds
the routing bias to the sigmoid's scores (``scores.add_(bias)``) and normalises the gathered weights
(``routing_weights.div_(s)``). The dataflow the proofs read shows the node that made the tensor, not the write, so
the driver refuses such regions (``stale_reads.unseen_write``, ``driver.inputs_unchanged``). Where the write is
provably the same program as ``x2 = x.op(y)`` with every later reader of ``x`` reading ``x2``, the graph is respelled
so before the passes match, and the proofs see the product, the sum or the quotient as a value of its own:

- ``x`` is made by an op that always returns memory of its own (``_FRESH_*``: a linear, a matmul, elementwise
  arithmetic and activations, a gather, an advanced index, a reduction, a clone, a cast that changes the dtype), and
  its traced value is no view. A view, an input, a parameter or a buffer is never respelled: its memory is seen by
  other names, which the write changes too;
- every reader of ``x`` before the write makes a new tensor of its own (the same list) or reads only its shape: no
  view, alias, second write or hook sees ``x``'s memory, so after the write only the readers the graph points at
  ``x2`` could see it;
- the out-of-place op gives ``x``'s dtype, shape and device (an in-place op keeps ``x``'s dtype where the
  out-of-place one may promote: that write is left as it is);
- no backward can reach the write: a write over a tensor that autograd saved (the sigmoid's output, or ``x`` read
  by a product with a weight that requires grad) makes eager's backward raise ("modified by an inplace operation"),
  which the out-of-place spelling would not. So neither ``x``, nor the write's result, nor any reader of ``x`` before
  the write requires grad (under ``torch.no_grad()`` none does).

The driver runs this on each pass's copy of the graph, which is kept only where the pass rewrites a region
(``driver.run_pass``); a write it leaves is still refused by the driver's checks.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from .aliases import alias_source, tensors_written
from .fx_utils import known_equal, reads_metadata_only, val

#: the in-place methods respelled, and the out-of-place method each equals (the binary ones without keywords
#: become operator calls, the spelling the matchers read)
_METHODS = {"mul_": "mul", "div_": "div", "add_": "add", "sub_": "sub", "clamp_": "clamp",
            "clamp_min_": "clamp_min", "clamp_max_": "clamp_max",
            "__imul__": "mul", "__itruediv__": "div", "__iadd__": "add", "__isub__": "sub"}
_OPERATORS = {operator.imul: "mul", operator.itruediv: "div", operator.iadd: "add", operator.isub: "sub"}
_AS_OPERATOR = {"mul": operator.mul, "div": operator.truediv, "add": operator.add, "sub": operator.sub}

#: ops whose result is always memory of its own (with no ``out=`` and no ``inplace=True``, checked apart)
_FRESH_FUNCTIONS = {
    torch._C._nn.linear, F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm,
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.exp, torch.sigmoid, torch.tanh,
    torch.relu, torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, F.silu, F.gelu, F.relu, torch.gather,
    torch.index_select, torch.cat, torch.concat, torch.stack, torch.clone, torch.sum, torch.mean, torch.clamp,
    torch.where, torch.topk, torch.sort, torch.amax, torch.amin, torch.rsqrt, torch.sqrt, torch.square,
}
_FRESH_METHODS = {
    "mul", "add", "sub", "div", "neg", "pow", "exp", "sigmoid", "tanh", "relu", "softmax", "log_softmax", "matmul",
    "mm", "bmm", "gather", "index_select", "clone", "sum", "mean", "clamp", "clamp_min", "clamp_max", "topk", "sort",
    "amax", "amin", "rsqrt", "sqrt", "square", "__mul__", "__add__", "__sub__", "__truediv__", "__matmul__",
    # casts: fresh only where the dtype changes (``_returns_its_input`` makes a same-dtype cast an alias)
    "to", "float", "half", "bfloat16", "double", "type_as",
}
#: readers of a tensor's shape, dtype or device only
_METADATA_METHODS = {"size", "dim", "numel", "ndimension", "nelement"}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"}


def _parts(node: Node) -> Optional[tuple]:
    """The tensors of a node's traced value (one, or a tuple's), or None where any part is no tensor."""
    got = node.meta.get("val", node.meta.get("example_value"))
    parts = got if isinstance(got, (tuple, list)) else (got,)
    return tuple(parts) if parts and all(isinstance(p, torch.Tensor) for p in parts) else None


def makes_own_memory(node: Node) -> bool:
    """Whether ``node``'s result is memory of its own: an op of ``_FRESH_*`` (or an index by a tensor) that writes
    nothing and returns no alias of an argument, whose traced values are no views."""
    if node.op == "call_function":
        known = node.target in _FRESH_FUNCTIONS or (node.target is operator.getitem and _tensor_index(node))
    else:
        known = node.op == "call_method" and node.target in _FRESH_METHODS
    if not known or "out" in node.kwargs or tensors_written(node) or alias_source(node) is not None:
        return False
    parts = _parts(node)
    return parts is not None and not any(p._is_view() for p in parts)


def _tensor_index(node: Node) -> bool:
    """``t[i]`` with a tensor in the index (advanced indexing, which copies); a tuple's element is never one."""
    if len(node.args) != 2 or not isinstance(node.args[0], Node) or val(node.args[0]) is None:
        return False
    index = node.args[1] if isinstance(node.args[1], (tuple, list)) else (node.args[1],)
    return any(isinstance(p, Node) and val(p) is not None for p in index)


def _reads_shape_only(user: Node, node: Node) -> bool:
    if user.op == "call_method" and user.target in _METADATA_METHODS:
        return True
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[1] in _METADATA_ATTRIBUTES
    return reads_metadata_only(user, node)


def _needs_grad(node: Node) -> bool:
    parts = _parts(node)
    return parts is None or any(p.requires_grad for p in parts)


def _written(node: Node) -> Optional[tuple[Node, str]]:
    """(the tensor written, the out-of-place method it equals) for an in-place op of ``_METHODS``/``_OPERATORS``."""
    if node.op == "call_method" and node.target in _METHODS:
        name = _METHODS[node.target]
    elif node.op == "call_function" and node.target in _OPERATORS and not node.kwargs:
        name = _OPERATORS[node.target]
    else:
        return None
    if not node.args or not isinstance(node.args[0], Node) or "out" in node.kwargs:
        return None
    return node.args[0], name


def _fake(a: Any) -> Any:
    """The traced value that stands for argument ``a`` (a node's, or the constant itself)."""
    if isinstance(a, Node):
        got = a.meta.get("val", a.meta.get("example_value"))
        if got is None:
            raise LookupError(a.name)
        return got
    if isinstance(a, (tuple, list)):
        return type(a)(_fake(p) for p in a)
    return a


def _out_of_place(write: Node, x: Node, name: str) -> Optional[torch.Tensor]:
    """The traced value of the out-of-place op, where it has ``x``'s dtype, shape and device; else None."""
    xv = val(x)
    mode = getattr(xv, "fake_mode", None)
    if mode is None:
        return None
    try:
        args, kwargs = _fake(write.args[1:]), {k: _fake(v) for k, v in write.kwargs.items()}
        with mode, torch.no_grad():
            out = getattr(xv, name)(*args, **kwargs)
    except Exception:  # a value the trace does not hold, or an op the fake tensors refuse: the write stays
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != xv.dtype or out.device != xv.device or out.dim() != xv.dim():
        return None
    return out if all(known_equal(a, b) for a, b in zip(out.shape, xv.shape)) else None


def _before(x: Node, write: Node) -> list[Node]:
    """The readers of ``x`` that come before ``write`` in graph order."""
    found, cur = [], x.next
    while cur is not write:
        if cur in x.users:
            found.append(cur)
        cur = cur.next
    return found


def respell_private_writes(graph: Graph) -> int:
    """Replace each in-place write of ``_METHODS``/``_OPERATORS`` that the module docstring proves equal by its
    out-of-place op, the later readers of the written tensor and of the write's result reading the new node. Writes
    are taken in graph order, so a chain (``x.div_(s); x.mul_(c)``) is respelled link by link. Returns how many."""
    done = 0
    for write in list(graph.nodes):
        found = _written(write)
        if found is None:
            continue
        x, name = found
        if not makes_own_memory(x) or _needs_grad(x) or _needs_grad(write):
            continue
        earlier = _before(x, write)
        if any(not (_reads_shape_only(u, x) or (makes_own_memory(u) and not _needs_grad(u))) for u in earlier):
            continue
        out = _out_of_place(write, x, name)
        if out is None:
            continue
        with graph.inserting_before(write):
            if name in _AS_OPERATOR and len(write.args) == 2 and not write.kwargs:
                new = graph.call_function(_AS_OPERATOR[name], write.args)
            else:
                new = graph.call_method(name, write.args, dict(write.kwargs))
        new.meta = {k: v for k, v in write.meta.items() if k != "val"}
        new.meta["example_value"] = out
        later = [u for u in x.users if u is not write and u is not new and u not in earlier]
        for user in later:
            user.replace_input_with(x, new)
        write.replace_all_uses_with(new)
        graph.erase_node(write)
        done += 1
    return done
