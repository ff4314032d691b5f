"""Speculated skips, the backend's side (speculation.py makes them while tracing): before the passes, each body that
was assumed to run is proven counted by its own expert's rows and reading only those (``check_traced``); after them,
every such body went with a rewrite (``discharge``), and the bincount sizes proven while tracing are dropped. Anything
short raises ``SpeculationNotDischarged``, and capture's fallback compiles the frame as plain capture would."""
from __future__ import annotations

import operator
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule, Node

from . import count_totals, host_cumsum, mask_guards, unproven_loops
from .speculation import LENGTH, TAG, Speculation, SpeculationNotDischarged, _fail, _trace


def of_graph(gm: GraphModule) -> list[Speculation]:
    """The speculations made while tracing ``gm`` (those of a restarted attempt at the frame are not)."""
    trace = _trace()
    if trace is None:
        return []
    trace.checked = True
    tags = {n.meta.get(TAG) for n in gm.graph.nodes}
    return [s for s in trace.speculations if s.graph is gm.graph or s.id in tags]


def _selection_of(node: Node) -> Optional[tuple[Node, int]]:
    """(ids, e) when ``node`` is a row selection ``torch.where(ids == e)`` / ``nonzero(as_tuple=True)`` / HF's
    ``torch.where(one_hot(ids, E).permute(2, 1, 0)[e])`` (the rows of expert e), or a selection of the tokens that
    chose e at all, ``(ids == e).any(-1)``, by ``nonzero()`` (with or without its ``.squeeze(-1)``),
    ``torch.where(...)`` or ``.nonzero(as_tuple=True)`` (and their ``[0]``): a token that chose e is a row of e,
    so either selection is empty exactly when expert e got no tokens (passes/loop_rows.py reads them)."""
    from .passes.fx_utils import is_call
    from .passes.loop_rows import any_hit, any_selection, selected_ids, where_like

    if where_like(node) and isinstance(node.args[0], Node):
        selected = selected_ids(node.args[0]) or any_hit(node.args[0])
        return None if selected is None or not isinstance(selected[0], Node) else selected[:2]
    if ((is_call(node, "call_method", "nonzero") or is_call(node, "call_function", torch.nonzero))
            and len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], Node)):
        hit = any_hit(node.args[0])
        return None if hit is None else hit[:2]
    picked = any_selection(node)
    return None if picked is None else (picked.ids, picked.e)


def _counted(graph, symbol) -> Optional[tuple[Node, int, Optional[Node]]]:
    """(ids, e, the selection whose size it is, if it is one) that the count ``symbol`` counts the rows of:
    ``bincount(ids.flatten(), minlength=E).tolist()[e]`` (Dynamo: ``counts[e].item()``; or a ``histc`` of top-k ids
    over E bins, ``count_totals.histogram_of``), or the row count of a
    selection of expert e (``tok.shape[0]`` of ``tok, pos = torch.where(ids == e)``)."""
    from .passes.counts import count_item, host_copy_of, per_expert_counts
    from .passes.fx_utils import is_call

    item = _count_item(graph, symbol)  # (the node that makes the symbol: any size equal to it comes after)
    if item is not None:
        source, e = count_item(item)
        marked = per_expert_counts(source)  # DeepSeek-V2's scatter_ of ones, or a one-hot sum
        if marked is not None:
            return marked[0], e, None
        counts = host_copy_of(source)
        histogram = count_totals.histogram_of(source)  # a histc of top-k ids (Unsloth's counts) too
        if histogram is not None:
            flat = histogram[0]
        elif not ((is_call(counts, "call_function", torch.bincount) or is_call(counts, "call_method", "bincount"))
                  and len(counts.args) == 1 and set(counts.kwargs) <= {"minlength"}):
            return None
        else:
            flat = counts.args[0]
        ids = flat.args[0] if is_call(flat, "call_method", "flatten", "view", "reshape") else flat
        if flat is not ids and not (len(flat.args) == 1 or tuple(flat.args[1:]) in ((-1,), ((-1,),))):
            return None
        return ids, e, None
    for node in graph.nodes:
        v = node.meta.get("example_value")
        rows = v[0] if isinstance(v, (tuple, list)) and v else v
        if isinstance(rows, torch.Tensor) and rows.dim() >= 1 and not isinstance(rows.shape[0], int) and (
                rows.shape[0].node.expr == symbol):
            selected = _selection_of(node)
            return None if selected is None else (*selected, node)
    return None


def check_traced(gm: GraphModule, speculations: list[Speculation]) -> None:
    """Before the passes: each speculated body is clean, counted by its own expert's rows, and reads rows of that
    expert only. Raises SpeculationNotDischarged."""
    from .passes.fx_utils import canonicalize_operators, is_call, same_value_key

    from . import host_counts

    host_cumsum.check(gm, speculations)
    host_counts.check(gm)
    _check_asserted_lengths(gm)
    if not speculations:
        return
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    canonicalize_operators(graph)  # ids == e as operator.eq, whichever torch recorded it
    for s in speculations:
        if not s.closed:
            raise _fail(s, "the iteration it skips did not end in this graph")
        if s.failed:
            raise _fail(s, s.failed)
        counted = _counted(graph, s.symbol) if s.counts is None else s.counts(graph)
        if counted is None:
            raise _fail(s, "the count is not the number of rows one expert gets (bincount of the ids, or the size "
                           "of torch.where(ids == e))")
        ids, e, own = counted
        if s.counts is not None and s.symbol is not None:  # a hit loop's iteration that skipped its empty rows
            skipped = _counted(graph, s.symbol)
            if skipped is None or skipped[0] is not ids or skipped[1] != e:
                raise _fail(s, f"its no-tokens skip does not count the rows of its own expert {e} (of {ids.name})")
        body = [n for n in graph.nodes if n.meta.get(TAG) == s.id]
        if s.counts is not None and not s.mask and _computes_nothing(body):
            s.vacuous = True
            continue
        read = {own} if own is not None else set()
        item = _count_item(graph, s.symbol) if s.symbol is not None else None
        slices = _slices_by_count(body, item)
        pieces = _pieces_by_count(body, item)
        if s.appended:
            _check_appended(s, graph, ids)
        for node in body:
            if node in slices:
                continue  # rows[start:start + count]: no rows at a count of 0 (the rewrite proves which rows)
            if _selection_of(node) is not None:
                read.add(node)
            for arg in node.all_input_nodes:
                if is_call(arg, "call_function", operator.getitem) and _selection_of(arg.args[0]) is not None:
                    read.add(arg.args[0])
                elif _selection_of(arg) is not None:  # the tokens that chose e (any_selection), read whole
                    read.add(arg)
            read.update(mask_guards.masks_read(node))
        if not read and not slices and not pieces:
            raise _fail(s, "the body it guards selects no expert's rows")
        for selection in read:
            sel_ids, sel_e = _selection_of(selection) or mask_guards.selected_by(selection)
            if sel_ids is not ids or sel_e != e:
                raise _fail(s, f"the body reads the rows of expert {sel_e} (of {sel_ids.name}), and the count is of "
                               f"expert {e} (of {ids.name})")
        if torch.is_grad_enabled():
            own = [n for n in graph.nodes if n.op == "placeholder" and n.users and all(
                u.meta.get(TAG) == s.id for u in n.users) and getattr(n.meta.get("example_value"), "requires_grad",
                                                                       False) and any(map(_records_grad, n.users))]
            # eager leaves these without a gradient where it skips the expert: the gate (grad_gate.py) does too. A
            # body run under no_grad (DeepSeek's ``moe_infer``) records no gradient for them at all: gating them
            # would turn the compiled graph's zero gradient for an unread input into a zero ``p.grad``
            s.own = [n.name for n in own]
        # the ids recomputed elsewhere (each iteration's own ``logits.argmax(-1)``): a rewrite keeps one of them
        key = same_value_key(ids)
        same = [n.name for n in graph.nodes if n is not ids and n.op == ids.op and n.target == ids.target
                and same_value_key(n) == key]
        s.counted = (ids.name, e, tuple(same))


def _listed(bincount: Node) -> list[Node]:
    """The ``.item()`` reads of the entries of ``bincount`` (its ``.tolist()`` as Dynamo traces it)."""
    from .passes.fx_utils import is_call

    return [item for pick in bincount.users if is_call(pick, "call_function", operator.getitem)
            for item in pick.users if is_call(item, "call_method", "item")]


def _check_asserted_lengths(gm: GraphModule) -> None:
    """Before the passes: a bincount whose length E was asserted while tracing (count_totals.ASSUMED: eager's list
    is longer where an id is E or more) has its E counts read, in order, only as the sizes of one ``torch.split``
    (and by Dynamo's size checks): eager's split then makes more pieces than the E its loop reads, whose ``cat`` no
    longer lines up with the sorted rows' weights, and fails; so the assertion fails only where eager does (but in
    the one case where the shorter ``cat`` has a single row and broadcasts). Raises SpeculationNotDischarged."""
    from .count_totals import ASSUMED
    from .passes.split_loop import _split_of
    from .passes.fx_utils import is_call

    for node in gm.graph.nodes:
        if ASSUMED not in node.meta:
            continue
        items, splits = _listed(node), set()
        for item in items:
            for user in item.users:
                if is_call(user, "call_function", torch.split, torch.functional.split) or is_call(
                        user, "call_method", "split"):
                    splits.add(user)
                elif not (user.target in _SIZE_CHECK_OPS or user.target is torch.sym_sum
                          or user.target is torch.ops.aten._assert_scalar.default):
                    splits.add(None)
        split = next(iter(splits)) if len(splits) == 1 else None
        if split is None or _split_of(split)[1] != items or len(items) != node.meta[ASSUMED]:
            raise SpeculationNotDischarged(
                f"the length {node.meta[ASSUMED]} of {node.name} (a bincount of ids not known to lie below it) was "
                "asserted while tracing, and its counts are read other than as the sizes of one torch.split; not "
                "kept")


def _asserted_lengths_left(gm: GraphModule) -> Optional[str]:
    """After the passes: why a bincount whose length was asserted still has its counts read (no rewrite took the
    split they size), else None."""
    from .count_totals import ASSUMED

    for node in gm.graph.nodes:
        if ASSUMED in node.meta and _listed(node):
            return (f"the length {node.meta[ASSUMED]} of {node.name} (a bincount of ids not known to lie below it) "
                    "was asserted while tracing, and no rewrite took the split its counts size")
    return None


def _count_item(graph, symbol) -> Optional[Node]:
    """The ``.item()`` node that made the count ``symbol``, if one did."""
    from .passes.counts import count_item

    for node in graph.nodes:
        v = node.meta.get("example_value")
        if isinstance(v, torch.SymInt) and v.node.expr == symbol and count_item(node) is not None:
            return node
    return None


def _slices_by_count(body: list[Node], item: Optional[Node]) -> list[Node]:
    """The body's slices ``rows[start:start + count]`` (``rows[0:count]`` at the first) of the count's own ``item``:
    empty at a count of 0, whatever the rows."""
    from .passes.slice_runs import size_after, slice_bounds

    if item is None:
        return []
    found = []
    for node in body:
        bounds = slice_bounds(node)
        if bounds is not None and size_after(*bounds) is item:
            found.append(node)
    return found


def _pieces_by_count(body: list[Node], item: Optional[Node]) -> list[Node]:
    """The pieces ``torch.split(rows, sizes)[j]`` the body reads whose size ``sizes[j]`` is the count's own
    ``item`` (LLaMA-MoE splits its sorted rows by the counts' list before the loop): empty at a count of 0, whatever
    the rows."""
    from .passes.split_loop import _pieces, _split_of

    if item is None:
        return []
    found = []
    for node in body:
        for arg in node.all_input_nodes:
            piece = _pieces(arg) if arg not in body else None
            if piece is not None and not isinstance(piece[0], tuple) and _piece_size(piece, _split_of) is item:
                found.append(arg)
    return found


def _piece_size(piece, split_of) -> Optional[Node]:
    split, j = piece
    sizes = split_of(split)[1]
    return sizes[j] if 0 <= j < len(sizes) else None


def _check_appended(s: Speculation, graph, ids: Node) -> None:
    """The outputs the skipped body appended to a list are read by one ``torch.cat`` along dim 0 only (where a
    part of zero rows adds nothing), and the ids have rows: ``len`` of the list, which the skip changes, differs
    only where no expert has a row."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    from .passes.fx_utils import val

    by_name = {n.name: n for n in graph.nodes}
    iv = val(ids)
    if iv is None or iv.dim() < 1 or not statically_known_true(iv.shape[0] >= 1):
        raise _fail(s, "its outputs go to a list whose length could show the skip (the ids may have no rows)")
    for appended in s.appended:
        node = by_name.get(appended.name)
        users = list(node.users) if node is not None else []
        cat = users[0] if len(users) == 1 else None
        rank = val(node).dim() if node is not None and val(node) is not None else 0
        if cat is None or cat.target is not torch.cat or not cat.args or node not in cat.args[0] or (
                cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0) not in (0, -rank)) or rank == 0:
            raise _fail(s, f"the output it appends ({appended.name}) is read other than by one torch.cat along "
                           "dim 0")


def _computes_nothing(body: list[Node]) -> bool:
    """Whether an iteration's nodes are only reads of its hit-loop index (``t[0]``, ``t == c``): what is left of an
    iteration that a branch on the index skipped whole."""
    from .hit_loops import is_index_arithmetic

    return all(is_index_arithmetic(n) for n in body)


def _drop_empty_grad_modes(gm: GraphModule, tag: int) -> None:
    """Erase an iteration's ``_set_grad_enabled(False)`` / ``(True)`` pairs (its ``with torch.no_grad():``, which
    the loop's bytecode check allows around row-finding code only: loop_bytecode._index_only_no_grad) that enclose
    no node any more: the rewrite that took the body took what they enclosed. A pair around anything left stays."""
    toggles = [n for n in gm.graph.nodes if n.meta.get(TAG) == tag and n.op == "call_function"
               and n.target is torch._C._set_grad_enabled and not n.users]
    for off, on in zip(toggles, toggles[1:]):
        if off.args != (False,) or on.args != (True,) or off.next is not on:
            continue
        gm.graph.erase_node(on)
        gm.graph.erase_node(off)


def discharge(gm: GraphModule, speculations: list[Speculation], left_alone: Iterable = ()) -> None:
    """After the passes: every speculated body went with a rewrite (no node of it is left but inputs); then the
    counts' proven size checks go. Raises SpeculationNotDischarged, saying what the passes said (``left_alone``,
    report.LeftAlone records)."""
    from . import host_counts

    trace = _trace()
    unread = host_counts.unconsumed(gm) if trace is not None and trace.host_counts else None
    unread = unread or host_cumsum.leftover(gm) or _asserted_lengths_left(gm)
    if unread is not None:  # the walk's body was not taken: what the passes said of it is the reason to give
        said = "; ".join(f"{m.form} left {m.where} alone: {m.reason}" for m in left_alone)
        raise SpeculationNotDischarged(unread + (f" ({said})" if said else ""))
    for s in speculations:
        if s.vacuous:
            continue
        _drop_empty_grad_modes(gm, s.id)
        left = [n for n in gm.graph.nodes if n.meta.get(TAG) == s.id and n.op not in ("placeholder", "get_attr")]
        if left:
            unproven_loops.remember(s.loop_key, left_alone)  # later frames around the break: not unrolled again
            said = "; ".join(f"{m.form} left {m.where} alone: {m.reason}" for m in left_alone)
            raise _fail(s, f"no rewrite took its body ({said or left[0].name + ' is still in the graph'})")
    if speculations and _drop_proven_lengths(gm.graph):
        gm.recompile()


_SIZE_CHECK_OPS = (operator.ge, operator.le, operator.eq, operator.gt, operator.lt, torch.sym_max, torch.sym_min)


def _drop_proven_lengths(graph) -> bool:
    """Erase a bincount of proven length E read by nothing but its own size checks (facts: its length is E), and
    those checks: on a GPU the bincount is a host sync that nothing needs once its counts went with the loop."""
    changed = False
    for node in [n for n in graph.nodes if LENGTH in n.meta]:
        region, stack = [], list(node.users)
        while stack:
            user = stack.pop()
            if user in region:
                continue
            region.append(user)
            stack.extend(user.users)
        # (a getitem: the one tensor of ``nonzero(as_tuple=True)``, read by nothing but its size checks either)
        checks = all(u.target is torch.ops.aten.sym_size.int or u.target in _SIZE_CHECK_OPS
                     or u.target is torch.ops.aten._assert_scalar.default or u.target is operator.getitem
                     for u in region)
        if not checks:
            continue
        position = {n: i for i, n in enumerate(graph.nodes)}
        for user in sorted(region, key=position.__getitem__, reverse=True):
            graph.erase_node(user)
        graph.erase_node(node)
        changed = True
    return changed


def _records_grad(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a reader of an input) made a value autograd records: its traced value, or one of them,
    requires grad (not so under a no_grad span of the graph)."""
    traced = node.meta.get("example_value")
    values = traced if isinstance(traced, (tuple, list)) else (traced,)
    return any(getattr(v, "requires_grad", False) for v in values)
