"""Loops over a Python list of the experts that kept rows: traced as the loop over every expert, kept only where a
rewrite proves the two the same program (a speculation, as hit_loops.py's loops over a nonzero() tensor are).

The user code this is for (transformers v4.4x-v4.5x SwitchTransformersSparseMLP):

    router_mask = router_mask.bool()                                            # (B, T, E), the drops in it
    idx_mask = router_mask.reshape(B * T, E).sum(dim=0)                         # rows kept per expert
    idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()               # the experts that kept rows
    for idx in idx_mask:
        next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
            hidden_states[router_mask[:, :, idx]])

and a top-k router's hit vector as a list (GPTQModel's MiniMax-M2 port, and copies of transformers v4's loop):

    expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
    expert_hit = torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()
    for expert_idx in expert_hit.tolist():
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        final.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None])

Under the capture settings the list's length is an unbacked symbol, and Dynamo's ``tolist`` cannot make it: the
frame fails and falls back to plain capture. Iterating the experts that kept rows equals iterating every expert in
order when the body, run on an expert with no rows, does nothing: which holds when the body is an expert MLP on the
rows of that expert's mask, written at those rows (what the top1_masks rewrite proves, and which then disappears
into the op). So, during a moe_inductor compile only, ``t.tolist()`` is traced as the list ``[0, ..., E-1]`` of
Python ints when all of this holds, and else runs as Dynamo's own (the frame falls back as before, saying why):

- t is ``nonzero(counts, as_tuple=True)[0]`` of a (E,) count of each expert's rows of a one-hot with the router's
  drops in it (``kept_masks.kept_counts``): zero exactly where expert e keeps no row; or the nonzero of a (E,) hit
  vector, "expert e got tokens" of the router's ids (``hit_loops.hit_vector``), as ``nonzero(hit, as_tuple=True)[0]``
  or the one column of ``nonzero(hit)`` (``.flatten()``, ``.squeeze(-1)``, ``.view(-1)``, ``[:, 0]``): the rewrite
  then is the unrolled loop's, as for hit_loops.py's loops over the nonzero itself;
- the list, used in place or stored in a local, is read (every read that can see that store) only once, by the
  ``GET_ITER`` of a for loop, whose body neither leaves the loop nor sets a local read after it (the loop variable
  included: after the loop eager holds the last expert that kept rows, the trace E - 1);
- each iteration is an ordinary ``Speculation`` (hit_loops' FOR_ITER hook): ``check_traced`` proves its body reads
  the rows of that expert's column of that same one-hot only (``mask_guards.selected_by``; of a hit vector, the rows
  that expert's selection of those same ids picks), the counts or the hit vector proven again on the final graph,
  unchanged in place anywhere, and ``discharge`` requires a rewrite to take every body.
"""
from __future__ import annotations

import dis
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.fx import Graph, Node

from . import chunked_rows, hit_loops, speculation
from .loop_bytecode import NO_OPS, _body_refusal, _local_names, _loop_of, _next


def _nonzero_column(node: Node) -> Optional[Node]:
    """The nonzero for ``nonzero(v, as_tuple=True)[0]`` of a vector v."""
    from .passes.fx_utils import is_call

    if not (is_call(node, "call_function", operator.getitem) and node.args[1:] == (0,)):
        return None
    nonzero = node.args[0]
    if not ((is_call(nonzero, "call_function", torch.nonzero) or is_call(nonzero, "call_method", "nonzero"))
            and len(nonzero.args) == 1 and nonzero.kwargs == {"as_tuple": True} and isinstance(nonzero.args[0],
                                                                                                 Node)):
        return None
    return nonzero


def _kept_nonzero(node: Node) -> Optional[tuple[Node, Node]]:
    """(the nonzero, the kept one-hot M) for ``nonzero(counts, as_tuple=True)[0]`` of M's per-expert counts."""
    from .passes.kept_masks import kept_counts

    nonzero = _nonzero_column(node)
    M = kept_counts(nonzero.args[0]) if nonzero is not None else None
    return None if M is None else (nonzero, M)


def _reads_after(tx, start: int, name: str) -> Optional[list[int]]:
    """The indices in Dynamo's instructions of the frame of the instructions that read the local ``name`` as stored by
    ``tx.instructions[start]``: every read some path from the store reaches before another store of it (exception
    handlers included); None when one is not a plain load."""
    instructions = tx.instructions
    index_of = {id(ins): i for i, ins in enumerate(instructions)}
    ends = {"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD", "JUMP_BACKWARD",
            "JUMP_ABSOLUTE", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP"}
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    found, seen, stack = [], set(), [start + 1]
    while stack:
        i = stack.pop()
        if i in seen or i >= len(instructions):
            continue
        seen.add(i)
        ins = instructions[i]
        if ins.opcode in dis.haslocal and name in _local_names(ins):
            if ins.opname.startswith("STORE"):
                continue
            if ins.opname not in ("LOAD_FAST", "LOAD_FAST_CHECK"):
                return None
            found.append(i)
        if ins.opname not in ends:
            stack.append(i + 1)
        if ins.opcode in jumps and ins.target is not None:
            stack.append(index_of[id(ins.target)])
        entry = getattr(ins, "exn_tab_entry", None)
        if entry is not None:
            stack.append(index_of[id(entry.target)])
    return sorted(found)


def _real_after(tx, index: int):
    """The first instruction after ``tx.instructions[index]`` that does something, and its index."""
    for i in range(index + 1, len(tx.instructions)):
        if tx.instructions[i].opname not in NO_OPS:
            return i, tx.instructions[i]
    return None, None


def _iterated_once(tx) -> tuple[Optional[object], Optional[str]]:
    """(the GET_ITER that reads the value of the call being traced, None) when that is its only read, used in place
    or through a local; else (None, why not)."""
    call = getattr(tx, "current_instruction", None)
    if call is None or not call.opname.startswith("CALL") or call.arg not in (0, None) or call not in tx.instructions:
        return None, "it is not a call t.tolist()"
    i, first = _real_after(tx, tx.instructions.index(call))
    if first is None:
        return None, "the list is not iterated"
    if first.opname == "GET_ITER":
        return first, None
    if first.opname != "STORE_FAST":
        return None, f"the list reaches {first.opname}, not a for loop"
    name = first.argval
    code = tx.f_code
    if name in code.co_cellvars or name in code.co_freevars:
        return None, f"{name} is read by a nested function"
    reads = _reads_after(tx, i, name)
    if reads is None or len(reads) != 1:
        return None, f"{name} is read {'other than by loads' if reads is None else f'{len(reads)} times'}, not once"
    _, nxt = _real_after(tx, reads[0])
    if nxt is None or nxt.opname != "GET_ITER":
        return None, f"{name} is read other than by a for loop"
    return nxt, None


def _refusal(tx, get_iter) -> Optional[str]:
    """Why the for loop of ``get_iter`` is not one whose iterations can run for every expert: it is no for loop, or
    its body leaves it or sets a local read after it."""
    head = _next(tx, get_iter)
    if head is None or head.opname != "FOR_ITER" or head.target is None:
        return "the list is iterated other than by a for loop"
    loop = _loop_of(tx, _next(tx, head))
    if not loop or tx.instructions[loop[0]] is not head:
        return "its loop body was not found"
    return _body_refusal(tx, head, *loop)


def _ended(loop, e: int, graph: Graph, nonzero_name: str) -> tuple:
    """(iteration e's speculation, the graph's node named ``nonzero_name`` or None), where the loop over the experts
    ended in this graph; else its speculation fails."""
    s = loop.iterations[e]
    if not loop.finished or len(loop.iterations) != loop.E:
        raise speculation._fail(s, "the loop over the experts did not end in this graph")
    return s, next((n for n in graph.nodes if n.name == nonzero_name), None)


def _counts_of(nonzero_name: str) -> Callable:
    """``_Loop.counts_of``: what iteration e counts, proven on check_traced's graph copy: (M, e, None)."""
    from .passes.aliases import mutated_alias

    def counts_of(loop, e: int) -> Callable[[Graph], tuple]:
        def counts(graph: Graph) -> tuple:
            s, nonzero = _ended(loop, e, graph, nonzero_name)
            column = next((u for u in nonzero.users if u.args[1:] == (0,)), None) if nonzero is not None else None
            found = _kept_nonzero(column) if column is not None else None
            if found is None:
                raise speculation._fail(s, "its nonzero() is no longer of the kept rows' counts")
            M = found[1]
            if any(mutated_alias(n) for n in (M, M.args[0], nonzero.args[0])):
                raise speculation._fail(s, "the kept one-hot or its counts are changed in place")
            return M, e, None

        return counts

    return counts_of


def _hit_counts_of(nonzero_name: str) -> Callable:
    """``_Loop.counts_of`` of a list of a hit vector's nonzero: (ids, e, None), the vector proven again on
    check_traced's graph copy (``hit_loops.hit_vector``, unchanged in place anywhere)."""

    def counts_of(loop, e: int) -> Callable[[Graph], tuple]:
        def counts(graph: Graph) -> tuple:
            s, nonzero = _ended(loop, e, graph, nonzero_name)
            found = hit_loops.hit_vector(nonzero) if nonzero is not None else "its nonzero() is gone"
            if isinstance(found, str):
                raise speculation._fail(s, found)
            return found[0], e, None

        return counts

    return counts_of


def as_expert_list(variable, tx):
    """The list ``[0, ..., E-1]`` (a Dynamo ListVariable of constants) to trace ``variable.tolist()`` as, where the
    module docstring's conditions hold at the call; else None (Dynamo's own tolist runs)."""
    from torch._dynamo.variables import ConstantVariable, ListVariable
    from torch._dynamo.variables.base import ValueMutationNew

    trace = speculation._trace()
    if trace is None:
        return None
    try:
        node = variable.as_proxy().node
    except Exception:  # noqa: BLE001  (no proxy: not a graph tensor)
        return None
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or isinstance(value.shape[0], int):
        return None
    found = _kept_nonzero(node)
    where = speculation._user_line(tx)
    if found is not None:
        nonzero, M = found
        E, counts_of = M.meta["example_value"].shape[-1], _counts_of(nonzero.name)
    else:  # a hit vector's nonzero, as_tuple or its one column: the hit loops' proof of it (hit_loops.hit_vector)
        nonzero = _nonzero_column(node) or hit_loops._column_of(node)
        hit = hit_loops.hit_vector(nonzero) if nonzero is not None else None
        if not isinstance(hit, tuple):
            if nonzero is not None:  # the mark of such a loop: say why it is not unrolled
                trace.refusals.append(
                    f"{where}: the list of nonzero(...).tolist() was not traced as every expert: its vector is neither "
                    "each expert's count of a one-hot's rows, (one_hot(idx, E) * keep).bool() with an integer or bool "
                    f"keep, nor 'expert e got tokens' ({hit.removeprefix('the loop runs over ')})")
            return None
        E, counts_of = hit[1], _hit_counts_of(nonzero.name)
    get_iter, why = _iterated_once(tx)
    if why is None:
        why = _refusal(tx, get_iter)
    if why is None and any(s.tx is tx and not s.closed for s in trace.speculations):
        why = "it is inside a body already assumed to have rows"
    if why is not None or not isinstance(E, int):
        trace.refusals.append(f"{where}: the list of the experts that kept rows was not traced as every expert: "
                              f"{why or 'the number of experts is not static'}")
        return None
    nonzero.meta[speculation.LENGTH] = E  # its size checks (0 <= n_hit <= E) are facts: they go if its loop does
    items = ListVariable([ConstantVariable.create(e) for e in range(E)], mutation_type=ValueMutationNew())
    trace.loops[id(items)] = (items, _Listed(nonzero.name, E, where, counts_of))
    return items


@dataclass(frozen=True)
class _Listed:
    """A list ``as_expert_list`` made, waiting for the GET_ITER of its loop (held in ``Trace.loops`` by its id)."""

    nonzero: str
    E: int
    where: str
    #: ``hit_loops._Loop.counts_of``: the kept counts' (``_counts_of``) or a hit vector's (``_hit_counts_of``)
    counts_of: Optional[Callable] = None


def _get_iter(tx, inst, handler: Callable) -> None:
    """GET_ITER of a list made by ``as_expert_list``: Dynamo's iterator over it becomes a loop that hit_loops' FOR_ITER
    hook opens an iteration (a Speculation) of at each step. Each GET_ITER makes a loop of its own: the one read of
    the list may run again (a loop inside another), and every run of its body is speculated and proven."""
    trace = speculation._trace()
    got = trace.loops.get(id(tx.stack[-1])) if trace is not None and tx.stack else None
    if got is not None and isinstance(got[1], _Listed) and any(s.tx is tx and not s.closed
                                                                for s in trace.speculations):
        # the list is [0, ..., E-1] already: only a failed frame (and capture's fallback) undoes it
        raise speculation.SpeculationNotDischarged(f"{got[1].where}: the list of the experts that kept rows is "
                                                   "iterated inside a body already assumed to have rows")
    handler(tx, inst)
    if got is not None and isinstance(got[1], _Listed):
        listed, iterator = got[1], tx.stack[-1]
        trace.loops[id(iterator)] = (iterator, hit_loops._Loop(listed.nonzero, listed.E, listed.where,
                                                               counts_of=listed.counts_of))


_installed = False


def install() -> None:
    """Hook Dynamo's ``tolist``, GET_ITER and ``range`` (idempotent; after list_indices' and hit_loops' hooks), and
    chunked_rows' hooks; each does nothing outside a moe_inductor compile. A failure warns: such loops then fall back
    as before."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._dynamo import symbolic_convert
        from torch._dynamo.variables.tensor import TensorVariable

        real = TensorVariable.method_tolist

        def method_tolist(self, tx, *args, **kwargs):
            listed = None if args or kwargs else as_expert_list(self, tx)
            return listed if listed is not None else real(self, tx, *args, **kwargs)

        TensorVariable.method_tolist = method_tolist
        from torch._dynamo.variables import BuiltinVariable

        call_builtin = BuiltinVariable.call_function

        def builtin_call(self, tx, args, kwargs):
            if getattr(self, "fn", None) is range and not kwargs:  # an expert's rows in chunks: one pass, or raises
                chunks = chunked_rows.chunk_range(tx, list(args))
                if chunks is not None:
                    return chunks
            return call_builtin(self, tx, args, kwargs)

        BuiltinVariable.call_function = builtin_call
        op = dis.opmap["GET_ITER"]
        for table in speculation.dispatch_tables(symbolic_convert.InstructionTranslatorBase):
            if op < len(table) and table[op] is not None:
                table[op] = (lambda handler: lambda tx, inst: _get_iter(tx, inst, handler))(table[op])
        chunked_rows.install()  # outermost: its subscript hook takes a chunk before any other reads the slice
    except Exception as error:  # an optional hook into Dynamo internals must never stop the backend from loading
        import warnings

        warnings.warn(f"moe_inductor: loops over a list of the experts that kept rows are not unrolled on this torch "
                      f"({error!r}); they fall back to plain capture")
