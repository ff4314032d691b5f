"""Form "unrolled_loop": a per-expert Python loop, unrolled by Dynamo into E copies of its body.

The user code this matches (under moe_inductor's scoped capture, ``torch.where`` with one argument traces as an op
with a data-dependent size instead of a graph break):

    out = torch.zeros_like(x)
    for e in range(E):                                   # every expert, each once
        tok, pos = torch.where(ids == e)                 # or nonzero(as_tuple=True), or HF v4's mask:
                                                         # pos, tok = torch.where(one_hot(ids, E).permute(2, 1, 0)[e])
        xe = x[tok]                                      # or x[None, tok].reshape(-1, H)
        h = F.silu(xe @ w1[e].T) * (xe @ w3[e].T)        # or F.linear(xe, w1[e]); or w1 stored (E, in, out)
        out.index_add_(0, tok, (h @ w2[e].T) * weights[tok, pos, None])   # or out[tok] += ... (ids from topk)
    return out

The routing weight may instead scale the expert's input (``xe = x[tok] * weights[tok, pos, None]``) or the hidden
state before the down projection; the op takes it at the same place. The rows may be the tokens that chose e at all,
``tok = (ids == e).any(-1).nonzero().squeeze(-1)`` with weights ``(weights * (ids == e)).sum(-1)[tok, None]``
(``loop_rows``), and the experts' weights row blocks of flat (E*I, H) weights, DBRX's ``w1[e * I:(e + 1) * I]``
(``flat_slices``).

A Switch-style top-1 loop (one choice per token, so the experts' rows are disjoint) may write each expert's rows
(``out[tok, :] = expert(x[tok, :])``, tok from ``(ids == e).nonzero(as_tuple=True)[0]`` of (T,) ids) and apply the
routing weight to the whole result (``out * p.view(-1, 1)``, the op's weight where the ids are provably in range(E):
else a row of no expert is eager's ``0 * p``, NaN at a non-finite p), or leave any scale of it to the code after the
loop (LLaMA-MoE's ``torch.mul(out, scores.reshape(-1, 1) * factor)``): the op then scales by 1, and a row no expert
writes stays zero, as the op leaves an out-of-range id; its nn.Linear experts may have biases.

DeepSeek-V2's training loop is the same form with boolean masks and writes (``match_masked_writes``):
``buf[flat == e] = expert(x.repeat_interleave(k, 0)[flat == e])``, then ``(buf.view(T, k, H) * w[..., None]).sum(1)``;
so is a top-1 router's ``out[idx == e] = expert(x[idx == e])`` (``match_top1_masks``).

The E bodies must agree on everything but e (same x, ids, weights, weights tensors, activation, layout), e must run
over all of range(E), and the accumulator must start from zeros and be changed by nothing else. Then the loop
becomes one ``moe_inductor::experts_forward``, and with it go the E nonzero calls (host syncs) and their unbacked
sizes. Anything else is left alone.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Graph, Node

from ..spec import MoESpec
from .driver import CHANGED_IN_PLACE, Anchor, Form, Match
from .emit import per_expert_for_op
from .flat_slices import block_linear, blocks, sliced_spec, views
from .aliases import alias_mutations, mutated_alias
from .expert_projections import biased_linear
from .fx_utils import is_call, known_equal, reads_metadata_only, scale_of_rows, source_line, val
from .gated_reads import read_gated
from .loop_rows import routing_scaled, rows_index, selection, token_rows_of
from .masked_writes import match_masked_writes, match_top1_masks, top1_buffer
from .table_writes import match_table_writes, table_buffer
from .zero_experts import Passthrough, identity_body, leading_rows, passthrough, proven, stacked_rows_cover

FORM = "unrolled_loop"


@dataclass(frozen=True)
class _Body:
    """One unrolled copy of the loop body: its expert, what it computes, and the nodes that only it uses."""

    e: int
    spec: MoESpec
    where: Node
    add: Node
    stacked: bool
    read: Optional[Node] = None  # the acc[tok] read of an ``acc[tok] += c`` body
    blocks: Optional[tuple] = None  # the (gate, up, down) row blocks of flat weights it reads (flat_slices.Block)
    #: the (gate, up, down) layouts of stacked weights that do not share one (the spec holds the down one's)
    layouts: Optional[tuple] = None


def _accumulation(add: Node, acc: Node) -> Optional[tuple[Node, Node, Optional[Node]]]:
    """(tok, contribution, the read of acc it adds to) for ``acc.index_add_(0, tok, c)`` or ``acc[tok] += c``
    (Dynamo: ``acc.__setitem__(tok, acc[tok].__iadd__(c))``); ``acc.index_add(0, tok, c)`` out of place too, a
    link of ``out = out.index_add(...)`` chain (``_chain``)."""
    if is_call(add, "call_method", "index_add_", "index_add") and len(add.args) == 4 and add.args[0] is acc and (
            add.args[1] == 0) and not add.kwargs:
        return add.args[2], add.args[3], None
    # acc.index_put_((tok,), c, accumulate=True): index_add_ spelled as an accumulating put
    if is_call(add, "call_method", "index_put_") and add.args[0] is acc and len(add.args) in (3, 4) and (
            add.args[3] if len(add.args) == 4 else add.kwargs.get("accumulate")) is True and set(add.kwargs) <= {
            "accumulate"} and isinstance(add.args[1], (tuple, list)) and len(add.args[1]) == 1:
        return add.args[1][0], add.args[2], None
    # acc.scatter_add_(0, tok[:, None].expand(-1, H), c): the index repeats each row's token across all H columns
    if is_call(add, "call_method", "scatter_add_", "scatter_add") and len(add.args) == 4 and add.args[0] is acc and (
            add.args[1] == 0) and not add.kwargs:
        tok = _broadcast_rows(add.args[2])
        iv, cv, av = val(add.args[2]), val(add.args[3]), val(acc)
        if tok is not None and None not in (iv, cv, av) and av.dim() == 2 and cv.dim() == 2 and iv.dim() == 2 and all(
                known_equal(a, b) for a, b in zip(iv.shape, cv.shape)) and known_equal(cv.shape[1], av.shape[1]):
            return tok, add.args[3], None
    if is_call(add, "call_function", operator.setitem) and add.args[0] is acc and isinstance(add.args[1], Node):
        tok, value = add.args[1], add.args[2]
        if is_call(value, "call_function", operator.iadd, operator.add) and len(value.users) == 1:
            read, contribution = value.args
            if is_call(read, "call_function", operator.getitem) and read.args == (acc, tok) and len(read.users) == 1:
                return tok, contribution, read
    return None


def _broadcast_rows(index: Node) -> Optional[Node]:
    """``tok`` for a (n, H) scatter index ``tok[:, None]`` / ``tok.unsqueeze(-1)`` / ``tok.view(-1, 1)``, expanded by
    ``.expand(-1, H)`` or ``.expand_as(c)``: row i of it is tok[i] in every column."""
    if not (is_call(index, "call_method", "expand", "expand_as") and isinstance(index.args[0], Node)):
        return None
    column = index.args[0]
    cv = val(column)
    if cv is None or cv.dim() != 2 or not known_equal(cv.shape[1], 1):
        return None
    if is_call(column, "call_function", operator.getitem) and column.args[1] in (
            (slice(None, None, None), None), (Ellipsis, None)):
        return column.args[0]
    if is_call(column, "call_method", "unsqueeze") and column.args[1] in (1, -1):
        return column.args[0]
    if is_call(column, "call_method", "view", "reshape") and tuple(column.args[1:]) == (-1, 1):
        return column.args[0]
    return None


def _topk_ids(ids: Node) -> bool:
    """``ids`` are ``topk(...).indices``: distinct within a row, so ``acc[tok] += c`` never writes a row twice."""
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return False
    topk = ids.args[0]
    return is_call(topk, "call_function", torch.topk) or is_call(topk, "call_method", "topk") or max_ids(ids)


def max_ids(ids: Node) -> bool:
    """``ids`` are ``max(dim=-1, keepdim=True).indices`` (a top-1 router): one id per row, so distinct within it,
    and in range of the last dim as topk's are."""
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return False
    top = ids.args[0]
    if not (is_call(top, "call_function", torch.max) or is_call(top, "call_method", "max")):
        return False
    dim = top.kwargs.get("dim", top.args[1] if len(top.args) > 1 else None)
    keepdim = top.kwargs.get("keepdim", top.args[2] if len(top.args) > 2 else False)
    src = val(top.args[0]) if isinstance(top.args[0], Node) else None
    return keepdim is True and src is not None and src.dim() == 2 and dim in (-1, 1)


def _body(add: Node, acc: Node) -> Union[_Body, Passthrough, str]:
    """One expert's body, read backwards from ``acc.index_add_(0, tok, contribution)`` or ``acc[tok] += ...`` (an
    expert MLP, or a zero-computation expert's rows added back: zero_experts.py); or, when it is not one we can
    prove, why not (explain() reports it)."""
    accumulated = _accumulation(add, acc)
    assigned = accumulated is None and (accumulated := _assignment(add, acc)) is not None
    if accumulated is None:
        return "a write to the accumulator is neither acc.index_add_(0, tok, ...) nor acc[tok] += ..."
    tok, contribution, read = accumulated
    if is_call(contribution, "call_method", "to") and len(contribution.args) == 2 and val(acc) is not None and (
            contribution.args[1] == val(acc).dtype):  # HF v4 casts each expert's output to the buffer's dtype
        contribution = contribution.args[0]
    sel = selection(tok)
    if sel is None:
        return "the rows are not selected by torch.where(ids == e) or (ids == e).nonzero(as_tuple=True)"
    ids, e = sel.ids, sel.e
    # (weights * (ids == e)).sum(-1) is the weight of e's one choice only where a token chooses e at most once
    if sel.hit is not None and not _topk_ids(ids):
        return "rows by (ids == e).any(-1) with ids not from topk: a token choosing e twice gets their summed weight"
    one_column = val(ids).dim() == 1 or val(ids).shape[-1] == 1
    if read is not None and not (one_column or _topk_ids(ids)):  # repeated ids: acc[tok] += c keeps one write
        return "acc[tok] += ... with ids not from topk: a token choosing an expert twice would be written once"
    # acc[tok] = c equals an accumulation only where every token has one choice: then the experts' rows are disjoint
    if assigned and not one_column:
        return "acc[tok] = ... with k > 1 choices per token: a token routed to two experts keeps only the last write"
    # the routing weight scales the expert's output (the usual place), its input, or the hidden state between the
    # projections; exactly one of the three, and always this body's own weights[tok, pos]
    position, weights = "output", None
    scaled = routing_scaled(contribution, tok, sel)
    expert_out = contribution
    if scaled is not None:
        expert_out, weights = scaled
    def projection(n: Node):  # e's own weights: w[e] of a stacked one, a per-expert one, or a row block of a flat one
        got = biased_linear(n, e)
        block = block_linear(n) if got is None else None
        return got if block is None else (*block, None)

    down = projection(expert_out)
    same = identity_body(contribution, tok, sel) if down is None else None
    if same is not None:  # a zero-computation expert: its rows back, times numbers and its routing weight at most
        return Passthrough(e, same[0], ids, same[1], same[2], sel.where, add, read)
    if down is None and is_call(expert_out, "call_function", operator.mul) and len(expert_out.args) == 2 and any(
            isinstance(a, Node) and projection(a) is not None for a in expert_out.args):
        return (f"expert {e}'s output is scaled by a factor that is not this body's own routing weight "
                "(weights[tok, pos, None] or a column of weights[tok, pos], at the rows and choices its selection "
                "picked)")
    if down is None:
        return (f"expert {e}'s output is not a matmul or F.linear on w[{e}] (stacked, plus row {e} of a stacked bias) "
                "or on a per-expert weight (plus its nn.Linear bias)")
    h, w_down, layout = down[:3]
    if weights is None and (scaled := routing_scaled(h, tok, sel)) is not None:
        (h, weights), position = scaled, "between"
    gated = read_gated(h, projection)
    if gated is None:
        return f"expert {e}'s hidden state is not a known activation of its own up projection(s)"
    activation, gate, up = gated.activation, gated.gate, gated.up
    xe = gate[0]
    # gate and up read the same rows: one node, or x[tok] written out twice (two identical gathers of x)
    if up is not None and up[0] is not xe:
        rows = token_rows_of(xe, tok)
        if rows is None or rows is not token_rows_of(up[0], tok):
            return f"expert {e}'s gate and up projections read different rows"
    if weights is None and (scaled := routing_scaled(xe, tok, sel)) is not None:
        (xe, weights), position = scaled, "input"
    # no routing weight in the body: ``match`` looks for it on the combined result (Switch scales after the loop)
    x = token_rows_of(xe, tok)
    if x is None and weights is None:
        return "no routing weight weights[tok, pos, None] scales the output, the input or the hidden state"
    if x is None:
        return f"expert {e}'s input is not x[tok] (its own selected rows of one (T, H) tensor)"
    sliced = blocks([None if p is None else (p[1], p[2]) for p in (gate, up, down)])
    if isinstance(sliced, str):
        return sliced
    if any(p[3] != down[3] for p in (gate, up) if p is not None):  # all stacked, or all per-expert
        return "the projections mix stacked and per-expert weights"
    layouts = None
    if sliced is None and any(p[2] != layout for p in (gate, up) if p is not None):  # a flat one's blocks may mix
        if not down[3] or gated.gate_up is not None:
            return "the projections mix weight layouts"
        # stacked weights in two layouts (DBRX: x @ w1[e].t(), h @ w2[e]): the op gets (E, out, in) views of each
        layouts = tuple(None if p is None else p[2] for p in (gate, up, down))
    if up is not None and (gate[4] is None) != (up[4] is None):
        return f"expert {e}'s gate projection has a bias and its up projection none, or the other way round"
    spec = MoESpec(x, ids, weights, gate[1], up[1] if up else None, w_down, layout, activation,
                   weight_position=position, b1=gate[4], b1_up=up[4] if up else None, b2=down[4],
                   **gated.spec_fields())
    return _Body(e, spec, sel.where, add, stacked=down[3], read=read, blocks=sliced, layouts=layouts)


def _assignment(write: Node, acc: Node) -> Optional[tuple[Node, Node, None]]:
    """(tok, value, None) for ``acc[tok] = value`` or ``acc[tok, :] = value`` (an index_put that replaces rows)."""
    if is_call(write, "call_function", operator.setitem) and write.args[0] is acc and isinstance(write.args[2], Node):
        index = write.args[1]
        tok = index if isinstance(index, Node) else index[0] if isinstance(index, tuple) and index else None
        vv, av = val(write.args[2]), val(acc)
        # whole (n, H) rows: a narrower value would be broadcast across the row, which no expert output is
        same_width = vv is not None and av is not None and vv.dim() == 2 and vv.shape[-1] == av.shape[-1]
        if isinstance(tok, Node) and (index is tok or rows_index(index, tok)) and same_width:
            return tok, write.args[2], None
    return None


def _per_expert_spec(bodies: list[_Body]) -> Optional[MoESpec]:
    """One spec over per-expert weights: tuples ordered by e, every e of range(E) once, one weight per expert and
    projection, all (out, in) (nn.Linear, ``F.linear``) or all (in, out) (``x @ w``)."""
    first = bodies[0].spec
    def biased(spec: MoESpec) -> tuple:
        return spec.b1 is None, spec.b1_up is None, spec.b2 is None

    shared = (first.x, first.ids, first.weights, first.layout, first.activation, first.up is None,
              first.weight_position, first.gate_up, first.alpha, first.limit, biased(first))
    if any((b.spec.x, b.spec.ids, b.spec.weights, b.spec.layout, b.spec.activation, b.spec.up is None,
            b.spec.weight_position, b.spec.gate_up, b.spec.alpha, b.spec.limit, biased(b.spec)) != shared
           for b in bodies):
        return None
    if sorted(b.e for b in bodies) != list(range(len(bodies))):
        return None
    ordered = sorted(bodies, key=lambda b: b.e)
    gate, down = tuple(b.spec.gate for b in ordered), tuple(b.spec.down for b in ordered)
    up = tuple(b.spec.up for b in ordered) if first.up is not None else None
    if len({id(n) for w in (gate, up or (), down) for n in w}) != len(gate) * (3 if up else 2):
        return None  # a weight shared between experts or projections is not the per-expert form
    if len({tuple(val(w).shape) for w in gate}) != 1 or len({tuple(val(w).shape) for w in down}) != 1:
        return None
    b1, b1_up, b2 = (None if getattr(first, f) is None else tuple(getattr(b.spec, f) for b in ordered)
                     for f in ("b1", "b1_up", "b2"))
    if any(t is not None and len({id(n) for n in t}) != len(t) for t in (b1, b1_up, b2)):
        return None  # a bias shared between experts: not one nn.Linear per expert
    return MoESpec(first.x, first.ids, first.weights, gate, up, down, first.layout, first.activation,
                   weight_position=first.weight_position, gate_up=first.gate_up, alpha=first.alpha, limit=first.limit,
                   b1=b1, b1_up=b1_up, b2=b2)


def _column_ids(graph: Graph, spec: MoESpec) -> MoESpec:
    """The spec with a top-1 router's (T,) ids as the op's (T, 1)."""
    return dataclasses.replace(spec, ids=graph.call_method("view", (spec.ids, -1, 1)))


def _scale_of_result(acc: Node, users: set) -> Optional[tuple[Node, Node]]:
    """``fx_utils.scale_of_rows`` of a (T, H) result: ``acc * s`` with s a (T, 1) float tensor (Switch scales the
    combined result by the chosen probability). ``users`` are acc's readers other than the loop's own writes and
    reads; s cannot depend on acc, since nothing else reads it."""
    av = val(acc)
    return None if av is None else scale_of_rows(acc, users, (av.shape[0],))


def _ids_width(ids: Node) -> Optional[int]:
    """N where the (T,) or (T, 1) ids are provably in range(N) (argmax, max or topk(1) over N scores), else None."""
    from .top1_masks import _router_width, _topk_width

    iv = val(ids)
    return None if iv is None else _router_width(ids) if iv.dim() == 1 else _topk_width(ids) if iv.shape[-1] == 1 else None


def _zeros_like_x(acc: Node) -> bool:
    return (is_call(acc, "call_function", torch.zeros_like, torch.zeros) or is_call(acc, "call_method", "new_zeros")) and (
        "fill_value" not in acc.kwargs)


def match(acc: Node, position: dict[Node, int]) -> Union[tuple, str, None]:
    """(the MoE, its E expert bodies, the ``acc * s`` product that applies the routing weight when the bodies do
    not, whether the adds are an out-of-place chain, the zero-computation experts' bodies and what they add or None)
    accumulating into ``acc``, when they form a complete, consistent MoE; else why not (a string) when ``acc``
    looked like a per-expert loop's accumulator, None when it never did.

    ``position`` gives each node's index in graph order."""
    if not _zeros_like_x(acc):
        return None
    mutations = alias_mutations(acc)  # index_add_ / out[tok] += ..., on acc or through any view of it
    chain = _chain(acc) if not mutations else None
    if chain is not None:  # out = out.index_add(0, tok, c) per expert: each link adds to the one before
        mutations, result, onto = chain, chain[-1], {add: add.args[0] for add in chain}
    else:
        result, onto = acc, {add: acc for add in mutations}
    if not any(_looks_like_a_body(m, onto[m]) for m in mutations):
        return None
    if chain is None and any(
            u.target not in ("index_add_", "index_put_", "scatter_add_", operator.setitem) for u in mutations):
        return "the accumulator is also changed by something other than the loop's writes"
    bodies = [_body(add, onto[add]) for add in mutations]
    failed = [(b, add) for b, add in zip(bodies, mutations) if isinstance(b, str)]
    if failed:  # the first failing body, at its own line (the write), which is where the user will look
        reason, add = failed[0]
        return f"{reason} (at {source_line(add).split(': ', 1)[0]})"
    zero = [b for b in bodies if isinstance(b, Passthrough)]
    routed = [b for b in bodies if not isinstance(b, Passthrough)]
    if zero and not routed:
        return proven(zero, routed, None)
    bodies = routed
    spec = bodies[0].spec
    if any(b.blocks is not None for b in bodies):
        if zero:
            return "zero-computation experts beside row blocks of flat weights"
        if not all(b.blocks is not None for b in bodies):
            return "some bodies read row blocks of flat weights and others not"
        spec = sliced_spec([(b.e, b.blocks, b.spec) for b in bodies])
        if isinstance(spec, str):
            return spec
    elif all(b.stacked for b in bodies):
        if any(b.spec != spec or b.layouts != bodies[0].layouts for b in bodies):  # the same region but for e
            return "the loop bodies differ in more than the expert index"
        if zero and not stacked_rows_cover(spec, len(bodies)):
            return "the stacked weights hold fewer experts than the loop routes to them"
        if not zero and sorted(b.e for b in bodies) != list(range(val(spec.gate).shape[0])):
            return f"the loop runs over experts {sorted(b.e for b in bodies)}, not each of range(E) once"
    elif not any(b.stacked for b in bodies):
        spec = _per_expert_spec(bodies)
        if spec is None:
            return "the per-expert weights are not one distinct weight per expert and projection, of one shape"
    else:
        return "some bodies use stacked weights and others per-expert ones"
    zeros = proven(zero, bodies, spec) if zero else None
    if isinstance(zeros, str):
        return zeros
    biases = [b for t in (spec.b1, spec.b1_up, spec.b2) if isinstance(t, tuple) for b in t]
    if biases and spec.gate_up is not None:
        return "the experts' fused gate/up projections have biases: the op splits a fused weight only when stacked"
    if any(mutated_alias(b) for b in biases):  # the op reads the biases later than the user's code did
        return CHANGED_IN_PLACE
    own_reads = {b.read for b in (*bodies, *zero) if b.read is not None}
    readers = {u for u in result.users if u not in mutations and u not in own_reads
               and not reads_metadata_only(u, result)}  # a template (``out.new_zeros(())``) reads no value
    iv = val(spec.ids)
    product = None
    one_choice = iv.dim() == 1 or iv.shape[-1] == 1
    if spec.weights is None and not one_choice:
        return ("no routing weight weights[tok, pos, None] scales the output, the input or the hidden state "
                "(nor, with one choice per token, the loop's result as acc * w[:, None])")
    if spec.weights is None:  # the routing weight on the result: only where each token has one choice
        # and only where every row has an expert: a row of none is 0 * w in eager (NaN at a non-finite w), 0 in the op
        scaled = _scale_of_result(result, readers) if _ids_width(spec.ids) == len(bodies) else None
        # else the result is each row's one expert output as it is (a row of no expert stays zero, as the op leaves
        # an out-of-range id): the op scales by 1 and whatever reads the result reads the op's
        if scaled is not None:
            product, weights = scaled
            spec = dataclasses.replace(spec, weights=weights)
    xv, av, wv = val(spec.x), val(acc), val(spec.weights)
    # an fp32 accumulator under half-precision experts (transformers v4's DeepSeek-V3: zeros_like(x, dtype=weights'
    # dtype)) holds their outputs widened: the op's result is cast to it
    wider = av is not None and xv is not None and av.dtype == torch.float32 and xv.dtype in (torch.bfloat16,
                                                                                            torch.float16)
    if xv is None or av is None or xv.dim() != 2 or tuple(av.shape) != tuple(xv.shape) or (
            av.dtype != xv.dtype and not wider):
        return "the accumulator does not have x's (T, H) shape and dtype (or fp32 under half-precision experts)"
    # weights[tok, pos] must be the (T, k) routing weights; a top-1 router's (T,) ids take a (T, 1) factor
    if spec.weights is not None and (wv is None or tuple(wv.shape) != (
            tuple(iv.shape) if iv.dim() == 2 else (iv.shape[0], 1))):
        return "the routing weights are not (T, k) like the ids"
    # every read of the accumulator must come after the last index_add_
    last_add = max(position[b.add] for b in (*bodies, *zero))
    if any(position[u] < last_add for u in readers):
        return "the accumulator is read before the loop ends"
    return spec, bodies, product, chain is not None, zero, zeros


def _chain(acc: Node) -> Optional[list[Node]]:
    """The links of ``out = out.index_add(0, tok, c)`` (or ``scatter_add``) starting at ``acc``, each read only by
    the next, the last read by what follows the loop; None when acc is not the start of such a chain. The zeros
    ``acc`` may also be a template of another tensor (``link = out.new_zeros(())``, a hand-written DDP keep-alive):
    that reader sees its shape, dtype and device only, which the rewrite leaves as they are."""
    links, cur = [], acc
    while True:
        users = [u for u in cur.users if not (cur is acc and reads_metadata_only(u, acc))]
        if len(users) != 1:
            break
        (user,) = users
        if not (is_call(user, "call_method", "index_add", "scatter_add") and user.args and user.args[0] is cur):
            break
        links.append(user)
        cur = user
    return links or None


def _as_nk(graph: Graph, spec: MoESpec, layouts: tuple) -> MoESpec:
    """Stacked weights of mixed layouts as (E, out, in) views: each (E, in, out) one transposed, nothing copied."""
    def nk(w: Optional[Node], layout: Optional[str]) -> Optional[Node]:
        return w if w is None or layout == "nk" else graph.call_method("transpose", (w, 1, 2))

    return dataclasses.replace(spec, gate=nk(spec.gate, layouts[0]), up=nk(spec.up, layouts[1]),
                               down=nk(spec.down, layouts[2]), layout="nk")


def _looks_like_a_body(write: Node, acc: Node) -> bool:
    """Whether a write to ``acc`` is at rows picked by ``torch.where(ids == e)`` (or nonzero): the mark of a
    per-expert loop, worth a reason in explain() when it is not rewritten."""
    accumulated = _accumulation(write, acc) or _assignment(write, acc)
    return accumulated is not None and isinstance(accumulated[0], Node) and selection(accumulated[0]) is not None


def match_loop(acc: Node) -> Union[Match, str, None]:
    """The loop accumulating into ``acc`` (see ``match``): the op replaces the accumulator after its last write."""
    position = {n: i for i, n in enumerate(acc.graph.nodes)}
    got = match(acc, position)
    if not isinstance(got, tuple):
        return got
    spec, bodies, product, chained, zero, zeros = got
    adds = tuple(b.add for b in (*bodies, *zero))
    biased = isinstance(spec.gate, tuple) and any(b is not None for b in (spec.b1, spec.b1_up, spec.b2))
    one_id = val(spec.ids).dim() == 1
    sliced = bodies[0].blocks
    note = (f"{len(bodies) + len(zero)} nonzero host syncs and data-dependent sizes removed"
            + ("; the flat weights read as (E, n, m) views" if sliced is not None else
               "; per-expert weights read where they lie" if isinstance(spec.gate, tuple) else "")
            + (f"; routing weight on the {spec.weight_position}" if spec.weight_position != "output" else "")
            + ("; the routing weight scaled the combined result" if product is not None else "")
            + ("; no routing weight (the op scales by 1)" if spec.weights is None else "")
            + (zeros.note() if zeros is not None else ""))

    layouts = bodies[0].layouts
    unweighted = spec.weights is None

    def derive(graph: Graph, spec: MoESpec) -> MoESpec:
        if zeros is not None:  # the routed experts are the first ones of weights sized for every choice
            spec = leading_rows(graph, spec, zeros.first)
        spec = per_expert_for_op(graph, spec) if biased else views(sliced)(graph, spec) if sliced is not None else spec
        if layouts is not None:
            spec = _as_nk(graph, spec, layouts)
        spec = _column_ids(graph, spec) if one_id else spec
        if unweighted:  # a weight of exactly 1: the op's product leaves each expert output as it is
            ones = graph.call_function(torch.ones_like, (spec.ids,), {"dtype": val(spec.x).dtype})
            spec = dataclasses.replace(spec, weights=ones)
        return spec

    # scaled after the loop, the result is the product (the accumulator goes with the region); else the accumulator.
    # Out of place (chained), the last link's value is the result, and the chain goes as dead code.
    end = product if product is not None else max(adds, key=position.__getitem__)
    in_place = not chained and product is None
    plus = passthrough(zeros, val(acc).dtype) if zeros is not None else None
    return Match(spec, end, note, where=bodies[0].add, acc=acc if in_place else None, writes=() if chained else adds,
                 transient=tuple(b.where for b in (*bodies, *zero)),
                 derive=derive if biased or one_id or unweighted or sliced is not None or layouts is not None or (
                     zeros is not None) else None,
                 top_k=1 if one_id else None, plus=plus, experts=zeros.first if zeros is not None else None)


rewrite = Form(FORM, (Anchor(_zeros_like_x, match_loop),
                     Anchor(lambda n: is_call(n, "call_method", "sum", "squeeze"), match_masked_writes),
                     Anchor(table_buffer, match_table_writes),
                     # last: the buffers the DeepSeek proof rewrote are gone by then
                     Anchor(top1_buffer, match_top1_masks)))
"""Replace every provable unrolled per-expert loop in a GraphModule; returns what was rewritten."""
