"""An expert's rows walked in chunks of a fixed size, inside a loop over the experts that got tokens: traced as one
pass over all the rows, and kept only where the rewrite of the enclosing iteration takes its body.

The user code this is for (GPTQModel's MiniMax-M2 port, which bounds the memory of each expert's activations):

    for expert_idx in expert_hit.tolist():                    # hit_lists.py: traced as every expert, speculated
        idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))
        for i in range(0, top_x_full.size(0), chunk):          # chunk = 1024: the rows in chunks
            top_x, idx = top_x_full[i:i + chunk], idx_full[i:i + chunk]
            y = expert(x.index_select(0, top_x)) * weights[top_x, idx].unsqueeze(-1)
            out.index_add_(0, top_x, y)

The number of rows is data-dependent, so Dynamo cannot iterate the range. The chunks ``[i, i + chunk)`` for ``i`` in
``range(0, n, chunk)`` partition ``[0, n)``, so a body that reads the n rows only through such chunks and adds each
row's own contribution into a buffer computes, over all its chunks, what it computes once on the whole: the chunk
size only bounds memory. That holds for the body the unrolled_loop proof reads (an expert MLP of each selected row,
scaled by that row's weight, added at that row's token), and fails for a body that mixes rows of a chunk
(normalising by a chunk's statistics) or carries a value from one chunk to the next (a running sum). So, during a
moe_inductor compile and inside an iteration that is already a ``Speculation`` (whose body a rewrite must take
whole, or the frame falls back: ``speculation_check.discharge``), ``range(0, n, step)`` with n a data-dependent
count, a positive int step and all of this holding, runs its body once, with every chunk ``t[i:i + step]`` as all
of t:

- the range is iterated at once by a for loop over a local ``i`` whose body neither leaves the loop, nor runs
  anything but graph work on locals (no attribute or global store), nor sets a local read after the loop or in the
  next chunk (``loop_bytecode._body_refusal``: a running sum is such a local);
- ``i`` is read only as ``t[i:i + s]`` (bytecode: load i, load i, load s, add, slice), s a constant or a local the
  body does not set, and while tracing each such slice has the bounds (0, step) (s is the step) and a t whose
  first dim is n: the chunks of t are then exactly a partition of its rows;
- no Python state changes in the body (a list append, an iterator made before it stepped);
- the body's graph reads no tensor made before the loop whose shape involves n other than through those chunks (a
  whole ``top_x_full`` beside its chunks: eager adds it once per chunk). Each chunk is a marker node
  (``aten.alias`` tagged ``MARK``) while tracing, for this check, which ``unmark`` removes before the passes run.

Where the count is data-dependent and any of it fails, the frame falls back, saying which (the range cannot be
iterated by Dynamo either way). A body that does not add per-row contributions (chunk statistics, a matmul across
rows) passes these checks and then is taken by no rewrite: the enclosing speculation is not discharged, and the
frame falls back as well.
"""
from __future__ import annotations

import dis
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from . import speculation
from .loop_bytecode import LOCAL_LOADS, NO_OPS, _body_refusal, _local_names, _loop_of, _next

#: on the ``aten.alias`` node standing for one chunk ``t[i:i + step]`` of all of t while tracing
MARK = "moe_inductor_chunk_of_rows"

_NB_ADD = 0  # BINARY_OP's argument for ``+``


@dataclass
class _Chunks:
    """One chunk loop being traced as a single pass."""

    tx: Any
    where: str
    bound: Any  # the sympy expression of the row count n
    step: int
    slices: set  # ids of the subscript instructions that take a chunk
    start: Optional[Node]  # the graph's last node when the range was called
    mark: tuple  # ``Trace.mark()`` then
    markers: list = field(default_factory=list)
    finished: bool = False


def _fail(where: str, why: str) -> speculation.SpeculationNotDischarged:
    return speculation.SpeculationNotDischarged(
        f"{where}: range(...) over a data-dependent count inside a loop body assumed to have rows (an expert's rows "
        f"in chunks) is not traced as one pass over the rows: {why}")


def _real(tx, inst):
    """The first instruction from ``inst`` on that does something."""
    while inst is not None and (inst.opname in NO_OPS or inst.opname == "CACHE"):
        inst = _next(tx, inst)
    return inst


def _constant(var) -> Any:
    from torch._dynamo.variables import ConstantVariable

    return var.value if isinstance(var, ConstantVariable) else None


def _range_args(args: list) -> tuple[Any, Any, Any]:
    """(start, stop, step) variables of ``range(*args)``, the defaults as Python ints."""
    if len(args) == 1:
        return 0, args[0], 1
    if len(args) == 2:
        return _constant(args[0]), args[1], 1
    return _constant(args[0]), args[1], _constant(args[2])


def chunk_range(tx, args: list):
    """The variable to trace ``range(*args)`` as (a one-item list ``[0]``) where it walks a data-dependent count in
    chunks as the module docstring says; None where the count is not data-dependent or no speculated body is open
    (Dynamo's own range). Raises SpeculationNotDischarged where the count is data-dependent and a condition fails."""
    from torch._dynamo.variables import ConstantVariable, ListVariable, SymNodeVariable
    from torch._dynamo.variables.base import ValueMutationNew
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    trace = speculation._trace()
    if trace is None or not any(not s.closed for s in trace.speculations):
        return None
    if not any(isinstance(a, SymNodeVariable) and free_unbacked_symbols(a.sym_num) for a in args):
        return None
    where = speculation._user_line(tx)
    if not 1 <= len(args) <= 3:
        raise _fail(where, "it is not range(start, stop, step)")
    start, stop, step = _range_args(args)
    if start != 0 or type(start) is not int:
        raise _fail(where, "it does not start at 0")
    if type(step) is not int or step < 1:
        raise _fail(where, "its step is not a positive int")
    if not isinstance(stop, SymNodeVariable) or not isinstance(stop.sym_num, torch.SymInt):
        raise _fail(where, "its stop is not an integer count")
    head, why = _loop_head(tx)
    loop = _loop_of(tx, _next(tx, head)) if why is None else None
    if why is None and (not loop or tx.instructions[loop[0]] is not head):
        why = "its loop body was not found"
    if why is None:
        why = _body_refusal(tx, head, *loop)
    slices = None
    if why is None:
        slices = _chunk_slices(tx, head, loop[1])
        why = slices if isinstance(slices, str) else None
    if why is not None:
        raise _fail(where, why)
    graph = tx.output.graph
    record = _Chunks(tx, where, stop.sym_num.node.expr, step, set(slices), speculation._last_node(graph),
                     trace.mark())
    items = ListVariable([ConstantVariable.create(0)], mutation_type=ValueMutationNew())
    trace.chunk_loops[("list", id(items))] = (items, record)
    for inst in slices:
        trace.chunk_loops[("slice", id(inst))] = (inst, record)
    return items


def _loop_head(tx) -> tuple[Any, Optional[str]]:
    """(the FOR_ITER of the for loop that iterates the range being called at once, None), else (None, why not)."""
    call = getattr(tx, "current_instruction", None)
    if call is None or call not in tx.instructions:
        return None, "the range is not called in this frame's code"
    get_iter = _real(tx, _next(tx, call))
    if get_iter is None or get_iter.opname != "GET_ITER":
        return None, "the range is not iterated by a for loop at once"
    head = _real(tx, _next(tx, get_iter))
    if head is None or head.opname != "FOR_ITER" or head.target is None:
        return None, "the range is not iterated by a for loop at once"
    return head, None


def _chunk_slices(tx, head, exit_: int):
    """The subscript instructions of the loop body after ``head`` (up to ``instructions[exit_]``) that take
    ``t[i:i + s]`` of the loop's local ``i``, when those are its only reads of ``i``; else why not."""
    instructions = tx.instructions
    store = _real(tx, _next(tx, head))
    if store is None or store.opname != "STORE_FAST":
        return "its loop variable is not one local"
    name = store.argval
    if name in tx.f_code.co_cellvars or name in tx.f_code.co_freevars:
        return f"{name} is read by a nested function"
    body_start = instructions.index(store) + 1
    body = [ins for ins in instructions[body_start:exit_] if ins.opname not in NO_OPS and ins.opname != "CACHE"]
    written = {n for ins in body if ins.opcode in dis.haslocal and ("STORE" in ins.opname or "DELETE" in ins.opname)
               for n in _local_names(ins)}
    if name in written:
        return f"the body sets {name}"
    # one entry per value pushed or instruction run: a paired load (Python 3.13) is two loads
    seq = []
    for ins in body:
        if ins.opname in LOCAL_LOADS:
            seq.extend(("load", n, ins) for n in _local_names(ins))
        else:
            seq.append((ins.opname, ins.argval, ins))
    reads = [p for p, (kind, n, _) in enumerate(seq) if kind == "load" and n == name]
    if any(ins.opcode in dis.haslocal and name in _local_names(ins) and ins.opname not in LOCAL_LOADS
           for ins in body):
        return f"the body uses {name} other than by loading it"
    found, covered = [], set()
    for p in reads:
        if p in covered:
            continue
        taken = _slice_at(seq, p, name, written)
        if taken is None:
            return f"{name} is read other than as a chunk t[{name}:{name} + step]"
        found.append(taken)
        covered.update((p, p + 1))
    if not found:
        return f"the body takes no chunk t[{name}:{name} + step] of the rows"
    return found


def _slice_at(seq: list, p: int, name: str, written: set):
    """The subscript instruction of ``t[i:i + s]`` whose first read of ``i`` is ``seq[p]``, or None."""
    window = seq[p:p + 6]
    if len(window) < 5 or window[1][:2] != ("load", name):
        return None
    kind, addend, ins = window[2]
    if not (kind == "load" and addend != name and addend not in written
            and ins.opname in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST")
            or kind == "LOAD_CONST" and type(addend) is int):
        return None
    if window[3][0] != "BINARY_OP" or window[3][2].arg != _NB_ADD:
        return None
    if window[4][0] == "BINARY_SLICE":
        return window[4][2]
    if window[4][0] == "BUILD_SLICE" and window[4][1] == 2 and len(window) == 6 and window[5][0] == "BINARY_SUBSCR":
        return window[5][2]
    return None


def _take_chunk(tx, inst, operands: int) -> bool:
    """At a chunk's subscript (BINARY_SUBSCR of a slice, or BINARY_SLICE; ``operands`` the stack entries it reads):
    push the marker standing for all of t (and return True) after checking the bounds and t's rows; False where
    ``inst`` is no chunk of an open chunk loop."""
    from torch._dynamo.variables import SliceVariable, TensorVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy

    trace = speculation._trace()
    got = trace.chunk_loops.get(("slice", id(inst))) if trace is not None else None
    if got is None or got[0] is not inst or got[1].tx is not tx or got[1].finished:
        return False
    record = got[1]
    stack = tx.stack[-operands:]
    try:
        if operands == 2 and isinstance(stack[1], SliceVariable):
            bounds = stack[1].as_python_constant()
            bounds = (bounds.start, bounds.stop) if bounds.step is None else None
        else:
            bounds = tuple(v.as_python_constant() for v in stack[1:])
    except Exception:  # noqa: BLE001  (bounds that are not constants)
        bounds = None
    if bounds != (0, record.step):
        raise _fail(record.where, f"a chunk's bounds are {bounds}, not (i, i + step) of step {record.step}")
    container = stack[0]
    value = container.as_proxy().node.meta.get("example_value") if isinstance(container, TensorVariable) else None
    rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() >= 1 else None
    if not isinstance(rows, torch.SymInt) or rows.node.expr != record.bound:
        raise _fail(record.where, "a chunk is taken of a tensor whose rows are not the count the range walks")
    if container.as_proxy().node in _body_nodes(record):  # a chunk of a chunk: rows [i, i + step) of fewer rows
        raise _fail(record.where, "a chunk is taken of a tensor the loop body made, not of one made before the loop")
    proxy = tx.output.create_proxy("call_function", torch.ops.aten.alias.default, (container.as_proxy(),), {})
    proxy.node.meta[MARK] = True
    record.markers.append(proxy.node)
    for _ in range(operands):
        tx.pop()
    tx.push(wrap_fx_proxy(tx, proxy))
    return True


def _finish(trace, record: _Chunks) -> None:
    """The chunk loop ran its one pass: nothing of Python's changed in it, and its graph reads no tensor of the
    count's rows made before it other than through the chunk markers."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    record.finished = True
    if trace.mutations != record.mark[0] or trace.stepped_since(record.mark):
        raise _fail(record.where, "its body changes Python state (a list, a dict, an attribute, an iterator), which "
                                  "each chunk would change again")
    symbols = free_unbacked_symbols(record.bound)
    body = _body_nodes(record)
    for node in body:
        if node.meta.get(MARK):
            continue
        for arg in node.all_input_nodes:
            value = arg.meta.get("example_value")
            if arg in body or not isinstance(value, torch.Tensor):
                continue
            if any(free_unbacked_symbols(d) & symbols for d in value.shape if isinstance(d, torch.SymInt)):
                raise _fail(record.where, f"its body reads {arg.name}, of the rows it walks, whole rather than in "
                                          "chunks")


def _body_nodes(record: _Chunks) -> set:
    """The graph nodes made since the chunk loop's range was called."""
    graph = record.tx.output.graph
    node = record.start.next if record.start is not None else next(iter(graph.nodes), None)
    body = set()
    while node is not None and node is not graph._root:
        body.add(node)
        node = node.next
    return body


def _get_iter(tx, inst, handler) -> None:
    trace = speculation._trace()
    listed = tx.stack[-1] if trace is not None and tx.stack else None
    got = trace.chunk_loops.get(("list", id(listed))) if listed is not None else None
    handler(tx, inst)
    if got is not None and got[0] is listed:
        iterator = tx.stack[-1]
        trace.chunk_loops[("iter", id(iterator))] = (iterator, got[1])


def _for_iter(tx, inst, handler) -> None:
    stepped = speculation.step_tracked(tx, inst, handler, lambda trace, top: trace.chunk_loops.get(("iter", id(top))))
    if stepped is not None and stepped[2]:  # the chunk loop ended
        _finish(speculation._trace(), stepped[0])


def unmark(gm: GraphModule) -> None:
    """Before the passes: each chunk marker reads as the tensor it stands for (all of its rows)."""
    marked = [n for n in gm.graph.nodes if n.meta.get(MARK)]
    for node in marked:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    if marked:
        gm.recompile()


_installed = False


def install() -> None:
    """Hook Dynamo's GET_ITER, FOR_ITER, BINARY_SUBSCR and BINARY_SLICE (idempotent; after hit_lists' hooks, whose
    range hook calls ``chunk_range``); each does nothing outside a moe_inductor compile's chunk loops."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._dynamo import symbolic_convert

    def subscript(tx, inst, handler):
        if not _take_chunk(tx, inst, 2):
            handler(tx, inst)

    def slice3(tx, inst, handler):
        if not _take_chunk(tx, inst, 3):
            handler(tx, inst)

    hooks = {"GET_ITER": _get_iter, "FOR_ITER": _for_iter, "BINARY_SUBSCR": subscript, "BINARY_SLICE": slice3}
    for table in speculation.dispatch_tables(symbolic_convert.InstructionTranslatorBase):
        for opname, hook in hooks.items():
            op = dis.opmap.get(opname)
            if op is not None and 0 <= op < len(table) and table[op] is not None:
                table[op] = (lambda handler, hook: lambda tx, inst: hook(tx, inst, handler))(table[op], hook)
