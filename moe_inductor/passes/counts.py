"""Per-expert count vectors of top-k ids, and their reads as numbers: a marked (T, E) table's column sums
(``zeros(T, E).scatter_(1, ids, 1).sum(dim=0)``), a one-hot sum, host copies of either, and ``counts[e]`` read
by ``.item()`` or through NumPy.

DeepSeek-V2's remote code (``moe_infer``) and its copies count each expert's tokens so:

    cnts = topk_ids.new_zeros((topk_ids.shape[0], E))
    cnts.scatter_(1, topk_ids, 1)                      # or out of place: cnts = zeros(T, E).scatter(1, ids, 1)
    tokens_per_expert = cnts.sum(dim=0)
    tokens_per_expert = tokens_per_expert.cpu().numpy()   # walked on the host (speculation.py reads it)

Entry e is the number of rows of ``topk_ids`` holding e, which is the number of times e occurs in them because
top-k indices are distinct within a row: the same vector as ``bincount(topk_ids.flatten(), minlength=E)``.
Every fact is checked on the graph: the table is zeros of (T, E) with T the ids' rows, written once, by that
scatter, before the sum reads it; the ids are top-k indices over a last dim of E.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from .aliases import alias_mutations
from .fx_utils import ONE_HOT, comes_before, flat_of, is_call, val


def host_copy_of(node) -> Node:
    """``t`` for ``t.cpu()``, ``t.cpu().numpy()`` as Dynamo traces it (``view_as`` of itself), int64 or int32 casts
    (``.long()``, ``.int()``, ``.to(torch.long)``) of integer ``t``, or ``t`` itself: the same values."""
    for _ in range(8):
        if is_call(node, "call_method", "view_as") and len(node.args) == 2 and node.args[0] is node.args[1]:
            node = node.args[0]
        elif is_call(node, "call_method", "cpu") and len(node.args) == 1 and not node.kwargs:
            node = node.args[0]
        elif (is_call(node, "call_method", "long", "int") and len(node.args) == 1 and not node.kwargs
              or is_call(node, "call_method", "to") and node.args[1:] in ((torch.long,), (torch.int32,))
              and not node.kwargs) and val(node.args[0]) is not None and not val(node.args[0]).is_floating_point():
            node = node.args[0]
        else:
            break
    return node


def _integer_ids(node) -> Node:
    """``ids`` for ``ids.long()`` / ``ids.to(torch.int64)`` of integer ids (SGLang casts them for the scatter)."""
    while isinstance(node, Node) and (
            is_call(node, "call_method", "long") and len(node.args) == 1 and not node.kwargs
            or is_call(node, "call_method", "to") and len(node.args) == 2 and node.args[1] == torch.int64
            and not node.kwargs):
        inner = val(node.args[0])
        if inner is None or inner.is_floating_point():
            break
        node = node.args[0]
    return node


def topk_ids_over(ids: Node, num_experts: int) -> bool:
    """``ids`` are ``topk(s, k)[1]`` (or a top-1 router's ``max(dim=-1, keepdim=True)[1]``) over a last dim of
    ``num_experts``, unchanged since: each row's values are distinct and below E."""
    from ..count_totals import topk_ids_below
    from .unrolled_loop import max_ids

    iv = val(ids)
    if iv is None or iv.dim() != 2:
        return False
    if max_ids(ids):
        scores = val(ids.args[0].args[0])
        return scores is not None and scores.shape[-1] == num_experts and not alias_mutations(ids)
    return topk_ids_below(ids, num_experts)


def _zeros_table(node) -> bool:
    return (is_call(node, "call_function", torch.zeros, torch.zeros_like) or is_call(node, "call_method", "new_zeros")
            ) and "fill_value" not in node.kwargs


def marked_ids(table: Node) -> Optional[Node]:
    """The (T, k) ids of a table that is 1 at (t, ids[t, j]) and 0 elsewhere: ``zeros(T, E).scatter(1, ids, 1)``,
    or zeros written once in place by ``scatter_(1, ids, 1)``; else None."""
    if is_call(table, "call_method", "scatter") and len(table.args) == 4 and not table.kwargs:
        base, dim, ids, value = table.args
        if not _zeros_table(base) or alias_mutations(base):
            return None
    elif _zeros_table(table):
        writes = alias_mutations(table)
        if len(writes) != 1 or not is_call(writes[0], "call_method", "scatter_"):
            return None
        write = writes[0]
        if write.args[:1] != (table,) or len(write.args) != 4 or write.kwargs:
            return None
        _, dim, ids, value = write.args
    else:
        return None
    if dim not in (1, -1) or isinstance(value, Node) or value != 1 or not isinstance(ids, Node):
        return None
    ids = _integer_ids(ids)
    tv, iv = val(table), val(ids)
    if tv is None or iv is None or tv.dim() != 2 or iv.dim() != 2 or tv.shape[0] != iv.shape[0]:
        return None
    return ids


def _column_sums(node) -> Optional[Node]:
    """``t`` for ``node`` = ``t.sum(0)`` / ``t.sum(dim=0)`` (host copies and integer casts of it aside), else None."""
    node = host_copy_of(node)
    if is_call(node, "call_method", "sum") and isinstance(node.args[0], Node) and (
            node.args[1:] == (0,) and not node.kwargs or (len(node.args) == 1 and node.kwargs == {"dim": 0})):
        return node.args[0]
    return None


def marked_counts(node) -> Optional[tuple[Node, int]]:
    """(ids, E) for ``node`` = a marked table's column sums (``table.sum(dim=0)``, casts and host copies aside),
    with ``ids`` top-k indices over E: each expert's number of tokens, which equals its number of assignments."""
    table = _column_sums(node)
    ids = marked_ids(table) if table is not None else None
    writes = alias_mutations(table) if ids is not None else []
    if ids is None or (writes and not comes_before(writes[0], host_copy_of(node))):
        return None
    num_experts = val(table).shape[1]
    if not isinstance(num_experts, int) or not topk_ids_over(ids, num_experts):
        return None
    return ids, num_experts


def bincount_of(node, num_experts: int) -> Optional[Node]:
    """``t`` for ``node`` = ``torch.bincount(t, minlength=E)`` / ``t.bincount(minlength=E)`` without weights (host
    copies and integer casts aside), else None. For ids in [0, E) that is each expert's count, as ``histc`` over E
    unit bins gives it; an id out of range makes it longer than E, and the op raises where such ids reach it."""
    node = host_copy_of(node)
    if not (is_call(node, "call_function", torch.bincount) or is_call(node, "call_method", "bincount")):
        return None
    weights = node.kwargs.get("weights", node.args[1] if len(node.args) > 1 else None)
    minlength = node.kwargs.get("minlength", node.args[2] if len(node.args) > 2 else 0)
    if weights is not None or minlength != num_experts or set(node.kwargs) - {"weights", "minlength"}:
        return None
    return node.args[0] if isinstance(node.args[0], Node) else None


def count_item(node) -> Optional[tuple[Node, int]]:
    """(counts, e) for a count read as a number: ``counts[e].item()`` (``.tolist()`` as Dynamo traces it), or
    ``int(counts_np[e])`` / ``counts_np[e].item()`` of a NumPy copy as Dynamo traces those (its ``wrapped_getitem``
    and ``wrapped_item``); else None."""
    if is_call(node, "call_method", "item") and len(node.args) == 1 and not node.kwargs:
        pick = node.args[0]
    elif _numpy_wrapper(node, "item") and len(node.args) == 1 and not node.kwargs:
        pick = node.args[0]
    else:
        return None
    if (is_call(pick, "call_function", operator.getitem) or _numpy_wrapper(pick, "getitem")) and len(
            pick.args) == 2 and isinstance(pick.args[0], Node) and type(pick.args[1]) is int:
        return pick.args[0], pick.args[1]
    return None


def _numpy_wrapper(node, name: str) -> bool:
    """``node`` calls Dynamo's wrapper of a NumPy method or operator ``name`` (how it traces ``arr[e]``,
    ``arr[e].item()`` and ``int(arr[e])`` of an array it holds as a tensor)."""
    if not (isinstance(node, Node) and node.op == "call_function"):
        return False
    target = node.target
    if getattr(target, "method", None) == name:  # numpy_method_wrapper
        return True
    op = getattr(target, "op", None)  # numpy_operator_wrapper
    return getattr(op, "__name__", None) == name and type(target).__name__ == "numpy_operator_wrapper"


def one_hot_counts(node) -> Optional[tuple[Node, int]]:
    """(ids, E) for ``F.one_hot(ids.flatten(), E).sum(0)`` (casts and host copies aside) of top-k ids over E: the
    number of assignments of each expert."""
    hot = _column_sums(node)
    if not is_call(hot, "call_function", *ONE_HOT):
        return None
    num_experts = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else None)
    ids = flat_of(hot.args[0]) if isinstance(hot.args[0], Node) else None
    if not isinstance(num_experts, int) or ids is None or not topk_ids_over(ids, num_experts):
        return None
    return ids, num_experts


def per_expert_counts(node) -> Optional[tuple[Node, int]]:
    """(ids, E) where ``node`` holds each expert's number of assignments of the (T, k) top-k ``ids`` in expert
    order: a marked table's column sums (``marked_counts``) or a one-hot sum (``one_hot_counts``)."""
    return marked_counts(node) or one_hot_counts(node)
