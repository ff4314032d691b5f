"""Speculated skips: a per-expert loop that skips an expert with no tokens traces as the loop that runs every body,
and the backend keeps that graph only where a rewrite proves the two the same program.

The user code this is for (DeepSeek-V3's reference MoE, DBRX in transformers v4):

    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    for i in range(E):
        if counts[i] == 0:                        # or: tok, pos = torch.where(...); if tok.shape[0] == 0
            continue
        tok, pos = torch.where(ids == i)
        y[tok] += expert_i(x[tok]) * weights[tok, pos, None]

Under moe_inductor's capture settings ``counts[i]`` is an unbacked symbol, and Dynamo cannot branch on it. Skipping
body i when expert i has no rows equals running it on zero rows, but only when (a) the skipped rest of the iteration
is an expert body that gathers rows of that same expert and accumulates them (which the unrolled_loop proof
establishes, and which then disappears into the op), and (b) the test is exactly "expert i has no rows" for the ids
that body selects on. So, during a moe_inductor compile only:

- at trace time (``_jump``), a branch on such a count that is ``count == 0`` (or its negation, ``count > 0``,
  ``count >= 1``, truthiness), whose zero side jumps straight to the loop's next iteration (``continue``, or an
  ``elif self.training:`` that Dynamo reads False: ``loop_bytecode.through_constant_test``), with a
  rest of iteration that neither leaves the loop nor writes a local that outlives it nor stores attributes or
  globals, is answered "has rows"; the answer is a recorded ``Speculation``, and its body's graph nodes are tagged
  with it when the iteration ends (``_for_iter``), provided no Python object was mutated in between and no
  iterator made before the branch was stepped (``_hook_iterators``: Dynamo logs no side effect for most steps);
- ``.tolist()`` of ``bincount(topk_ids.flatten(), minlength=E)`` gets its length E (``_tolist``): a fact, since
  top-k indices over a dim of E are below E;
- the backend calls ``check_traced`` before the passes (the count is of the ids and expert the body selects on)
  and ``discharge`` after them (every tagged node went with a rewrite), both in speculation_check.py; anything
  short raises ``SpeculationNotDischarged``, and capture's fallback compiles the frame as plain capture would,
  saying why.

A guard ``if mask.any():`` (or ``torch.any(mask)``, or ``if not mask.any(): continue``) of a mask ``ids == e`` is the
same skip, its value False exactly at no rows: it is answered alike, and proven by the mask's (ids, e) and the masks
the body indexes by (``mask_guards.py``).

A test that is not "no rows" (``counts[i] < 2``) is never assumed away: it is noted (``refusal``) and the frame falls
back as before, the note in its explain() line.

The hooks are Dynamo internals (the bytecode dispatch table, ``TensorVariable.method_tolist``,
``SideEffects.mutation``), each looked up with getattr; where one is missing nothing is installed and these loops
fall back as they did without it.
"""
from __future__ import annotations

import dis
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from . import count_totals, host_counts, host_cumsum, mask_guards, skipped_state, unproven_loops
from .loop_bytecode import _body_refusal, _loop_of, _next, _resolve, through_constant_test

TAG = "moe_inductor_speculation"
#: on a node whose size checks are facts, removable once its loop went with a rewrite: a bincount whose length is
#: proven E (``_tolist``), the nonzero a hit loop was unrolled from (hit_loops.py)
LENGTH = "moe_inductor_length_is_minlength"

class SpeculationNotDischarged(RuntimeError):
    """A skip assumed away while tracing was not proven equal to running the body (the frame falls back)."""


@dataclass
class Speculation:
    """One branch on a count answered "has rows" while tracing."""

    id: int
    symbol: Any  # the sympy symbol of the count
    where: str  # the user's file:line of the test
    graph: Any  # the fx.Graph being traced
    start: Optional[Node]  # the graph's last node when the branch was answered
    code: Any
    loop_head: int  # offset of the FOR_ITER whose iteration the body is
    tx: Any
    mark: tuple  # ``Trace.mark()`` when the branch was answered
    closed: bool = False
    failed: Optional[str] = None  # why the body is not a clean one, found when the iteration ended
    #: (ids, expert, names of nodes computing the same ids) the count counts, by node names; filled by check_traced
    counted: Optional[tuple] = None
    #: the graph inputs needing gradients that only the body reads (an expert's own weights), filled by check_traced
    own: list = field(default_factory=list)
    #: made elsewhere (hit_loops.py): ``counts(graph) -> (ids, e, None)`` on check_traced's graph copy, or raises
    counts: Optional[Callable] = None
    #: a hit loop's iteration that computes nothing (a branch on its index skipped it whole, as transformers v5
    #: skips its sentinel class): found by check_traced, and then nothing of it is to be rewritten
    vacuous: bool = False
    #: the guard is ``mask.any()`` of one expert's mask (mask_guards.py), not a count
    mask: bool = False
    #: locals the skipped body sets that are read after it, each with what it held at the branch (a graph node,
    #: or an integer's ``skipped_state.Offset``): each must end the iteration as it began at no rows
    #: (``skipped_state.rebinds_hold``)
    rebinds: dict = field(default_factory=dict)
    #: the frame's lists at the branch (``skipped_state.lists_of``): the body may append its outputs to them
    lists: dict = field(default_factory=dict)
    #: the nodes the body appended to such lists: check_traced proves a cat is their only reader
    appended: list = field(default_factory=list)
    #: the offset of the branch instruction, and the mutation count when the iteration ended (host_cumsum.py)
    branch: Optional[int] = None
    closed_at: Optional[int] = None
    #: the loop's ``unproven_loops.key_of`` where it is one to remember: filed if no rewrite takes the body
    loop_key: Optional[tuple] = None


@dataclass
class Trace:
    """What one frame compile speculated and refused (held on capture's compile state)."""

    speculations: list = field(default_factory=list)
    refusals: list = field(default_factory=list)
    mutations: int = 0
    #: the variable of each logged mutation, in order (None for a store to an attribute, a global or a cell)
    mutated: list = field(default_factory=list)
    #: the iterators Dynamo made in this compile, by id: (the variable, its birth number). An iterator born inside a
    #: skipped body and stepped there is that body's own state: nn.Sequential's ``for module in self``, which
    #: torch 2.11 records as a mutation, is one
    born: dict = field(default_factory=dict)
    births: int = 0
    #: the birth number of each stepped iterator, in order
    steps: list = field(default_factory=list)
    #: hit_loops.py's loops over the experts that got tokens, by the id of the iterator Dynamo holds
    loops: dict = field(default_factory=dict)
    #: whether moe_inductor's backend was handed a graph of this compile (``of_graph``)
    checked: bool = False
    #: per-expert counts known to add up to the number of ids (``count_totals.counts_total``): (their symbols, that number)
    totals: list = field(default_factory=list)
    #: whether a host copy of counts was walked as integers (host_counts.py): the backend must see the graph
    host_counts: bool = False
    #: the lists ``BUILD_LIST`` made in this compile, by id: (the variable, its frame) (skipped_state.build_list_hook)
    built: dict = field(default_factory=dict)
    #: cumulative count arrays walked as running sums (host_cumsum.Walk)
    cumulative_walks: list = field(default_factory=list)
    #: chunked_rows.py's loops over an expert's rows in chunks: ("list" | "iter" | "slice", id) -> (what, its record)
    chunk_loops: dict = field(default_factory=dict)
    #: host count tensors read element by element (host_counts.subscript), by node: their ``.tolist()`` items
    listed_counts: dict = field(default_factory=dict)
    #: whether a bincount's length was asserted while tracing (count_totals.ASSUMED): the backend must see the graph
    assumed_lengths: bool = False

    def mark(self) -> tuple:
        """Where the side-effect record stands: (mutations, births, steps) so far."""
        return self.mutations, self.births, len(self.steps)

    def stepped_since(self, mark: tuple) -> bool:
        """Whether an iterator made before ``mark`` was stepped since."""
        _, births, steps = mark
        return any(born <= births for born in self.steps[steps:])

    def require_checked(self) -> None:
        """A speculation holds only through the backend's proof, which a look-alike wrapper (capture.py) that hands
        the graph to another compiler never runs: then the frame falls back."""
        if (self.speculations or self.host_counts or self.assumed_lengths) and not self.checked:
            raise SpeculationNotDischarged("skips of an empty expert were assumed while tracing, and the graph went to "
                                           "a compiler other than moe_inductor's backend, which cannot prove them")


_ids = itertools.count(1)


#: capture.py's thread-local compile stack, bound by ``install`` (capture imports this module)
_local = None


def _trace() -> Optional[Trace]:
    """The speculation record of the compile being traced, when it is a moe_inductor compile that may speculate."""
    if _local is not None and not _local.__dict__.get("stack"):
        return None  # no compile of ours is on: the hooks run in every compile's tracing, so this test comes first
    from . import capture

    state = capture.current()
    if not capture.capturing() or "unrolled_loop" not in state.forms:
        return None
    if state.speculation is None:
        state.speculation = Trace()
    return state.speculation


# --- trace time -------------------------------------------------------------------------------------------------


def _user_line(tx) -> str:
    try:
        inst = tx.current_instruction
        line = inst.positions.lineno if getattr(inst, "positions", None) else inst.starts_line
        return f"{tx.f_code.co_filename.rsplit('/', 1)[-1]}:{line}"
    except Exception:  # noqa: BLE001  (a location for a message only)
        return f"{getattr(getattr(tx, 'f_code', None), 'co_name', '?')}"


def _branch_condition(value) -> Optional[torch.SymBool]:
    """The symbolic condition a branch on the stack's top ``value`` tests (an int tests ``!= 0``); None when it is
    not symbolic."""
    from torch._dynamo.variables import SymNodeVariable

    if not isinstance(value, SymNodeVariable):
        return None
    sym = value.sym_num
    if isinstance(sym, torch.SymInt):
        sym = sym != 0
    return sym if isinstance(sym, torch.SymBool) else None


def _count_symbol(value) -> Optional[tuple[Any, Any]]:
    """(sympy expr of the branch condition, its one unbacked symbol) for a data-dependent branch on a count."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

    sym = _branch_condition(value)
    if sym is None:
        return None
    try:
        if statically_known_true(sym) or statically_known_true(torch.sym_not(sym)):
            return None  # Dynamo decides it (a guard), nothing to speculate
    except Exception:  # noqa: BLE001
        return None
    expr = host_cumsum.one_count(sym.node.expr)  # ``start == end`` of running sums: ``c == 0``
    symbols = free_unbacked_symbols(expr)
    if len(symbols) != 1 or expr.free_symbols != symbols:
        return None
    return expr, next(iter(symbols))


def _no_rows_test(expr, symbol) -> Optional[bool]:
    """The condition's value at count 0, when it is a test of "no rows" (its value at 0 differs from its one value
    at every count >= 1: ``== 0``, ``!= 0``, ``> 0``, ``>= 1``); None for any other test (``< 2``, ``== 3``)."""
    import sympy

    if not isinstance(expr, sympy.core.relational.Relational):
        return None
    lhs, rhs = expr.lhs, expr.rhs
    other = rhs if lhs == symbol else lhs if rhs == symbol else None
    if other is None or not other.is_Integer or int(other) not in (0, 1):
        return None
    if isinstance(expr, (sympy.Eq, sympy.Ne)) and int(other) != 0:
        return None
    at = [bool(expr.subs(symbol, n)) for n in (0, 1, 2, 3, 2**40)]
    if len(set(at[1:])) != 1 or at[0] == at[1]:
        return None
    return at[0]


def _last_node(graph) -> Optional[Node]:
    node = graph._root.prev
    return None if node is graph._root else node


def _speculate(tx, inst, jumps_when: bool) -> bool:
    """Answer the branch ``inst`` on a count "has rows" (and return True) when it is a no-rows skip of the rest of
    the iteration; else record why not (when it was a branch on a count) and return False."""
    trace = _trace()
    if trace is None or not tx.stack:
        return False
    found = _count_symbol(tx.stack[-1])
    guard = mask_guards.any_of_mask(tx.stack[-1]) if found is None else None
    if found is None and guard is None:
        return False
    where = _user_line(tx)
    if guard is not None:  # mask.any() is False exactly when the mask has no rows
        expr, symbol, at_zero = f"{guard.args[0].name}.any()", None, False
    else:
        expr, symbol = found
        at_zero = _no_rows_test(expr, symbol)
    if at_zero is None:
        trace.refusals.append(f"{where}: the branch on {expr} is not a test of 'this expert got no tokens': "
                              "not assumed away")
        return False
    zero_jumps = at_zero == jumps_when
    taken, fallthrough = inst.target, _next(tx, inst)
    zero_side, rows_side = (taken, fallthrough) if zero_jumps else (fallthrough, taken)
    zero_side = through_constant_test(tx, zero_side)  # ``elif self.training:`` in eval: straight on
    loop = _loop_of(tx, inst)
    head = tx.instructions[loop[0]] if loop else None
    reason = None
    open_here = [s for s in trace.speculations if s.tx is tx and not s.closed]
    # A hit loop's iteration (hit_loops.py) takes the skip of its own expert's empty rows as part of itself: an
    # expert with no rows computes nothing either way. check_traced proves the count is that expert's.
    hit_iteration = (open_here[0] if guard is None and len(open_here) == 1 and open_here[0].counts is not None
                     and not open_here[0].mask and open_here[0].symbol is None and head is not None
                     and open_here[0].loop_head == head.offset else None)
    key = unproven_loops.key_of(tx, head.offset) if head is not None and hit_iteration is None else None
    if loop is None or _resolve(tx, zero_side) is not head or _resolve(tx, rows_side) is head:
        reason = "its no-tokens side does not go straight to the next iteration (continue)"
    elif open_here and hit_iteration is None:
        reason = "it is inside another skipped body"
    elif unproven_loops.known_unproven(key):
        reason = unproven_loops.REFUSAL
    else:
        names: list = []
        reason = _body_refusal(tx, inst, *loop, rebinds=names)
        held = {name: skipped_state.held(tx.symbolic_locals.get(name)) for name in names}
        if reason is None and names and (hit_iteration is not None or any(h is None for h in held.values())):
            reason = f"the rest of the iteration sets {', '.join(names)}, read after it"
    if reason is not None:
        trace.refusals.append(f"{where}: the branch on {expr}: {reason}: not assumed away")
        return False
    graph = tx.output.graph
    if hit_iteration is not None:
        hit_iteration.symbol = symbol
    elif guard is not None:
        trace.speculations.append(Speculation(next(_ids), None, where, graph, _last_node(graph), tx.f_code,
                                              head.offset, tx, trace.mark(),
                                              counts=mask_guards.counted_by(guard.name), mask=True, rebinds=held,
                                              loop_key=key))
    else:
        trace.speculations.append(Speculation(next(_ids), symbol, where, graph, _last_node(graph), tx.f_code,
                                              head.offset, tx, trace.mark(), rebinds=held,
                                              lists=skipped_state.lists_of(tx), branch=inst.offset, loop_key=key))
    tx.pop()
    if not zero_jumps:  # the rows side is the jump target
        tx.jump(inst)
    return True


def _close(tx, inst) -> None:
    """The iteration of an open speculation ends at its FOR_ITER: tag the body's nodes, check nothing was mutated."""
    trace = _trace()
    if trace is None:
        return
    for s in trace.speculations:
        if s.tx is tx and not s.closed and s.loop_head == inst.offset:
            s.closed, s.closed_at = True, trace.mutations
            body = set()
            node = s.start.next if s.start is not None else next(iter(s.graph.nodes), None)
            while node is not None and node is not s.graph._root:
                node.meta[TAG] = s.id
                body.add(node)
                node = node.next
            if trace.stepped_since(s.mark):
                s.failed = "the skipped body changes Python state (a list, a dict, an attribute, an iterator)"
            elif trace.mutations != s.mark[0]:
                s.failed, s.appended = skipped_state.appends(tx, trace.mutated[s.mark[0]:], s.lists, body,
                                                             trace.built, inst)
            if s.failed is None and s.rebinds:
                s.failed = skipped_state.rebinds_hold(tx, s.rebinds, body, s.symbol)


# --- installation -------------------------------------------------------------------------------------------------

_installed = False


def install() -> None:
    """Hook Dynamo's branch, FOR_ITER and tolist handling and its side-effect log (idempotent); each hook does
    nothing outside a moe_inductor compile."""
    global _installed, _local
    if _installed:
        return
    _installed = True
    from .capture import _local
    try:
        from torch._dynamo import side_effects, symbolic_convert
        from torch._dynamo.variables.base import VariableTracker
        from torch._dynamo.variables.tensor import TensorVariable
    except ImportError:
        return
    base = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    original_tolist = getattr(TensorVariable, "method_tolist", None)
    mutation = getattr(getattr(side_effects, "SideEffects", None), "mutation", None)
    if base is None or original_tolist is None or mutation is None or not hasattr(base, "dispatch_table"):
        return

    def counted(self, *args, **kwargs):
        trace = _trace()
        if trace is not None:
            var = args[0] if args else kwargs.get("var")
            if id(var) in trace.born:  # an iterator's step (torch 2.11 logs list iterators' steps here)
                trace.steps.append(_birth(trace, var))
            else:
                trace.mutations += 1
                trace.mutated.append(var)
        return mutation(self, *args, **kwargs)

    side_effects.SideEffects.mutation = counted
    _hook_iterators(VariableTracker)
    for name in ("store_attr", "store_global", "store_cell"):
        method = getattr(side_effects.SideEffects, name, None)
        if method is not None:
            setattr(side_effects.SideEffects, name, _counting(method))

    def method_tolist(self, *args, **kwargs):  # (self, tx) in torch 2.13; whatever the version passes, passed on
        count_totals.tolist_length(self)
        listed = host_cumsum.cumulative_list(self, *args, **kwargs) if _trace() is not None else None
        listed = listed if listed is not None else original_tolist(self, *args, **kwargs)
        count_totals.counts_total(self, listed)
        return listed

    TensorVariable.method_tolist = method_tolist
    host_counts.install()
    for table in dispatch_tables(base):
        hook_table(table, dis.opmap)


def dispatch_tables(base: type) -> list[list]:
    """The bytecode dispatch table of ``base`` and of every subclass that holds its own (Dynamo builds one per
    translator class), for the trace-time hooks to wrap entries of."""
    classes, stack = [], [base]
    while stack:
        cls = stack.pop()
        classes.append(cls)
        stack.extend(cls.__subclasses__())
    tables = [cls.__dict__.get("dispatch_table") for cls in classes]
    return [t for t in tables if isinstance(t, list)]


def is_bool_branch(opname: str) -> bool:
    """Whether the opcode named ``opname`` jumps on the truth of the value it pops (POP_JUMP_[FORWARD_|BACKWARD_]
    IF_TRUE / IF_FALSE, across Python versions)."""
    return opname.startswith("POP_JUMP") and opname.endswith(("_IF_TRUE", "_IF_FALSE"))


def hook_table(table: list, opmap: dict) -> None:
    """Wrap the branch and FOR_ITER handlers of one Dynamo dispatch table (a list indexed by opcode) in place."""
    for opname, op in opmap.items():
        # Python 3.12's pseudo-instructions (JUMP, LOAD_METHOD, SETUP_*) have opcodes of 256 and up: they never
        # reach the interpreter, and the table does not hold them
        if not 0 <= op < len(table) or table[op] is None:
            continue
        handler = table[op]
        if is_bool_branch(opname):
            table[op] = _jump_hook(handler, opname.endswith("_IF_TRUE"))
        elif opname == "FOR_ITER":
            table[op] = _for_iter_hook(handler)
        elif opname == "BUILD_LIST":
            table[op] = skipped_state.build_list_hook(handler, _trace)
        elif opname == "BINARY_SUBSCR":
            table[op] = host_cumsum.subscript_hook(handler)


#: the methods by which Dynamo steps an iterator it traces (one or both, by torch version)
_STEPS = ("next_variable", "tp_iternext_impl")


def _hook_iterators(base: type) -> None:
    """Number every iterator Dynamo makes during a moe_inductor compile, and log each step of one, so that a skipped
    body that steps an iterator it did not make is seen: ranges, dict views and generators step without any entry
    in Dynamo's side-effect log. An iterator class is one that defines a step method (its subclasses inherit the
    hooked ``__init__``)."""
    seen, todo = set(), [base]
    while todo:
        cls = todo.pop()
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
        seen.add(cls)
        if cls is base or cls.__name__ == "LazyVariableTracker":  # the lazy one realises, then steps the real one
            continue
        steps = [name for name in _STEPS if name in cls.__dict__]
        if not steps:
            continue
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording_birth(cls.__init__)
        for name in steps:
            setattr(cls, name, _recording_step(getattr(cls, name)))


def _recording_birth(init: Callable) -> Callable:
    def born(self, *args, **kwargs):
        init(self, *args, **kwargs)
        trace = _trace()
        if trace is not None:
            trace.births += 1
            trace.born[id(self)] = (self, trace.births)

    return born


def _recording_step(step: Callable) -> Callable:
    def stepped(self, *args, **kwargs):
        trace = _trace()
        if trace is not None:
            trace.steps.append(_birth(trace, self))
        return step(self, *args, **kwargs)

    return stepped


def _birth(trace: Trace, var) -> int:
    """The birth number of an iterator Dynamo made during this compile; 0 (born before anything) for one it did
    not number, or one that stands for a user's object (it has a source: the user's iterator existed before)."""
    born = trace.born.get(id(var))
    if born is None or born[0] is not var or getattr(var, "source", None) is not None:
        return 0
    return born[1]


def _counting(method: Callable) -> Callable:
    def counted(self, *args, **kwargs):
        trace = _trace()
        if trace is not None:
            trace.mutations += 1
            trace.mutated.append(None)
        return method(self, *args, **kwargs)

    return counted


def _jump_hook(handler: Callable, jumps_when: bool) -> Callable:
    def jump(tx, inst):
        if not count_totals.decide_by_totals(tx, inst, jumps_when) and not _speculate(tx, inst, jumps_when):
            handler(tx, inst)

    return jump


def _for_iter_hook(handler: Callable) -> Callable:
    def for_iter(tx, inst):
        _close(tx, inst)
        handler(tx, inst)

    return for_iter


def step_tracked(tx, inst, handler: Callable, tracked: Callable) -> Optional[tuple[Any, int, bool]]:
    """FOR_ITER of a loop a hook unrolls itself (hit_loops, chunked_rows). ``tracked(trace, top)`` is the
    (iterator, record) kept for the iterator on top of the stack, or None. Dynamo's ``handler`` steps the iterator
    either way; for a tracked one this returns (record, its index before the step, whether the step ended the loop:
    an exhausted iterator's index does not move), else None."""
    trace = _trace()
    top = tx.stack[-1] if trace is not None and tx.stack else None
    got = tracked(trace, top) if top is not None else None
    if got is None or got[0] is not top:
        handler(tx, inst)
        return None
    iterator, record = got
    before = iterator.index
    handler(tx, inst)
    return record, before, iterator.index == before


def _fail(s: Speculation, why: str) -> SpeculationNotDischarged:
    return SpeculationNotDischarged(f"the skip of an expert with no tokens at {s.where} was assumed away while "
                                    f"tracing, and {why}; not kept")
