"""Boolean-mask writes, spellings of form "unrolled_loop". The user code this matches:

DeepSeek-V2's training loop (``match_masked_writes``):

    flat = ids.view(-1)
    xr = x.repeat_interleave(k, dim=0)                   # row t*k + c is token t, like the flat ids
    buf = torch.empty_like(xr)
    for e in range(E):
        buf[flat == e] = expert_e(xr[flat == e])         # nn.Linear experts of a ModuleList
    out = (buf.view(T, k, H) * weights.unsqueeze(-1)).sum(dim=1)

The anchor is the weighted sum over k; the proof walks back to the E masked writes.

A top-1 router's loop, ``out[idx == e] = expert_e(x[idx == e])`` over (T,) ids or (B, T) ids of (B, T, H) tokens, is
in top1_masks.py (``match_top1_masks``); the checks of an expert's body (``_masked_body``, which reads through the
expert's dropouts that are the identity: eval mode, or p == 0) and of the loop's bodies together (``_one_spec``) are
shared by both spellings and live here. The loop's other spellings are in unrolled_loop.py.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional, Union

import torch
from torch.fx import Node

from ..spec import MoESpec
from .driver import Match
from .flat_slices import block_linear, blocks, sliced_spec, views
from .aliases import alias_mutations
from .fx_utils import is_call, rounding_cast, val, weighted_sum
from .gated_reads import read_gated
from .slot_layers import through_dropouts
from .top1_masks import match_top1_masks, top1_buffer  # noqa: F401  (the top-1 spelling, read by unrolled_loop.py)


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


def _under_identity_dropouts(node: Node, e: int) -> tuple[Node, Optional[str]]:
    """``node`` under the dropouts that are the identity (p == 0, or not training: an expert module in eval mode); and
    why not, at a dropout that may drop (its random mask is no part of what the op computes)."""
    node, why = through_dropouts(node)
    if why is None:
        return node, None
    return node, (f"expert {e}'s dropout may drop (p > 0 in training, or a p or training flag that is not a literal): "
                  "a random mask the op does not draw")


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
    value, why = _under_identity_dropouts(value, e)
    if why is not None:
        return why
    down = projection(value)
    if down is None:
        cast = rounding_cast(value)
        if cast is not None:
            return (f"expert {e}'s output is cast from {cast[0]} to {cast[1]} before it is written: the cast rounds "
                    "what the experts compute")
        return f"expert {e}'s output is not a projection on its own weights"
    h, w_down, layout, stacked = down[:4]
    h, why = _under_identity_dropouts(h, e)
    if look and weights is None and why is None and (got := scaled(h)) is not None:
        (h, weights, read), position = got, "between"
        h, why = _under_identity_dropouts(h, e)
    if why is not None:
        return why
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
    from .expert_projections import _linear
    from .unrolled_loop import _Body, _topk_ids  # the loop's shared checks

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
               "; per-expert weights read where they lie" if isinstance(spec.gate, tuple) else "")
            + (f"; routing weight on the {spec.weight_position}" if spec.weight_position != "output" else ""))
    return Match(spec, y, note, where=writes[0], writes=tuple(writes), transient=tuple(reads), derive=derive)

