"""Row lists used only as indices: ``t.tolist()`` of a data-dependent number of rows, read only as an index of
tensors, traced as ``t`` itself (moe_inductor compiles only).

The user code this is for (transformers v4.36-v4.39 Mixtral, AI21's Jamba, early Qwen2-MoE, many 2024 remote-code
models), which finds list indices faster than tensor indices in eager:

    idx, top_x = torch.where(expert_mask[expert_idx])
    if top_x.shape[0] == 0:
        continue
    top_x_list = top_x.tolist()
    idx_list = idx.tolist()
    current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
    current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]
    final_hidden_states.index_add_(0, top_x, current_hidden_states)

Under the capture settings the length of ``top_x`` is an unbacked symbol, and Dynamo's ``tolist`` cannot make a
Python list of it (``unbind`` guards on the length): the frame fails and falls back to plain capture, rewrites off.
A list of Python ints and the int64 tensor of the same ints select the same elements of a tensor, as a whole index
or as an item of an index tuple: torch turns the list into that very tensor (a list of ints is never read as a tuple
of indices), then copies it to the indexed tensor's device. So the list is traced as the tensor when all of this
holds, and else ``tolist`` runs as Dynamo's own (and the frame falls back, as before, saying why):

- the tensor is a plain 1-D int64 tensor with a data-dependent length (what Dynamo's own ``tolist`` fails on: no
  trace that succeeded before changes);
- the call is ``t.tolist()``, and its value, used in place or stored in a local that no nested function reads, is
  read (every read of that local in the function's bytecode) only as the index of a subscript ``x[...]``, whole or
  as an item of a flat index tuple; beside it may be computed any expression of loads, attribute reads, calls and
  operators that leaves it on the stack (``index_only``): no ``len()``, iteration, arithmetic, ``append``, call,
  attribute store, return, slice bound, and no other name bound to it;
- at each such subscript (``_subscript_hook``) the indexed value is a plain tensor on the index's device (or the
  index is on the CPU, as a list is), and the tensor was not changed in place since ``tolist`` (its version counter,
  shared with every view): the list is a copy of the values, the tensor is not;
- the frame's graph ends without a graph break (the code after a break would hold the tensor where the user's code
  holds the list), and moe_inductor's backend sees it (``check_graph``, ``require_checked``).

The trace then equals the tensor-indexing form (``hf_v4_jamba``), which the unrolled_loop rewrite proves or leaves.
"""
from __future__ import annotations

import dis
from typing import Any, Optional

import torch

from .loop_bytecode import LOCAL_LOADS, NO_OPS, _local_names, line_of

_READS = LOCAL_LOADS + ("DELETE_FAST",)
#: names through which a function can read its own locals other than by bytecode loads
_FRAME_READERS = ("locals", "vars", "eval", "exec", "_getframe", "currentframe")


class ListIndexRefused(RuntimeError):
    """A row list traced as its tensor met a subscript where the two differ (the frame falls back)."""


#: capture.py's thread-local compile stack, bound by ``install``
_local = None


def _standing() -> Optional[dict]:
    """The tensor variables standing for lists in the frame compile being traced, by id: (the variable, its fake
    tensor's version at ``tolist``, where); None outside a moe_inductor compile that captures."""
    if _local is None or not _local.__dict__.get("stack"):
        return None  # no compile of ours is on: the hooks run in every compile's tracing, so this test comes first
    from . import capture

    return capture.current().lists if capture.capturing() else None


def _real(instructions: list, start: int) -> list:
    return [i for i in instructions[start:] if i.opname not in NO_OPS]


def _pops(ins) -> Optional[int]:
    """How many stack values ``ins`` reads, for the instructions an index expression is made of; None for others."""
    op, arg = ins.opname, ins.arg or 0
    if op in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "LOAD_DEREF", "LOAD_GLOBAL",
              "PUSH_NULL", "KW_NAMES"):
        return 0
    if op in ("LOAD_ATTR", "LOAD_METHOD", "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT"):
        return 1
    if op in ("BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR"):
        return 2
    if op in ("BUILD_TUPLE", "BUILD_SLICE"):
        return arg
    if op == "CALL":  # the callable, self or NULL, and the arguments (Python 3.11 and 3.12)
        return arg + 2
    return None


def index_only(instructions: list, at: int, depth: int = 0) -> Optional[str]:
    """Why the value on the stack after ``instructions[at]`` (``depth`` values above it) is read other than as the
    index of a subscript, whole or as an item of its index tuple; None when it is only that. The other items of the
    tuple (and what is computed above the value meanwhile) may be any expression that leaves the value unread."""
    in_tuple = False
    for ins in _real(instructions, at + 1):
        pops = _pops(ins)
        if pops is None:
            return f"it reaches {ins.opname}"
        if pops <= depth:  # the instruction works on values above it
            depth += dis.stack_effect(ins.opcode, ins.arg) if ins.opcode >= dis.HAVE_ARGUMENT else (
                dis.stack_effect(ins.opcode))
        elif ins.opname == "BINARY_SUBSCR":
            return None if depth == 0 else "it is subscripted itself"
        elif ins.opname == "BUILD_TUPLE" and not in_tuple:
            in_tuple, depth = True, 0  # the tuple holding it is the value followed now
        elif ins.opname == "BUILD_TUPLE":
            return "it is in a tuple inside a tuple"
        elif ins.opname == "BUILD_SLICE":
            return "it is a bound of a slice"
        else:
            return f"it reaches {ins.opname}"
    return "it reaches the end of the function"


def _call_site(tx) -> Optional[tuple[list, int]]:
    """(the frame's bytecode as CPython holds it, the index in it of the call ``t.tolist()`` being traced), when that
    is what runs: the proof reads CPython's own instructions, whose stack effects ``dis`` states."""
    inst = getattr(tx, "current_instruction", None)
    code = getattr(tx, "f_code", None)
    if inst is None or code is None or not inst.opname.startswith("CALL") or inst.arg not in (0, None):
        return None
    instructions = list(dis.get_instructions(code))
    at = next((i for i, ins in enumerate(instructions) if ins.offset == inst.offset), None)
    if at is None or instructions[at].opname != inst.opname or instructions[at].arg != inst.arg:
        return None
    before = [i for i in instructions[:at] if i.opname not in NO_OPS]
    if not before or before[-1].opname not in ("LOAD_METHOD", "LOAD_ATTR") or before[-1].argval != "tolist":
        return None
    return instructions, at


def uses_refusal(code, instructions: list, at: int) -> Optional[str]:
    """Why the value of the call at ``instructions[at]`` is read other than as a subscript's index; None when every
    read is one (the call's own consumer, or, where it is stored in a local, every read of that local)."""
    after = _real(instructions, at + 1)
    if not after or after[0].opname not in ("STORE_FAST",):
        return index_only(instructions, at)
    name = after[0].argval
    if name in code.co_cellvars or name in code.co_freevars:
        return f"{name} is read by a nested function"
    if any(n in code.co_names for n in _FRAME_READERS):
        return "the function reads its frame's locals by name"
    for i, ins in enumerate(instructions):
        if ins.opname not in _READS or name not in _local_names(ins):
            continue
        if ins.opname == "DELETE_FAST":
            continue
        if ins.opname not in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST"):
            return f"{name} is read by {ins.opname}"
        depth = 1 if ins.opname == "LOAD_FAST_LOAD_FAST" and _local_names(ins)[0] == name else 0
        if ins.opname == "LOAD_FAST_LOAD_FAST" and len(set(_local_names(ins))) != 2:
            return f"{name} is read twice in one instruction"
        why = index_only(instructions, i, depth)
        if why is not None:
            return f"{name} is read other than as an index of a subscript (at line {line_of(ins)}: {why})"
    return None


def _where(tx) -> str:
    code = getattr(tx, "f_code", None)
    inst = getattr(tx, "current_instruction", None)
    return f"{getattr(code, 'co_filename', '?').rsplit('/', 1)[-1]}:{line_of(inst) if inst is not None else '?'}"


def _refuse(why: str) -> None:
    """Note why a tolist was not traced as its tensor: the frame's fallback line says it (capture.note_fallback)."""
    from . import speculation

    trace = speculation._trace()
    if trace is not None:
        trace.refusals.append(why)


def as_tensor_index(variable, tx, refusals: list) -> Optional[Any]:
    """The variable to trace ``variable.tolist()`` as: a copy of the tensor variable where the module docstring's
    conditions hold at the call (the subscripts check the rest), else None (Dynamo's own tolist runs), with why it
    was not taken added to ``refusals`` where the tensor is one this module could have taken."""
    from torch._dynamo.variables import TensorVariable

    standing = _standing()
    if standing is None:
        return None
    try:
        value = variable.as_proxy().node.meta.get("example_value")
    except Exception:  # noqa: BLE001  (no proxy: not a graph tensor)
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or isinstance(value.shape[0], int):
        return None  # Dynamo's own tolist makes the list (a static length), or refuses (another rank)
    if type(variable) is not TensorVariable or variable.python_type() is not torch.Tensor:
        return None  # a numpy array or a tensor subclass: its indexing is not torch.Tensor's
    where = _where(tx)
    if value.dtype != torch.int64:
        refusals.append(f"{where}: .tolist() of a {value.dtype} tensor is not traced as its tensor (an int64 one "
                        "only)")
        return None
    site = _call_site(tx)
    why = "it is not a call t.tolist()" if site is None else uses_refusal(tx.f_code, *site)
    if why is not None:
        refusals.append(f"{where}: the list of .tolist() is not traced as its tensor: {why}")
        return None
    tensor = variable.clone()
    standing[id(tensor)] = (tensor, value._version, where)
    return tensor


def _standing_in(index) -> list:
    """The standing-for-a-list variables among a subscript's index (the index, or the items of its tuple)."""
    from torch._dynamo.variables import TupleVariable

    standing = _standing()
    if not standing:
        return []
    items = index.items if isinstance(index, TupleVariable) else [index]
    return [standing[id(v)] for v in items if id(v) in standing and standing[id(v)][0] is v]


def _subscript_refusal(container, found: list) -> Optional[str]:
    from torch._dynamo.variables import TensorVariable

    if not isinstance(container, TensorVariable) or container.python_type() not in (torch.Tensor,
                                                                                     torch.nn.Parameter):
        return "indexes what is not a plain tensor"
    indexed = container.as_proxy().node.meta.get("example_value")
    for variable, version, _ in found:
        value = variable.as_proxy().node.meta.get("example_value")
        if value._version != version:
            return "indexes after its tensor was changed in place (the list holds the values before)"
        if value.device != indexed.device and value.device.type != "cpu":
            return f"indexes a tensor on {indexed.device} with rows on {value.device}"
    return None


def _subscript_hook(handler):
    def subscript(tx, inst):
        found = _standing_in(tx.stack[-1]) if len(tx.stack) >= 2 else []
        if found:
            why = _subscript_refusal(tx.stack[-2], found)
            if why is not None:
                raise ListIndexRefused(f"the list of .tolist() at {found[0][2]}, traced as its tensor, {why}")
        handler(tx, inst)

    return subscript


def check_graph(gm, state) -> None:
    """Before the passes: a graph that a list traced as its tensor reached may not end at a graph break, since the
    code after the break would run with the tensor where the user's code holds the list (a copy of its values);
    raises ListIndexRefused."""
    if state is None or not state.lists:
        return
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        where = next(iter(state.lists.values()))[2]
        raise ListIndexRefused(f"the list of .tolist() at {where} was traced as its tensor, and the frame breaks its "
                               "graph: the code after the break would hold the tensor")
    state.lists_checked = True


def require_checked(state) -> None:
    """After a frame compile of ours: where a list was traced as its tensor, moe_inductor's backend saw the graph
    (a look-alike wrapper that hands it to another compiler never runs ``check_graph``)."""
    if state.lists and not state.lists_checked:
        raise ListIndexRefused("a list of .tolist() was traced as its tensor, and the graph went to a compiler other "
                               "than moe_inductor's backend, which checks where the list goes")


_installed = False


def install() -> None:
    """Hook Dynamo's ``tolist`` and ``BINARY_SUBSCR`` handling (idempotent); each hook does nothing outside a
    moe_inductor compile."""
    global _installed, _local
    if _installed:
        return
    _installed = True
    from torch._dynamo import symbolic_convert
    from torch._dynamo.variables.tensor import TensorVariable

    from .capture import _local
    from .speculation import dispatch_tables

    original = TensorVariable.method_tolist
    base = symbolic_convert.InstructionTranslatorBase
    op = dis.opmap.get("BINARY_SUBSCR")
    if op is None:  # a Python whose subscript is another instruction: Dynamo's own tolist stays
        return

    def method_tolist(self, tx, *args, **kwargs):
        refusals: list[str] = []
        standing = None if args or kwargs else as_tensor_index(self, tx, refusals)
        if standing is not None:
            return standing
        try:
            return original(self, tx, *args, **kwargs)
        except Exception:
            # the refusals explain the frame's fallback only where the tolist then fails; one that another hook
            # takes (a walk of cumulative counts, host_cumsum.py) or Dynamo traces would be noise in its reason
            for why in refusals:
                _refuse(why)
            raise

    TensorVariable.method_tolist = method_tolist
    for table in dispatch_tables(base):
        if op < len(table) and table[op] is not None:
            table[op] = _subscript_hook(table[op])
