"""A top-1 router's boolean-mask writes, a spelling of form "unrolled_loop" (``match_top1_masks``). The user code this
matches:

    out = torch.zeros_like(x)                            # or torch.empty_like(x), x.new_zeros(x.shape)
    for e in range(E):                                   # each expert once, in any order
        out[idx == e] = expert_e(x[idx == e])            # or w[m, None] * expert_e(x[m]); or out[m] += ...
    y = out * w[:, None]                                 # or the weight inside, or none (a weight of 1)

with x (T, H) tokens and idx (T,) ids (argmax, max(dim=-1) or topk(1) of a router), or with the batch dimension kept:
x (B, T, H), idx (B, T) ids of (B, T, E) scores, each mask (B, T) over the leading two dims of x and of out, and the
weight after the loop ``w[..., None]`` / ``w.unsqueeze(-1)`` of a (B, T) w:

    out[idx == e] = expert_e(x[idx == e])                # x[mask] is (n, H): the rows of (B, T) in row-major order

Several such passes, one per choice j of a top-k router, adding into one zeros buffer are the top-k MoE of the
(..., k) ids and weights whose columns they read (RaF-in/Build-deepseek-from-scratch; ``_choices_spec``):

    for j in range(k):
        ids, w = topk_ids[..., j], topk_weights[..., j]
        for e in range(E):
            out[ids == e] += expert_e(x[ids == e]) * w[ids == e].unsqueeze(-1)

The masks may also be the columns ``M[..., e]`` of a one-hot with the router's drops in it (transformers v4's
Switch, ``kept_masks.py``): ``out[M[:, :, e]] = expert_e(x[M[:, :, e]])`` into zeros, a dropped row then the op's
out-of-range id E (left zero), a weight on the whole buffer left to the graph. v4.2x-v4.3x's Switch starts the
buffer as ``x.clone()`` and casts each column, ``out[P[:, :, e].bool()] = expert_e(x[P[:, :, e].bool()])``: a dropped
row keeps its token, so the buffer's readers get ``torch.where(P.any(-1)[..., None], op, x)`` (``_kept_rows_or``).

A boolean mask of x's leading dims picks its rows in row-major order, so the batched loop is the flat loop on
``x.reshape(-1, H)``, ``idx.reshape(-1)`` and ``out.view(-1, H)``: the op reads those views and its (B*T, H) result is
viewed back as (B, T, H). The driver has no step for a result of another shape than the region's, so the match's
derive (run by the driver as it emits the op) inserts that view after the region and points the buffer's readers at
it (``_viewed_back``). Shape legend: T tokens (B*T when batched), H hidden, E experts, lead the ids' shape.

The anchor is the buffer; the proof reads every write to it. The bodies' checks are shared with the other spellings
(``masked_writes._masked_body``, unrolled_loop.py).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .driver import Match
from .flat_slices import block_linear
from .aliases import alias_mutations, mutated_alias
from .fx_utils import column_of, is_call, redirect_later_readers, same_value_key, scale_of_rows, val
from .kept_masks import choice_column, kept_choices, kept_column

_ZEROS = ((torch.zeros_like, torch.zeros), ("new_zeros",))
_EMPTY = ((torch.empty_like, torch.empty), ("new_empty",))
#: the dims of ids a mask may have: (T,) tokens, or (B, T) with the batch dimension kept
_ID_DIMS = (1, 2)
_ALL = slice(None, None, None)


def _mask_of(index) -> Optional[tuple[Node, object, int]]:
    """(ids, the ids' key, e) for the index ``ids == e`` (either order; or ``(ids == e, :)``) of (T,) or (B, T)
    integer ids."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] == _ALL:
        index = index[0]
    kept = kept_column(index) if isinstance(index, Node) else None
    if kept is not None:  # the rows expert e keeps of a one-hot with the router's drops in it (kept_masks.py)
        return (kept[0], same_value_key(kept[0]), kept[1]) if val(kept[0]).dim() - 1 in _ID_DIMS else None
    if not (is_call(index, "call_function", operator.eq, torch.eq) and len(index.args) == 2 and not index.kwargs):
        return None
    a, b = index.args
    ids, e = (a, b) if type(b) is int else (b, a) if type(a) is int else (None, None)
    iv = val(ids)
    if iv is None or iv.dim() not in _ID_DIMS or iv.dtype.is_floating_point or iv.dtype.is_complex or (
            iv.dtype == torch.bool):
        return None
    return ids, same_value_key(ids), e


def _router_width(ids: Node) -> Optional[int]:
    """N when every id is provably in range(N): ``argmax(dim=-1)`` or ``max(dim=-1)`` indices of (*lead, N) scores,
    or the one column of ``topk(1)`` (or ``max(keepdim=True)``) indices, squeezed (``squeeze(-1)``, ``[..., 0]``;
    flat ids also ``view(-1)``, ``flatten()``, ``[:, 0]``). lead is the ids' (T,) or (B, T)."""
    iv = val(ids)
    if iv is None or iv.dim() not in _ID_DIMS:
        return None
    d, column = iv.dim(), False
    index = ids.args[1] if is_call(ids, "call_function", operator.getitem) and len(ids.args) == 2 else None
    if (is_call(ids, "call_method", "squeeze") and tuple(ids.args[1:]) in ((-1,), (d,))) or index in (
            (Ellipsis, 0), (_ALL,) * d + (0,)) or (d == 1 and (
            (is_call(ids, "call_method", "view", "reshape") and tuple(ids.args[1:]) in ((-1,), ((-1,),))) or (
            is_call(ids, "call_method", "flatten") and len(ids.args) == 1))):
        ids, column = ids.args[0], True
        cv = val(ids)
        if ids.kwargs or cv is None or tuple(cv.shape) != (*iv.shape, 1):
            return None
    if is_call(ids, "call_function", torch.argmax) or is_call(ids, "call_method", "argmax"):
        top, keep, k = ids, ids.kwargs.get("keepdim", ids.args[2] if len(ids.args) > 2 else False), 1
    elif is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1 and (
            is_call(ids.args[0], "call_function", torch.max, torch.topk) or
            is_call(ids.args[0], "call_method", "max", "topk")):
        top = ids.args[0]
        is_topk = top.target in (torch.topk, "topk")
        k = top.kwargs.get("k", top.args[1] if len(top.args) > 1 else None) if is_topk else 1
        keep = True if is_topk else top.kwargs.get("keepdim", top.args[2] if len(top.args) > 2 else False)
    else:
        return None
    default_dim = -1 if top.target in (torch.topk, "topk") else None
    dim = top.kwargs.get("dim", top.args[2 if top.target in (torch.topk, "topk") else 1] if len(top.args) > (
        2 if top.target in (torch.topk, "topk") else 1) else default_dim)
    scores = val(top.args[0]) if top.args else None
    if k != 1 or keep is not column or dim not in (-1, d) or scores is None or scores.dim() != d + 1:
        return None
    width = scores.shape[-1]
    return width if isinstance(width, int) else None


def _top1_rows(node, key, e: int) -> Optional[Node]:
    """``x`` for ``x[mask]`` or ``x[mask, :]``, mask this body's own ``ids == e``."""
    if not is_call(node, "call_function", operator.getitem):
        return None
    got = _mask_of(node.args[1])
    return node.args[0] if got is not None and got[1:] == (key, e) else None


def _top1_scale(node, key, e: int, lead: tuple) -> Optional[tuple[Node, Node, Node]]:
    """(value, w, the masked read of w) for ``value * s`` (either order), s this body's rows of one float w as a
    column: ``w[mask, None]``, ``w[mask].unsqueeze(-1)`` (``[:, None]``, ``.view(-1, 1)``) or ``w.unsqueeze(-1)[mask]``
    (``w[..., None]``) of a w shaped like the ids, or ``w[mask]`` of a w shaped like the ids plus a 1."""
    if not (is_call(node, "call_function", operator.mul) and len(node.args) == 2 and not node.kwargs):
        return None
    for value, s in (node.args, node.args[::-1]):
        got = _column_weight(s, key, e, len(lead)) if isinstance(value, Node) else None
        if got is None:
            continue
        w, read, column = got
        wv = val(w)
        if wv is not None and wv.is_floating_point() and tuple(wv.shape) == (lead + (1,) if column else lead):
            return value, w, read
    return None


def _column_weight(s, key, e: int, dims: int) -> Optional[tuple[Node, Node, bool]]:
    """(w, the masked read of w, whether w has a trailing 1 beyond the ids' ``dims``) for the column ``s`` of
    ``_top1_scale``."""
    if is_call(s, "call_function", operator.getitem) and isinstance(s.args[1], tuple) and len(s.args[1]) == 2 and (
            s.args[1][1] is None):  # w[mask, None]
        got = _mask_of(s.args[1][0])
        return (s.args[0], s, False) if got is not None and got[1:] == (key, e) else None
    inner = column_of(s, 1)  # w[mask].unsqueeze(-1): the masked rows are 1-D whatever the ids' dims
    if inner is not None and (w := _top1_rows(inner, key, e)) is not None:
        return w, inner, False
    w = _top1_rows(s, key, e)
    if w is None:
        return None
    base = column_of(w, dims)  # w.unsqueeze(-1)[mask], or w[mask] of a w with a trailing 1
    return (base, s, False) if base is not None else (w, s, True)



def _groups(marked: list) -> list[tuple[object, list]]:
    """The writes' masks grouped by the key of their ids, in the order the keys first appear."""
    groups: dict = {}
    for _, m in marked:
        groups.setdefault(m[1], []).append(m)
    return list(groups.items())


def _choice_columns(marked: list) -> Union[tuple[Node, int, dict], str, None]:
    """None where every mask is of one id tensor. Where they are of several, RaF's DeepSeek-from-scratch loop (one
    top-1 pass per choice j of a top-k router, ``out[ids_j == e] += expert_e(x[m]) * w_j[m].unsqueeze(-1)``):
    (the (..., k) integer ids, k, the choice j of each id tensor's key) when each is a column ``ids[..., j]`` of one
    id tensor and every j of range(k) has its writes; else why not."""
    groups = _groups(marked)
    if len(groups) == 1:
        return None
    columns = {key: choice_column(group[0][0]) for key, group in groups}
    if any(c is None for c in columns.values()):
        return "the writes select rows by masks of different id tensors (not the columns of one (..., k) id tensor)"
    base = next(iter(columns.values()))[0]
    bv, k = val(base), val(base).shape[-1]
    if bv.dtype.is_floating_point or bv.dtype.is_complex or bv.dtype == torch.bool or len(
            {same_value_key(b) for b, _ in columns.values()}) != 1:
        return "the writes' id tensors are not the columns of one (..., k) integer id tensor"
    if sorted(j for _, j in columns.values()) != list(range(k)):
        return f"the writes' id tensors are not each column of the (..., {k}) ids once"
    return base, k, {key: j for key, (_, j) in columns.items()}


def _choices_spec(choices: tuple, marked: list, bodies: list) -> Union[tuple[MoESpec, int, None], str]:
    """One top-k spec for the choices' passes (``_choice_columns``): each pass j a complete top-1 loop (each of
    range(E) once), every pass running the same experts, pass j scaled by column j of one (..., k) float routing
    weight at one place. Exact: the op sums, for each token, its k choices' weighted expert outputs, as the passes'
    ``+=`` into one zeros buffer do."""
    from .masked_writes import _one_spec

    base, k, choice_of = choices
    passes: dict = {}
    for (_, m), body in zip(marked, bodies):
        passes.setdefault(choice_of[m[1]], []).append(body)
    weights, keys, specs = {}, set(), {}
    for j, group in sorted(passes.items()):
        cols = [choice_column(b.spec.weights) if b.spec.weights is not None else None for b in group]
        if any(c is None or c[1] != j for c in cols):
            return (f"the experts of choice {j} are not scaled by column {j} of one (..., {k}) routing weight (several "
                    "choices need their own weights)")
        keys |= {(same_value_key(c[0]), b.spec.weight_position) for c, b in zip(cols, group)}
        weights[j] = cols[0][0]
        group = [dataclasses.replace(b, spec=dataclasses.replace(b.spec, weights=group[0].spec.weights))
                 for b in group]
        one = _one_spec(group)
        if isinstance(one, str):
            return f"choice {j}: {one}"
        if one[2] is not None:
            return "row blocks of flat weights are not read with several choices"
        specs[j] = one
    wv = val(weights[0])
    if len(keys) != 1 or wv is None or not wv.is_floating_point() or tuple(wv.shape) != tuple(val(base).shape):
        return f"the choices are not scaled by the columns of one (..., {k}) routing weight at one place"
    first, num_experts, _ = specs[0]
    plain = dataclasses.replace(first, ids=None, weights=None)
    if any(n != num_experts or dataclasses.replace(s, ids=None, weights=None) != plain for s, n, _ in specs.values()):
        return "the choices' passes run different experts"
    return dataclasses.replace(first, ids=base, weights=weights[0]), num_experts, None


def _topk_width(ids: Node) -> Optional[int]:
    """N for ``topk(scores, k).indices`` over the last dim of (..., N) scores (every id in range(N)), else None."""
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return None
    top = ids.args[0]
    if not (is_call(top, "call_function", torch.topk) or is_call(top, "call_method", "topk")):
        return None
    dim = top.kwargs.get("dim", top.args[2] if len(top.args) > 2 else -1)
    scores = val(top.args[0]) if top.args else None
    if scores is None or dim not in (-1, scores.dim() - 1) or not isinstance(scores.shape[-1], int):
        return None
    return scores.shape[-1]


def top1_buffer(node: Node) -> bool:
    """The mark of a top-1 masked-writes loop: ``node`` is written at the rows of ``ids == e`` of (T,) or (B, T)
    integer ids."""
    return any(is_call(u, "call_function", operator.setitem) and u.args[0] is node and _mask_of(u.args[1])
               for u in node.users)


def _accumulated(value: Node, buf: Node, key, e: int) -> Optional[tuple[Node, Node]]:
    """(the read of buf, v) for ``buf[mask] += v`` (Dynamo: ``buf[mask] = buf[mask].__iadd__(v)``) at this mask."""
    if not (is_call(value, "call_function", operator.iadd, operator.add) and len(value.args) == 2 and len(
            value.users) == 1):
        return None
    read, v = value.args
    if not (is_call(read, "call_function", operator.getitem) and read.args[0] is buf and isinstance(v, Node)):
        return None
    got = _mask_of(read.args[1])
    # read only by the add (and by the size checks of its data-dependent row count)
    if got is not None and got[1:] == (key, e) and all(
            u is value or is_call(u, "call_function", torch.ops.aten.sym_size.int) for u in read.users):
        return read, v
    return None


def _viewed_back(graph: Graph, result: Node, after: Node, like: Node) -> None:
    """Point the readers of ``result`` that come after ``after`` at ``result.view_as(like)``, inserted right after
    ``after``. The driver then reads the op's flat (B*T, H) output in ``result``'s place: what the readers get is it
    viewed as the user's (B, T, H) buffer."""
    with graph.inserting_after(after):
        back = graph.call_method("view_as", (result, like))
    redirect_later_readers(result, after, back)


def _cloned(buf: Node) -> Optional[Node]:
    """t for ``t.clone()`` (``torch.clone(t)``; a memory format changes no value)."""
    if (is_call(buf, "call_method", "clone") or is_call(buf, "call_function", torch.clone)) and len(
            buf.args) == 1 and isinstance(buf.args[0], Node) and set(buf.kwargs) <= {"memory_format"}:
        return buf.args[0]
    return None


def _kept_rows_or(graph: Graph, buf: Node, after: Node, kept_row: Node, base: Node) -> None:
    """Point the readers of ``buf`` that come after ``after`` at ``torch.where(kept_row, buf, base)``, inserted right
    after ``after``. The driver then reads the op's result in ``buf``'s place: a kept row is its expert's output, a
    dropped row (the op's 0) is ``base``'s row, as the user's buffer, a clone of ``base``, held it."""
    with graph.inserting_after(after):
        chosen = graph.call_function(torch.where, (kept_row, buf, base))
    if val(buf) is not None:
        chosen.meta["example_value"] = val(buf)
    redirect_later_readers(buf, after, chosen)


def match_top1_masks(buf: Node) -> Union[Match, str, None]:
    """A top-1 router's loop of boolean-mask writes (``idx`` (T,) or (B, T) integer ids, one expert per token)::

        out = torch.zeros_like(x)                        # or empty_like(x), x.new_zeros(x.shape)
        for e in range(E):                               # each of range(E) once, in any order
            out[idx == e] = expert_e(x[idx == e])        # or out[m] = w[m, None] * expert_e(x[m]); or out[m] += ...
        y = out * w[:, None]                             # or w[..., None] of (B, T) w; or none: the op scales by 1

    Exact because the masks ``idx == e`` of distinct e never share a row, so each row is written by its one expert
    (or by none), as the op computes it. A row whose id is outside range(E) keeps the buffer's first value: zeros,
    which is what the op gives for an out-of-range id, but garbage with ``empty_like`` and the clone's row with
    ``t.clone()``; so an empty or cloned buffer, and a weight applied to the whole buffer (eager's ``0 * w`` is NaN at
    a non-finite w), need ids provably in range(E): argmax, max or topk(1) indices over E scores. With a kept
    one-hot's masks the dropped rows are known (``M.any(-1)`` false): a clone of the tokens the experts read keeps
    their token there, which ``torch.where`` on the op's result gives (a clone of anything else is left alone). Ids
    of a router over another number of experts than the loop writes are left alone. The experts are the unrolled
    loop's (``_masked_body``), biases included.

    With (B, T) ids, x and the buffer must be (B, T, H), the masks then selecting rows of their leading two dims in
    one row-major order: the op runs on the flat views and its result is viewed back (``_viewed_back``)."""
    from .driver import CHANGED_IN_PLACE
    from .masked_writes import _flat_ids, _masked_body, _one_spec  # the checks shared with DeepSeek's spelling
    from .expert_projections import biased_linear
    from .emit import per_expert_for_op
    from .unrolled_loop import _Body

    writes = alias_mutations(buf)
    marked = [(w, _mask_of(w.args[1])) for w in writes if is_call(w, "call_function", operator.setitem)
              and w.args[0] is buf]
    marked = [(w, m) for w, m in marked if m is not None]
    # the mark: tensors written at the rows of two ids or more (``t[labels == -100] = 0.0`` is no expert loop)
    if len({m[2] for _, m in marked}) < 2 or not all(isinstance(w.args[2], Node) for w, _ in marked):
        return None
    ids = marked[0][1][0]
    flat = _flat_ids(ids)
    if flat is not None and val(flat).shape[-1] != 1:  # DeepSeek's (T*k,) flat ids: match_masked_writes speaks
        return None
    zeros = is_call(buf, "call_function", *_ZEROS[0]) or is_call(buf, "call_method", *_ZEROS[1])
    empty = is_call(buf, "call_function", *_EMPTY[0]) or is_call(buf, "call_method", *_EMPTY[1])
    base = _cloned(buf)  # a row no expert writes keeps base's values
    if not (zeros or empty or base is not None) or set(buf.kwargs) - {"dtype", "device", "layout", "memory_format"}:
        return ("the buffer does not start as zeros, empty (zeros_like, new_zeros, empty_like) or a clone: the rows "
                "no expert writes would keep values the op does not give")
    if len(marked) != len(writes):
        return "the buffer is also changed by something other than its masked writes"
    kept = kept_choices(ids)  # (idx, E): the masks are the columns of a one-hot with the router's drops in it
    if kept is not None and empty:
        return "the buffer is torch.empty_like and the router drops rows: a dropped row would hold garbage"
    if kept is not None and mutated_alias(kept[0]):  # the op reads the one-hot's ids later, where the loop ends
        return CHANGED_IN_PLACE
    choices = _choice_columns(marked)
    if isinstance(choices, str):
        return choices
    for _, group in _groups(marked):
        experts = [m[2] for m in group]
        if len(set(experts)) != len(experts):
            twice = next(e for e in experts if experts.count(e) > 1)
            return f"expert {twice}'s rows are written twice: the second write replaces the first"
    position = {n: i for i, n in enumerate(buf.graph.nodes)}
    marked.sort(key=lambda wm: position[wm[0]])
    lead = tuple(val(ids).shape) if kept is None else tuple(val(ids).shape[:-1])
    bodies, reads, own = [], [], set()
    for w, (_, key, e) in marked:
        value, vv, bv = w.args[2], val(w.args[2]), val(buf)
        # whole rows: a narrower value would be broadcast across each row, and a cast is the buffer's, not the op's
        if vv is None or bv is None or vv.dim() != 2 or vv.shape[-1] != bv.shape[-1] or vv.dtype != bv.dtype:
            return f"expert {e}'s write is not whole rows of the buffer's dtype"
        if (added := _accumulated(value, buf, key, e)) is not None:
            if not zeros:
                return "out[mask] += ... onto a buffer that does not start as zeros"
            own.add(added[0])
            reads.append(added[0])
            value = added[1]
        elif choices is not None:  # the choices' masks share rows: a second write would replace the first's sum
            return f"expert {e}'s write of one of several choices replaces the rows (out[mask] = ...), not adds to them"

        def projection(n, e=e):  # e's own weights (an nn.Linear's bias, row e of a stacked one), or a row block
            got = biased_linear(n, e)
            block = block_linear(n) if got is None else None
            return got if block is None else (*block, None)

        body = _masked_body(value, e, rows=lambda n, key=key, e=e: _top1_rows(n, key, e),
                            scaled=lambda n, key=key, e=e: _top1_scale(n, key, e, lead), projection=projection,
                            look=True, required=False)
        if isinstance(body, str):
            return body
        xe, gated, down, layout, stacked, sliced, scale, where, scale_read = body
        gate, up = gated.gate, gated.up
        x = _top1_rows(xe, key, e)
        if x is None:
            return f"expert {e} does not read the tokens at its own mask"
        if up is not None and (gate[4] is None) != (up[4] is None):
            return f"expert {e}'s gate projection has a bias and its up projection none, or the other way round"
        reads += [n for n in (xe, gate[0], up[0] if up else None, scale_read) if n is not None]
        spec = MoESpec(x, ids, scale, gate[1], up[1] if up else None, down[1], layout, gated.activation,
                       weight_position=where, b1=gate[4], b1_up=up[4] if up else None, b2=down[4],
                       **gated.spec_fields())
        mask = w.args[1][0] if isinstance(w.args[1], tuple) else w.args[1]
        bodies.append(_Body(e, spec, mask, w, stacked, blocks=sliced))
    if choices is not None:
        one = _choices_spec(choices, marked, bodies)
    else:
        # a weight recomputed in each write (``w.squeeze(-1)[m, None]``) is one weight: the same ops on the same
        # inputs
        keys = {(None if b.spec.weights is None else same_value_key(b.spec.weights), b.spec.weight_position)
                for b in bodies}
        if len(keys) != 1:
            return "the experts do not all apply one routing weight at one place"
        bodies = [dataclasses.replace(b, spec=dataclasses.replace(b.spec, weights=bodies[0].spec.weights))
                  for b in bodies]
        one = _one_spec(bodies)
    if isinstance(one, str):
        return one
    spec, num_experts, sliced = one
    biases = [b for t in (spec.b1, spec.b1_up, spec.b2) if isinstance(t, tuple) for b in t]
    if biases and spec.gate_up is not None:
        return "the experts' fused gate/up projections have biases: the op splits a fused weight only when stacked"
    if any(alias_mutations(b) for b in biases):  # the op reads the biases later than the user's code did
        return CHANGED_IN_PLACE
    readers = {u for u in buf.users if u not in writes and u not in own}
    if any(position[u] < position[marked[-1][0]] for u in readers):
        return "the buffer is read before the loop's last write"
    product = None
    # with drops, a weight on the whole buffer stays the user's multiply: a dropped row is 0 * w there (NaN at a
    # non-finite w), and the op would give 0
    if spec.weights is None and kept is None and (scaled := scale_of_rows(buf, readers, lead)) is not None:
        product, weights = scaled
        spec = dataclasses.replace(spec, weights=weights)
    width = kept[1] if kept is not None else _router_width(ids) if choices is None else _topk_width(choices[0])
    if width is not None and width != num_experts:
        return f"the router chooses among {width} experts and the loop writes {num_experts}"
    if empty and width is None:
        return ("the buffer is torch.empty_like and the ids are not provably in range(E) (argmax, max or topk(1) "
                "over E scores): a row no expert writes would hold garbage")
    if base is not None and kept is None and width is None:
        return ("the buffer is a clone and the ids are not provably in range(E) (argmax, max or topk(1) over E "
                "scores): a row no expert writes would keep the clone's values, where the op gives 0")
    if base is not None and kept is not None and same_value_key(base) != same_value_key(spec.x):
        return ("the buffer is a clone of another tensor than the tokens the experts read: a row the router drops "
                "would keep that tensor's values, not pass its token through")
    if product is not None and width is None:
        return ("the routing weight scales the whole buffer and the ids are not provably in range(E): a row no "
                "expert writes is 0 * w in eager, NaN at a non-finite w, where the op gives 0")
    xv, bv = val(spec.x), val(buf)
    if xv is None or bv is None or xv.dim() != len(lead) + 1 or tuple(xv.shape[:-1]) != lead or tuple(
            bv.shape) != tuple(xv.shape) or bv.dtype != xv.dtype:
        return ("the buffer and the tokens are not (T, H) of one dtype, with (T,) ids" if len(lead) == 1 else
                "the buffer and the tokens are not (B, T, H) of one dtype, their leading dims the (B, T) ids'")
    biased = isinstance(spec.gate, tuple) and any(b is not None for b in (spec.b1, spec.b1_up, spec.b2))
    unweighted, batched, hidden = spec.weights is None, len(lead) > 1, xv.shape[-1]
    top_k = 1 if choices is None else len(choices[2])
    last = marked[-1][0]
    end = product if product is not None else last

    def derive(graph, spec: MoESpec) -> MoESpec:
        spec = per_expert_for_op(graph, spec) if biased else sliced(graph, spec) if sliced is not None else spec
        if kept is not None:  # a row the router dropped gets the out-of-range id E: the op leaves it zero
            has_row = graph.call_method("any", (spec.ids, -1))
            if base is not None:  # ... and the clone's token passes through it, as in the user's buffer
                _kept_rows_or(graph, buf, end, graph.call_method("unsqueeze", (has_row, -1)), base)
            spec = dataclasses.replace(spec, ids=graph.call_function(torch.where, (has_row, kept[0], num_experts)))
        if batched:  # the flat loop on row-major views; the readers get the op's result viewed back as (B, T, H)
            _viewed_back(graph, product if product is not None else buf, end, spec.x)
            tokens = graph.call_method("reshape", (spec.x, -1, hidden))
            # the emitter reads the tokens' dtype and grad from their traced value, the user's x flattened
            tokens.meta["example_value"] = xv.reshape(-1, hidden)
            column = graph.call_method("reshape", (spec.ids, -1, top_k))
            spec = dataclasses.replace(spec, x=tokens)
        elif choices is not None:  # (T, k) ids and weights, as the op takes them
            return spec
        else:  # a top-1 router's (T,) ids as the op's (T, 1)
            column = graph.call_method("view", (spec.ids, -1, 1))
        if unweighted:  # a weight of exactly 1: the op's product leaves each expert output as it is
            weights = graph.call_function(torch.ones_like, (column,), {"dtype": xv.dtype})
        elif batched:
            weights = graph.call_method("reshape", (spec.weights, -1, top_k))
        else:
            weights = graph.call_method("view", (spec.weights, -1, 1)) if val(spec.weights).dim() == 1 else spec.weights
        return dataclasses.replace(spec, ids=column, weights=weights)

    note = (f"{len(bodies)} boolean-mask selections (host syncs) removed"
            + ("; the router's drops kept (a dropped row is the op's out-of-range id)" if kept is not None else "")
            + ("; a dropped row passes its token through (the buffer was the tokens' clone)"
               if kept is not None and base is not None else "")
            + ("; the (B, T) tokens read as one (B*T, H) view" if batched else "")
            + ("; the flat weights read as (E, n, m) views" if sliced is not None else
               "; per-expert weights read where they lie" if isinstance(spec.gate, tuple) else "")
            + (f"; routing weight on the {spec.weight_position}" if spec.weight_position != "output" else "")
            + ("; the routing weight scaled the combined result" if product is not None else "")
            + ("; no routing weight (the op scales by 1)" if unweighted else ""))
    if choices is not None:
        note += f"; {top_k} passes over the choices, one per column of the (..., {top_k}) ids, read as top-{top_k}"
    return Match(spec, end, note, where=marked[0][0], acc=None if product is not None else buf,
                 writes=tuple(w for w, _ in marked), transient=tuple(reads),
                 derive=derive, top_k=top_k)
