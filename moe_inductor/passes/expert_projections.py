"""One expert's projections read off an unrolled loop body: ``w[e]`` of a stacked weight or a per-expert one (an
nn.Linear's), ``a @ w.T`` / ``F.linear(a, w)`` / ``a @ w``, a bias (an nn.Linear's, or row e of a stacked one) and
the whole bias-free MLP ending at an expert's output. Shared by the loop forms (unrolled_loop, split_loop,
masked_writes, top1_masks, table_writes, padded_capacity, dense_experts, scattered_slices): each proof keeps its own
checks between the projections.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional, Union

import torch
from torch.fx import Node

from .fx_utils import is_call, val
from .gated_reads import GatedRead, read_gated


def _expert_weight(node: Node, e: int) -> Optional[tuple[Node, bool, bool]]:
    """(weight, transposed?, stacked?) for ``w[e]`` of a stacked (E, ., .) weight, or a per-expert 2D weight (an
    nn.Linear's), each optionally as ``.T``, ``.t()`` or ``.transpose(0, 1)``."""
    transposed = False
    if is_call(node, "call_function", getattr) and node.args[1] in ("T", "mT"):
        node, transposed = node.args[0], True
    elif is_call(node, "call_method", "t") or (is_call(node, "call_method", "transpose") and set(node.args[1:]) in ({0, 1},
                                                                                                        {-1, -2})):
        node, transposed = node.args[0], True
    chunked = _chunk_of_stacked(node, e)
    if chunked is not None:
        return chunked, transposed, True
    if is_call(node, "call_function", operator.getitem) and node.args[1] == e:
        w = node.args[0]
        wv = val(w)
        return (w, transposed, True) if wv is not None and wv.dim() == 3 and wv.is_floating_point() else None
    wv = val(node)
    if node.op in ("placeholder", "get_attr") and wv is not None and wv.dim() == 2 and wv.is_floating_point():
        return node, transposed, False
    return None


def _chunk_of_stacked(node: Node, e: int) -> Optional[Node]:
    """``w`` for DBRX's ``w.chunk(E, dim=0)[e].squeeze(0)`` of a stacked (E, ., .) weight: the same tensor as
    ``w[e]`` (E chunks of a dimension of size E are its E slices, in order)."""
    if not (is_call(node, "call_method", "squeeze") and tuple(node.args[1:]) in ((0,), ()) and (
            not node.kwargs or node.kwargs == {"dim": 0})):
        return None
    piece = node.args[0]
    if not (is_call(piece, "call_function", operator.getitem) and piece.args[1] == e):
        return None
    chunk = piece.args[0]
    if not is_call(chunk, "call_method", "chunk") or not isinstance(chunk.args[0], Node):
        return None
    chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    w = chunk.args[0]
    wv = val(w)
    if wv is None or wv.dim() != 3 or not wv.is_floating_point() or dim != 0 or chunks != wv.shape[0]:
        return None
    return w


def _linear(node: Node, e: int) -> Optional[tuple[Node, Node, str, bool]]:
    """(input, weight, layout, stacked?) for ``a @ w.T`` / ``F.linear(a, w)`` ("nk") or ``a @ w`` ("kn"), where w is
    ``w[e]`` of a stacked weight or a per-expert one."""
    if is_call(node, "call_function", torch._C._nn.linear, torch.nn.functional.linear):
        if len(node.args) > 2 and node.args[2] is not None or node.kwargs:
            return None
        got = _expert_weight(node.args[1], e)
        return (node.args[0], got[0], "nk", got[2]) if got and not got[1] else None
    if (is_call(node, "call_function", operator.matmul, torch.matmul) or is_call(node, "call_method", "matmul")) and (
            len(node.args) == 2 and not node.kwargs):
        got = _expert_weight(node.args[1], e)
        if got is None:
            return None
        return node.args[0], got[0], "nk" if got[1] else "kn", got[2]
    return None


def expert_mlp(out: Node, e: int, hidden: Optional[Callable[[Node], Union[Node, str]]] = None,
               ) -> Union[tuple[Node, str, bool, GatedRead], str]:
    """Expert ``e``'s whole MLP ending at ``out``, bias-free, on its own weights: (w_down, layout, stacked, the gated
    read of the hidden state), or why not. The checks between the projections stay with each proof. ``hidden`` maps
    the down projection's input to the node whose value it holds (or why it cannot tell), where a proof reads the
    hidden state through a buffer (``dense_tables.copied_value``)."""
    down = _linear(out, e)
    if down is None:
        return f"expert {e}'s output is not a bias-free projection on its own weights"
    h, w_down, layout, stacked = down
    if hidden is not None:
        h = hidden(h)
        if isinstance(h, str):
            return f"expert {e}'s {h}"
    gated = read_gated(h, lambda n: _linear(n, e))
    if gated is None:
        return f"expert {e}'s hidden state is not a known activation of its own projections"
    return w_down, layout, stacked, gated


def biased_linear(node: Node, e: int) -> Optional[tuple[Node, Node, str, bool, Optional[Node]]]:
    """``_linear``'s reading plus the bias: (input, weight, layout, stacked?, bias or None). A bias is read as an
    nn.Linear's, ``F.linear(a, w, b)`` with a per-expert (out, in) weight and its own (out,) bias; or, on a stacked
    weight, as row e of a stacked (E, out) bias: ``a @ w[e] + b[e]`` or ``F.linear(a, w[e], b[e])`` (transformers
    v5's GPT-OSS eager loop). The bias is then the stacked one."""
    if is_call(node, "call_function", torch._C._nn.linear, torch.nn.functional.linear) and len(node.args) == 3 and (
            node.args[2] is not None and not node.kwargs):
        got = _expert_weight(node.args[1], e)
        b = node.args[2]
        if got is not None and got[2] and not got[1]:  # w[e] of a stacked (E, out, in) weight, and b[e]
            stacked_b = _stacked_bias_row(b, e, got[0], out_dim=1)
            return None if stacked_b is None else (node.args[0], got[0], "nk", True, stacked_b)
        bv, wv = (val(b), val(got[0])) if got and isinstance(b, Node) else (None, None)
        if got is None or got[1] or got[2] or b.op not in ("placeholder", "get_attr") or bv is None or wv is None or (
                tuple(bv.shape) != (wv.shape[0],)) or bv.dtype != wv.dtype:
            return None
        return node.args[0], got[0], "nk", False, b
    if is_call(node, "call_function", operator.add) and len(node.args) == 2 and not node.kwargs:
        for product, b in (node.args, node.args[::-1]):
            got = _linear(product, e) if isinstance(product, Node) else None
            if got is None or not got[3]:  # a per-expert weight's bias is an nn.Linear's (above)
                continue
            stacked_b = _stacked_bias_row(b, e, got[1], out_dim=1 if got[2] == "nk" else 2)
            if stacked_b is not None:
                return (*got, stacked_b)
        return None
    got = _linear(node, e)
    return None if got is None else (*got, None)


def _stacked_bias_row(b: object, e: int, w: Node, out_dim: int) -> Optional[Node]:
    """The stacked (E, out) bias B when ``b`` is ``B[e]`` and B matches the stacked weight ``w`` (E experts, its
    output width at ``out_dim``, its dtype), a graph input; else None."""
    if not (is_call(b, "call_function", operator.getitem) and b.args[1] == e and isinstance(b.args[0], Node)):
        return None
    B = b.args[0]
    bv, wv = val(B), val(w)
    if B.op not in ("placeholder", "get_attr") or bv is None or wv is None or wv.dim() != 3:
        return None
    if tuple(bv.shape) != (wv.shape[0], wv.shape[out_dim]) or bv.dtype != wv.dtype:
        return None
    return B
