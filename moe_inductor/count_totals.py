"""Per-expert counts whose total is known, for the trace-time hooks of speculation.py: a ``bincount``/``histc`` of
top-k ids over E experts has E bins and adds up to the number of ids, facts Dynamo cannot derive alone.

- ``histogram_total``/``topk_ids_below`` read those facts off the FX graph;
- ``tolist_length`` records that such a bincount (minlength E) has E entries before ``.tolist()``; of ids it cannot
  bound (a graph input: LLaMA-MoE's calculator gets its router's ids from another frame) it asserts E entries at
  run time instead, which only a rewrite that consumes the whole list may keep (``ASSUMED``, speculation_check.py);
- ``counts_total`` notes the listed counts' symbols and their total, and ``decide_by_totals`` decides a branch on
  their sum with it (torchtune's ``if out.numel() > 0``), checked at run time too.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Node

from . import speculation


def topk_ids_below(ids_flat: Node, E: int) -> bool:
    """``ids_flat`` is ``ids.flatten()`` (or ``view(-1)``/``reshape(-1)``, or ids itself) of ``topk(s, k)[1]`` over a
    last dim of size E, unchanged since: every value is below E."""
    from .passes.aliases import mutated_alias
    from .passes.fx_utils import is_call, val

    ids = ids_flat
    if is_call(ids, "call_method", "flatten") and len(ids.args) == 1 and not ids.kwargs or (
            is_call(ids, "call_method", "view", "reshape") and tuple(ids.args[1:]) in ((-1,), ((-1,),))):
        ids = ids.args[0]
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return False
    topk = ids.args[0]
    if not (is_call(topk, "call_function", torch.topk) or is_call(topk, "call_method", "topk")):
        return False
    src = topk.args[0] if isinstance(topk.args[0], Node) else None
    sv = val(src)
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    if sv is None or dim not in (-1, sv.dim() - 1) or topk.kwargs.get("largest", True) is not True:
        return False
    return sv.shape[-1] == E and not mutated_alias(ids) and not mutated_alias(src)


def histogram_total(node: Node) -> Optional[Any]:
    """The number of ids a per-expert count vector adds up to: ``bincount(ids.flatten(), minlength=E)`` or
    ``histc(ids.flatten()(.float()), bins=E, min=0, max=E or E - 1)`` of ``topk`` ids over E experts (integer casts
    aside), every id landing in one of the E bins, is the flat ids' length; None for anything else."""
    from .passes.fx_utils import val

    flat = histogram_of(node)
    return None if flat is None else val(flat[0]).shape[0]


def histogram_of(node: Node) -> Optional[tuple[Node, int]]:
    """(the flat ids, E) of ``histogram_total``'s count vectors: entry e is the number of ids equal to e. A histc's
    bins are of width 1 (max E) or (E - 1) / E (max E - 1), and integer id e < E falls in bin e either way (histc
    scales ``(x - min) * bins`` before dividing, exact for these integers); its float counts are exact integers."""
    from .passes.fx_utils import is_call, val

    while (is_call(node, "call_method", "long", "int", "cpu") and len(node.args) == 1 and not node.kwargs) or (
            is_call(node, "call_method", "to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype)
            and not node.args[1].is_floating_point and not node.kwargs):
        node = node.args[0]
    if is_call(node, "call_function", torch.bincount) and len(node.args) == 1 and set(node.kwargs) == {"minlength"}:
        E, flat = node.kwargs["minlength"], node.args[0]
    elif is_call(node, "call_function", torch.histc) and len(node.args) == 1 and set(node.kwargs) == {
            "bins", "min", "max"}:
        E, flat = node.kwargs["bins"], node.args[0]
        if node.kwargs["min"] != 0 or node.kwargs["max"] not in (E, E - 1):
            return None
        if is_call(flat, "call_method", "float") and len(flat.args) == 1 and not flat.kwargs:
            flat = flat.args[0]
    else:
        return None
    fv = val(flat) if isinstance(flat, Node) else None
    if not isinstance(E, int) or E <= 0 or fv is None or fv.dim() != 1 or not topk_ids_below(flat, E):
        return None
    return flat, E


def counts_total(tensor_variable, listed) -> None:
    """After ``.tolist()`` of per-expert counts that add up to the number of ids (``histogram_total``): record
    their symbols and that number, which ``decide_by_totals`` reads."""
    trace = speculation._trace()
    if trace is None:
        return
    total = histogram_total(tensor_variable.as_proxy().node)
    sizes = [getattr(item, "sym_num", None) for item in getattr(listed, "items", None) or []]
    if total is None or not sizes or any(not isinstance(x, torch.SymInt) for x in sizes):
        return
    symbols = [x.node.expr for x in sizes]
    if len(set(symbols)) == len(symbols) and all(getattr(x, "is_Symbol", False) for x in symbols):
        trace.totals.append((symbols, total.node.expr if isinstance(total, torch.SymInt) else total))


def decide_by_totals(tx, inst, jumps_when: bool) -> bool:
    """Take the branch ``inst`` (and return True) when its condition is decided once counts recorded by
    ``counts_total`` are known to add up to their number of ids: ``if out.numel() > 0`` on the ``cat`` of rows split
    by those counts (torchtune) reads their sum, which Dynamo cannot decide alone. The condition is checked at run
    time too (``torch._check``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    trace = speculation._trace()
    sym = speculation._branch_condition(tx.stack[-1]) if trace is not None and trace.totals and tx.stack else None
    if sym is None:
        return False
    expr = sym.node.expr
    for symbols, total in trace.totals:
        if not free_unbacked_symbols(expr) <= set(symbols):
            continue
        decided = tx.output.shape_env._maybe_evaluate_static(
            expr.xreplace({symbols[-1]: total - sum(symbols[:-1])}))
        if decided is None or decided not in (True, False):
            continue
        value = bool(decided)
        torch._check(sym if value else torch.sym_not(sym))
        tx.pop()
        if value == jumps_when:
            tx.jump(inst)
        return True
    return False


#: on a bincount of ids not known to lie below E, whose length E ``tolist_length`` asserted (checked at run time)
ASSUMED = "moe_inductor_length_asserted"


def tolist_length(tensor_variable) -> None:
    """Before ``.tolist()`` of ``bincount(topk_ids.flatten(), minlength=E)``: its length is E (a fact). Of a
    bincount(minlength=E) of other 1-D integer ids: its length E is asserted at run time (``ASSUMED``); eager's list
    is longer exactly when an id is E or more, and speculation_check.discharge keeps the assertion only where a
    rewrite took every count of the list (a split of rows by all of them, which such a list would not fit)."""
    trace = speculation._trace()
    if trace is None:
        return
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    from .passes.fx_utils import is_call

    node = tensor_variable.as_proxy().node
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or isinstance(value.shape[0], int):
        return
    if is_call(node, "call_function", torch.bincount) and histogram_total(node) is not None:
        E = node.kwargs["minlength"]
        torch._check(value.shape[0] == E)
        node.meta[speculation.LENGTH] = E
        return
    E = unbounded_bincount(node)
    if E is not None and not statically_known_true(value.shape[0] == E):  # (not the user's own assert of it)
        torch._check(value.shape[0] == E)
        node.meta[ASSUMED] = E
        trace.assumed_lengths = True


def unbounded_bincount(node: Node) -> Optional[int]:
    """E for ``torch.bincount(flat, minlength=E)`` / ``flat.bincount(minlength=E)`` (no weights) of a 1-D integer
    tensor; else None."""
    from .passes.fx_utils import is_call, val

    if not ((is_call(node, "call_function", torch.bincount) or is_call(node, "call_method", "bincount"))
            and len(node.args) == 1 and set(node.kwargs) == {"minlength"}):
        return None
    E, flat = node.kwargs["minlength"], node.args[0]
    fv = val(flat) if isinstance(flat, Node) else None
    if type(E) is not int or E <= 0 or fv is None or fv.dim() != 1 or fv.dtype.is_floating_point or (
            fv.dtype == torch.bool):
        return None
    return E
