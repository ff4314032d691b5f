"""What a moe_inductor compile did: graphs, graph breaks, rewrites. Built by ``explain()``; printable."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

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


@dataclass
class Report:
    graphs: list[GraphRecord] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)
    graph_before: list[str] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    #: anything else the user must know about how the compile went
    notes: list[str] = field(default_factory=list)

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
        lines = [f"moe_inductor: {len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s), "
                 f"{len(self.rewrites)} MoE rewrite(s)"]
        if self.rewrites:
            lines.append(f"  GEMMs: {gemm_engine_summary()}")
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
            if self.graph_before and i < len(self.graph_before):
                lines.append("before:")
                lines.append(self.graph_before[i].strip())
                lines.append("after:")
            lines.append(g.code.strip())
        return "\n".join(lines)


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
