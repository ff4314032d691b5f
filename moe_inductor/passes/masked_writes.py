"""Boolean-mask writes, spellings of form "unrolled_loop". The user code this matches:

DeepSeek-V2's training loop (``match_masked_writes``):

    flat = ids.view(-1)
    xr = x.repeat_interleave(k, dim=0)                   # row t*k + c is token t, like the flat ids
    buf = torch.empty_like(xr)
    for e in range(E):
        buf[flat == e] = expert_e(xr[flat == e])         # nn.Linear experts of a ModuleList
    out = (buf.view(T, k, H) * weights.unsqueeze(-1)).sum(dim=1)

The anchor is the weighted sum over k; the proof walks back to the E masked writes.

A top-1 router's loop (``match_top1_masks``), idx (T,) ids from argmax, max(dim=-1) or topk(1):

    out = torch.zeros_like(x)                            # or torch.empty_like(x), x.new_zeros(x.shape)
    for e in range(E):                                   # each expert once, in any order
        out[idx == e] = expert_e(x[idx == e])            # or w[m, None] * expert_e(x[m]); or out[m] += ...
    y = out * w[:, None]                                 # or the weight inside, or none (a weight of 1)

The anchor is the buffer; the proof reads every write to it. The loop's other spellings, and the checks the bodies
share, are in unrolled_loop.py.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Match
from .flat_slices import block_linear, blocks, sliced_spec, views
from .fx_utils import alias_mutations, is_call, read_gated, val, weighted_sum


def _flat_ids(node) -> Optional[Node]:
    """``ids`` for ``ids.view(-1)`` / ``ids.reshape(-1)`` / ``ids.flatten()`` of (T, k) integer ids."""
    if is_call(node, "call_method", "view", "reshape") and tuple(node.args[1:]) in ((-1,), ((-1,),)):
        ids = node.args[0]
    elif is_call(node, "call_method", "flatten") and len(node.args) == 1 and not node.kwargs:
        ids = node.args[0]
    else:
        return None
    iv = val(ids)
    return ids if iv is not None and iv.dim() == 2 and not iv.dtype.is_floating_point else None


def _masked_rows(node, flat: Node) -> Optional[tuple[Node, int]]:
    """(xr, e) for ``xr[flat == e]``."""
    if not is_call(node, "call_function", operator.getitem):
        return None
    xr, mask = node.args
    if not (is_call(mask, "call_function", operator.eq) and mask.args[0] is flat and isinstance(mask.args[1], int)):
        return None
    return xr, mask.args[1]


def _repeated_tokens(xr: Node, k: int) -> Optional[Node]:
    """``x`` for ``x.repeat_interleave(k, dim=0)`` (row t*k + c is token t, like the flat ids)."""
    if not is_call(xr, "call_method", "repeat_interleave"):
        return None
    reps = xr.kwargs.get("repeats", xr.args[1] if len(xr.args) > 1 else None)
    dim = xr.kwargs.get("dim", xr.args[2] if len(xr.args) > 2 else None)
    if reps != k or dim != 0 or set(xr.kwargs) - {"repeats", "dim"}:
        return None
    return xr.args[0]


def _summed_over_k(y: Node) -> Optional[Node]:
    """``g`` for ``g.sum(dim=1)`` (the routing weight applied inside the experts, the combine a plain sum)."""
    dim = y.kwargs.get("dim", y.args[1] if len(y.args) > 1 else None)
    if is_call(y, "call_method", "sum") and dim == 1 and set(y.kwargs) <= {"dim"} and len(y.args) <= 2 and isinstance(
            y.args[0], Node):
        return y.args[0]
    return None


def _masked_weight(node, flat: Node, e: int) -> Optional[Node]:
    """``weights`` for ``weights.reshape(-1, 1)[flat == e]`` (or ``.view(-1, 1)``) of (T, k) float weights: row t*k + c
    of the flat weights is choice c of token t, like the flat ids."""
    rows = _masked_rows(node, flat)
    if rows is None or rows[1] != e:
        return None
    column = rows[0]
    if not (is_call(column, "call_method", "view", "reshape") and tuple(column.args[1:]) in ((-1, 1), ((-1, 1),))):
        return None
    weights = column.args[0]
    wv, iv = val(weights), val(flat.args[0]) if isinstance(flat.args[0], Node) else None
    if wv is None or iv is None or not wv.is_floating_point() or tuple(wv.shape) != tuple(iv.shape):
        return None
    return weights


def _scaled(node, flat: Node, e: int) -> Optional[tuple[Node, Node, Node]]:
    """(value, weights, the masked read of the weights) for ``value * weights.reshape(-1, 1)[flat == e]`` (either
    order)."""
    if not (is_call(node, "call_function", operator.mul) and len(node.args) == 2 and not node.kwargs):
        return None
    for value, scale in (node.args, node.args[::-1]):
        weights = _masked_weight(scale, flat, e) if isinstance(value, Node) else None
        if weights is not None:
            return value, weights, scale
    return None


def _masked_body(value: Node, e: int, rows, scaled, projection, look: bool, required: bool) -> Union[tuple, str]:
    """Expert e's write ``buf[mask_e] = value``, read back: (the rows it reads, the gated reading, the down
    projection's reading, layout, stacked, the row blocks of flat weights or None, weights or None, position, the
    masked read of the weights or None), or why not. ``rows(n)`` says which rows a masked read of the tokens reads,
    ``scaled(n)`` (value, weights, read) for ``value`` times this body's own routing weight, ``projection(n)`` the
    reading of a projection on e's own weights. When ``look``, the routing weight may scale exactly one of the
    expert's output, hidden state or input, at the rows of its own mask; when ``required``, one must."""
    weights, position, read = None, "output", None
    if look and (got := scaled(value)) is not None:
        value, weights, read = got
    down = projection(value)
    if down is None:
        return f"expert {e}'s output is not a projection on its own weights"
    h, w_down, layout, stacked = down[:4]
    if look and weights is None and (got := scaled(h)) is not None:
        (h, weights, read), position = got, "between"
    gated = read_gated(h, projection)
    if gated is None:
        return f"expert {e}'s hidden state is not a known activation of its own projections"
    gate, up = gated.gate, gated.up
    xe = gate[0]
    if up is not None and up[0] is not xe and not (rows(xe) is not None and rows(xe) == rows(up[0])):
        return f"expert {e}'s gate and up projections read different rows"
    if look and weights is None and (got := scaled(xe)) is not None:
        (xe, weights, read), position = got, "input"
    if required and weights is None:
        return "no routing weight: neither the combine nor weights.view(-1, 1)[flat == e] in the experts applies one"
    sliced = blocks([None if p is None else (p[1], p[2]) for p in (gate, up, down)])
    if isinstance(sliced, str):
        return sliced
    if any((sliced is None and p[2] != layout) or p[3] != stacked for p in (gate, up) if p is not None):
        return "the projections mix weight layouts or stacked and per-expert weights"
    return xe, gated, down, layout, stacked, sliced, weights, position, read


def _one_spec(bodies: list) -> Union[tuple[MoESpec, int, Optional[Callable]], str]:
    """One spec for the loop's bodies (``unrolled_loop._Body``): (spec, E, the derive that makes the op's weights
    from flat row blocks, or None), or why not. Each of range(E) must be written once."""
    from .unrolled_loop import _per_expert_spec

    spec, derive = bodies[0].spec, None
    experts = sorted(b.e for b in bodies)
    if any(b.blocks is not None for b in bodies):
        if not all(b.blocks is not None for b in bodies):
            return "some bodies read row blocks of flat weights and others not"
        spec = sliced_spec([(b.e, b.blocks, b.spec) for b in bodies])
        if isinstance(spec, str):
            return spec
        return spec, len(spec.gate), views(bodies[0].blocks)
    if all(b.stacked for b in bodies):
        if any(b.spec != spec for b in bodies):
            return "the loop bodies differ in more than the expert index"
        num_experts = val(spec.gate).shape[0]
    elif not any(b.stacked for b in bodies):
        num_experts = len(bodies)
    else:
        return "some bodies use stacked weights and others per-expert ones"
    if experts != list(range(num_experts)):
        return f"the loop writes experts {experts}, not each of range({num_experts}) once"
    if not bodies[0].stacked:
        spec = _per_expert_spec(bodies)
        if spec is None:
            return "the per-expert weights are not one distinct weight per expert and projection, of one shape"
    return spec, num_experts, derive


def match_masked_writes(y: Node) -> Union[Match, str, None]:
    """DeepSeek-V2/DeepSeek-MoE's training loop (boolean masks over the repeated tokens, writes, not adds)::

        xr = x.repeat_interleave(k, dim=0); flat = ids.view(-1); buf = torch.empty_like(xr)
        for e, expert in enumerate(experts):
            buf[flat == e] = expert(xr[flat == e])
        y = (buf.view(T, k, -1) * weights.unsqueeze(-1)).sum(dim=1)

    or the routing weight inside each expert, at its input or between its projections (``xr[flat == e] *
    weights.view(-1, 1)[flat == e]``), and ``y = buf.view(T, k, -1).sum(dim=1)``.

    Every row is written once: each flat id is one of range(E) (ids from topk over E columns) and each e is
    written once. The writes go with the region, and the masked reads take their size asserts with them."""
    from .unrolled_loop import _Body, _linear, _topk_ids  # the loop's shared checks

    combined = weighted_sum(y)
    if combined is not None:
        grouped, weights = combined
    elif (grouped := _summed_over_k(y)) is not None:
        weights = None
    else:
        return None
    if not (is_call(grouped, "call_method", "view", "reshape") and len(grouped.args) >= 2):
        return None
    buf = grouped.args[0]
    if not (is_call(buf, "call_function", torch.empty_like, torch.zeros_like) and len(buf.args) == 1):
        return None
    writes = alias_mutations(buf)
    if not writes or not all(is_call(w, "call_function", operator.setitem) and w.args[0] is buf for w in writes):
        return None
    first = writes[0].args[1]
    flat = first.args[0] if is_call(first, "call_function", operator.eq) else None
    ids = _flat_ids(flat) if flat is not None else None
    if ids is None:
        return None
    iv, wv = val(ids), val(weights)
    T, k = iv.shape
    gv, bv = val(grouped), val(buf)
    if (weights is not None and (wv is None or tuple(wv.shape) != tuple(iv.shape))) or gv is None or tuple(
            gv.shape) != (T, k, bv.shape[-1]):
        return "the buffer is not viewed (T, k, H) like the ids and weights"
    if not _topk_ids(ids):
        return "the ids are not from topk: rows of ids outside range(E) would never be written"
    bodies, reads = [], []
    for w in writes:
        mask, value = w.args[1], w.args[2]
        if not (is_call(mask, "call_function", operator.eq) and mask.args[0] is flat and isinstance(mask.args[1], int)):
            return "a write to the buffer is not at the rows of flat ids == e"
        e = mask.args[1]
        if is_call(value, "call_method", "to") and isinstance(value.args[0], Node) and val(value.args[0]) is not None and (
                val(value) is not None and val(value.args[0]).dtype == val(value).dtype):  # a cast to the buffer's own dtype
            value = value.args[0]
        body = _masked_body(value, e, rows=lambda n: _masked_rows(n, flat), scaled=lambda n: _scaled(n, flat, e),
                            projection=lambda n, e=e: _linear(n, e) or block_linear(n),
                            look=weights is None, required=weights is None)
        if isinstance(body, str):
            return body
        xe, gated, down, layout, stacked, sliced, scale, position, scale_read = body
        gate, up = gated.gate, gated.up
        rows = _masked_rows(xe, flat)
        if rows is None or rows[1] != e:
            return f"expert {e} does not read the repeated tokens at its own mask"
        x = _repeated_tokens(rows[0], k)
        if x is None or x is not _repeated_tokens(buf.args[0], k) and buf.args[0] is not rows[0]:
            return "the experts do not read x.repeat_interleave(k, dim=0), the rows the buffer holds"
        reads += [n for n in (xe, gate[0], up[0] if up else None, scale_read) if n is not None]
        spec = MoESpec(x, ids, weights if weights is not None else scale, gate[1], up[1] if up else None, down[1],
                       layout, gated.activation, weight_position=position, **gated.spec_fields())
        bodies.append(_Body(e, spec, mask, w, stacked, blocks=sliced))
    one = _one_spec(bodies)
    if isinstance(one, str):
        return one
    spec, num_experts, derive = one
    top = ids.args[0]
    scores = val(top.args[0]) if top.args else None
    if scores is None or scores.shape[-1] != num_experts:
        return "the ids are chosen among another number of experts than the loop runs"
    xv = val(spec.x)
    if xv is None or xv.dim() != 2 or xv.shape[0] != T or tuple(val(buf).shape) != (T * k, xv.shape[1]):
        return "the tokens and the buffer do not have (T, H) and (T*k, H) shapes"
    note = (f"{num_experts} boolean-mask selections (host syncs) removed"
            + ("; the flat weights read as (E, n, m) views" if derive is not None else
               "; per-expert weights stacked at each call" if isinstance(spec.gate, tuple) else "")
            + (f"; routing weight on the {spec.weight_position}" if spec.weight_position != "output" else ""))
    return Match(spec, y, note, where=writes[0], writes=tuple(writes), transient=tuple(reads), derive=derive)


# A top-1 router's boolean-mask writes: ``out[idx == e] = expert_e(x[idx == e])`` over (T,) ids, one expert per row.

_ZEROS = ((torch.zeros_like, torch.zeros), ("new_zeros",))
_EMPTY = ((torch.empty_like, torch.empty), ("new_empty",))
#: ops that give the same values from the same inputs: ids recomputed in each body (``x[idx == e]`` and
#: ``out[idx == e]`` as two masks, or ``logits.argmax(-1) == e`` written in the loop) are the same ids
_PURE_METHODS = {"argmax", "max", "topk", "squeeze", "view", "reshape", "flatten"}
_PURE_FUNCTIONS = {torch.argmax, torch.max, torch.topk, torch.squeeze, torch.flatten, operator.getitem}


def _ids_key(node: Node, top: Optional[Node] = None):
    """A key equal for two nodes that compute the same ids: the same pure ops on the same inputs, none of which is
    changed in place (a changed input may give another value at each read: the node is then only itself)."""
    top = node if top is None else top
    pure = (node.op == "call_method" and node.target in _PURE_METHODS) or (
        node.op == "call_function" and node.target in _PURE_FUNCTIONS)
    if not pure:
        return top if alias_mutations(node) else node

    def arg(a):
        return _ids_key(a, top) if isinstance(a, Node) else repr(a)  # slices are unhashable here
    return node.target, tuple(map(arg, node.args)), tuple(sorted((k, arg(v)) for k, v in node.kwargs.items()))


def _mask_of(index) -> Optional[tuple[Node, object, int]]:
    """(ids, the ids' key, e) for the index ``ids == e`` (either order; or ``(ids == e, :)``) of (T,) integer ids."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None, None, None):
        index = index[0]
    if not (is_call(index, "call_function", operator.eq, torch.eq) and len(index.args) == 2 and not index.kwargs):
        return None
    a, b = index.args
    ids, e = (a, b) if type(b) is int else (b, a) if type(a) is int else (None, None)
    iv = val(ids)
    if iv is None or iv.dim() != 1 or iv.dtype.is_floating_point or iv.dtype.is_complex or iv.dtype == torch.bool:
        return None
    return ids, _ids_key(ids), e


def _router_width(ids: Node) -> Optional[int]:
    """N when every id is provably in range(N): ``argmax(dim=-1)`` or ``max(dim=-1)`` indices of (T, N) scores, or
    the one column of ``topk(1)`` (or ``max(keepdim=True)``) indices, squeezed, flattened or sliced ``[:, 0]``."""
    column = False
    if (is_call(ids, "call_method", "squeeze") and tuple(ids.args[1:]) in ((-1,), (1,))) or (
            is_call(ids, "call_method", "view", "reshape") and tuple(ids.args[1:]) in ((-1,), ((-1,),))) or (
            is_call(ids, "call_method", "flatten") and len(ids.args) == 1) or (
            is_call(ids, "call_function", operator.getitem) and ids.args[1] == (slice(None, None, None), 0)):
        ids, column = ids.args[0], True
        if ids.kwargs or val(ids) is None or val(ids).dim() != 2 or val(ids).shape[-1] != 1:
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
    if k != 1 or keep is not column or dim not in (-1, 1) or scores is None or scores.dim() != 2:
        return None
    width = scores.shape[-1]
    return width if isinstance(width, int) else None


def _top1_rows(node, key, e: int) -> Optional[Node]:
    """``x`` for ``x[mask]`` or ``x[mask, :]``, mask this body's own ``ids == e``."""
    if not is_call(node, "call_function", operator.getitem):
        return None
    got = _mask_of(node.args[1])
    return node.args[0] if got is not None and got[1:] == (key, e) else None


def _top1_scale(node, key, e: int, T) -> Optional[tuple[Node, Node, Node]]:
    """(value, w, the masked read of w) for ``value * s`` (either order), s this body's rows of one float w as a
    column: ``w[mask, None]``, ``w[mask].unsqueeze(-1)`` (``[:, None]``, ``.view(-1, 1)``) or ``w.unsqueeze(-1)[mask]``
    of a (T,) w, or ``w[mask]`` of a (T, 1) w."""
    if not (is_call(node, "call_function", operator.mul) and len(node.args) == 2 and not node.kwargs):
        return None
    for value, s in (node.args, node.args[::-1]):
        got = _column_weight(s, key, e) if isinstance(value, Node) else None
        if got is None:
            continue
        w, read, dim = got
        wv = val(w)
        if wv is not None and wv.is_floating_point() and tuple(wv.shape) == ((T,) if dim == 1 else (T, 1)):
            return value, w, read
    return None


def _column_weight(s, key, e: int) -> Optional[tuple[Node, Node, int]]:
    """(w, the masked read of w, the dims w must have) for the column ``s`` of ``_top1_scale``."""
    if is_call(s, "call_function", operator.getitem) and isinstance(s.args[1], tuple) and len(s.args[1]) == 2 and (
            s.args[1][1] is None):  # w[mask, None]
        got = _mask_of(s.args[1][0])
        return (s.args[0], s, 1) if got is not None and got[1:] == (key, e) else None
    inner = _as_column(s)  # w[mask].unsqueeze(-1)
    if inner is not None and (w := _top1_rows(inner, key, e)) is not None:
        return w, inner, 1
    w = _top1_rows(s, key, e)
    if w is None:
        return None
    base = _as_column(w)  # w.unsqueeze(-1)[mask], or w[mask] of a (T, 1) w
    return (base, s, 1) if base is not None else (w, s, 2)


def _as_column(node) -> Optional[Node]:
    """``w`` for ``w.unsqueeze(-1)``, ``w[:, None]`` or ``w.view(-1, 1)`` (``reshape``) of a 1-D w."""
    if not isinstance(node, Node) or not node.args or not isinstance(node.args[0], Node):
        return None
    w = node.args[0]
    if (is_call(node, "call_method", "unsqueeze") and tuple(node.args[1:]) in ((-1,), (1,))) or (
            is_call(node, "call_function", operator.getitem) and node.args[1] in (
            (slice(None, None, None), None), (Ellipsis, None))) or (
            is_call(node, "call_method", "view", "reshape") and tuple(node.args[1:]) in ((-1, 1), ((-1, 1),))):
        return w if val(w) is not None and val(w).dim() == 1 and not node.kwargs else None
    return None


def top1_buffer(node: Node) -> bool:
    """The mark of a top-1 masked-writes loop: ``node`` is written at the rows of ``ids == e`` of (T,) integer ids."""
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


def match_top1_masks(buf: Node) -> Union[Match, str, None]:
    """A top-1 router's loop of boolean-mask writes (``idx`` (T,) integer ids, one expert per token)::

        out = torch.zeros_like(x)                        # or empty_like(x), x.new_zeros(x.shape)
        for e in range(E):                               # each of range(E) once, in any order
            out[idx == e] = expert_e(x[idx == e])        # or out[m] = w[m, None] * expert_e(x[m]); or out[m] += ...
        y = out * w[:, None]                             # or no weight at all: the op scales by 1

    Exact because the masks ``idx == e`` of distinct e never share a row, so each row is written by its one expert
    (or by none), as the op computes it. A row whose id is outside range(E) keeps the buffer's first value: zeros,
    which is what the op gives for an out-of-range id, but garbage with ``empty_like``; so an empty buffer, and a
    weight applied to the whole buffer (eager's ``0 * w`` is NaN at a non-finite w), need ids provably in range(E):
    argmax, max or topk(1) indices over E scores. Ids of a router over another number of experts than the loop
    writes are left alone. The experts are the unrolled loop's (``_masked_body``), biases included."""
    from .driver import CHANGED_IN_PLACE
    from .unrolled_loop import _Body, _scale_of_result, _stacked, biased_linear

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
    if not (zeros or empty) or set(buf.kwargs) - {"dtype", "device", "layout", "memory_format"}:
        return ("the buffer does not start as zeros or empty (zeros_like, new_zeros, empty_like): the rows no expert "
                "writes would keep values the op does not give")
    if len(marked) != len(writes):
        return "the buffer is also changed by something other than its masked writes"
    if len({m[1] for _, m in marked}) != 1:
        return "the writes select rows by masks of different id tensors"
    experts = [m[2] for _, m in marked]
    if len(set(experts)) != len(experts):
        twice = next(e for e in experts if experts.count(e) > 1)
        return f"expert {twice}'s rows are written twice: the second write replaces the first"
    position = {n: i for i, n in enumerate(buf.graph.nodes)}
    marked.sort(key=lambda wm: position[wm[0]])
    T = val(ids).shape[0]
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

        def projection(n, e=e):  # e's own weights (an nn.Linear's bias, row e of a stacked one), or a row block
            got = biased_linear(n, e)
            block = block_linear(n) if got is None else None
            return got if block is None else (*block, None)

        body = _masked_body(value, e, rows=lambda n, key=key, e=e: _top1_rows(n, key, e),
                            scaled=lambda n, key=key, e=e: _top1_scale(n, key, e, T), projection=projection,
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
    if len({(b.spec.weights, b.spec.weight_position) for b in bodies}) != 1:
        return "the experts do not all apply one routing weight at one place"
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
    if spec.weights is None and (scaled := _scale_of_result(buf, readers)) is not None:
        product, weights = scaled
        spec = dataclasses.replace(spec, weights=weights)
    width = _router_width(ids)
    if width is not None and width != num_experts:
        return f"the router chooses among {width} experts and the loop writes {num_experts}"
    if empty and width is None:
        return ("the buffer is torch.empty_like and the ids are not provably in range(E) (argmax, max or topk(1) "
                "over E scores): a row no expert writes would hold garbage")
    if product is not None and width is None:
        return ("the routing weight scales the whole buffer and the ids are not provably in range(E): a row no "
                "expert writes is 0 * w in eager, NaN at a non-finite w, where the op gives 0")
    xv, bv = val(spec.x), val(buf)
    if xv is None or bv is None or xv.dim() != 2 or tuple(bv.shape) != tuple(xv.shape) or bv.dtype != xv.dtype or (
            xv.shape[0] != T):
        return "the buffer and the tokens are not (T, H) of one dtype, with (T,) ids"
    biased = isinstance(spec.gate, tuple) and any(b is not None for b in (spec.b1, spec.b1_up, spec.b2))
    unweighted = spec.weights is None

    def derive(graph, spec: MoESpec) -> MoESpec:
        spec = _stacked(graph, spec) if biased else sliced(graph, spec) if sliced is not None else spec
        column = graph.call_method("view", (spec.ids, -1, 1))  # a top-1 router's (T,) ids as the op's (T, 1)
        if unweighted:  # a weight of exactly 1: the op's product leaves each expert output as it is
            weights = graph.call_function(torch.ones_like, (column,), {"dtype": xv.dtype})
        else:
            weights = graph.call_method("view", (spec.weights, -1, 1)) if val(spec.weights).dim() == 1 else spec.weights
        return dataclasses.replace(spec, ids=column, weights=weights)

    note = (f"{len(bodies)} boolean-mask selections (host syncs) removed"
            + ("; the flat weights read as (E, n, m) views" if sliced is not None else
               "; per-expert weights stacked at each call" if isinstance(spec.gate, tuple) else "")
            + (f"; routing weight on the {spec.weight_position}" if spec.weight_position != "output" else "")
            + ("; the routing weight scaled the combined result" if product is not None else "")
            + ("; no routing weight (the op scales by 1)" if unweighted else ""))
    last = marked[-1][0]
    return Match(spec, product if product is not None else last, note, where=marked[0][0],
                 acc=None if product is not None else buf, writes=tuple(w for w, _ in marked), transient=tuple(reads),
                 derive=derive, top_k=1)
