"""``moe_inductor.explain``, the ``moe_rewrites`` TORCH_LOGS artifact, and the CLI behind ``python -m moe_inductor``."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from .report import Report, collecting

log = logging.getLogger("moe_inductor")


def _register_logging() -> None:
    """Register the ``moe_inductor`` log and the ``moe_rewrites`` artifact with torch's logging.

    ``TORCH_LOGS="moe_inductor"`` prints a line per rewrite and ``"+moe_inductor"`` also the rewritten graph; both
    work from the shell because TORCH_LOGS takes module names. The artifact name is only known once this package is
    imported, so it is for ``torch._logging`` users in-process, not for TORCH_LOGS at ``import torch``.
    """
    try:
        from torch._logging._internal import register_artifact, register_log

        register_log("moe_inductor", "moe_inductor")
        register_artifact("moe_rewrites", "Each MoE region moe_inductor rewrote, with its graph", off_by_default=True)
    except Exception:  # an API change in torch._logging must never break compiles
        pass


def log_rewrites(report_line: str, code: str) -> None:
    log.info("%s", report_line)
    log.debug("rewritten graph:\n%s", code)
    try:
        torch._logging.getArtifactLogger("moe_inductor", "moe_rewrites").debug("%s\n%s", report_line, code)
    except Exception:
        pass


def _compile_and_run(fn: Callable, args, kwargs, options: dict, report: Report) -> None:
    from torch._dynamo.utils import counters

    from .backend import moe_inductor_backend

    torch._dynamo.reset()
    breaks_before = dict(counters["graph_break"])
    with collecting(report):
        compiled = torch.compile(fn, backend=moe_inductor_backend, options=options)
        with torch.no_grad():
            compiled(*args, **kwargs)
    for reason, count in counters["graph_break"].items():
        report.graph_breaks += [reason] * (count - breaks_before.get(reason, 0))


def explain(model_or_fn: Callable, *args: Any, options: Optional[dict] = None, **kwargs: Any) -> Report:
    """Compile ``model_or_fn`` with moe_inductor on these inputs and say what was done.

    Runs it twice under a light inner compiler: once with every rewrite off (the graphs "before") and once as
    configured ("after"). Resets Dynamo's caches, like ``torch._dynamo.explain``.

    Returns:
        a Report: graphs, graph breaks with reasons, each rewrite (form, module, E, k, activation, weight shapes) and
        the graph code before and after; ``print(report)`` reads well in a terminal.
    """
    options = dict(options or {})
    options.setdefault("inner", "eager")
    before = Report()
    _compile_and_run(model_or_fn, args, kwargs, dict(options, forms=()), before)
    report = Report()
    _compile_and_run(model_or_fn, args, kwargs, options, report)
    report.graph_before = [g.code for g in before.graphs]
    torch._dynamo.reset()
    return report
