"""Top-1 masks with the router's drops already in them. The user code this reads is Switch Transformers' (transformers
v4): the router hands the experts a one-hot of its choice with the rows past the capacity zeroed, and the experts
loop reads one column per expert:

    router_mask = F.one_hot(idx, E) * (torch.cumsum(F.one_hot(idx, E), dim=-2) <= C)     # (B, T, E) int
    router_mask = router_mask.bool()
    counts = router_mask.reshape(B * T, E).sum(dim=0)                                  # rows kept per expert
    for e in torch.nonzero(counts, as_tuple=True)[0].tolist():                         # the experts with rows
        out[router_mask[:, :, e]] = expert_e(x[router_mask[:, :, e]])

Whatever ``keep`` is, ``(one_hot(idx, E) * keep).bool()`` is True at most at idx's position of each row: at
(t, idx_t) where ``keep`` there is nonzero. So the column e of it is ``(idx == e) & kept`` with ``kept`` the row's
one test, and the masks of two experts never share a row: they are a top-1 router's masks (``top1_masks.py``) whose
dropped rows have no expert at all, which the op gives as the out-of-range id E (it skips such a row, leaving it
zero). A float ``keep`` is refused: NaN times one_hot's 0 is NaN, nonzero, which would put True off idx.

transformers v4.2x-v4.3x casts each column instead of the whole product, ``router_mask[:, :, e].bool()`` of the
integer ``one_hot(idx, E) * keep``: the same rows, read the same way (``kept_column``, ``kept_choices``).

Shape legend: lead the ids' (T,) or (B, T), E experts.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import Node

from .aliases import mutated_alias
from .fx_utils import ONE_HOT, is_call, val

_ALL = slice(None, None, None)


def choice_column(node) -> Optional[tuple[Node, int]]:
    """(base, j) for column j of a base whose last dim is a static k: ``base[..., j]``, ``base[:, :, j]`` (a full
    slice over every other dim) or ``base.select(-1, j)``, j normalised to range(k)."""
    if is_call(node, "call_function", operator.getitem) and len(node.args) == 2 and isinstance(node.args[1], tuple):
        base, index = node.args
        bv = val(base)
        if bv is None or not index or index[:-1] not in ((Ellipsis,), (_ALL,) * (bv.dim() - 1)):
            return None
        j = index[-1]
    elif is_call(node, "call_method", "select") and len(node.args) == 3 and not node.kwargs:
        base, dim, j = node.args
        bv = val(base)
        if bv is None or dim not in (-1, bv.dim() - 1):
            return None
    else:
        return None
    k = bv.shape[-1]
    if type(j) is not int or not isinstance(k, int) or not -k <= j < k:
        return None
    return base, j % k


def _one_hot(node) -> Optional[tuple[Node, int]]:
    """(idx, E) for ``one_hot(idx, E)`` of integer ids, E a Python int."""
    if not (is_call(node, "call_function", *ONE_HOT) and node.args and isinstance(node.args[0], Node)):
        return None
    E = node.kwargs.get("num_classes", node.args[1] if len(node.args) > 1 else None)
    iv = val(node.args[0])
    if type(E) is not int or E <= 0 or iv is None or iv.dtype.is_floating_point or iv.dtype.is_complex or (
            iv.dtype == torch.bool):
        return None
    return node.args[0], E


def kept_product(product: Node) -> Optional[tuple[Node, int]]:
    """(idx, E) when ``product`` is ``one_hot(idx, E) * keep`` (either order), keep a bool or integer tensor that
    broadcasts to the one-hot's shape without widening it, and neither the one-hot nor the product changed in place
    anywhere (``hot[..., 0] = 1`` puts a second 1 in a row: several experts' masks share it); else None. Such a
    product is nonzero at most at idx's position of each row: 1 * keep there, 0 * keep elsewhere (integers, so no
    NaN)."""
    if not (is_call(product, "call_function", operator.mul, torch.mul) and len(product.args) == 2
            and not product.kwargs):
        return None
    for hot, keep in (product.args, product.args[::-1]):
        got = _one_hot(hot)
        kv, hv, pv = val(keep), val(hot), val(product)
        if got is None or kv is None or hv is None or pv is None:
            continue
        if kv.dtype.is_floating_point or kv.dtype.is_complex or tuple(pv.shape) != tuple(hv.shape):
            continue
        if any(mutated_alias(n) for n in (hot, product)):
            return None
        return got
    return None


def bool_cast_of(mask: Node) -> Optional[Node]:
    """t for ``t.bool()`` or ``t.to(torch.bool)``."""
    if is_call(mask, "call_method", "bool") and len(mask.args) == 1 and not mask.kwargs:
        return mask.args[0]
    if is_call(mask, "call_method", "to") and len(mask.args) == 2 and mask.args[1] == torch.bool and not (
            mask.kwargs):
        return mask.args[0]
    return None


def kept_one_hot(mask: Node) -> Optional[tuple[Node, int]]:
    """(idx, E) when ``mask`` is a (*lead, E) bool tensor True at most at idx's position of each row:
    ``(one_hot(idx, E) * keep).bool()`` (``.to(torch.bool)`` too) of a ``kept_product``, the mask not changed in
    place anywhere; else None."""
    mv = val(mask)
    if mv is None or mv.dtype != torch.bool:
        return None
    product = bool_cast_of(mask)
    got = kept_product(product) if isinstance(product, Node) else None
    return None if got is None or mutated_alias(mask) else got


def kept_choices(node: Node) -> Optional[tuple[Node, int]]:
    """(idx, E) when column e of ``node`` is nonzero exactly at the rows expert e keeps: a ``kept_one_hot`` mask, or
    the integer ``kept_product`` itself (transformers v4.2x-v4.3x Switch casts each column, ``M[:, :, e].bool()``).
    Either way ``node.any(-1)`` is whether a row was kept and ``node.select(-1, e)`` is nonzero at expert e's rows."""
    return kept_one_hot(node) or kept_product(node)


def kept_column(mask: Node) -> Optional[tuple[Node, int]]:
    """(M, e) when ``mask`` is column e of a kept one-hot M (``kept_one_hot``) over E experts: the rows expert e
    keeps; or (P, e) when it is column e of an integer ``kept_product`` P cast to bool (``P[..., e].bool()``), the
    same rows, the column and its cast not changed in place."""
    got = choice_column(mask)
    if got is not None:
        return got if kept_one_hot(got[0]) is not None else None
    column = bool_cast_of(mask)
    got = choice_column(column) if isinstance(column, Node) else None
    mv = val(mask)
    if got is None or mv is None or mv.dtype != torch.bool or kept_product(got[0]) is None or any(
            mutated_alias(n) for n in (column, mask)):
        return None
    return got


def kept_counts(node: Node) -> Optional[Node]:
    """M when ``node`` counts each expert's rows of a kept one-hot M: ``M.reshape(-1, E).sum(0)`` (``view``, dim=0,
    the reshape's leading size any product of M's leading dims) or ``M.sum(dims)`` over every dim but the last; a
    (E,) integer count, zero exactly where expert e keeps no row."""
    if not (is_call(node, "call_method", "sum") or is_call(node, "call_function", torch.sum)) or len(node.args) < 1:
        return None
    args, kwargs = node.args[1:], dict(node.kwargs)
    if set(kwargs) - {"dim"} or len(args) > 1 or (args and kwargs):
        return None
    dim = args[0] if args else kwargs.get("dim")
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    source = node.args[0]
    if is_call(source, "call_method", "reshape", "view") and len(source.args) >= 2 and kept_one_hot(
            source.args[0]) is not None:
        mv, sv = val(source.args[0]), val(source)
        if sv is None or sv.dim() != 2 or sv.shape[-1] != mv.shape[-1] or dims not in ((0,), (-2,)):
            return None
        return source.args[0]
    if kept_one_hot(source) is None:
        return None
    rank = val(source).dim()
    if not all(type(d) is int and -rank <= d < rank for d in dims) or {d % rank for d in dims} != set(
            range(rank - 1)):
        return None
    return source
