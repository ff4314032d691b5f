"""Form "dense_experts", the spelling of vLLM's Gaudi (HPU) ``static_fused_moe``: every expert on every token, each
weighted by its column of a dense routing table and added in place into a zeros buffer (``match_table_loop``).

The user code this matches::

    table = torch.zeros(T, E).scatter_(-1, ids, weights)            # ids from topk: distinct in a row
    cols = table.reshape(-1, T, E).permute(2, 0, 1).unsqueeze(-1)    # (E, 1, T, 1): cols[e][0, t, 0] = table[t, e]
    y = torch.zeros(1, T, H)
    for e in range(E):
        out = torch.empty(T, I)
        out.copy_(F.silu(g) * u)                                     # g, u: the halves of x @ w1[e].T
        y += (out @ w2[e].T) * cols[e]
    return y.view(-1, H)

Shape legend: T tokens, H hidden, I intermediate, E experts, k choices per token.

Row t of y is the sum over e of table[t, e] * expert_e(x[t]). table[t, e] is weights[t, j] where ids[t, j] == e (at
most one j: topk's ids are distinct in a row) and 0 elsewhere, so the sum is the op's weighted sum over the k choices.
What the proof checks, each on the traced graph:

- the table (``dense_experts._topk_scatter``): (ids, weights) scattered along the last dim into fresh zeros, in place
  or not, the only write to them or to any alias, before every read; the ids from topk over E columns;
- each term's weight is column e of the table: the views from the table to the term (``_follow``) are replayed dim by
  dim on their traced shapes, and end with the expert dim picked at e and the token dim where the term's rows are;
- the buffer: fresh zeros of the terms' shape, written only by one ``+=`` (``operator.iadd`` or ``add_``) of a whole
  term per expert of range(E), each once, and read by nothing between its first add and its last (such a read would
  see a partial sum); then its value is the sum, read by what follows through one name;
- an expert's hidden state written by ``copy_`` into a fresh ``torch.empty`` (vLLM's out-parameter ``silu_and_mul``)
  is the value copied (``copied_value``);
- no tensor the terms are computed from is changed in place by any write but those (``stale_reads.unseen_write``):
  ``out.mul_(2)`` before ``out * col`` would make the reading above another function.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import Node

from .aliases import alias_mutations, alias_source, view_family
from .driver import Match, num_experts, spec_inputs
from .fx_utils import is_call, known_equal, val
from .stale_reads import unseen_write

_TOKEN, _EXPERT = "token", "expert"

#: (functions, methods) that make a tensor of their own
_ZEROS = ((torch.zeros, torch.zeros_like), ("new_zeros",))
_EMPTY = ((torch.empty, torch.empty_like), ("new_empty",))

_VIEW_METHODS = {"reshape", "view", "permute", "transpose", "swapaxes", "swapdims", "unsqueeze", "squeeze", "select",
                 "contiguous"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.permute, torch.transpose, torch.swapaxes, torch.swapdims,
                   torch.unsqueeze, torch.squeeze, torch.select}


def _made_by(node: Node, kinds: tuple) -> bool:
    functions, methods = kinds
    return (is_call(node, "call_function", *functions) or is_call(node, "call_method", *methods)) and (
        "out" not in node.kwargs)


def _is_one(size) -> bool:
    return known_equal(size, 1)


def _same_sizes(a, b) -> bool:
    return len(a) == len(b) and all(known_equal(p, q) for p, q in zip(a, b))


def same_tokens(node: Node) -> Node:
    """``x`` for ``x.reshape(...)`` / ``x.view(...)`` to x's own shape and dtype (vLLM reshapes the tokens to (-1, H)
    in every expert's body): the same values, so every expert reads one input."""
    while (is_call(node, "call_method", "reshape", "view") or is_call(node, "call_function", torch.reshape)) and (
            isinstance(node.args[0], Node)):
        a, b = val(node.args[0]), val(node)
        if a is None or b is None or a.dtype != b.dtype or not _same_sizes(a.shape, b.shape):
            break
        node = node.args[0]
    return node


def copied_value(h: Node) -> Union[Node, str]:
    """The value an expert's hidden state ``h`` holds: where ``h`` is a fresh ``torch.empty`` (or ``copy_``'s result
    on one) that one ``h.copy_(v)`` fills whole (v of its shape, dtype and device), with no other write to it or view
    of it and no read of it before the copy, every read sees v; else ``h`` itself where it is no such buffer, or why
    not."""
    copy = fresh_copy(h)
    return h if copy is None else copy if isinstance(copy, str) else copy.args[1]


def fresh_copy(h: Node) -> Union[Node, str, None]:
    """The ``copy_`` that fills ``h`` (``copied_value``); None where ``h`` is no fresh ``torch.empty``, or why the
    copy is not one whose value every read of ``h`` sees."""
    buf = h.args[0] if is_call(h, "call_method", "copy_") and h.args and isinstance(h.args[0], Node) else h
    if not _made_by(buf, _EMPTY):
        return None
    writes = alias_mutations(buf)
    copy = writes[0] if len(writes) == 1 else None
    if not (is_call(copy, "call_method", "copy_") and len(copy.args) == 2 and not copy.kwargs and copy.args[0] is buf):
        return "hidden state is a fresh buffer not filled by one copy_ into the whole of it"
    if set(view_family(buf)) != {buf, copy}:  # a view of it may be read or written apart from its copy
        return "hidden state is a fresh buffer viewed under another name"
    position = {n: i for i, n in enumerate(buf.graph.nodes)}
    if any(u is not copy and position[u] < position[copy] for u in buf.users):
        return "hidden state is a fresh buffer read before its copy_"
    src = copy.args[1]
    sv, bv = val(src), val(buf)
    if sv is None or bv is None or sv.dtype != bv.dtype or sv.device != bv.device or not _same_sizes(sv.shape,
                                                                                                     bv.shape):
        return "hidden state is a fresh buffer that copy_ does not fill with a value of its shape and dtype"
    return copy


@dataclass(frozen=True)
class _Column:
    """A view of a (T, E) table: per dim of the view, the table dim it walks (``_TOKEN``, ``_EXPERT``) or None (a
    dim of size 1 of no table dim); the index each table dim was picked at, where one was."""

    table: Node
    dims: tuple
    picks: dict


def _view_step(node: Node) -> bool:
    return (is_call(node, "call_method", *_VIEW_METHODS) or is_call(node, "call_function", *_VIEW_FUNCTIONS)) and (
        bool(node.args) and isinstance(node.args[0], Node))


def _table_like(node: Node) -> bool:
    """A scatter's result, or a tensor written by ``scatter_``: what a routing table is made by (the mark)."""
    if is_call(node, "call_method", "scatter", "scatter_") or is_call(node, "call_function", torch.scatter):
        return True
    return any(is_call(m, "call_method", "scatter_") for m in alias_mutations(node))


def _dim(d, n: int) -> Optional[int]:
    """``d`` as a dim of a tensor of ``n`` dims, else None."""
    return d + n if isinstance(d, int) and -n <= d < 0 else d if isinstance(d, int) and 0 <= d < n else None


def _pick(dims: list, i: int, index: int, size, picks: dict) -> bool:
    """Pick dim ``i`` at ``index``: the dim goes, and the table dim it walked keeps the index."""
    if isinstance(size, int):
        index = index + size if index < 0 else index
    elif index < 0:
        return False
    label = dims.pop(i)
    if label is not None:
        picks[label] = index
    return True


def _apply(step: Node, dims: list, picks: dict) -> Optional[list]:
    """The dims of ``step``'s result, from those of its input (``dims``, changed), or None where the step is not a
    view this reads. Every step is checked against the traced shapes of its input and result."""
    sv, ov = val(step.args[0]), val(step)
    if sv is None or ov is None or sv.dim() != len(dims) or sv.dtype != ov.dtype:
        return None
    n, name = sv.dim(), step.target if step.op == "call_method" else getattr(step.target, "__name__", "")
    args = step.args[1:]
    if name in ("reshape", "view"):  # only size-1 dims come or go: the other dims keep their order and sizes
        kept = [d for d, s in zip(dims, sv.shape) if not _is_one(s)]
        sizes = [s for s, d in zip(sv.shape, dims) if not _is_one(s)]
        if not _same_sizes(sizes, [s for s in ov.shape if not _is_one(s)]):
            return None
        it = iter(kept)
        dims = [None if _is_one(s) else next(it) for s in ov.shape]
    elif name == "permute":
        order = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        order = [_dim(d, n) for d in order]
        if sorted(o for o in order if o is not None) != list(range(n)) or len(order) != n:
            return None
        dims = [dims[o] for o in order]
    elif name in ("transpose", "swapaxes", "swapdims"):
        a, b = (_dim(d, n) for d in args) if len(args) == 2 else (None, None)
        if a is None or b is None:
            return None
        dims[a], dims[b] = dims[b], dims[a]
    elif name == "unsqueeze":
        d = _dim(args[0] if args else step.kwargs.get("dim"), n + 1)
        if d is None:
            return None
        dims.insert(d, None)
    elif name == "squeeze":
        if len(args) > 1 or step.kwargs:
            return None
        at = [_dim(args[0], n)] if args else list(range(n))
        if None in at:
            return None
        for i in sorted((i for i in at if _is_one(sv.shape[i])), reverse=True):
            dims.pop(i)
    elif name == "select":
        i = _dim(args[0], n) if len(args) == 2 and isinstance(args[1], int) else None
        if i is None or not _pick(dims, i, args[1], sv.shape[i], picks):
            return None
    elif name == "getitem":
        index = args[0] if isinstance(args[0], tuple) else (args[0],)
        taking = sum(1 for p in index if isinstance(p, int) or p == slice(None))
        if sum(1 for p in index if p is Ellipsis) > 1 or taking > n:
            return None
        out, i, sizes = [], 0, list(sv.shape)
        for p in index:
            if p is Ellipsis:
                out += dims[i:i + n - taking]
                i += n - taking
            elif p is None:
                out.append(None)
            elif p == slice(None):
                out.append(dims[i])
                i += 1
            elif isinstance(p, int) and not isinstance(p, bool):
                rest = [dims[i]]
                if not _pick(rest, 0, p, sizes[i], picks):
                    return None
                i += 1
            else:  # a partial slice, a tensor index: not one whole column
                return None
        dims = out + dims[i:]
    elif name != "contiguous":
        return None
    if len(dims) != ov.dim():
        return None
    return dims


def _follow(col: Node) -> Union[_Column, str, None]:
    """How ``col`` reads a (T, E) routing table through a chain of views; None where no scatter made the tensor the
    chain starts from (not this spelling's mark), or why the chain is not one this reads."""
    chain, node = [], col
    while _view_step(node):
        chain.append(node)
        node = node.args[0]
    if not _table_like(node):
        return None
    tv = val(node)
    if tv is None or tv.dim() != 2:
        return "the routing table is not (T, E)"
    dims, picks = [_TOKEN, _EXPERT], {}
    for step in reversed(chain):
        dims = _apply(step, dims, picks)
        if dims is None:
            return f"the routing table is read through a view this does not follow ({step.name})"
    return _Column(node, tuple(dims), picks)


def _term(p: Node) -> Optional[tuple[Node, Node, Union[_Column, str]]]:
    """(out, col, how col reads the table) for ``out * col`` in either order, col a view of a routing table."""
    if not (is_call(p, "call_function", operator.mul, torch.mul) and len(p.args) == 2 and not p.kwargs):
        return None
    for out, col in (p.args, p.args[::-1]):
        if isinstance(out, Node) and isinstance(col, Node):
            read = _follow(col)
            if read is not None:
                return out, col, read
    return None


def _added(write: Node) -> Optional[tuple[Node, Node]]:
    """(receiver, term) for ``receiver += term`` (``operator.iadd``) or ``receiver.add_(term)``, no alpha."""
    if (is_call(write, "call_function", operator.iadd) or is_call(write, "call_method", "add_")) and len(
            write.args) == 2 and not write.kwargs and all(isinstance(a, Node) for a in write.args):
        return write.args[0], write.args[1]
    return None


def _entry(node: Node, acc: Node, writes: set) -> Node:
    """The name a read of the buffer goes through: ``acc`` or one of its writes, up the views from ``node``."""
    while node is not acc and node not in writes:
        node = alias_source(node)
    return node


def _column_reason(column: _Column, col: Node, term: Node, tokens) -> Optional[str]:
    """Why ``col`` is not, for every row t of the term, table[t, e] for one expert e; None where it is."""
    if _EXPERT in column.dims or _EXPERT not in column.picks:
        return "a term's weight is not one expert's column of the routing table (the view picks no expert)"
    cv, pv = val(col), val(term)
    offset = pv.dim() - cv.dim()
    walks_tokens = False
    for i, (label, size) in enumerate(zip(column.dims, cv.shape)):
        if _is_one(size):
            continue
        if label != _TOKEN or i + offset != pv.dim() - 2:
            return "a term's weight does not line its table's tokens up with the term's rows"
        walks_tokens = True
    if not walks_tokens and not _is_one(tokens):  # one row of the table for every token: a row, not a column
        return "a term's weight is a row of the routing table, not an expert's column"
    return None


def match_table_loop(acc: Node) -> Union[Match, str, None]:
    """Every expert on every token, weighted by its column of a scattered (T, E) table, added into ``acc`` (module
    docstring); None where no add into ``acc`` weights a term by a view of a scattered table (the mark)."""
    from .dense_experts import _every_expert, _fewer_flops, _topk_scatter

    position = {n: i for i, n in enumerate(acc.graph.nodes)}
    writes = sorted(alias_mutations(acc), key=position.__getitem__)
    added = [_added(w) for w in writes]
    terms = [_term(a[1]) if a is not None else None for a in added]
    if not any(t is not None for t in terms):
        return None
    if not _made_by(acc, _ZEROS):
        return "the buffer the experts are added into does not start from zeros"
    names = {acc}
    for w, a, t in zip(writes, added, terms):
        if a is None or a[0] not in names:  # a write to part of the buffer, or of something else than +=
            return "the buffer is written other than by += of whole terms"
        if t is None:
            return "a term added into the buffer is not an expert's output times a column of the routing table"
        if isinstance(t[2], str):
            return t[2]
        names.add(w)
    first, last, written = writes[0], writes[-1], set(writes)
    family = view_family(acc)
    entries = set()
    for n in family:
        for u in n.users:
            if u in written and u.args[0] is n and u.args[1] is not n:
                continue
            if position[u] <= position[last]:
                return "the buffer is read between its += (a partial sum)"
            if u not in family:
                entries.add(_entry(n, acc, written))
    table = terms[0][2].table
    if any(t[2].table is not table for t in terms):
        return "the terms are weighted by columns of different routing tables"
    E = val(table).shape[1]
    experts = sorted(t[2].picks[_EXPERT] for t in terms if _EXPERT in t[2].picks)
    if len(experts) == len(terms) and experts != list(range(E)):
        return f"the buffer gets experts {experts}, not each of range({E}) once"
    routed = _topk_scatter(table)
    if routed is None:
        return ("the routing table is not zeros scattered with distinct topk ids along its last dim (its only write, "
                "before every read)")
    ids, values = routed
    av, tv = val(acc), val(table)
    T, H = (av.shape[-2], av.shape[-1]) if av.dim() >= 2 else (None, None)
    if T is None or not all(_is_one(s) for s in av.shape[:-2]) or not known_equal(tv.shape[0], T) or not known_equal(
            val(ids).shape[0], T):
        return "the buffer is not (T, H) (with leading 1s) for the routing table's T tokens"
    for (_, term), (out, col, column) in zip(added, terms):
        reason = _column_reason(column, col, term, T)
        if reason is not None:
            return reason
        ov, pv = val(out), val(term)
        if ov is None or ov.dim() != 2 or not _same_sizes(ov.shape, (T, H)) or not _same_sizes(pv.shape, av.shape):
            return "an expert's output or its weighted term is not of the buffer's (T, H) shape"
        if len({ov.dtype, pv.dtype, val(col).dtype, av.dtype}) != 1:
            return "the expert outputs, table and buffer do not share one dtype"
    by_expert = sorted(terms, key=lambda t: t[2].picks[_EXPERT])
    copies = []

    def hidden(h: Node) -> Union[Node, str]:  # copied_value, keeping each copy it reads through
        copy = fresh_copy(h)
        if isinstance(copy, Node):
            copies.append(copy)
            return copy.args[1]
        return h if copy is None else copy

    experts_read = _every_expert([t[0] for t in by_expert], hidden=hidden, tokens=same_tokens)
    if isinstance(experts_read, str):
        return experts_read
    spec = experts_read.spec(ids, values)
    # every write the reading went through is proven above: the adds, the table's scatter, the hidden states' copies
    proven = (*writes, *alias_mutations(table.args[0] if is_call(table, "call_method", "scatter_") else table),
              *copies)
    unseen = unseen_write(spec_inputs(spec), writes, proven)
    if unseen is not None:
        return unseen
    xv, top = val(spec.x), ids.args[0]
    scores = val(top.args[0]) if top.args and isinstance(top.args[0], Node) else None
    if xv is None or xv.dim() != 2 or not _same_sizes(xv.shape, (T, H)) or xv.dtype != av.dtype:
        return "the tokens are not the buffer's (T, H)"
    if scores is None or scores.shape[-1] != E or num_experts(spec) != E:
        return "the ids are chosen among another number of experts than the table and the weights hold"
    note = ("every expert on every token, weighted by its column of a scatter_-made (T, E) table and += into a "
            "zeros buffer; " + _fewer_flops(spec))
    if entries == {last}:  # ``y += t`` rebinds y: what follows reads the last add's result, the sum
        shape = None if av.dim() == 2 else (*[1] * (av.dim() - 2), -1, H)
        if shape is not None and not isinstance(H, int):
            return "the buffer's hidden size is symbolic under its leading 1s"
        return Match(spec, last, note, where=first, writes=tuple(reversed(writes)), result_shape=shape)
    if entries == {acc} and av.dim() == 2:  # ``y.add_(t)``: what follows reads y, the sum
        return Match(spec, last, note, where=first, acc=acc, writes=tuple(reversed(writes)))
    return "the buffer's sum is read through another name than its last +="
