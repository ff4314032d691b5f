"""``moe_inductor.explain``, the ``moe_inductor`` and ``moe_rewrites`` logs, and the CLI behind ``python -m moe_inductor``."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from .report import Report, collecting

log = logging.getLogger("moe_inductor")


def _register_logging() -> None:
    """Register the ``moe_inductor`` log with torch's logging.

    From the shell: ``TORCH_LOGS="moe_inductor"`` prints a line per rewrite, ``"+moe_inductor"`` adds the rewritten
    graph, and ``TORCH_LOGS="moe_rewrites"`` prints each rewrite with its graph. TORCH_LOGS is read at
    ``import torch``, before this package loads, and takes importable module names: both names are modules of this
    distribution (``moe_rewrites.py`` exists for that alone).
    """
    try:
        from torch._logging._internal import register_log

        register_log("moe_inductor", "moe_inductor")
    except Exception:  # an API change in torch._logging must never break compiles
        pass


_rewrites_log = logging.getLogger("moe_rewrites")


def log_rewrites(report_line: str, code: str) -> None:
    log.info("%s", report_line)
    log.debug("rewritten graph:\n%s", code)
    _rewrites_log.info("%s\n%s", report_line, code)


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
        a Report: graphs, graph breaks with reasons, each rewrite (form, module, E, k, activation, weight shapes),
        each MoE-looking region left as it was with the reason (``report.left_alone``), and the graph code before
        and after; ``print(report)`` reads well in a terminal.
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
