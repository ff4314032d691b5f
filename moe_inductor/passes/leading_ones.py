"""A canonical form the loop passes read: one expert's work computed with a leading size-1 dim and read back by
``[0]``, spelled without that dim.

transformers v4.55-4.57's GPT-OSS and Qwen3-VL-MoE index their stacked weights by the loop's (1,) index tensor, so
each projection is batched over one expert and the result is read back at its first row::

    gate_up = rows @ gate_up_proj[expert_idx] + gate_up_proj_bias[expert_idx]    # (1, n, 2I)
    out = act(gate_up) @ down_proj[expert_idx] + down_proj_bias[expert_idx]      # (1, n, H)
    y = out[0] * weights[tok, expert_idx, None]                                   # (n, H)

hit_loops.py traces ``w[expert_idx]`` as the view ``w[e:e+1]`` (the same values as eager's copy; a rewrite that keeps
the loop never writes to it). ``peel_leading_ones`` then rewrites ``out[0]`` as the same chain of ops on ``w[e]``:
a matmul of a 2-d input by a (1, K, N) weight is that row of the 2-d product, an elementwise op of operands with a
leading 1 and operands of at most 2 dims broadcasts the same over the trailing dims once the 1 is gone, and an index
or chunk of the last dim reads the same columns. Anything else in the chain leaves ``out[0]`` as it is.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from .fx_utils import is_call, val

#: elementwise functions and methods a peeled chain may hold (scalar arguments besides the chain's own)
_ELEMENTWISE_FUNCTIONS = {operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, torch.add,
                          torch.mul, torch.sub, torch.sigmoid, torch.tanh, torch.clamp, F.silu, F.gelu, F.relu,
                          torch.relu}
_ELEMENTWISE_METHODS = {"add", "mul", "sub", "sigmoid", "tanh", "clamp", "clip", "neg", "relu", "to", "float",
                        "type_as"}
_MATMULS = {operator.matmul, torch.matmul}
#: an argument a peeled chain cannot take
_NO = object()


def _weight_slice(node: Node) -> Optional[tuple[Node, int]]:
    """(w, e) for ``w[e:e+1]`` of a graph input: the one-expert batch of a stacked weight or bias."""
    if not (is_call(node, "call_function", operator.getitem) and isinstance(node.args[0], Node)):
        return None
    w, index = node.args
    if not (isinstance(index, slice) and isinstance(index.start, int) and index.stop == index.start + 1
            and index.step in (None, 1) and w.op in ("placeholder", "get_attr")):
        return None
    return w, index.start


def _last_dim_index(index) -> bool:
    """An index that reads the last dim only: ``[..., s]`` with s a slice."""
    return isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)


class _Peeler:
    def __init__(self, graph: Graph, before: Node):
        self.graph, self.before, self.memo = graph, before, {}

    def _new(self, op: str, target, args, kwargs, like: Node) -> Node:
        """A node before the chain's end with ``like``'s meta, its traced value (or each of a tuple's) without the
        leading 1."""
        with self.graph.inserting_before(self.before):
            node = self.graph.create_node(op, target, args, kwargs)
        node.meta = {k: v for k, v in like.meta.items() if k != "example_value"}
        value = like.meta.get("example_value")
        if isinstance(value, (tuple, list)):
            node.meta["example_value"] = tuple(p[0] for p in value)
        elif val(like) is not None:
            node.meta["example_value"] = val(like)[0]
        return node

    def peel(self, node) -> Optional[Node]:
        """``node[0]`` spelled without the leading 1 (a node of one dim fewer), or None."""
        if not isinstance(node, Node):
            return None
        if node in self.memo:
            return self.memo[node]
        self.memo[node] = None  # a cycle cannot happen in a graph; this only stops repeated failing work
        got = self._peel(node)
        self.memo[node] = got
        return got

    def _operand(self, arg):
        """A peeled argument: the chain's own nodes peeled; numbers and tensors of at most 2 dims as they are."""
        if not isinstance(arg, Node):
            return arg if isinstance(arg, (int, float, bool, torch.dtype)) or arg is None else _NO
        v = val(arg)
        if v is None:
            return _NO
        sliced = _weight_slice(arg)
        if sliced is not None and v.dim() == 2:  # b[e:e+1] (1, N) of a stacked bias: b[e] broadcasts the same
            return self._new("call_function", operator.getitem, sliced, {}, arg)
        if v.dim() == 3 and v.shape[0] == 1:
            peeled = self.peel(arg)
            return _NO if peeled is None else peeled
        return arg if v.dim() <= 2 else _NO

    def _peel(self, node: Node) -> Optional[Node]:
        v = val(node)
        if v is None or v.dim() != 3 or v.shape[0] != 1:
            return None
        sliced = _weight_slice(node)
        if sliced is not None:
            w, e = sliced
            return self._new("call_function", operator.getitem, (w, e), {}, node)
        if node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2 and not node.kwargs:
            a, w = node.args
            av = val(a) if isinstance(a, Node) else None
            if av is None:
                return None
            a2 = a if av.dim() == 2 else (self.peel(a) if av.dim() == 3 and av.shape[0] == 1 else None)
            w2 = self.peel(w) if isinstance(w, Node) and _weight_slice(w) is not None else None
            if a2 is None or w2 is None:
                return None
            return self._new("call_function", node.target, (a2, w2), {}, node)
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
            base, index = node.args
            if _last_dim_index(index):
                peeled = self.peel(base)
                return None if peeled is None else self._new("call_function", operator.getitem, (peeled, index), {},
                                                             node)
            if isinstance(index, int) and is_call(base, "call_method", "chunk") and _chunks_last_dim(base):
                chunks = self._peel_chunk(base)
                return None if chunks is None else self._new("call_function", operator.getitem, (chunks, index), {},
                                                             node)
            return None
        elementwise = (node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS) or (
            node.op == "call_method" and node.target in _ELEMENTWISE_METHODS)
        if not elementwise:
            return None
        args = [self._operand(a) for a in node.args]
        kwargs = {k: self._operand(a) for k, a in node.kwargs.items()}
        if any(a is _NO for a in (*args, *kwargs.values())):
            return None
        if not any(isinstance(a, Node) and a is not b for a, b in zip(args, node.args)):
            return None  # nothing of the chain in it: a leading 1 of another origin
        return self._new(node.op, node.target, tuple(args), kwargs, node)

    def _peel_chunk(self, chunk: Node) -> Optional[Node]:
        if chunk in self.memo:
            return self.memo[chunk]
        base = self.peel(chunk.args[0])
        got = None if base is None else self._new("call_method", "chunk", (base, *chunk.args[1:]), dict(chunk.kwargs),
                                                  chunk)
        self.memo[chunk] = got
        return got


def _chunks_last_dim(chunk: Node) -> bool:
    dim = chunk.kwargs.get("dim", chunk.args[2] if len(chunk.args) > 2 else 0)
    return dim == -1 and isinstance(chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks"), int)


def peel_leading_ones(graph: Graph) -> int:
    """Replace each ``y[0]`` of a one-expert chain (module docstring) by the chain without its leading 1; the old
    chain goes with dead-code elimination. Returns how many were replaced."""
    done = 0
    for node in list(graph.nodes):
        if not (is_call(node, "call_function", operator.getitem) and node.args[1] == 0
                and isinstance(node.args[0], Node)):
            continue
        base = node.args[0]
        bv = val(base)
        if bv is None or bv.dim() != 3 or bv.shape[0] != 1:
            continue
        peeled = _Peeler(graph, node).peel(base)
        if peeled is None:
            continue
        node.replace_all_uses_with(peeled)
        graph.erase_node(node)
        done += 1
    return done
