"""``moe_inductor.explain`` and the ``moe_inductor`` log."""
from __future__ import annotations

import inspect
import logging
import re
from typing import Any, Callable, Optional

import torch

from .report import Report, collecting
from .rewrites import log_rewrites  # noqa: F401  (kept importable from here)

log = logging.getLogger("moe_inductor")


def _register_logging() -> None:
    """Register the ``moe_inductor`` log with torch's logging.

    From the shell: ``TORCH_LOGS="moe_inductor"`` prints a line per rewrite (naming the layer), ``"+moe_inductor"``
    adds each rewritten region's code, and ``TORCH_LOGS="moe_inductor.rewrites"`` prints only the rewrites, each
    with its region (moe_inductor/rewrites.py).
    """
    try:
        from torch._logging._internal import register_log

        register_log("moe_inductor", "moe_inductor")
    except Exception:  # an API change in torch._logging must never break compiles
        pass


def _source_lines(gm: torch.fx.GraphModule) -> frozenset:
    """The user source lines ("file:line") a Dynamo graph was traced from, every frame of every node's stack."""
    lines = set()
    for node in gm.graph.nodes:
        for match in _FRAME.finditer(node.meta.get("stack_trace") or ""):
            lines.add(f"{match.group(1)}:{match.group(2)}")
    return frozenset(lines)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _break_line(reason: Any) -> str:
    """A graph break as one line: Dynamo's reason and the user's file:line where the graph broke."""
    text = str(getattr(reason, "reason", reason)).strip().splitlines()
    where = ""
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}"
    return f"{text[0] if text else 'graph break'}{where}"


def _unwrap_compiled(model_or_fn: Callable) -> Callable:
    """The user's own module or function under a ``torch.compile`` wrapper: explain compiles that, with its own
    backend, and leaves the wrapper (and its compiled code) as it was."""
    orig = getattr(model_or_fn, "_orig_mod", None)
    if isinstance(orig, torch.nn.Module):
        return orig
    return torch._dynamo.eval_frame.innermost_fn(model_or_fn)


def _compile_and_run(fn: Callable, args, kwargs, options: dict, report: Report) -> None:
    """Compile ``fn`` with moe_inductor through a backend made for this call and run it once, in the caller's grad
    mode (nothing calls backward, so no gradient is written), recording each graph, its source lines and the graph
    break that ended it (as ``torch._dynamo.explain`` counts them)."""
    from . import capture
    from .backend import moe_inductor_backend

    def backend(gm: torch.fx.GraphModule, example_inputs: list, options: Optional[dict] = None,
                mode: Optional[str] = None) -> Callable:
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            report.graph_breaks.append(_break_line(reason))
        sources, count = _source_lines(gm), len(report.graphs)
        compiled = moe_inductor_backend(gm, example_inputs, options=options, mode=mode)
        for record in report.graphs[count:]:
            record.sources = sources
        return compiled

    # A backend of its own gives explain's graphs their own cache entries (Dynamo matches cached code to its
    # backend): the user's compiled model keeps its code, and explain never reuses it. Where torch has it
    # (2.13), isolate_recompiles keeps those entries out of the user's recompile count too; before that, the limit
    # is lifted for explain's own compiles, which are two per frame and call.
    setattr(backend, capture.BACKEND_MARKER, True)
    isolate = {"isolate_recompiles": True} if _HAS_ISOLATE_RECOMPILES else {}
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    lifted = {} if isolate else {limit: max(getattr(torch._dynamo.config, limit), 1 << 16)}
    with collecting(report), torch._dynamo.config.patch(lifted):
        compiled = torch.compile(fn, backend=backend, options=options, **isolate)
        compiled(*args, **kwargs)


_HAS_ISOLATE_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def explain(model_or_fn: Callable, *args: Any, options: Optional[dict] = None, **kwargs: Any) -> Report:
    """Compile ``model_or_fn`` with moe_inductor on these inputs and say what was done.

    Runs it twice under a light inner compiler: once with every rewrite off (the graphs "before") and once as
    configured ("after"). The speed rule judges each layer as the user's compile would (Inductor's inner compiler),
    unless ``options`` names an inner compiler. The inputs run in the caller's grad mode, as the user's compiled
    call would: under ``torch.no_grad()`` each layer is judged for inference; with grad enabled and weights that
    require grad, for a training step (the forward's graph then records for autograd; no gradient is written).
    Dynamo's caches are not reset: a model the user already compiled stays compiled (warm), and explain's graphs
    get cache entries of their own. A ``torch.compile`` wrapper is looked through: explain compiles the module or
    function inside it.

    Returns:
        a Report: graphs, graph breaks with reasons, each rewrite (form, module, E, k, activation, weight shapes),
        each MoE-looking region left as it was with the reason (``report.left_alone``), and the graph code before
        and after; ``print(report)`` reads well in a terminal.
    """
    from . import capture, speed_rule

    options = dict(options or {})
    # The speed rule judges as the user's compile would, Inductor's, unless an inner compiler is named: explain's
    # own light one has no Inductor path to compare with, and would make the rule say nothing.
    judged = None if "inner" in options else "inductor"
    options.setdefault("inner", "eager")
    fn = _unwrap_compiled(model_or_fn)
    before = Report()
    try:
        # Its fallbacks are this pass's own (with every rewrite off, a loop that the rewrites would prove is
        # data-dependent branching): kept in ``before``, not logged as if the user's compile had fallen back
        with capture.quiet_fallbacks():
            _compile_and_run(fn, args, kwargs, dict(options, forms=()), before)
        failed = None
    except Exception as error:  # noqa: BLE001  (said in the report; the configured pass below is what counts)
        # The graphs before are an aid, from a compile the user never runs: where it fails (torch 2.11's Dynamo
        # can build a broken graph under the capture settings with every rewrite off) the report says so, and
        # the configured pass, the user's own compile, still decides whether explain raises.
        failed = f"the graphs before (rewrites off) could not be shown: that compile failed ({type(error).__name__}: " \
                 f"{str(error)[:200]})"
    report = Report(device=_device_of(fn, args, kwargs))
    with speed_rule.judging_as(judged):
        _compile_and_run(fn, args, kwargs, options, report)
    report.before = before.graphs
    if failed is not None:
        report.notes.append(failed)
    return report


def _device_of(fn: Callable, args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device the model runs on: its first parameter's, else the first tensor input's."""
    if isinstance(fn, torch.nn.Module):
        for p in fn.parameters():
            return p.device
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None
