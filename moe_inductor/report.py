"""What a moe_inductor compile did: graphs, graph breaks, rewrites. Built by ``explain()``; printable."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from . import config
from .ops.grouped_mm_engine import engine_mode

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
            lines.append(f"  fallback: {f.where} failed to {f.stage} under moe_inductor's capture settings and was "
                         f"compiled as backend='inductor' would, without rewrites ({f.reason})")
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
    where = f"on {device} ({torch.cuda.get_device_name(device)})"
    if forward == backward:
        return f"{where}: {forward}"
    return f"{where}: forward {forward}; backward {backward}"


def _engine_short(mode: str, backward: bool, hopper: bool) -> str:
    if mode == "triton" or not hopper:  # torch._grouped_mm's fast kernel is Hopper's; elsewhere ours always run
        return "our Triton kernels"
    if mode == "grouped_mm":
        return "torch._grouped_mm, our kernels around it"
    if backward:
        return f"torch._grouped_mm in bf16 from {config.grouped_mm_backward_min_rows_per_expert} rows/expert, else ours"
    return "our Triton kernels; torch._grouped_mm for large bf16 experts"


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
    if backward:
        return (f"torch._grouped_mm for bf16 on Hopper at >= {config.grouped_mm_backward_min_rows_per_expert}"
                " rows per expert, else our fused Triton kernels")
    weights = config.grouped_mm_min_expert_weights
    size = f"{weights / 2**20:g}Mi" if weights % 2**20 == 0 else str(weights)
    return (f"our fused Triton kernels; torch._grouped_mm for bf16 on Hopper when experts have H*I >= {size} and "
            f">= {config.grouped_mm_min_rows_per_expert} rows each")


def note_left_alone(form: str, where: str, reason: str) -> None:
    """Called by a pass that met an MoE-looking region it could not prove: kept for explain() and the log."""
    sink = getattr(_local, "left_alone", None)
    if sink is not None:
        sink.append(LeftAlone(form, where, reason))


@contextlib.contextmanager
def collecting_left_alone() -> Iterator[list[LeftAlone]]:
    """The regions the passes run inside this block leave alone, with their reasons."""
    previous = getattr(_local, "left_alone", None)
    _local.left_alone = []
    try:
        yield _local.left_alone
    finally:
        _local.left_alone = previous


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
