"""What a moe_inductor compile did: graphs, graph breaks, rewrites, regions left alone, fallbacks.

Both routes record through one API here: the trace-time substitutions (hf.py) and the FX passes call
``record_rewrite`` / ``record_left_alone`` into the innermost ``recording()`` block, the backend files each graph
with its records (``file_graph``: counters, log lines, the report), and the per-frame fallback calls
``record_fallback``. A report (``Report``, built by ``explain()``, printable) collects while ``collecting`` is open.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch._dynamo.utils import counters

from . import config
from .ops.grouped_mm_engine import engine_mode
from .rewrites import log_rewrites

_local = threading.local()


@dataclass
class Rewrite:
    """One MoE region replaced by moe_inductor ops (what explain() and the counters report)."""

    form: str
    where: str
    num_experts: int
    top_k: int
    activation: str
    weight_shapes: tuple
    note: str = ""


@dataclass
class LeftAlone:
    """A region that looked like an MoE to a pass, which could not prove it one and left it as it was."""

    form: str
    where: str
    reason: str


@dataclass
class Fallback:
    """A frame compiled as plain capture would (no capture settings, no rewrites), because it failed under ours."""

    where: str
    stage: str  # "compile" (tracing or compiling failed) or "first call" (the compiled code failed when run)
    reason: str


@dataclass
class GraphRecord:
    code: str
    rewrites: list[Rewrite]
    moe_ops: int
    #: of those, how many Inductor launches from its own wrapper (``config.visible_kernels``; lowerings/visible.py)
    visible_ops: int = 0
    left_alone: list[LeftAlone] = field(default_factory=list)
    #: the user source lines ("file:line") the graph was traced from; explain() pairs graphs before/after by them
    sources: frozenset = frozenset()


@dataclass
class Report:
    graphs: list[GraphRecord] = field(default_factory=list)
    #: one line per graph break, as ``torch._dynamo.explain`` counts them: Dynamo's reason, then the user's file:line
    graph_breaks: list[str] = field(default_factory=list)
    #: the graphs of the same code compiled with every rewrite off
    before: list[GraphRecord] = field(default_factory=list)
    #: the device the model ran on (the GEMM line says what runs there)
    device: Optional[torch.device] = None
    fallbacks: list[Fallback] = field(default_factory=list)
    #: anything else the user must know about how the compile went
    notes: list[str] = field(default_factory=list)

    @property
    def graph_break_count(self) -> int:
        """Graph breaks as ``torch._dynamo.explain`` counts them: one fewer than the graphs (the reasons Dynamo gives
        are in ``graph_breaks``; a frame Dynamo skips splits the graphs without one)."""
        return max(len(self.graphs) - 1, len(self.graph_breaks))

    @property
    def graph_before(self) -> list[str]:
        """The code of the graphs with every rewrite off."""
        return [g.code for g in self.before]

    def before_of(self, graph: GraphRecord) -> list[GraphRecord]:
        """The graphs with rewrites off that cover the same source as ``graph`` (the same region of the model; a
        graph break present only without the rewrite splits it in several)."""
        return [b for b in self.before if b.sources & graph.sources]

    @property
    def rewrites(self) -> list[Rewrite]:
        return [r for g in self.graphs for r in g.rewrites]

    @property
    def left_alone(self) -> list[LeftAlone]:
        return [m for g in self.graphs for m in g.left_alone]

    def summary(self) -> str:
        """The counts, graph breaks, rewrites and regions left alone, without the graph code."""
        return str(self).split("\n--- graph")[0]

    def __str__(self) -> str:
        lines = [f"moe_inductor: {len(self.graphs)} graph(s), {self.graph_break_count} graph break(s), "
                 f"{len(self.rewrites)} MoE rewrite(s)"]
        if self.rewrites:
            lines.append(f"  GEMMs: {gemm_engine_line(self.device)}")
        for reason in self.graph_breaks:
            lines.append(f"  graph break: {reason.splitlines()[0]}")
        for i, r in enumerate(self.rewrites):
            shapes = " ".join("x".join(map(str, s)) for s in r.weight_shapes)
            lines.append(f"  [{i}] {r.form:<14} {r.where}  E={r.num_experts} k={r.top_k} act={r.activation} "
                         f"weights {shapes}" + (f"  ({r.note})" if r.note else ""))
        for m in self.left_alone:
            lines.append(f"  left alone: {m.form:<14} {m.where}  ({m.reason})")
        for f in self.fallbacks:
            lines.append(f"  fallback: {f.where} failed to {f.stage} under moe_inductor's capture settings, so it ran "
                         f"as plain torch.compile runs it (what backend='inductor' does), without rewrites: {f.reason}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        for i, g in enumerate(self.graphs):
            visible = f", {g.visible_ops} launched from Inductor's wrapper" if g.visible_ops else ""
            lines.append(f"--- graph {i}: {g.moe_ops} moe_inductor op call(s){visible} ---")
            before = self.before_of(g)
            if before:
                which = ", ".join(str(self.before.index(b)) for b in before)
                lines.append(f"before (rewrites off; the graph(s) of the same source: {which}):")
                lines += [b.code.strip() for b in before]
                lines.append("after:")
            lines.append(g.code.strip())
        return "\n".join(lines)


def gemm_engine_line(device: Optional[torch.device]) -> str:
    """What runs the rewritten layers' GEMMs on ``device``, in a few words (``gemm_engine_summary`` has the rules)."""
    if device is None or device.type != "cuda":
        name = device.type if device is not None else "cpu"
        if name == "cpu" and config.triton_on_cpu:
            return "on cpu: our Triton kernels, in Triton's interpreter (config.triton_on_cpu)"
        return f"on {name}: plain torch (the Triton kernels run on CUDA GPUs)"
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    forward, backward = (_engine_short(engine_mode(backward=b), b, hopper) for b in (False, True))
    if engine_mode(backward=False) != "grouped_mm":
        forward += _tma_short(torch.cuda.get_device_capability(device)[0] >= 9)
    where = f"on {device} ({torch.cuda.get_device_name(device)})"
    if forward == backward:
        return f"{where}: {forward}"
    return f"{where}: forward {forward}; backward {backward}"


def _tma_short(tma_capable: bool) -> str:
    """How our forward GEMM reads its weights, as ``config.gemm_tma_weights`` says, for the explain line."""
    mode = config.gemm_tma_weights
    if not tma_capable or mode == "off":
        return ""
    if mode == "tuned":
        from .kernels import configs

        tiles = configs.TABLE.tma_tiles()
        if not tiles:
            return " (pointer loads: this GPU's tuned table has no TMA tile)"
        return f" (TMA weight loads on the {tiles} GEMM shapes this GPU's tuned table gives a tile, pointers elsewhere)"
    return f" (TMA weight loads where the call allows: gemm_tma_weights={mode!r})"


def _engine_short(mode: str, backward: bool, hopper: bool) -> str:
    if mode == "triton" or not hopper:  # torch._grouped_mm's fast kernel is Hopper's; elsewhere ours always run
        return "our Triton kernels"
    if mode == "grouped_mm":
        return "torch._grouped_mm, our kernels around it"
    if backward:
        return f"torch._grouped_mm in bf16 from {config.grouped_mm_backward_min_rows_per_expert} rows/expert, else ours"
    return "our Triton kernels; torch._grouped_mm for large bf16 experts and biased ones with many rows"


def gemm_engine_summary() -> str:
    """Who runs the rewritten layers' GEMMs, forward and backward, as ``config.gemm_engine`` and
    ``config.gemm_engine_backward`` say (decided per call, from shapes)."""
    forward = _engine_rule(engine_mode(backward=False), backward=False)
    backward = _engine_rule(engine_mode(backward=True), backward=True)
    modes = f"gemm_engine={config.gemm_engine!r}"
    if config.gemm_engine_backward is not None:
        modes += f", gemm_engine_backward={config.gemm_engine_backward!r}"
    return f"forward: {forward}; backward: {backward} ({modes})"


def _engine_rule(mode: str, backward: bool) -> str:
    if mode == "triton":
        return "our fused Triton kernels"
    if mode == "grouped_mm":
        return "torch._grouped_mm wherever the layout allows, our kernels around it"
    biased = _size(config.grouped_mm_biased_min_expert_weights)
    if backward:
        return (f"torch._grouped_mm for bf16 on Hopper at >= {config.grouped_mm_backward_min_rows_per_expert}"
                f" rows per expert (layers with biases: H*I >= {biased} and >="
                f" {config.grouped_mm_biased_backward_min_rows_per_expert}), else our fused Triton kernels")
    return (f"our fused Triton kernels; torch._grouped_mm for bf16 on Hopper when experts have H*I >="
            f" {_size(config.grouped_mm_min_expert_weights)} and >= {config.grouped_mm_min_rows_per_expert} rows each,"
            f" or biases, H*I >= {biased} and >= {config.grouped_mm_biased_min_rows_per_expert} rows each")


def _size(weights: int) -> str:
    return f"{weights / 2**20:g}Mi" if weights % 2**20 == 0 else str(weights)


# --- the record API: what a compile did, from both routes (trace-time substitutions and FX passes) -------------

log = logging.getLogger("moe_inductor")


@dataclass
class Records:
    """What was recorded for the graph being compiled, until the backend files it with the graph."""

    rewrites: list[Rewrite] = field(default_factory=list)
    left_alone: list[LeftAlone] = field(default_factory=list)


def _recording_stack() -> list[Records]:
    if not hasattr(_local, "records"):
        _local.records = []
    return _local.records


@contextlib.contextmanager
def recording() -> Iterator[Records]:
    """Collect what is recorded inside the block in fresh Records of its own, which an enclosing block does not
    see: a moe_inductor frame compile (capture.py) opens one for its trace-time records, and each FX pass one for
    its own, dropped when the pass fails. Outside every block, records are dropped: only our compiles record."""
    stack = _recording_stack()
    records = Records()
    stack.append(records)
    try:
        yield records
    finally:
        stack.remove(records)


@torch._dynamo.assume_constant_result
def record_rewrite(form: str, where: str, num_experts: int, top_k: int, activation: str, weight_shapes: tuple,
                   note: str = "") -> bool:
    """Record one MoE region rewritten into moe_inductor ops. Callable at trace time (constant arguments; it runs
    once, while Dynamo traces) and from an FX pass."""
    stack = _recording_stack()
    if stack:
        stack[-1].rewrites.append(Rewrite(form, where, num_experts, top_k, activation, weight_shapes, note))
    return True


@torch._dynamo.assume_constant_result
def record_left_alone(form: str, where: str, reason: str) -> bool:
    """Record a region that looked like an MoE and was left as it was, with the reason (callable like
    ``record_rewrite``)."""
    stack = _recording_stack()
    if stack:
        stack[-1].left_alone.append(LeftAlone(form, where, reason))
    return True


def take_records() -> Records:
    """What the innermost recording block holds now (for the graph being compiled); clears it."""
    stack = _recording_stack()
    if not stack:
        return Records()
    out = Records(stack[-1].rewrites, stack[-1].left_alone)
    stack[-1].rewrites, stack[-1].left_alone = [], []
    return out


def file_graph(code: str, moe_ops: int, rewrites: list[Rewrite], left_alone: list[LeftAlone]) -> GraphRecord:
    """File one compiled graph with what was done to it: counted (``counters["moe_inductor"][form]``,
    ``counters["moe_inductor_left_alone"][form]``), logged (``moe_inductor``), and kept for explain()."""
    for r in rewrites:
        counters["moe_inductor"][r.form] += 1
        log_rewrites(f"moe_inductor rewrote {r.where} ({r.form}, E={r.num_experts}, k={r.top_k}, {r.activation})",
                     code)
    for m in left_alone:
        counters["moe_inductor_left_alone"][m.form] += 1
        log.info("moe_inductor left alone %s (%s): %s", m.where, m.form, m.reason)
    record = GraphRecord(code=code, rewrites=rewrites, moe_ops=moe_ops, left_alone=left_alone)
    report = current_report()
    if report is not None:
        report.graphs.append(record)
    return record


def record_fallback(where: str, stage: str, reason: str, log_it: bool = True) -> None:
    """Record a frame compiled as plain capture would: counted (``counters["moe_inductor_fallback"][stage]``),
    logged when ``log_it`` (once per frame: the caller knows the frame), kept for explain()."""
    counters["moe_inductor_fallback"][stage] += 1
    if log_it:
        log.warning("moe_inductor: %s failed to %s under its capture settings, so it runs as plain torch.compile "
                    "runs it (what backend='inductor' does), without rewrites: %s", where, stage, reason)
    report = current_report()
    if report is not None:
        report.fallbacks.append(Fallback(where, stage, reason))


def record_note(text: str) -> None:
    """Something else the user must know about how the compile went (explain() lists it)."""
    report = current_report()
    if report is not None:
        report.notes.append(text)


@torch._dynamo.assume_constant_result
def record_note_once(text: str) -> bool:
    """``record_note`` unless the report has the note already; callable at trace time (a constant argument, run once
    while Dynamo traces), as the trace-time substitutions do."""
    report = current_report()
    if report is not None and text not in report.notes:
        report.notes.append(text)
    return True


@dataclass(frozen=True)
class Checkpoint:
    """The filed records at one moment, for ``roll_back``."""

    graphs: int
    counts: dict


_FILED_COUNTERS = ("moe_inductor", "moe_inductor_left_alone")


def checkpoint() -> Checkpoint:
    report = current_report()
    return Checkpoint(len(report.graphs) if report is not None else 0,
                      {name: dict(counters[name]) for name in _FILED_COUNTERS})


def roll_back(point: Checkpoint) -> None:
    """Undo what was filed since ``point`` (graphs and their counts): a frame whose attempt failed is compiled
    again, and only that compile happened."""
    report = current_report()
    if report is not None:
        del report.graphs[point.graphs:]
    for name, values in point.counts.items():
        counters[name].clear()
        counters[name].update(values)


def current_report() -> Optional[Report]:
    return getattr(_local, "report", None)


@contextlib.contextmanager
def collecting(report: Report) -> Iterator[Report]:
    previous = current_report()
    _local.report = report
    try:
        yield report
    finally:
        _local.report = previous
