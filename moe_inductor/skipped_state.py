"""What a skipped body (speculation.py) may change that outlives its iteration, and why each change is the same
whether the body runs on an expert with no tokens or is skipped.

DeepSeek-V2's ``moe_infer`` (and SGLang's copy) walks the host counts so:

    outputs, start_idx = [], 0
    for i, num_tokens in enumerate(tokens_per_expert):
        end_idx = start_idx + num_tokens
        if num_tokens == 0:
            continue
        outputs.append(expert_i(sorted_tokens[start_idx:end_idx]))
        start_idx = end_idx
    outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)

Run at a count of 0, the skipped rest sets ``start_idx`` to ``start_idx + 0`` (``offsets_hold``) and appends the
expert's output on zero rows to a list that only ``torch.cat`` reads (``appends``): the cat is the same. Three kinds
of change are taken, each checked when the iteration ends:

- a tensor local rebound to ``x.index_add(0, rows, c)`` / ``scatter_add`` of its value at the branch, made in the body
  (adds nothing at no rows: the rewrite that must take the body proves the rows are its expert's);
- an integer local whose new value equals its old one at a count of 0 (the running slice offset);
- appends of tensors made in the body to a list this frame made (``[]``, not the caller's nor one handed in),
  whose every read in the function is an ``append``, ``torch.cat(list, ...)`` or a ``len(list)`` truth test: an output of zero rows adds
  nothing to the cat, and check_traced proves the cat is its only reader in the graph. ``len`` differs only when
  no expert has a row at all, which no call with tokens meets.
- the same appends by a list comprehension to its own list (LLaMA-MoE's ``UniversalCalculator``):

      expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 0]
      cat_expert_outputs = torch.cat(expert_outputs, 0)

  the list lives on the stack under the loop's iterator (``LIST_APPEND``), and is read only where the loop ends:
  stored at once in one local (Python 3.12 inlines the comprehension, restoring its loop variable first; 3.11
  returns the list from its own ``<listcomp>`` function to the call, which stores it), whose reads are then checked
  as those of a list the frame made (``_comprehension_local``).

Anything else the body changes refuses the skip, as before.
"""
from __future__ import annotations

import dis
from dataclasses import dataclass
from typing import Any, Optional

from torch.fx import Node

from .loop_bytecode import LOCAL_LOADS, NO_OPS, _local_names, line_of

#: ``LOAD_ATTR``/``LOAD_METHOD`` names under which a list is passed whole to a concatenation
_CATS = ("cat", "concat", "concatenate")


@dataclass(frozen=True)
class Offset:
    """An integer local's value at the branch, as a sympy expression."""

    expr: Any


def tensor_node(var) -> Optional[Node]:
    """The graph node a local's variable holds, when it is a tensor of the graph; else None."""
    from torch._dynamo.variables import TensorVariable

    if not isinstance(var, TensorVariable):
        return None
    try:
        return var.as_proxy().node
    except Exception:  # noqa: BLE001  (no proxy: not a graph tensor)
        return None


def _int_expr(var) -> Optional[Any]:
    """A sympy expression of an integer local (a traced SymInt, or a Python int), else None."""
    import sympy
    import torch
    from torch._dynamo.variables import ConstantVariable, SymNodeVariable

    if isinstance(var, SymNodeVariable) and isinstance(var.sym_num, torch.SymInt):
        return var.sym_num.node.expr
    if isinstance(var, ConstantVariable) and type(var.value) is int:
        return sympy.Integer(var.value)
    return None


def held(var) -> Optional[object]:
    """What a local holds at the branch, for a rebinding to be checked against: its tensor's node, or its integer
    value (``Offset``); None for anything else (the skip is refused)."""
    node = tensor_node(var)
    if node is not None:
        return node
    expr = _int_expr(var)
    return Offset(expr) if expr is not None else None


def rebinds_hold(tx, before: dict, body: set, symbol) -> Optional[str]:
    """Why a local the skipped body set does not end as it began at a count of 0 (``symbol`` = 0); None when each
    does: a tensor rebound to an out-of-place add into its value made in the body, an integer rebound to a value
    equal to its old one at 0."""
    from .passes.fx_utils import is_call

    for name, old in before.items():
        var = tx.symbolic_locals.get(name)
        if isinstance(old, Offset):
            new = _int_expr(var)
            if symbol is None or new is None or (new - old.expr).subs(symbol, 0) != 0:
                return f"the skipped body sets {name}, read after it, to a number other than its value at no tokens"
            continue
        after = tensor_node(var)
        if after is old:  # set only on a path this iteration did not take (the no-tokens side's own code)
            continue
        if not (after in body and is_call(after, "call_method", "index_add", "scatter_add") and after.args
                and after.args[0] is old):
            return f"the skipped body sets {name}, read after it, to other than an out-of-place add into its value"
    return None


#: the name ``lists_of`` gives a comprehension's own list, which no local holds while its loop runs
COMPREHENSION = "<comprehension>"


def lists_of(tx) -> dict:
    """The lists the frame's locals hold at the branch, by id: (name, the variable, its length); and the list a
    comprehension builds, on the stack under the loop's iterator and the branch's value (``COMPREHENSION``)."""
    from torch._dynamo.variables.lists import ListVariable

    found = {id(var): (name, var, len(var.items)) for name, var in tx.symbolic_locals.items()
             if type(var) is ListVariable}
    built = tx.stack[-3] if len(tx.stack) >= 3 else None
    if type(built) is ListVariable and id(built) not in found:
        found[id(built)] = (COMPREHENSION, built, len(built.items))
    return found


def appends(tx, mutated: list, lists: dict, body: set, built: dict, head=None) -> tuple[Optional[str], list]:
    """(why the Python changes the skipped body made are not appends of its outputs to output lists, or None; the
    appended nodes). ``mutated``: the variables Dynamo logged a change of since the branch (None for a store to an
    attribute, global or cell); ``lists``: ``lists_of`` at the branch; ``built``: the lists made by ``BUILD_LIST``
    in this compile, with their frame (``build_list_hook``); ``head``: the loop's ``FOR_ITER``, where the iteration
    ends (its stack holds a comprehension's list under the iterator)."""
    count: dict = {}
    for var in mutated:
        if var is None or id(var) not in lists or lists[id(var)][1] is not var:
            return "the skipped body changes Python state (a list, a dict, an attribute, an iterator)", []
        count[id(var)] = count.get(id(var), 0) + 1
    nodes = []
    for key, n in count.items():
        name, var, length = lists[key]
        made = built.get(id(var))
        if getattr(var, "source", None) is not None or made is None or made[0] is not var or made[1] is not tx:
            # a list of the caller's, or one this function was handed: reads of it elsewhere are not checked here
            return f"the skipped body appends to {name}, a list not made by this function (a caller can see it)", []
        added = var.items[length:]
        if len(var.items) != length + n or len(added) != n:
            return f"the skipped body changes the list {name} other than by appending", []
        for item in added:
            node = tensor_node(item)
            if node is None or node not in body:
                return f"the skipped body appends to {name} what is not a tensor it computed", []
            nodes.append(node)
        if name == COMPREHENSION:
            held = _comprehension_local(tx, var, head)
            if isinstance(held, str):
                return held, []
            reason = _list_reads(*held)
            if reason is not None:
                return reason, []
            continue
        # every name the frame holds it by (an alias's reads are reads of it too)
        for alias in [other for other, v in tx.symbolic_locals.items() if v is var] or [name]:
            reason = _list_reads(tx, alias)
            if reason is not None:
                return reason, []
    return None, nodes


def _real_from(instructions: list, start: int) -> list:
    return [i for i in instructions[start:] if i.opname not in NO_OPS]


def _comprehension_local(tx, var, head) -> "tuple[Any, str] | str":
    """(the frame, the local) that the comprehension's list ``var`` is stored in when its loop ends, the list then
    held by that local alone; else why not. ``head``: the loop's ``FOR_ITER``, running now, whose iterator is on
    top of the stack with the list under it, where ``LIST_APPEND 2`` puts the body's values."""
    refusal = "the skipped body appends to a comprehension's list that is not stored in one local when it ends"
    if head is None or len(tx.stack) < 2 or tx.stack[-2] is not var:
        return refusal
    instructions = tx.instructions
    appends = [i for i in instructions if i.opname == "LIST_APPEND"]
    if len(appends) != 1 or appends[0].arg != 2 or head.target is None:
        return refusal
    after = _real_from(instructions, instructions.index(head.target))
    if after and after[0].opname == "END_FOR":  # Python 3.12: the comprehension runs inline
        after = after[1:]
        while len(after) >= 2 and after[0].opname == "SWAP" and after[0].arg == 2 and after[1].opname == "STORE_FAST":
            after = after[2:]  # the comprehension's own loop variable, restored to what it held before
        if after and after[0].opname == "STORE_FAST":
            return tx, after[0].argval
        return refusal
    parent = getattr(tx, "parent", None)
    call = getattr(parent, "current_instruction", None)
    if not (after and after[0].opname == "RETURN_VALUE" and tx.f_code.co_name == "<listcomp>" and call is not None
            and call.opname in ("CALL", "CALL_FUNCTION")):
        return refusal
    rest = _real_from(parent.instructions, parent.instructions.index(call) + 1)
    if rest and rest[0].opname == "STORE_FAST":  # Python 3.11: the ``<listcomp>`` function's value, stored
        return parent, rest[0].argval
    return refusal


def build_list_hook(handler, trace_of):
    """Dynamo's ``BUILD_LIST`` handler, then a note of the list it made and in which frame (``appends`` takes only
    lists this frame made, whose every read ``_list_reads`` sees); ``trace_of()`` is the compile's record, or None
    outside a moe_inductor compile."""
    def build_list(tx, inst):
        handler(tx, inst)
        trace = trace_of()
        if trace is not None and tx.stack:
            trace.built[id(tx.stack[-1])] = (tx.stack[-1], tx)

    return build_list


def _list_reads(tx, name: str) -> Optional[str]:
    """Why some read of the local list ``name`` in the function is other than ``name.append(..)``,
    ``torch.cat(name, ..)`` or a ``len(name)`` truth test; None when none is."""
    code = list(dis.get_instructions(tx.f_code))
    real = [i for i in code if i.opname not in NO_OPS]
    for at, ins in enumerate(real):
        if ins.opname not in LOCAL_LOADS or name not in _local_names(ins):
            continue
        if ins.opname == "LOAD_FAST_LOAD_FAST":
            return f"the list {name} is read in a way not checked (with another local)"
        after = real[at + 1] if at + 1 < len(real) else None
        before = real[at - 1] if at > 0 else None
        if after is not None and after.opname in ("LOAD_ATTR", "LOAD_METHOD") and _attr(after) == "append":
            continue
        if before is not None and before.opname in ("LOAD_ATTR", "LOAD_METHOD") and _attr(before) in _CATS and (
                after is not None and after.opname in ("CALL", "CALL_FUNCTION", "CALL_KW", "LOAD_CONST", "KW_NAMES")):
            continue
        if before is not None and before.opname in ("LOAD_GLOBAL", "LOAD_NAME") and _attr(before) == "len":
            call = real[at + 1] if at + 1 < len(real) else None
            test = real[at + 2] if at + 2 < len(real) else None
            if call is not None and call.opname in ("CALL", "CALL_FUNCTION") and test is not None and (
                    test.opname.startswith("POP_JUMP") and not test.opname.endswith(("NONE", "NOT_NONE"))):
                continue
        return (f"the list {name} of outputs is read other than by append, torch.cat or a len() test (at line "
                f"{line_of(ins)}), where a skipped expert's missing entry could show")
    return None


def _attr(ins) -> Optional[str]:
    value = ins.argval
    if isinstance(value, tuple):  # (True, 'len') forms of some Python versions' LOAD_GLOBAL
        value = next((v for v in value if isinstance(v, str)), None)
    return value if isinstance(value, str) else None

