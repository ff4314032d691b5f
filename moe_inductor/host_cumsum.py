"""Cumulative per-expert counts walked on the host, traced as running sums of the ``.tolist()`` counts they equal.

MiniMind's ``moe_infer`` (jingyaogong/minimind, copied by its many forks) walks expert boundaries, not counts:

    tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
    for i, end_idx in enumerate(tokens_per_expert):
        start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
        if start_idx == end_idx:
            continue
        ...  # expert i on rows [start_idx, end_idx) of the sorted order

During a moe_inductor compile only, iterating such an array (the cumsum, on the host or before the copy, of
``bincount(ids.flatten())`` of top-k ids over E experts) yields the running sums ``c_0, c_0 + c_1, ...`` of
``one_hot(ids.flatten(), E).sum(0).tolist()`` (a count vector passes/counts.py proves), and ``arr[j]`` read inside
the walk (0 <= j <= the current index) gives the same sums: the values eager's elements hold. Then ``start_idx ==
end_idx`` is ``c_i == 0`` (speculation.py's no-rows test, ``one_count``), proven and discharged as DeepSeek-V2's walk.

Without ``minlength`` the bincount has L = ``max id + 1`` entries, not E: eager walks experts 0..L-1 only. The walk
over all E equals it only because the experts past L have no tokens, and an iteration at a count of 0 does nothing
that outlives it. Each part of that is checked, else the frame falls back:

- the array is unpacked for a ``for`` loop of the user's frame, ``for x in arr`` or ``for i, x in enumerate(arr)``
  (the builtin, from 0), not by ``list()``, ``zip()``, unpacking or a second walk (``_consumer``);
- every one of the E iterations reaches a speculated no-rows skip of its own count ``c_i``, in order (so an
  iteration past L skips its body; a walk that stops early, or breaks the graph inside, is refused; ``check``);
- the code before the skip is plain reads, arithmetic and local stores (no call, no in-place operator, no attribute
  or item store) and logs no side effect, and no local the loop sets is read after it: its last value is L - 1's
  in eager and E - 1's here (``check``);
- every graph node the walk made (the running sums, the code before each skip, the bodies) is gone after the
  rewrites (``leftover``): nothing of an iteration past L runs.

With ``minlength=E`` the array has E entries in eager too (the ids are below E): the walk is eager's own, and only
the skip in every iteration is asked. ``.tolist()`` of that cumsum is the list of the running sums
(``cumulative_list``); without ``minlength`` a list's length would show L, and it is left to Dynamo.
"""
from __future__ import annotations

import dis
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

#: on every node a padded walk made, from the first running sum to the last iteration's end
TAG = "moe_inductor_cumulative_walk"

#: bytecode allowed between a padded walk's FOR_ITER and its skip: reads, local stores, arithmetic and comparisons
_PLAIN = {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_CONST", "LOAD_SMALL_INT", "LOAD_DEREF",
          "STORE_FAST", "STORE_FAST_STORE_FAST", "STORE_FAST_LOAD_FAST", "UNPACK_SEQUENCE", "COMPARE_OP",
          "BINARY_OP", "BINARY_SUBSCR", "COPY", "SWAP", "POP_TOP", "UNARY_NEGATIVE", "UNARY_NOT", "IS_OP",
          "JUMP_FORWARD", "NOP", "CACHE", "PRECALL", "EXTENDED_ARG", "TO_BOOL", "NOT_TAKEN", "RESUME"}


@dataclass
class Walk:
    """One cumulative count array walked as running sums."""

    tx: Any  # the user's frame that runs the loop
    head: int  # offset of the loop's FOR_ITER
    num_experts: int
    ends: list  # the running sums handed out, variables
    symbols: list  # the sympy symbols of the counts c_0..c_{E-1}
    graph: Any
    first: Optional[Node]  # the graph's last node before the walk made any
    array: Any  # the array variable walked
    padded: bool  # eager's array may be shorter than E (a bincount without minlength)
    mutations: int  # the side-effect log's length when the walk began
    speculated: list = field(default_factory=list)


def cumulative_source(node) -> Optional[tuple[Node, int, bool]]:
    """(flat ids, E, padded) for an array that is the cumulative sum of ``bincount(ids.flatten())`` of top-k ids over
    E experts: NumPy's ``cumsum(0)`` of its host copy, or the host copy of ``torch.cumsum(.., 0)``; ``padded`` when the
    bincount has no ``minlength`` (its length is the largest id + 1); else None."""
    from .passes.counts import host_copy_of
    from .passes.fx_utils import is_call

    node = host_copy_of(node)
    if not _cumsum_over_0(node):
        return None
    inner = host_copy_of(node.args[0])
    if not (is_call(inner, "call_method", "bincount") or is_call(inner, "call_function", torch.bincount)):
        return None
    if len(inner.args) != 1 or set(inner.kwargs) - {"minlength"} or not isinstance(inner.args[0], Node):
        return None
    flat = inner.args[0]
    num_experts = _experts_of(flat)
    minlength = inner.kwargs.get("minlength")
    if num_experts is None or minlength not in (None, 0, num_experts):
        return None
    return flat, num_experts, minlength in (None, 0)


def _cumsum_over_0(node) -> bool:
    """``t.cumsum(0)`` / ``torch.cumsum(t, dim=0)`` of a 1-D tensor, or NumPy's ``arr.cumsum(0)`` (or with no axis,
    the same for 1-D) as Dynamo traces it (its ``numpy_method_wrapper``)."""
    from .passes.fx_utils import is_call, val

    if not (isinstance(node, Node) and node.args and isinstance(node.args[0], Node)):
        return False
    source = val(node.args[0])
    if source is None or source.dim() != 1:
        return False
    rest, kwargs = tuple(node.args[1:]), dict(node.kwargs)
    if node.op == "call_function" and getattr(node.target, "method", None) == "cumsum":
        return (rest in ((), (0,)) and not kwargs) or (not rest and kwargs == {"axis": 0})
    if is_call(node, "call_method", "cumsum") or is_call(node, "call_function", torch.cumsum):
        return (rest == (0,) and not kwargs) or (not rest and kwargs == {"dim": 0})
    return False


def _experts_of(flat) -> Optional[int]:
    """E for ``flat`` = top-k ids over a last dim of E, flattened (count_totals.topk_ids_below), or a top-1 router's
    ``max(dim=-1, keepdim=True)[1]`` ids over E flattened (passes/counts.topk_ids_over: one id per row, below E as
    topk's are); else None."""
    from .passes.counts import topk_ids_over
    from .passes.fx_utils import is_call, val
    from .count_totals import topk_ids_below

    ids = flat
    if is_call(ids, "call_method", "flatten", "view", "reshape"):
        ids = ids.args[0]
    if not (is_call(ids, "call_function", operator.getitem) and ids.args[1] == 1):
        return None
    topk = ids.args[0]
    scores = val(topk.args[0]) if topk.args and isinstance(topk.args[0], Node) else None
    fv = val(flat)
    if scores is None or fv is None or fv.dim() != 1 or not isinstance(scores.shape[-1], int):
        return None
    num_experts = scores.shape[-1]
    if topk_ids_below(flat, num_experts):
        return num_experts
    # the max ids' (T, 1) tensor flattened whole: ``view(-1)``, ``reshape(-1)`` or ``flatten()``
    whole = flat is not ids and (tuple(flat.args[1:]) in ((-1,), ((-1,),)) if flat.target != "flatten" else (
        len(flat.args) == 1)) and not flat.kwargs
    return num_experts if whole and topk_ids_over(ids, num_experts) else None


def _consumer(tx) -> Optional[tuple[Any, int]]:
    """(the user's frame, the index of its FOR_ITER) when the array being unpacked is consumed by that loop alone:
    ``for x in arr`` (GET_ITER then FOR_ITER in the frame) or ``for i, x in enumerate(arr)`` (Dynamo's enumerate
    polyfill, started at 0, run lazily by the frame's FOR_ITER, or called right before GET_ITER and FOR_ITER)."""
    from torch._dynamo.variables import ConstantVariable

    frame = tx
    if tx.f_code.co_name == "enumerate" and "polyfills" in tx.f_code.co_filename:
        start = tx.symbolic_locals.get("start")
        if not (isinstance(start, ConstantVariable) and start.value == 0) or _op(tx) != "GET_ITER":
            return None
        frame = getattr(tx, "parent", None)
        if frame is None:
            return None
        if _op(frame) == "FOR_ITER":  # the generator runs as the loop steps it
            return frame, frame.instructions.index(frame.current_instruction)
        if not _calls_builtin_enumerate(frame):
            return None
    elif _op(frame) == "FOR_ITER":  # ``for x in arr``, unpacked as the loop steps it
        return frame, frame.instructions.index(frame.current_instruction)
    elif _op(frame) != "GET_ITER" and not (_op(frame) in ("CALL", "CALL_FUNCTION", "PRECALL")
                                           and _calls_builtin_enumerate(frame)):
        return None
    return _loop_after(frame)


def _op(tx) -> Optional[str]:
    inst = getattr(tx, "current_instruction", None)
    return getattr(inst, "opname", None)


def _real(instructions, index: int, step: int):
    from .loop_bytecode import NO_OPS

    index += step
    while 0 <= index < len(instructions) and instructions[index].opname in NO_OPS:
        index += step
    return index


def _calls_builtin_enumerate(frame) -> bool:
    """The frame's current instruction calls the builtin ``enumerate`` on one local: ``enumerate(arr)``."""
    import builtins

    ins = frame.instructions
    at = ins.index(frame.current_instruction)
    if ins[at].opname == "PRECALL":
        at = _real(ins, at, 1)
    if ins[at].opname not in ("CALL", "CALL_FUNCTION") or ins[at].arg != 1:
        return False
    arg = _real(ins, at, -1)
    fn = _real(ins, arg, -1)
    if arg < 0 or fn < 0 or not ins[arg].opname.startswith("LOAD_FAST") or ins[fn].opname != "LOAD_GLOBAL":
        return False
    name = ins[fn].argval if isinstance(ins[fn].argval, str) else None
    return name == "enumerate" and frame.f_globals.get("enumerate", builtins.enumerate) is builtins.enumerate


def _loop_after(frame) -> Optional[tuple[Any, int]]:
    """(frame, index of FOR_ITER) when the frame's next real instructions are [CALL ->] GET_ITER, FOR_ITER."""
    ins = frame.instructions
    at = ins.index(frame.current_instruction)
    while ins[at].opname in ("PRECALL", "CALL", "CALL_FUNCTION"):
        at = _real(ins, at, 1)
    if ins[at].opname != "GET_ITER":
        return None
    loop = _real(ins, at, 1)
    if loop >= len(ins) or ins[loop].opname != "FOR_ITER":
        return None
    return frame, loop


def _running_sums(var, tx, flat: Node, num_experts: int) -> Optional[list]:
    """``c_0, c_0 + c_1, ...`` for ``c = one_hot(flat, E).sum(0).tolist()`` (the counts bincount gives of top-k ids,
    one per expert), traced in the graph of ``var``; None where Dynamo gives other than E integers."""
    from torch._dynamo.variables import BuiltinVariable, SymNodeVariable
    from torch._dynamo.variables.builder import wrap_fx_proxy
    from torch._dynamo.variables.tensor import TensorVariable

    from . import host_counts

    flat_proxy = torch.fx.Proxy(flat, var.as_proxy().tracer)
    hot = tx.output.create_proxy("call_function", torch.nn.functional.one_hot, (flat_proxy, num_experts), {})
    counts = wrap_fx_proxy(tx, tx.output.create_proxy("call_method", "sum", (hot, 0), {}))
    counts.as_proxy().node.meta[host_counts.WALKED] = True  # host_counts.unconsumed: no reader may outlive the loop
    items = TensorVariable.method_tolist(counts, tx).unpack_var_sequence(tx)
    if len(items) != num_experts or any(not isinstance(c, SymNodeVariable) for c in items):
        return None
    ends = [items[0]]
    for c in items[1:]:
        ends.append(BuiltinVariable(operator.add).call_function(tx, [ends[-1], c], {}))
    return [items, ends]


def cumulative_list(var, tx) -> Optional[Any]:
    """``.tolist()`` of the cumsum of ``bincount(flat, minlength=E)`` (E entries, exactly): the running sums of the
    counts as a list, or None (Dynamo's own ``tolist`` then runs). Without ``minlength`` the list's length, max id +
    1, is read by whatever holds the list, so it is left alone."""
    from torch._dynamo.variables import ListVariable

    from . import speculation

    trace = speculation._trace()
    if trace is None:
        return None
    found = cumulative_source(var.as_proxy().node)
    if found is None or found[2]:
        return None
    sums = _running_sums(var, tx, found[0], found[1])
    if sums is None:
        return None
    trace.host_counts = True
    return ListVariable(list(sums[1]))


def walk_items(var, tx) -> Optional[list]:
    """The running sums to hand out for the cumulative count array ``var`` being unpacked, or None (Dynamo's own
    unpacking then runs, as before)."""
    from . import host_counts, speculation

    trace, node = host_counts.traced_node(var)
    if node is None:
        return None
    found = cumulative_source(node)
    loop = _consumer(tx) if found is not None else None
    if loop is None:
        return None
    flat, num_experts, padded = found
    frame, head = loop
    graph = tx.output.graph
    first = speculation._last_node(graph)
    sums = _running_sums(var, tx, flat, num_experts)
    if sums is None:
        return None
    items, ends = sums
    trace.host_counts = True
    for item in ends:  # ``end_idx.item()`` of an element is the number itself, as for a NumPy int64
        if type(item).__name__ == "SymNodeVariable":
            item.__class__ = host_counts._count_class(type(item))
    symbols = [c.sym_num.node.expr for c in items]
    walks(trace).append(Walk(frame, frame.instructions[head].offset, num_experts, ends, symbols, graph, first, var,
                             padded, trace.mutations))
    return list(ends)


def walks(trace) -> list:
    """The compile's walks (kept on speculation's Trace)."""
    return trace.cumulative_walks


def subscript(var, tx, key) -> Optional[Any]:
    """``arr[j]`` inside the walk of ``arr``, 0 <= j <= the current iteration: the running sum j (the value eager's
    element holds; eager reads no other index there without raising or reading another element). Else None."""
    from torch._dynamo.variables import ConstantVariable

    from . import speculation

    trace = speculation._trace()
    if trace is None or not isinstance(key, ConstantVariable) or type(key.value) is not int:
        return None
    for walk in walks(trace):
        if walk.array is not var:
            continue
        done = [s for s in trace.speculations if s.tx is walk.tx and s.loop_head == walk.head and s.closed]
        if len(done) >= walk.num_experts:
            return None  # the loop is over: the array is eager's again
        if 0 <= key.value <= len(done):
            return walk.ends[key.value]
    return None


def subscript_hook(handler):
    """Dynamo's ``BINARY_SUBSCR`` handler, after ``subscript``'s answer for a walked array's ``arr[j]``."""
    from . import host_counts

    def binary_subscr(tx, inst):
        got = subscript(tx.stack[-2], tx, tx.stack[-1]) if len(tx.stack) >= 2 else None
        if got is None and len(tx.stack) >= 2:
            got = host_counts.subscript(tx.stack[-2], tx, tx.stack[-1])
        if got is None:
            return handler(tx, inst)
        tx.popn(2)
        tx.push(got)

    return binary_subscr


def one_count(expr):
    """``c OP 0`` (or ``0 OP c``) for a comparison whose two sides differ by one count ``c``: ``start == end`` with
    ``end = start + c`` is ``c == 0``, exactly (integers); else ``expr``."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(expr, (sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge)):
        return expr
    if len(free_unbacked_symbols(expr)) < 2:
        return expr
    diff = sympy.expand(expr.lhs - expr.rhs)
    if diff.is_Symbol:
        return type(expr)(diff, 0)
    if (-diff).is_Symbol:
        return type(expr)(0, -diff)
    return expr


# --- the backend's side ------------------------------------------------------------------------------------------


def check(gm: GraphModule, speculations: list) -> None:
    """Before the passes: each padded walk of this graph is the loop the module docstring describes; its nodes are
    tagged for ``leftover``. Raises SpeculationNotDischarged."""
    from .speculation import SpeculationNotDischarged, _trace

    trace = _trace()
    for walk in walks(trace) if trace is not None else []:
        if walk.graph is not gm.graph:
            continue
        why = _refusal(walk, speculations)
        if why is not None:
            length = "its length the largest id + 1" if walk.padded else "its length E"
            raise SpeculationNotDischarged(f"the walk of cumulative host counts at {_where(walk)} ({length}, traced "
                                           f"as all {walk.num_experts} experts): {why}; not kept")
        if not walk.padded:
            continue
        last = max((n for n in gm.graph.nodes if n.meta.get("moe_inductor_speculation") == walk.speculated[-1].id),
                   key=_position(gm.graph), default=walk.speculated[-1].start)
        node = walk.first.next if walk.first is not None else next(iter(gm.graph.nodes))
        while last is not None and node is not gm.graph._root:
            node.meta[TAG] = True
            if node is last:
                break
            node = node.next


def _where(walk: Walk) -> str:
    from .speculation import _user_line

    return _user_line(walk.tx)


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _refusal(walk: Walk, speculations: list) -> Optional[str]:
    """Why the walk over all E experts may differ from eager's over the first max id + 1, or None."""
    from .loop_bytecode import _local_names, _read_before_written

    mine = [s for s in speculations if s.tx is walk.tx and s.loop_head == walk.head]
    if len(mine) != walk.num_experts or [s.symbol for s in mine] != walk.symbols or any(
            s.mask or s.counts is not None for s in mine):
        return ("not every one of its iterations reaches a skip of that expert's count at 0 (start == end, then "
                "continue): an iteration past the largest id would run")
    walk.speculated = mine
    if not walk.padded:  # eager's array has the E entries walked: the two walks are one program
        return None
    ins = walk.tx.instructions
    head = next(i for i, x in enumerate(ins) if x.offset == walk.head)
    exit_ = ins.index(ins[head].target)
    stored = {name for x in ins[head:exit_] if x.opcode in dis.haslocal and "STORE" in x.opname
              for name in _local_names(x)}
    after = sorted(name for name in stored if _read_before_written(ins, exit_, name))
    if after:
        return f"the loop sets {', '.join(after)}, read after it (its last value differs where eager stops earlier)"
    began = [walk.mutations] + [s.closed_at for s in mine[:-1]]
    for s, mutations in zip(mine, began):
        if s.mark[0] != mutations:  # (a user's __getitem__ or __eq__ that changes Python state, say)
            return "the code before its skip changes Python state (an iteration past the largest id would too)"
        branch = next((i for i, x in enumerate(ins) if x.offset == s.branch), None)
        if branch is None:
            return "its skip is not found in the loop's code"
        for x in ins[head + 1:branch]:
            jump = x.opname.startswith("POP_JUMP") and head < ins.index(x.target) <= branch
            if x.opname not in _PLAIN and not jump or x.opname == "BINARY_OP" and str(x.argrepr).endswith("="):
                return (f"the code before its skip runs {x.opname} {x.argrepr or ''}".rstrip() + " (an iteration "
                        "past the largest id would run it where eager does not)")
    return None


def leftover(gm: GraphModule) -> Optional[str]:
    """After the rewrites: why some node a padded walk made is still in the graph (an iteration past the largest id
    would run it), else None."""
    for node in gm.graph.nodes:
        if node.meta.get(TAG) and node.op not in ("placeholder", "get_attr", "output"):
            return (f"{node.name}, made by the walk of cumulative host counts, is still in the graph after the "
                    "rewrites (an iteration eager does not run would run it)")
    return None
