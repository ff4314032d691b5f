"""The rows one body of a per-expert loop picks, and the routing weight it reads for them (form "unrolled_loop").

The user code this reads:

    tok, pos = torch.where(ids == e)                     # or (ids == e).nonzero(as_tuple=True)
    pos, tok = torch.where(one_hot(ids, E).permute(2, 1, 0)[e])          # HF v4's (E, k, T) mask
    tok, pos = torch.where((ids[..., None] == arange(E)).permute(2, 0, 1)[e])   # litgpt's (E, T, k) mask
    tok = (ids == e).nonzero(as_tuple=True)[0]           # a top-1 router's (T,) ids
    tok = (ids == e).any(-1).nonzero().squeeze(-1)       # the tokens that chose e at all

and each row's weight ``weights[tok, pos, None]`` (or ``weights[tok, pos].unsqueeze(-1)``), or, for the last, ``(weights * (ids == e)).sum(-1)[tok, None]``; or ``table[tok, e, None]`` of a (T, E) table scattered from the
choices' weights (``scattered_weights``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Node

from .fx_utils import arange_length, column_of, is_call, unsqueezed_last, val


def selected_ids(cond: Node) -> Optional[tuple[Node, int, bool]]:
    """(ids, e, token_first) for a selection condition: ``ids == e`` (rows are (token, choice)), HF's
    ``one_hot(ids, E).permute(2, 1, 0)[e]`` (rows are (choice, token)), or a (T, k, E) mask of ``ids[t, j] == e``
    (``expert_hot``) permuted (2, 0, 1) to (E, T, k) (rows (token, choice)) or (2, 1, 0), read at e. e may be held
    by a (1,) index tensor (``held_index``): ``ids == t`` and ``mask[t].squeeze(0)`` are then the same values."""
    if is_call(cond, "call_function", operator.eq, torch.eq) and isinstance(cond.args[0], Node):
        e = cond.args[1] if isinstance(cond.args[1], int) else held_index(cond.args[1])
        iv = val(cond.args[0])
        if e is not None and (isinstance(cond.args[1], int) or iv is not None and iv.dim() >= 1):
            return cond.args[0], e, True
    row = expert_row(cond)
    if row is None:
        return None
    perm, e = row
    if not is_call(perm, "call_method", "permute"):
        return None
    dims = tuple(perm.args[1]) if len(perm.args) == 2 and isinstance(perm.args[1], (tuple, list)) else perm.args[1:]
    if dims not in ((2, 1, 0), (2, 0, 1)):  # (E, k, T): rows (choice, token); (E, T, k): rows (token, choice)
        return None
    hot = expert_hot(perm.args[0])
    if hot is None:
        return None
    ids, num_experts = hot
    if not 0 <= e < num_experts:
        return None
    return ids, e, dims == (2, 0, 1)


def expert_hot(hot: Node) -> Optional[tuple[Node, int]]:
    """(ids, E) for a (T, k, E) mask whose [t, j, e] is ``ids[t, j] == e``: ``one_hot(ids, E)`` (transformers v4),
    or litgpt's broadcast ``ids.unsqueeze(-1) == torch.arange(E)`` (``ids[..., None]`` likewise; the arange from 0
    in steps of 1, so that its e-th entry is e)."""
    if is_call(hot, "call_function", torch.nn.functional.one_hot) and len(hot.args) >= 1:
        num_classes = hot.kwargs.get("num_classes", hot.args[1] if len(hot.args) > 1 else None)
        return (hot.args[0], num_classes) if isinstance(num_classes, int) and isinstance(hot.args[0], Node) else None
    if not (is_call(hot, "call_function", operator.eq, torch.eq) and len(hot.args) == 2 and not hot.kwargs):
        return None
    for column, row in (hot.args, hot.args[::-1]):
        ids, num_experts = unsqueezed_last(column), arange_length(row)
        if ids is not None and isinstance(num_experts, int):
            iv = val(ids)
            if iv is not None and iv.dim() == 2:
                return ids, num_experts
    return None


def held_index(t) -> Optional[int]:
    """e for ``t = torch.full((1,), e)`` of an integer dtype: the loop variable of a loop over the experts that got
    tokens, as hit_loops.py traces it (eager's is a (1,) int64 row of ``nonzero()``)."""
    if not (is_call(t, "call_function", torch.full) and len(t.args) == 2 and isinstance(t.args[1], int)
            and isinstance(t.args[0], (tuple, list)) and tuple(t.args[0]) == (1,)
            and set(t.kwargs) <= {"dtype", "device"}):
        return None
    tv = val(t)
    if tv is None or tv.dtype.is_floating_point or tv.dtype.is_complex or tv.dtype == torch.bool or tv.shape != (1,):
        return None
    return t.args[1]


def expert_row(cond: Node) -> Optional[tuple[Node, int]]:
    """(mask, e) for ``mask[e]``, or for ``mask[t].squeeze(0)`` with t holding e (``held_index``): the same values,
    since ``mask[t]`` is ``mask[e:e + 1]`` (copied). The second is transformers v4's ``expert_mask[expert_idx]
    .squeeze(0)`` in a loop over the experts that got tokens (hit_loops.py). ``mask[e].squeeze(0)`` at an int e is
    ``mask[e]`` where its first dim is not 1 (the squeeze then does nothing)."""
    if is_call(cond, "call_function", operator.getitem) and isinstance(cond.args[1], int):
        return cond.args[0], cond.args[1]
    if not (is_call(cond, "call_method", "squeeze") and (cond.args[1:], cond.kwargs) in (((0,), {}), ((), {"dim": 0}))):
        return None
    picked = cond.args[0]
    if not (is_call(picked, "call_function", operator.getitem) and isinstance(picked.args[0], Node)):
        return None
    if isinstance(picked.args[1], int):  # mask[e].squeeze(0) at an int (``expert_idx.item()``): a no-op squeeze
        pv = val(picked)  # when the choices' dim is not 1, which eager's two-way unpack of the where requires
        shape0 = pv.shape[0] if pv is not None and pv.dim() >= 1 else None
        return (picked.args[0], picked.args[1]) if isinstance(shape0, int) and shape0 > 1 else None
    e = held_index(picked.args[1])
    return None if e is None else (picked.args[0], e)


@dataclass(frozen=True)
class Rows:
    """How one body picks its rows ``tok``: the where/nonzero node (its size asserts go with the region), the ids
    and e, and where each row's routing weight is read from: ``weights[tok, where[pos], None]`` (``pos`` the index
    of the choices in where's result), or, for rows picked by ``(ids == e).any(-1)``, ``(weights * hit).sum(-1)[tok,
    None]`` (``hit`` the ``ids == e``). A top-1 router's (T,) ids have neither: no weight is read per row."""

    where: Node
    ids: Node
    e: int
    pos: Optional[int] = None
    hit: Optional[Node] = None


def selection(tok: Node) -> Optional[Rows]:
    """The rows of ``tok, pos = torch.where(ids == e)`` (or nonzero(as_tuple=True)), ``pos, tok =
    torch.where(one_hot(ids, E).permute(2, 1, 0)[e])``, a top-1 router's ``tok = (ids == e).nonzero(as_tuple=True)[0]``
    on (T,) ids, or the tokens that chose e at all: ``tok = (ids == e).any(-1).nonzero().squeeze(-1)`` (or
    ``torch.where(...)[0]``)."""
    picked = any_selection(tok)
    if picked is not None:
        return picked
    if not (is_call(tok, "call_function", operator.getitem) and tok.args[1] in (0, 1)):
        return None
    where = tok.args[0]
    if not where_like(where):
        return None
    selected = selected_ids(where.args[0])
    if selected is None:
        return None
    ids, e, token_first = selected
    if tok.args[1] != (0 if token_first else 1):
        return None
    iv = val(ids)
    if iv is None or iv.dtype.is_floating_point or iv.dtype == torch.bool:
        return None
    if iv.dim() == 1 and token_first:  # one id per token: the where result is (tok,) alone
        return Rows(where, ids, e)
    if iv.dim() != 2:
        return None
    return Rows(where, ids, e, pos=1 if token_first else 0)


def where_like(where: Node) -> bool:
    """``torch.where(cond)`` or ``cond.nonzero(as_tuple=True)``: a tuple of index tensors, one per dim of cond."""
    one_arg_where = is_call(where, "call_function", torch.where) and len(where.args) == 1 and not where.kwargs
    nonzero = ((is_call(where, "call_method", "nonzero") or is_call(where, "call_function", torch.nonzero))
               and where.kwargs == {"as_tuple": True} and len(where.args) == 1)
    return one_arg_where or nonzero


def any_selection(tok: Node) -> Optional[Rows]:
    """The tokens with any choice equal to e: ``(ids == e).any(-1)`` of (T, k) integer ids, its indices by
    ``.nonzero().squeeze(-1)``, ``torch.where(...)[0]`` or ``.nonzero(as_tuple=True)[0]``."""
    if is_call(tok, "call_method", "squeeze") and tok.args[1:] in ((-1,), (1,)) and not tok.kwargs:
        where = tok.args[0]
        if not ((is_call(where, "call_method", "nonzero") or is_call(where, "call_function", torch.nonzero))
                and len(where.args) == 1 and not where.kwargs):
            return None
    elif is_call(tok, "call_function", operator.getitem) and tok.args[1] == 0 and where_like(tok.args[0]):
        where = tok.args[0]
    else:
        return None
    hit = any_hit(where.args[0])
    return None if hit is None else Rows(where, hit[0], hit[1], hit=hit[2])


def any_hit(chose) -> Optional[tuple[Node, int, Node]]:
    """(ids, e, hit) for ``chose = (ids == e).any(-1)`` (or ``torch.any(hit, dim=1)``) of (T, k) integer ids:
    whether each token chose e at all."""
    if not (is_call(chose, "call_method", "any") or is_call(chose, "call_function", torch.any)):
        return None
    dim = chose.kwargs.get("dim", chose.args[1] if len(chose.args) > 1 else None)
    if dim not in (-1, 1) or set(chose.kwargs) - {"dim"} or len(chose.args) > 2:
        return None
    hit = chose.args[0]
    selected = selected_ids(hit) if isinstance(hit, Node) else None
    if selected is None or not selected[2]:
        return None
    iv = val(selected[0])
    if iv is None or iv.dim() != 2 or iv.dtype.is_floating_point or iv.dtype == torch.bool:
        return None
    return selected[0], selected[1], hit


def token_rows_of(xe: Node, tok: Node) -> Optional[Node]:
    """``x`` for ``x[tok]``, ``x.index_select(0, tok)`` or HF's ``x[None, tok].reshape(-1, H)``."""
    if is_call(xe, "call_function", operator.getitem) and (xe.args[1] is tok or rows_index(xe.args[1], tok)):
        return xe.args[0]
    if is_call(xe, "call_method", "index_select") or is_call(xe, "call_function", torch.index_select):
        bound = dict(zip(("input", "dim", "index"), xe.args), **xe.kwargs)
        x = bound.get("input")
        xv = val(x) if isinstance(x, Node) else None
        if set(bound) == {"input", "dim", "index"} and bound["index"] is tok and bound["dim"] in (0, -2) and (
                xv is not None and xv.dim() == 2):
            return x
    if is_call(xe, "call_method", "reshape", "view") and len(xe.args) == 3 and xe.args[1] == -1:
        inner = xe.args[0]
        if is_call(inner, "call_function", operator.getitem) and inner.args[1] == (None, tok):
            x = inner.args[0]
            xv = val(x)
            if xv is not None and xv.dim() == 2 and xe.args[2] == xv.shape[1]:
                return x
    return None


def rows_index(index, tok: Node) -> bool:
    """``index`` is ``(tok, :)``: whole rows at tok, as ``x[tok, :]`` reads them and ``out[tok, :] = v`` writes them."""
    return isinstance(index, tuple) and len(index) == 2 and index[0] is tok and index[1] == slice(None, None, None)


def routing_scaled(node: Node, tok: Node, sel: Rows) -> Optional[tuple[Node, Node]]:
    """(what is scaled, weights) for ``value * weights[tok, pos, None]`` (either order), where tok and pos are this
    body's own selection: the routing weight of each selected (token, choice) row; for rows picked by
    ``hit.any(-1)``, ``value * (weights * hit).sum(-1)[tok, None]`` with this body's own ``hit = ids == e``."""
    if not is_call(node, "call_function", operator.mul) or len(node.args) != 2 or node.kwargs:
        return None
    for value, scale in (node.args, node.args[::-1]):
        index = scale.args[1] if is_call(scale, "call_function", operator.getitem) else None
        if sel.pos is not None and isinstance(index, tuple) and len(index) == 3 and index[0] is tok and (
                index[2] is None) and _own_choice(index[1], sel):
            return value, scale.args[0]
        # weights[tok, pos].unsqueeze(-1) (or [:, None], .view(-1, 1)), possibly cast to the value's dtype first
        picked = _cast_to_dtype_of(column_of(scale, 1), value) if isinstance(value, Node) else None
        at = picked.args[1] if is_call(picked, "call_function", operator.getitem) else None
        if sel.pos is not None and isinstance(at, tuple) and len(at) == 2 and at[0] is tok and _own_choice(at[1], sel):
            return value, picked.args[0]
        if sel.hit is not None and index == (tok, None):
            weights = weights_at_hit(scale.args[0], sel)
            if weights is not None:
                return value, weights
        # table[tok, e, None] of a dense (T, E) table of the choices' weights (transformers v4's GPT-OSS, Qwen3-VL)
        if isinstance(index, tuple) and len(index) == 3 and index[0] is tok and index[1] == sel.e and (
                type(index[1]) is int and index[2] is None):
            weights = scattered_weights(scale.args[0], sel)
            if weights is not None:
                return value, weights
    return None


def scattered_weights(table: Node, sel: Rows) -> Optional[Node]:
    """``w`` for a (T, E) table of this body's own ids' weights, zeros scattered with them and left as made
    (``dense_experts._topk_scatter``, the dense form's proof of the same table): entry (t, e) is t's weight of its
    choice e, which is ``w[t, pos]`` for the (token, choice) rows the selection picks, where no token chooses e twice
    (``unrolled_loop._topk_ids``; with repeats the table holds one write, or their sum, where the rows are two)."""
    from .dense_experts import _topk_scatter
    from .unrolled_loop import _topk_ids

    routed = _topk_scatter(table)
    if routed is None or routed[0] is not sel.ids or not _topk_ids(sel.ids):
        return None
    return routed[1]


def _own_choice(pos, sel: Rows) -> bool:
    """``pos`` is this body's own choice index: the second output of its ``torch.where`` / ``nonzero``."""
    return is_call(pos, "call_function", operator.getitem) and pos.args == (sel.where, sel.pos)


def _cast_to_dtype_of(node, value: Node):
    """``node`` without a ``.to(dtype)`` / ``.type_as(value)`` that casts it to ``value``'s dtype (the op applies the
    weights in the experts' dtype), else ``node`` as it is."""
    vv = val(value)
    if vv is None or not isinstance(node, Node):
        return node
    if is_call(node, "call_method", "to") and len(node.args) == 2 and not node.kwargs and node.args[1] == vv.dtype:
        return node.args[0]
    if is_call(node, "call_method", "type_as") and len(node.args) == 2 and node.args[1] is value:
        return node.args[0]
    return node


def weights_at_hit(summed: Node, sel: Rows) -> Optional[Node]:
    """``weights`` for ``(weights * hit).sum(-1)`` (factors in either order), ``hit`` this body's ``ids == e``:
    each token's weight of its choice e (with ids from topk, at most one choice per token is e)."""
    dim = summed.kwargs.get("dim", summed.args[1] if len(summed.args) > 1 else None)
    if not (is_call(summed, "call_method", "sum") and dim in (-1, 1) and set(summed.kwargs) <= {"dim"}
            and len(summed.args) <= 2):
        return None
    prod = summed.args[0]
    if not (is_call(prod, "call_function", operator.mul) and len(prod.args) == 2 and not prod.kwargs):
        return None
    for weights, hit in (prod.args, prod.args[::-1]):
        same_hit = hit is sel.hit or (isinstance(hit, Node) and selected_ids(hit) == (sel.ids, sel.e, True))
        wv = val(weights) if isinstance(weights, Node) else None
        if same_hit and wv is not None and wv.is_floating_point() and tuple(wv.shape) == tuple(val(sel.ids).shape):
            return weights
    return None
