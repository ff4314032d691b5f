"""Reading a loop's bytecode while Dynamo traces it: where an iteration's loop is, where a jump really goes, and
whether the rest of an iteration is plain graph work on locals (speculation.py's and hit_loops.py's refusals)."""
from __future__ import annotations

import dis
from typing import Any, Optional

#: bytecode that makes the rest of an iteration more than graph work on locals (state that outlives it, exits)
_FORBIDDEN = {"RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_ATTR",
              "DELETE_ATTR", "STORE_DEREF", "DELETE_DEREF", "IMPORT_NAME", "RAISE_VARARGS", "RERAISE",
              "BEFORE_WITH", "SETUP_WITH", "PUSH_EXC_INFO", "SETUP_FINALLY", "END_ASYNC_FOR", "GET_AWAITABLE"}
_UNCONDITIONAL = {"NOP", "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_ABSOLUTE", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP"}
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)


def _resolve(tx, inst):
    """The first instruction that does something, following unconditional jumps and NOPs from ``inst``."""
    for _ in range(16):
        if inst is None or inst.opname not in _UNCONDITIONAL:
            return inst
        inst = inst.target if inst.opname != "NOP" else _next(tx, inst)
    return inst


def _next(tx, inst):
    instructions = tx.instructions
    index = tx.indexof[inst] if hasattr(tx, "indexof") else instructions.index(inst)
    return instructions[index + 1] if index + 1 < len(instructions) else None


def _loop_of(tx, inst):
    """(index of the innermost FOR_ITER around ``inst``, index of its exit), or None."""
    instructions = tx.instructions
    index = instructions.index(inst)
    best = None
    for i in range(index - 1, -1, -1):
        head = instructions[i]
        if head.opname == "FOR_ITER" and head.target is not None and instructions.index(head.target) > index:
            best = (i, instructions.index(head.target))
            break
    return best


#: the instructions that read a local variable (or a cell of one) onto the stack, across Python 3.11 to 3.13
LOCAL_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF",
               "LOAD_CLOSURE")


def _local_names(ins) -> tuple:
    """The local names ``ins`` loads or stores (two for Python 3.13's paired ``LOAD_FAST_LOAD_FAST``)."""
    names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
    return tuple(n for n in names if isinstance(n, str))


def line_of(ins) -> Any:
    """The source line of instruction ``ins`` (its positions on Python 3.11+, else where it starts a line)."""
    positions = getattr(ins, "positions", None)
    return getattr(positions, "lineno", None) or getattr(ins, "starts_line", "?")


def _body_refusal(tx, inst, head: int, exit_: int, rebinds: Optional[list] = None) -> Optional[str]:
    """Why the rest of the iteration after the branch ``inst`` is not plain graph work, or None. Locals it sets that
    are read after it refuse it, unless ``rebinds`` is a list: then their names go into it, for the caller to
    check what they are set to."""
    instructions = tx.instructions
    start = instructions.index(inst) + 1
    written, handlers = set(), set()
    reached = _reached(instructions, start - 1, exit_)  # from the branch itself: both of its ways
    for i in range(start, exit_):
        ins = instructions[i]
        if i not in reached:  # a handler only an exception enters (a ``with`` block's exit on an error)
            continue
        if ins.opname in ("BEFORE_WITH", "SETUP_WITH") and _index_only_no_grad(instructions, i, exit_):
            handlers |= _handlers_of_block(instructions, i, exit_)
            continue
        if ins.opname in _FORBIDDEN:
            return f"the rest of the iteration runs {ins.opname}"
        if ins.opcode in _JUMPS and ins.opname != "FOR_ITER" and ins.target is not None and not (
                head <= instructions.index(ins.target) < exit_):
            return "the rest of the iteration can leave the loop (break or return)"
        if ins.opcode in dis.haslocal and ("STORE" in ins.opname or "DELETE" in ins.opname):
            written.update(_local_names(ins))
    outlives = sorted(v for v in written if _read_before_written(instructions, head, v, handlers))
    if outlives and rebinds is None:
        return f"the rest of the iteration sets {', '.join(outlives)}, read after it"
    if rebinds is not None:
        rebinds.extend(outlives)
    return None


_ENDS = {"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"} | _UNCONDITIONAL - {"NOP"}


def _reached(instructions: list, start: int, stop: int) -> set:
    """The indices in [start, stop) that control reaches from ``start`` without an exception: fall-through and jumps,
    not the exception table's edges."""
    index_of = {id(ins): i for i, ins in enumerate(instructions)}
    seen, stack = set(), [start]
    while stack:
        i = stack.pop()
        if i in seen or not start <= i < stop:
            continue
        seen.add(i)
        ins = instructions[i]
        if ins.opname not in _ENDS:
            stack.append(i + 1)
        if ins.opcode in _JUMPS and ins.target is not None:
            stack.append(index_of[id(ins.target)])
    return seen


#: what the body of an allowed ``with torch.no_grad():`` may do: index locals, call torch.where / nonzero on them
#: and store the (integer) results
_INDEX_ONLY = {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "BINARY_SUBSCR", "PRECALL",
               "CALL", "KW_NAMES", "UNPACK_SEQUENCE", "STORE_FAST", "STORE_FAST_STORE_FAST", "POP_TOP", "PUSH_NULL",
               "CACHE", "NOP", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "RESUME"}
_INDEX_CALLS = {"where", "nonzero"}


def _index_only_no_grad(instructions: list, at: int, stop: int) -> bool:
    """Whether the ``with`` entered at ``instructions[at]`` is ``with torch.no_grad():`` around code that only
    finds rows (``tok = torch.where(mask[e])`` and the like): its results are integer tensors, which no gradient
    reaches with or without it, so the block changes nothing a rewrite of the loop could depend on."""
    before = [ins for ins in instructions[max(0, at - 8):at] if ins.opname not in NO_OPS and ins.opname != "CACHE"]
    if len(before) < 3 or before[-1].opname != "CALL" or before[-1].argval not in (0, None):
        return False
    if not (before[-2].opname in ("LOAD_ATTR", "LOAD_METHOD") and before[-2].argval == "no_grad"
            and before[-3].opname == "LOAD_GLOBAL" and before[-3].argval == "torch"):
        return False
    end = _with_exit(instructions, at, stop)
    if end is None:
        return False
    for ins in instructions[at + 1:end]:
        if ins.opname not in _INDEX_ONLY:
            return False
        if ins.opname == "LOAD_GLOBAL" and ins.argval != "torch":
            return False
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval not in _INDEX_CALLS:
            return False
    return True


def _handlers_of_block(instructions: list, at: int, stop: int) -> set:
    """The ids of the exception handlers of the instructions in the ``with`` block entered at ``at``, to its exit."""
    end = _with_exit(instructions, at, stop)
    block = instructions[at:stop if end is None else end + 1]
    return {id(entry.target) for ins in block for entry in [getattr(ins, "exn_tab_entry", None)] if entry is not None}


def _with_exit(instructions: list, at: int, stop: int) -> Optional[int]:
    """The index of the first instruction of the normal exit (``__exit__(None, None, None)``) of the ``with`` block
    entered at ``at``, before ``stop``; None where there is none. A nested ``with`` would end first: the callers
    allow no ``with`` inside the block."""
    for i in range(at + 1, stop):
        if instructions[i].opname == "LOAD_CONST" and instructions[i].argval is None and _exits_with(instructions, i):
            return i
    return None


def _exits_with(instructions: list, i: int) -> bool:
    """``instructions[i:]`` start the normal exit of a ``with``: three ``LOAD_CONST None`` and a call of two."""
    rest = [ins for ins in instructions[i:i + 8] if ins.opname not in NO_OPS and ins.opname != "CACHE"]
    return len(rest) >= 4 and all(r.opname == "LOAD_CONST" and r.argval is None for r in rest[:3]) and (
        rest[3].opname == "CALL")


def _read_before_written(instructions: list, start: int, name: str, unraised: frozenset = frozenset()) -> bool:
    """Whether some path of the code from ``instructions[start]`` reads the local ``name`` before it writes it (the
    value it holds at ``start`` is used). ``unraised``: the ids of exception handlers not to follow (an allowed
    ``with torch.no_grad():``'s, whose ``__exit__`` never swallows the error: the handler re-raises it)."""
    index_of = {id(ins): i for i, ins in enumerate(instructions)}
    seen, stack = set(), [start]
    while stack:
        i = stack.pop()
        if i in seen or i >= len(instructions):
            continue
        seen.add(i)
        ins = instructions[i]
        if ins.opcode in dis.haslocal and name in _local_names(ins):
            if "LOAD" in ins.opname or "DELETE" in ins.opname:
                return True
            if "STORE" in ins.opname:
                continue
        if ins.opname not in _ENDS:
            stack.append(i + 1)
        if ins.opcode in _JUMPS and ins.target is not None:
            stack.append(index_of[id(ins.target)])
        entry = getattr(ins, "exn_tab_entry", None)
        if entry is not None and id(entry.target) not in unraised:
            stack.append(index_of[id(entry.target)])
    return False


#: instructions that do nothing to the values a reading of the bytecode follows (across Python versions)
NO_OPS = ("PRECALL", "CACHE", "EXTENDED_ARG", "TO_BOOL", "NOP")


def through_constant_test(tx, inst):
    """Where control goes from ``inst`` when it starts a test of a local's attribute that Dynamo holds as a constant
    bool (``elif self.training:`` on the no-tokens side of a loop): the target its jump takes; else ``inst``. Reading
    the attribute guards on it, as Dynamo's own read would."""
    from torch._dynamo.variables import ConstantVariable

    seq, cur = [], inst
    while cur is not None and len(seq) < 3:
        if cur.opname not in NO_OPS:
            seq.append(cur)
        cur = _next(tx, cur)
    if len(seq) < 3 or seq[0].opname != "LOAD_FAST" or seq[1].opname != "LOAD_ATTR" or not seq[2].opname.startswith(
            "POP_JUMP") or not seq[2].opname.endswith(("_IF_TRUE", "_IF_FALSE")):
        return inst
    var = tx.symbolic_locals.get(seq[0].argval)
    try:
        value = var.var_getattr(tx, seq[1].argval) if var is not None else None
    except Exception:  # noqa: BLE001  (an attribute Dynamo cannot read here: no constant)
        return inst
    if not (isinstance(value, ConstantVariable) and type(value.value) is bool):
        return inst
    jumps = value.value == seq[2].opname.endswith("_IF_TRUE")
    return seq[2].target if jumps else _next(tx, seq[2])
