"""The one driver of the FX passes. A form declares anchors and proofs; the driver does every other step.

A form (``Form``) lists, for each spelling it reads, an anchor (which nodes to try) and a proof:
``match(anchor)`` gives a ``Match`` (the region is an MoE: its spec and how its result leaves the region), a reason
(the anchor is the form's mark but a check failed: the region is noted as left alone, at the anchor's line), or None
(no such region here). The driver then, for each match in graph order:

1. checks that no input of the region is changed in place anywhere in the graph (``inputs_unchanged``), and that
   nothing the region derives from them is read after an in-place write the proof did not account for
   (``stale_reads``), nor computed under another grad mode or autocast state than the op's (``grad_modes``), else
   notes the region as left alone;
2. emits the op (``emit.emit_experts``) where the region's result was complete, and points the readers of that
   result at the op;
3. erases the region's in-place writes, the size asserts Dynamo attached to its data-dependent nodes, and what is
   dead (``aliases.eliminate_dead_code``, which keeps the user's own writes);
4. records the rewrite (``report.record_rewrite``: counters, log and explain() follow from it).

Once a form's proofs have run, it recompiles the module, and notes each region still holding the form's marker
(``Unmatched``) that no proof explained. ``run_passes`` runs the forms, each on a copy of the graph that is kept only
if the pass succeeded, and keeps the checks of eager's errors that a rewrite removed (``kept_errors``).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch
from torch.fx import Graph, GraphModule, Node

from .. import report
from ..capture import _count_of
from ..report import LeftAlone, Rewrite
from ..spec import MoESpec
from .emit import emit_experts
from .leading_ones import peel_leading_ones
from .private_writes import respell_private_writes
from .scatter_sums import scatter_sums_as_adds
from .aliases import eliminate_dead_code, mutated_alias
from .fx_utils import (canonicalize_operators, drop_identity_casts, reach, read_receivers_of_inplace_results,
                       redirect_later_readers, source_function, source_line, val)
from .grad_modes import autocast_compute, autocast_note, mode_change
from .kept_errors import index_bounds, keep_removed_checks
from .stale_reads import stale_read, unseen_write

log = logging.getLogger("moe_inductor")

#: a note for a region whose inputs the op would read later than the user's code did
CHANGED_IN_PLACE = "an input of the region is changed in place elsewhere in the graph"

#: side-effecting nodes Dynamo adds for data-dependent sizes; dead-code removal keeps them, and with them the host
#: syncs of a removed ``nonzero``/``.item()``, so they go with their region
_SIZE_CHECKS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
                torch._check, torch._check_is_size)


@dataclass(frozen=True)
class Match:
    """A proven MoE region and how its result leaves it.

    ``end`` is where the op goes (it is inserted before ``end``). Without ``acc``, ``end``'s value is the region's
    result, and its readers read the op instead. With ``acc``, the region writes its result into the buffer ``acc``
    in place and ``end`` is the last of those writes: the readers of ``acc`` after ``end`` read the op instead (or
    ``acc + op`` with ``accumulate``, when the buffer held a value of the user's before the region added to it).
    """

    spec: MoESpec
    end: Node
    #: what explain() adds about the rewrite (what it saves)
    note: str = ""
    #: the node whose source line names the rewrite (default ``end``)
    where: Optional[Node] = None
    acc: Optional[Node] = None
    accumulate: bool = False
    #: the region's in-place writes, erased with it (the writes into ``acc``, or a buffer's writes)
    writes: tuple = ()
    #: nodes whose data-dependent size checks go with the region (a ``nonzero``, a split, an ``.item()``)
    transient: tuple = ()
    #: makes the op's inputs that the user's graph does not hold (stacked ids, a sigmoid of scores), inserted
    #: before ``end``: ``derive(graph, spec) -> spec``
    derive: Optional[Callable[[Graph, MoESpec], MoESpec]] = None
    #: k, where the spec's ids are made by ``derive`` (they have no traced value to read it from)
    top_k: Optional[int] = None
    #: without ``acc``: the region's result is ``onto + op`` (its outputs were added into this value of the user's,
    #: out of place)
    onto: Optional[Node] = None
    #: B, where the region is B independent MoEs (its queues and capacity per group): spec.x, ids and weights are
    #: (B, T, .), the op runs once per group and the (B, T, H) result is their stack
    groups: Optional[int] = None
    #: without ``acc``: the sizes the op's (T, H) result is reshaped to, ``end``'s shape (one size may be -1), where
    #: the region's result splits the tokens over more dims than one
    result_shape: Optional[tuple] = None
    #: a term the region adds beside the experts' combined output, made before ``end`` from the derived spec
    #: (``plus(graph, spec) -> node`` of the op's result dtype): zero-computation experts' tokens added back
    plus: Optional[Callable[[Graph, MoESpec], Node]] = None
    #: E, where ``derive`` hands the op fewer experts than the spec's stacked weights hold (the routed ones of a loop
    #: that also has zero-computation experts)
    experts: Optional[int] = None
    #: the dtype autocast computes the region's matmuls in, where that is not the tokens' and weights' own
    #: (grad_modes.autocast_compute): the op's inputs are cast to it
    compute_dtype: Optional[torch.dtype] = None


Proof = Callable[[Node], Union[Match, str, None]]


def every_node(node: Node) -> bool:
    """The anchor of a proof that starts from any node (one that reads its own mark first)."""
    return True


@dataclass(frozen=True)
class Anchor:
    """One spelling of a form: the nodes its proof starts from, and the proof."""

    at: Callable[[Node], bool]
    match: Proof


@dataclass(frozen=True)
class Unmatched:
    """After a form's proofs: a node for which ``marker`` gives a group (the shared ids or offsets) is MoE-looking
    code of the form; each region still holding one that no proof explained is noted with ``reason``."""

    marker: Callable[[Node], Optional[Node]]
    reason: str


@dataclass(frozen=True)
class Form:
    """A form of MoE code: its name, its anchors with their proofs, and its marker for what no proof explained.

    Calling it on a GraphModule rewrites every provable region in place and returns the rewrites."""

    name: str
    anchors: tuple
    unmatched: Optional[Unmatched] = None

    def __call__(self, gm: GraphModule) -> list[Rewrite]:
        graph, done, noted = gm.graph, [], []
        for anchor in self.anchors:
            for node in [n for n in graph.nodes if anchor.at(n)]:
                if getattr(node, "_erased", False):  # it went with an earlier region
                    continue
                found = anchor.match(node)
                if found is None:
                    continue
                if _hf_experts_code(node) or (not isinstance(found, str) and _hf_experts_code(found.end)):
                    continue  # transformers' own experts code: the hf route decided it (hf.py) and said why
                reason = found if isinstance(found, str) else (
                    None if inputs_unchanged(found.spec) else CHANGED_IN_PLACE)
                if reason is None:  # and what the region derives from them is read as the proof read it
                    reason = stale_read(spec_inputs(found.spec), (found.end, *found.writes), found.writes)
                if reason is None:  # nor changed in place where the dataflow the proof read does not show it
                    reason = unseen_write(spec_inputs(found.spec), (found.end, *found.writes), found.writes,
                                          fresh_left=True)
                if reason is None:  # and computed under the grad mode and autocast state the op runs in
                    reason = mode_change(spec_inputs(found.spec), found.end, found.writes)
                if reason is None:  # and computed in one dtype: autocast's, where it casts the user's matmuls
                    dtype = autocast_compute(spec_inputs(found.spec), found.end, found.writes, found.spec.x,
                                             expert_weights(found.spec))
                    if isinstance(dtype, str):
                        reason = dtype
                    elif dtype is not None:
                        found = dataclasses.replace(found, compute_dtype=dtype, note="; ".join(t for t in (
                            found.note, autocast_note(dtype)) if t))
                keep, said = (False, "") if reason is not None else _speed_verdict(self.name, found)
                if keep:
                    reason = said
                if reason is not None:  # noted at the anchor's line, which is where the user will look
                    report.record_left_alone(self.name, source_line(node), reason)
                    noted.append(node)
                    continue
                if said:
                    found = dataclasses.replace(found, note="; ".join(t for t in (found.note, said) if t))
                done.append(_replace(graph, self.name, found))
        if done:
            graph.lint()
            gm.recompile()
        if self.unmatched is not None:
            note_unmatched(gm, self.name, self.unmatched, already={region_of(n) for n in noted})
        return done


@dataclass(frozen=True)
class Explainer:
    """The last word on a graph (never a rewrite): ``find(gm)`` lists (node, reason) for MoE-looking code that no
    form rewrote; each is noted under ``name``, unless a form already said why it left the graph alone."""

    name: str
    find: Callable[[GraphModule], list]

    def __call__(self, gm: GraphModule) -> list[Rewrite]:
        for node, reason in self.find(gm):
            report.record_left_alone(self.name, source_line(node), reason)
        return []


def spec_inputs(spec: MoESpec) -> list[Node]:
    """The graph nodes the op reads: tokens, routing, expert weights and biases."""
    nodes = [spec.x, spec.ids, spec.weights, spec.b1, spec.b1_up, spec.b2]
    for w in (spec.gate, spec.up, spec.down):
        nodes += list(w) if isinstance(w, tuple) else [w]
    return [n for n in nodes if isinstance(n, Node)]


def expert_weights(spec: MoESpec) -> list[Node]:
    """The graph nodes of the experts' weights (gate, up, down; stacked or one per expert)."""
    nodes = []
    for w in (spec.gate, spec.up, spec.down):
        nodes += list(w) if isinstance(w, tuple) else [w]
    return [n for n in nodes if isinstance(n, Node)]


def inputs_unchanged(spec: MoESpec) -> bool:
    """No input of the region (tokens, routing, expert weights) is changed in place anywhere in the graph, through
    any view. The op reads its inputs where the region's output was, so a change between the user's reads and that
    point would give it other values than the user's code saw."""
    return not any(mutated_alias(n) for n in spec_inputs(spec))


#: the speed rule the backend hands ``run_passes``: ``speed(layer) -> (keep Inductor's path, what to say)``
SpeedRule = Callable[["Layer"], tuple[bool, str]]
_speed_rules: list[SpeedRule] = []


@dataclass(frozen=True)
class Layer:
    """What the speed rule reads of a proven region: shapes, dtypes and the mode, nothing on the device."""

    form: str
    activation: str
    gate_up: str  # "concat", "interleaved" or "separate"
    bias: bool
    shape: tuple  # (H, I, E, k)
    device: torch.device
    train: bool
    per_expert: bool = False  # separate per-expert weights (a ModuleList), which the list op reads where they lie
    tokens: Optional[int] = None  # the static token count (every dimension of x but the last an int), else None
    dtype: Optional[torch.dtype] = None  # the tokens'


def layer_of(form: str, m: Match) -> Layer:
    """The speed rule's view of a match."""
    spec = m.spec
    per_expert = isinstance(spec.gate, tuple)
    down = val(spec.down[0] if per_expert else spec.down).shape
    H = int(val(spec.x).shape[-1])
    I = int(down[-1] if spec.layout == "nk" else down[-2])
    k = m.top_k if m.top_k is not None else int(val(spec.ids).shape[-1])
    weights = [spec.x, spec.b1, spec.b1_up, spec.b2]
    for w in (spec.gate, spec.up, spec.down):
        weights += list(w) if isinstance(w, tuple) else [w]
    train = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in map(val, weights))
    tokens = _count_of(val(spec.x).shape[:-1])  # -1 where symbolic (a SymInt is never compared)
    return Layer(form, spec.activation, spec.gate_up or "separate",
                 any(b is not None for b in (spec.b1, spec.b1_up, spec.b2)), (H, I, m.experts or num_experts(spec), k),
                 val(spec.x).device, train, per_expert, tokens if tokens >= 0 else None,
                 m.compute_dtype or val(spec.x).dtype)


def _speed_verdict(form: str, m: Match) -> tuple[bool, str]:
    return _speed_rules[-1](layer_of(form, m)) if _speed_rules else (False, "")


def num_experts(spec: MoESpec) -> int:
    """E: the number of per-expert weights, or the leading size of the stacked ones."""
    return len(spec.gate) if isinstance(spec.gate, tuple) else int(val(spec.gate).shape[0])


def _describe(form: str, m: Match) -> Rewrite:
    spec = m.spec
    per_expert = isinstance(spec.gate, tuple)
    E = m.experts or num_experts(spec)
    shapes = tuple((E,) + tuple(val(w[0]).shape) if per_expert else tuple(val(w).shape) for w in (spec.gate, spec.down))
    k = m.top_k if m.top_k is not None else int(val(spec.ids).shape[-1])
    return Rewrite(form, source_line(m.where or m.end), E, k, spec.activation, shapes, note=m.note)


def _replace(graph: Graph, form: str, m: Match) -> Rewrite:
    """Put the op in place of the matched region, and erase the region."""
    done = _describe(form, m)
    result = val(m.acc) if m.acc is not None else val(m.end)
    out_dtype = (result if result is not None else val(m.spec.x)).dtype
    spec = m.spec
    if m.derive is not None:
        with graph.inserting_before(m.end):
            spec = m.derive(graph, spec)
    if m.groups is None:
        y = emit_experts(graph, spec, m.end, out_dtype, compute_dtype=m.compute_dtype)
    else:
        ys = []
        for g in range(m.groups):
            with graph.inserting_before(m.end):
                rows = {f: graph.call_function(operator.getitem, (getattr(spec, f), g))
                        for f in ("x", "ids", "weights")}
            ys.append(emit_experts(graph, dataclasses.replace(spec, **rows), m.end, out_dtype, traced_x=spec.x,
                                   compute_dtype=m.compute_dtype))
        with graph.inserting_before(m.end):
            y = graph.call_function(torch.stack, (ys,))
    if m.plus is not None:
        with graph.inserting_before(m.end):
            y = graph.call_function(operator.add, (y, m.plus(graph, spec)))
    if m.acc is None:
        if m.result_shape is not None:
            with graph.inserting_before(m.end):
                y = graph.call_method("reshape", (y, *m.result_shape))
            if val(m.end) is not None:
                y.meta["example_value"] = val(m.end)
        if m.onto is not None:
            with graph.inserting_before(m.end):
                y = graph.call_function(operator.add, (m.onto, y))
        m.end.replace_all_uses_with(y)
    else:
        if m.accumulate:
            with graph.inserting_before(m.end):
                y = graph.call_function(operator.add, (m.acc, y))
        redirect_later_readers(m.acc, m.end, y)
    doomed = reach(m.transient, lambda n: n.users)
    for write in m.writes:
        graph.erase_node(write)
    eliminate_dead_code(graph)
    for node in reversed(list(graph.nodes)):
        if node in doomed and not node.users and node.target in _SIZE_CHECKS:
            graph.erase_node(node)
    eliminate_dead_code(graph)
    return done


#: transformers' own experts code: when it is still in the graph, the HF substitution left that module alone and
#: said why (hf.py), its speed rule included; the FX passes neither rewrite it nor report it a second time
_HF_EXPERTS_SOURCE = "transformers/integrations/moe.py"


def _hf_experts_code(node: Node) -> bool:
    """Whether ``node`` was traced inside transformers' experts forwards (the shared implementations, or a class's
    eager loop behind their wrapper)."""
    return _HF_EXPERTS_SOURCE in (node.meta.get("stack_trace") or "")


def region_of(node: Node, fallback: object = None) -> object:
    """The user-level region a node belongs to, for left-alone notes: its innermost module's path; outside any
    submodule, the function of the user's source; else ``fallback``."""
    modules = node.meta.get("nn_module_stack") or {}
    return next(reversed(modules)) if modules else (source_function(node) or fallback)


def note_unmatched(gm: GraphModule, form: str, unmatched: Unmatched, already: Optional[set] = None) -> None:
    """Each region still holding the form's marker (a grouped GEMM, a weight gathered by routing ids) was MoE-looking
    code no proof took; note it, once per ``region_of`` (with the marker's group as the fallback). Regions in
    ``already`` got a more specific note."""
    seen = set(already or ())
    for node in gm.graph.nodes:
        group = unmatched.marker(node)
        if group is None or _hf_experts_code(node):
            continue
        region = region_of(node, group)
        if region in seen:
            continue
        seen.add(region)
        report.record_left_alone(form, source_line(node), unmatched.reason)


def run_pass(name: str, rewrite: Callable[[GraphModule], list[Rewrite]],
             gm: GraphModule) -> tuple[GraphModule, list[Rewrite], list[LeftAlone]]:
    """Run one pass on a copy of the graph and keep the copy only if the pass succeeded; returns the graph, the
    rewrites and the regions the pass left alone.

    A proof meeting a graph it was not written for must never break the user's compile: it is logged and the graph
    goes on as it was. ``moe_inductor.config.strict_passes`` turns that into an error (for the tests).
    """
    from .. import config

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    candidate = GraphModule(gm, graph)
    try:
        with report.recording() as records:
            canonicalize_operators(candidate.graph)
            drop_identity_casts(candidate.graph)
            respell_private_writes(candidate.graph)
            scatter_sums_as_adds(candidate.graph)
            peel_leading_ones(candidate.graph)
            read_receivers_of_inplace_results(candidate.graph)
            bounds = index_bounds(candidate.graph)
            found = rewrite(candidate)
            if found:  # what the rewrite made dead goes now, so that the checks it held are seen to go
                eliminate_dead_code(candidate.graph)
                keep_removed_checks(candidate.graph, bounds)
                candidate.recompile()
    except Exception as exc:
        if config.strict_passes:
            raise
        log.warning("moe_inductor: the %s pass failed (%s: %s); this graph is left as it was",
                    name, type(exc).__name__, exc)
        return gm, [], []
    return (candidate if found else gm), found, records.left_alone


def run_passes(gm: GraphModule, passes: Mapping[str, Callable], forms: frozenset,
               speed: Optional[SpeedRule] = None) -> tuple[GraphModule, list[Rewrite], list[LeftAlone]]:
    """Run the passes named in ``forms``, in order; an ``Explainer`` runs only if no pass before it noted a region
    left alone in this graph. ``speed`` is the speed rule: a proven region it keeps on Inductor's path is left alone
    with its reason, and what it says of the others goes into their rewrite's note. Returns the graph, the rewrites
    and the left-alone regions."""
    rewrites, left_alone = [], []
    if speed is not None:
        _speed_rules.append(speed)
    try:
        for name, rewrite in passes.items():
            if name not in forms or (isinstance(rewrite, Explainer) and left_alone):
                continue
            gm, found, missed = run_pass(name, rewrite, gm)
            rewrites += found
            left_alone += missed
    finally:
        if speed is not None:
            _speed_rules.pop()
    return gm, rewrites, left_alone
