"""Loops over the experts that got tokens: traced as the loop over every expert, kept only where a rewrite proves
the two the same program (a speculation, as speculation.py's skips are).

The user code this is for (transformers v4.48+ Mixtral, v4.5x Qwen2-MoE and their copies):

    expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)              # (E, k, T)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()    # (n_hit, 1): n_hit is data-dependent
    for expert_idx in expert_hit:
        expert_layer = self.experts[expert_idx]                               # a ModuleList at a (1,) int tensor
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        y.index_add_(0, top_x, expert_layer(x[None, top_x].reshape(-1, H)) * weights[top_x, idx, None])

Dynamo cannot iterate a tensor of unbacked length. Iterating the hit experts equals iterating every expert in
order when the body, run on an expert with no rows, adds nothing: which holds when the body is an expert MLP on the
rows expert e selects, accumulated (what the unrolled_loop rewrite proves, and which then disappears into the op).
So, during a moe_inductor compile only:

- at ``GET_ITER`` of ``nonzero()`` of a (E,) vector that is exactly "expert e has rows" of integer ids (``hit_vector``:
  ``one_hot(ids, E)``, permuted or not, summed over every dim but the experts' and compared ``> 0`` / ``>= 1`` /
  ``!= 0``, or reduced by ``.any`` over those dims; or ``bincount(topk_ids.flatten(), minlength=E)`` compared so),
  the loop iterates E (1,) int64 tensors holding 0..E-1 instead (``torch.full``: eager's rows of the nonzero output
  have that dtype, shape and device), provided the loop body neither leaves the loop nor sets a local read after it;
  a loop over the nonzero's one column (``.squeeze(-1)``, ``.flatten()``, ``.view(-1)``, ``[:, 0]``) iterates E 0-d
  ones, and a loop over its whole view ``[:]`` (transformers v4.55+'s GPT-OSS) iterates the nonzero's rows;
- ``ModuleList[t]`` (or a list's) at such a tensor is element e, as ``operator.index`` of it is in eager; so is
  any indexing at its one element ``t[0]`` (transformers v5's ``expert_idx = expert_idx[0]``), a tensor's too
  (``w[t[0]]`` is the view ``w[e]``, and ``table[tok, t[0], None]`` is ``table[tok, e, None]``), and ``t.item()``
  is the int e;
- a no-tokens skip inside the loop (``if len(top_x) == 0: continue``, as copies of the loop add) is part of the
  iteration: an expert with no rows computes nothing either way, and check_traced proves the count is of that
  iteration's own expert;
- a branch on ``t[0] == c`` (or another comparison with an int) takes its known value: v5's ``if expert_idx ==
  num_experts: continue``, which skips the spare class of its ``one_hot(ids, E + 1)``. An iteration left with
  nothing but such reads of its index (``speculation_check.check_traced``: vacuous) computes nothing, as eager's does;
- each iteration is an ordinary ``Speculation``: its graph nodes are tagged when it ends (speculation's FOR_ITER
  hook), ``check_traced`` asks ``counts`` what it counts (the vector proven again on the final graph, unchanged in
  place anywhere) and proves the body reads the rows of that expert of those ids only (``expert_mask[t].squeeze(0)``
  is read as the mask of expert e by passes/loop_rows.py), and ``discharge`` requires a rewrite to take every body.
  Anything short raises ``SpeculationNotDischarged``, and capture's fallback compiles the frame as plain capture would.

A loop over the nonzero of anything else (``count > 1``, a tensor unrelated to the router) is not touched: Dynamo
breaks the graph there as it does without moe_inductor, and explain() notes why the loop was not unrolled.
"""
from __future__ import annotations

import dis
import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch.fx import Graph, Node

from . import count_totals, report, speculation, unproven_loops
from .loop_bytecode import _body_refusal, _loop_of, _next, _resolve

#: on a ``torch.full((1,), e)`` node that stands for the e-th row of a hit loop's nonzero: e
INDEX = "moe_inductor_hit_index"

_GT = (operator.gt, torch.gt, torch.greater, "gt", "greater", "__gt__")
_GE = (operator.ge, torch.ge, torch.greater_equal, "ge", "greater_equal", "__ge__")
_NE = (operator.ne, torch.ne, torch.not_equal, "ne", "not_equal", "__ne__")
#: each comparison with the constant that makes it "count > 0" (counts are never negative)
_HAS_ROWS = [(_GT, 0), (_GE, 1), (_NE, 0)]


def _op_in(node: Node, names: tuple) -> bool:
    return isinstance(node, Node) and (node.op == "call_function" and node.target in names
                                       or node.op == "call_method" and node.target in names)


def _dims(node: Node, rank: int) -> Optional[set]:
    """The dims a ``sum``/``any`` reduces, normalised; None when it keeps them or takes other arguments."""
    args, kwargs = node.args[1:], dict(node.kwargs)
    if set(kwargs) - {"dim", "keepdim"} or kwargs.get("keepdim", False) is not False or len(args) > 1:
        return None
    dim = args[0] if args else kwargs.get("dim")
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if not dims or not all(isinstance(d, int) and -rank <= d < rank for d in dims):
        return None
    return {d % rank for d in dims}


def _one_hot_counted(node: Node) -> Optional[tuple[Node, int, Node, int, int]]:
    """(ids, E, the one_hot node, rank, where its class dim is) for ``one_hot(ids, E)`` optionally ``.permute``-d."""
    from .passes.fx_utils import is_call, val

    order = None
    if is_call(node, "call_method", "permute") or is_call(node, "call_function", torch.permute):
        dims = node.args[1:] if node.op == "call_method" else node.args[1:2]
        order = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
        node = node.args[0]
    if not (is_call(node, "call_function", torch.nn.functional.one_hot) and node.args and isinstance(
            node.args[0], Node)):
        return None
    E = node.kwargs.get("num_classes", node.args[1] if len(node.args) > 1 else None)
    iv = val(node.args[0])
    if not isinstance(E, int) or E <= 0 or iv is None or iv.dtype.is_floating_point or iv.dtype == torch.bool:
        return None
    rank = iv.dim() + 1
    if order is None:
        return node.args[0], E, node, rank, rank - 1
    if sorted(d % rank for d in order if isinstance(d, int)) != list(range(rank)) or len(order) != rank:
        return None
    return node.args[0], E, node, rank, [d % rank for d in order].index(rank - 1)


def _reduced_one_hot(node: Node) -> Union[tuple[Node, int, tuple], str]:
    """(ids, E, the nodes it is made of) when ``node`` (a sum or an any) reduces ``one_hot(ids, E)`` over every dim
    but the experts', else how it does not (the end of a sentence the caller begins)."""
    hot = _one_hot_counted(node.args[0]) if node.args else None
    if hot is None:
        return "that is not of one_hot(ids, E)"
    ids, E, one_hot, rank, expert_dim = hot
    if _dims(node, rank) != set(range(rank)) - {expert_dim}:
        return "of one_hot(ids, E) that keeps more than the experts' dim"
    return ids, E, (node.args[0], one_hot)


def _counts(node: Node) -> Union[tuple[Node, int, tuple], str]:
    """(ids, E, the nodes the counts are made of) for a (E,) vector of how many ids equal each e: ``one_hot(ids,
    E)[.permute(...)].sum(dims)`` over every dim but the experts', or ``bincount(topk_ids.flatten(), minlength=E)``."""
    from .passes.fx_utils import is_call

    if is_call(node, "call_method", "sum") or is_call(node, "call_function", torch.sum):
        reduced = _reduced_one_hot(node)
        if isinstance(reduced, str):
            return f"the counts are a sum {reduced}"
        ids, E, made_of = reduced
        return ids, E, (node, *made_of)
    if is_call(node, "call_function", torch.bincount) and len(node.args) == 1 and set(node.kwargs) == {"minlength"}:
        E, flat = node.kwargs["minlength"], node.args[0]
        if isinstance(E, int) and E > 0 and isinstance(flat, Node) and count_totals.topk_ids_below(flat, E):
            ids = flat.args[0] if flat.op == "call_method" else flat
            return ids, E, (node, flat)
        return "the bincount is not of top-k ids over E experts with minlength=E"
    return "the vector is not a count of the router's ids per expert"


def hit_vector(nonzero: Node) -> Union[tuple[Node, int], str]:
    """(ids, E) when ``nonzero`` is ``hit.nonzero()`` of a (E,) bool vector ``hit`` that is True exactly at the
    experts some id equals ("expert e has rows"), none of it changed in place anywhere in the graph; else why not."""
    from .passes.aliases import mutated_alias
    from .passes.fx_utils import is_call, val

    hit = nonzero.args[0] if nonzero.args else None
    if not isinstance(hit, Node):
        return "the loop runs over nonzero() of no tensor"
    made_of: tuple = ()
    if _op_in(hit, ("any",)) or is_call(hit, "call_function", torch.any):
        reduced = _reduced_one_hot(hit)
        if isinstance(reduced, str):
            return f"the loop runs over nonzero() of an any() {reduced}"
        ids, E, made_of = reduced
    else:
        compared = next(((hit.args[0], c) for names, c in _HAS_ROWS if _op_in(hit, names) and len(hit.args) == 2
                         and not hit.kwargs and hit.args[1] == c and isinstance(hit.args[0], Node)), None)
        if compared is None:
            return ("the loop runs over nonzero() of a vector that is not 'expert e got tokens' (counts > 0, >= 1 "
                    "or != 0, or one_hot(...).any(dims))")
        counted = _counts(compared[0])
        if isinstance(counted, str):
            return f"the loop runs over nonzero() of a comparison of counts, and {counted}"
        ids, E, made_of = counted
    hv = val(hit)
    if hv is None or hv.dtype != torch.bool or hv.dim() != 1:
        return "the loop runs over nonzero() of a vector that is not a (E,) bool"
    changed = [n for n in (ids, hit, *made_of) if mutated_alias(n)]
    if changed:
        return f"the 'expert got tokens' vector or the ids it is made of ({changed[0].name}) is changed in place"
    return ids, E


def _is_nonzero(node: Node) -> bool:
    """``t.nonzero()`` / ``torch.nonzero(t)`` (as_tuple False): a (n, t.dim()) tensor of indices."""
    from .passes.fx_utils import is_call

    if not (is_call(node, "call_method", "nonzero") or is_call(node, "call_function", torch.nonzero)):
        return False
    return len(node.args) == 1 and node.kwargs in ({}, {"as_tuple": False})


# --- trace time -------------------------------------------------------------------------------------------------


@dataclass
class _Loop:
    """One hit loop being traced: its nonzero (by name, for the check on the final graph) and its iterations."""

    nonzero: str
    E: int
    where: str
    iterations: list = field(default_factory=list)  # the Speculation of each iteration, in order
    finished: bool = False  # the loop's FOR_ITER ran out of experts in this trace
    #: ``counts_of(loop, e)``, what iteration e counts, where the loop is not over a hit vector's nonzero rows
    #: (hit_lists.py's loops over a list of kept experts); None: ``_counts_of``
    counts_of: Optional[Callable] = None
    #: ``unproven_loops.key_of`` the loop, where it is one to remember (each iteration's Speculation carries it)
    key: Optional[tuple] = None


def _unroll(tx, inst) -> bool:
    """At GET_ITER of a hit vector's nonzero: replace it on the stack with an iterator over E index tensors (and
    return True); else leave it (False)."""
    from torch._dynamo.variables import ListIteratorVariable, TensorVariable
    from torch._dynamo.variables.base import ValueMutationNew
    from torch._dynamo.variables.builder import wrap_fx_proxy

    trace = speculation._trace()
    if trace is None or not tx.stack or not isinstance(tx.stack[-1], TensorVariable):
        return False
    iterated = tx.stack[-1].as_proxy().node
    node = _column_of(iterated) or iterated  # the nonzero itself, or its one column as a (n,) vector
    scalar = node is not iterated  # each item a 0-d index, not a (1,) row
    value = node.meta.get("example_value")
    if not _is_nonzero(node) or not isinstance(value, torch.Tensor) or isinstance(value.shape[0], int):
        return False
    where = speculation._user_line(tx)
    found = hit_vector(node)
    reason = found if isinstance(found, str) else None
    instructions = tx.instructions
    head = _next(tx, inst)
    if reason is None and (head is None or head.opname != "FOR_ITER" or head.target is None):
        reason = "the nonzero() is iterated other than by a for loop"
    if reason is None:
        loop = _loop_of(tx, _next(tx, head))
        reason = _body_refusal(tx, head, *loop) if loop and instructions[loop[0]] is head else (
            "its loop body was not found")
    if reason is None and any(s.tx is tx and not s.closed for s in trace.speculations):
        reason = "it is inside a body already assumed to have rows"
    key = unproven_loops.key_of(tx, head.offset) if reason is None else None
    if unproven_loops.known_unproven(key):
        reason = unproven_loops.REFUSAL
    if reason is not None:
        text = f"{where}: the loop over a nonzero() was not unrolled over the experts: {reason}"
        trace.refusals.append(text)
        report.record_note_once(text)  # once: Dynamo may trace a frame twice after a graph break
        return False
    ids, E = found
    node.meta[speculation.LENGTH] = E  # its size checks (0 <= n_hit <= E) are facts: they go if its loop does
    items = []
    for e in range(E):
        proxy = tx.output.create_proxy("call_function", torch.full, ((), e) if scalar else ((1,), e),
                                       {"dtype": torch.int64, "device": value.device})
        proxy.node.meta[INDEX] = e
        items.append(wrap_fx_proxy(tx, proxy))
    tx.pop()
    iterator = ListIteratorVariable(items, mutation_type=ValueMutationNew())
    tx.push(iterator)
    trace.loops[id(iterator)] = (iterator, _Loop(node.name, E, where, key=key))
    return True


def _iteration(tx, inst, handler: Callable) -> None:
    """FOR_ITER of a hit loop: the speculation hooks end the previous iteration, the iterator yields the next index,
    and that iteration opens as a Speculation."""
    stepped = speculation.step_tracked(tx, inst, handler, lambda trace, top: trace.loops.get(id(top)))
    if stepped is None:
        return
    loop, before, ended = stepped
    if ended:
        loop.finished = True
        return
    trace = speculation._trace()
    graph = tx.output.graph
    s = speculation.Speculation(next(speculation._ids), None, loop.where, graph, speculation._last_node(graph),
                                tx.f_code, inst.offset, tx, trace.mark(), loop_key=loop.key)
    s.counts = (loop.counts_of or _counts_of)(loop, before)
    loop.iterations.append(s)
    trace.speculations.append(s)


def _counts_of(loop: _Loop, e: int) -> Callable[[Graph], tuple]:
    """What iteration e counts, proven on the graph the backend got (check_traced's copy): (ids, e, None)."""

    def counts(graph: Graph) -> tuple:
        s = loop.iterations[e]
        if not loop.finished or len(loop.iterations) != loop.E:
            raise speculation._fail(s, "the loop over the experts did not end in this graph")
        nonzero = next((n for n in graph.nodes if n.name == loop.nonzero), None)
        found = hit_vector(nonzero) if nonzero is not None and _is_nonzero(nonzero) else "its nonzero() is gone"
        if isinstance(found, str):
            raise speculation._fail(s, found)
        return found[0], e, None

    return counts


def _column_of(node: Node) -> Optional[Node]:
    """The nonzero ``n`` when ``node`` is its one column as a vector: ``n.squeeze(-1)`` / ``squeeze(1)``,
    ``n.flatten()``, ``n.view(-1)`` / ``reshape(-1)`` or ``n[:, 0]`` of a (n_hit, 1) nonzero; else None."""
    from .passes.fx_utils import is_call

    if node.op != "call_method" and not (node.op == "call_function" and node.target is operator.getitem):
        return None
    base = node.args[0] if node.args else None
    if not isinstance(base, Node) or not _is_nonzero(base):
        return None
    bv = base.meta.get("example_value")
    if not isinstance(bv, torch.Tensor) or bv.dim() != 2 or bv.shape[1] != 1:
        return None
    rest, kw = tuple(node.args[1:]), node.kwargs
    column = ((is_call(node, "call_method", "squeeze") and (rest, kw) in (((-1,), {}), ((1,), {}), ((), {"dim": -1}),
                                                                        ((), {"dim": 1})))
              or (is_call(node, "call_method", "flatten") and not rest and not kw)
              or (node.op == "call_method" and node.target in ("view", "reshape") and rest in ((-1,), ((-1,),))
                  and not kw)
              or (node.op == "call_function" and rest == ((slice(None), 0),)))
    return base if column else None


def _held(node: Node) -> tuple[Optional[int], bool]:
    """(e, is 0-d) where ``node`` is a hit loop's index tensor ``full((1,), e)`` (False) or ``full((), e)`` (True:
    the loop runs over the nonzero's one column), or the (1,) one's element ``t[0]`` / ``t[-1]`` (True: transformers
    v5's ``expert_idx = expert_idx[0]``); (None, False) otherwise."""
    e = node.meta.get(INDEX)
    if e is not None:
        return e, node.args[0] == ()
    if (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node)
            and type(node.args[1]) is int and node.args[1] in (0, -1)):
        e = node.args[0].meta.get(INDEX)
        if e is not None:
            return e, True
    return None, False


def _subscript(tx, inst, handler: Callable) -> None:
    """BINARY_SUBSCR at a hit loop's index: element e of a ModuleList (or list, tuple) at the index tensor or its
    element; a tensor at the 0-d element is ``tensor[e]`` (eager indexes by a 0-d integer tensor as by the int,
    and returns the same view); a graph input (a weight, a bias) at the (1,) index tensor itself is ``w[e:e+1]``, the values of
    eager's copy (transformers v4.55's GPT-OSS: ``gate_up_proj[expert_idx]``; passes/leading_ones.py reads the one-expert
    batch it makes); a tensor at a tuple holding the index beside other tensor indices is read at e
    (``weights[tok, e, None]``, ``_tuple_index``)."""
    from torch._dynamo.variables import ConstantVariable, TensorVariable, TupleVariable

    if _whole_nonzero(tx, inst, tx.stack[-2:-1], tx.stack[-1:]):  # ``for t in hit.nonzero()[:]``: the nonzero
        tx.pop()
        return
    if speculation._trace() is not None and len(tx.stack) >= 2 and isinstance(tx.stack[-1], TensorVariable):
        e, scalar = _held(tx.stack[-1].as_proxy().node)
        container = tx.stack[-2]
        if e is not None and (_indexable_by_int(container) or scalar and isinstance(container, TensorVariable)):
            tx.pop()
            tx.push(ConstantVariable.create(e))
        elif e is not None and isinstance(container, TensorVariable) and container.as_proxy().node.op in (
                "placeholder", "get_attr"):  # a weight's w[t]: eager's copy of w[e:e+1] (other tensors: as traced)
            tx.pop()
            tx.push(ConstantVariable.create(slice(e, e + 1)))
    elif (speculation._trace() is not None and len(tx.stack) >= 2 and type(tx.stack[-1]) is TupleVariable
          and isinstance(tx.stack[-2], TensorVariable)):
        items = _tuple_index(tx.stack[-1].items)
        if items is not None:
            tx.pop()
            tx.push(TupleVariable(items))
    handler(tx, inst)


def _whole_nonzero(tx, inst, container: list, bounds: list) -> bool:
    """Whether ``inst`` takes the whole of a nonzero() of unbacked length (``n[:]``: BINARY_SUBSCR at the slice
    ``bounds[0]``, or Python 3.12's BINARY_SLICE between ``bounds`` None and None) right before GET_ITER. The view
    iterates the same rows as the nonzero, and GET_ITER then decides on the nonzero itself (``_unroll``), where
    Dynamo cannot slice a tensor of unbacked length."""
    from torch._dynamo.variables import TensorVariable

    if speculation._trace() is None or len(container) != 1 or not isinstance(container[0], TensorVariable):
        return False
    following = _resolve(tx, _next(tx, inst))  # through a jump: ``for t in (n[:] if c else n)``
    if following is None or following.opname != "GET_ITER":
        return False
    try:
        values = [b.as_python_constant() for b in bounds]
    except Exception:  # noqa: BLE001  (bounds that are not constants: Dynamo's own subscript)
        return False
    if values not in ([slice(None)], [None, None]):
        return False
    node = container[0].as_proxy().node
    value = node.meta.get("example_value")
    return _is_nonzero(node) and isinstance(value, torch.Tensor) and not isinstance(value.shape[0], int)


def _slice(tx, inst, handler: Callable) -> None:
    """BINARY_SLICE (Python 3.12+): ``n[:]`` of a nonzero before GET_ITER is the nonzero (``_whole_nonzero``)."""
    if len(tx.stack) >= 3 and _whole_nonzero(tx, inst, tx.stack[-3:-2], tx.stack[-2:]):
        tx.pop()
        tx.pop()
        return
    handler(tx, inst)


def _tuple_index(items: list) -> Optional[list]:
    """A tensor's tuple index with a hit loop's 0-d index ``t`` (or ``t[0]`` of a (1,) one, or the (1,) one itself
    beside another tensor index of at least one dim, which it broadcasts to without adding a dim) in it, that
    element as the int e; None where nothing is held or the swap could change the result. A 0-d integer tensor in a
    tuple index is an advanced index, broadcast with the other tensors in it, and an int is a select: the two agree on
    values and on the result's dims where the advanced indices (the tensors and that element) stand side by side
    (``weights[tok, e, None]``), and where every other index is a tensor each advanced dim lands where the first
    advanced index stood either way. Separated by a slice or None, torch moves broadcast dims to the front for
    the tensor and not for the int, so such an index is left as it is."""
    from torch._dynamo.variables import ConstantVariable, TensorVariable

    held, tensors, wide = [], [], False
    for i, item in enumerate(items):
        if isinstance(item, TensorVariable):
            e, scalar = _held(item.as_proxy().node)
            if e is not None:
                held.append((i, e, scalar))
            else:
                tensors.append(i)
                value = item.as_proxy().node.meta.get("example_value")
                wide = wide or isinstance(value, torch.Tensor) and value.dim() >= 1
    if len(held) != 1 or not (held[0][2] or wide):  # a (1,) index broadcasts away only beside a wider one
        return None
    advanced = sorted([held[0][0], *tensors])
    if advanced != list(range(advanced[0], advanced[-1] + 1)):
        return None
    out = list(items)
    out[held[0][0]] = ConstantVariable.create(held[0][1])
    return out


_COMPARISONS = {
    operator.eq: ("eq", "__eq__"), operator.ne: ("ne", "__ne__"), operator.lt: ("lt", "__lt__"),
    operator.le: ("le", "__le__"), operator.gt: ("gt", "__gt__"), operator.ge: ("ge", "__ge__"),
}


def _compared_index(node: Node) -> Optional[bool]:
    """The value of ``index <op> c`` for a hit loop's index (``_held``) and an int c: known while tracing, since
    the index stands for expert e (transformers v5's ``if expert_idx == self.num_experts: continue``); else None."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs:
        return None
    a, c = node.args
    if not isinstance(a, Node) or type(c) is not int:
        return None
    for op, names in _COMPARISONS.items():
        if node.target in (op, getattr(torch, names[0])) or node.target in names:
            e, _ = _held(a)
            return None if e is None else op(e, c)
    return None


def is_index_arithmetic(node: Node) -> bool:
    """A hit loop's index element ``t[0]`` / ``t[-1]``, or its comparison with an int: nodes that compute nothing
    but the value the trace already knows (speculation_check.check_traced's vacuous iterations)."""
    return _held(node)[1] or _compared_index(node) is not None


def _branch(tx, inst, handler: Callable) -> None:
    """A branch on a comparison of a hit loop's index with an int: taken as its traced value."""
    from torch._dynamo.variables import ConstantVariable, TensorVariable

    if speculation._trace() is not None and tx.stack and isinstance(tx.stack[-1], TensorVariable):
        known = _compared_index(tx.stack[-1].as_proxy().node)
        if known is not None:
            tx.pop()
            tx.push(ConstantVariable.create(known))
    handler(tx, inst)


def _indexable_by_int(container) -> bool:
    """A ModuleList (as Dynamo holds one), or a Python list or tuple: ``c[t]`` is ``c[operator.index(t)]``."""
    from torch._dynamo.variables import ListVariable, TupleVariable

    module = getattr(container, "value", None)
    if isinstance(module, torch.nn.ModuleList):  # a subclass may index its own way
        return type(module).__getitem__ is torch.nn.ModuleList.__getitem__
    return type(container) in (ListVariable, TupleVariable)


# --- installation -------------------------------------------------------------------------------------------------

_installed = False


def install() -> None:
    """Hook Dynamo's GET_ITER, FOR_ITER, BINARY_SUBSCR and branch handling (idempotent; after speculation.install); each
    hook does nothing outside a moe_inductor compile. A failure warns: such loops then graph-break as before."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._dynamo import symbolic_convert

        for table in speculation.dispatch_tables(symbolic_convert.InstructionTranslatorBase):
            hook_table(table, dis.opmap)
        _hook_item()
    except Exception as error:  # an optional hook into Dynamo internals must never stop the backend from loading
        warnings.warn(f"moe_inductor: loops over the experts that got tokens are not unrolled on this torch "
                      f"({error!r}); they graph-break as under plain torch.compile")


def _hook_item() -> None:
    """``t.item()`` of a hit loop's index tensor is the int e, as in eager (copies of transformers' loop that read
    ``expert_idx = expert_idx.item()`` and index with the int); every other ``.item()`` is Dynamo's own."""
    from torch._dynamo.variables import ConstantVariable, VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable

    real = getattr(TensorVariable, "method_item", None)
    if real is None:  # a torch without it: such loops graph-break at .item(), as under plain torch.compile
        return

    def method_item(self, *args, **kwargs):
        user_args = [a for a in args if isinstance(a, VariableTracker)]  # torch >= 2.12 also passes the translator
        if speculation._trace() is not None and not user_args and not kwargs:
            e, _ = _held(self.as_proxy().node)
            if e is not None:
                return ConstantVariable.create(e)
        return real(self, *args, **kwargs)

    TensorVariable.method_item = method_item


def hook_table(table: list, opmap: dict) -> None:
    """Wrap the GET_ITER, FOR_ITER, BINARY_SUBSCR, BINARY_SLICE and POP_JUMP_IF_* handlers of one Dynamo dispatch
    table in place."""
    def hooked(handler: Callable, hook: Callable) -> Callable:
        return lambda tx, inst: hook(tx, inst, handler)

    def get_iter(tx, inst, handler):
        if not _unroll(tx, inst):
            handler(tx, inst)

    hooks = {"GET_ITER": get_iter, "FOR_ITER": _iteration, "BINARY_SUBSCR": _subscript, "BINARY_SLICE": _slice}
    hooks.update({name: _branch for name in opmap if speculation.is_bool_branch(name)})
    for opname, hook in hooks.items():
        op = opmap.get(opname)
        if op is not None and 0 <= op < len(table) and table[op] is not None:
            table[op] = hooked(table[op], hook)
