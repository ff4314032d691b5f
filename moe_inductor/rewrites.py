"""The log channel behind ``TORCH_LOGS="moe_inductor.rewrites"``: each MoE region moe_inductor rewrote, with the
rewritten region's code.

torch reads TORCH_LOGS at ``import torch``, before any plugin loads, and accepts a name it does not know only if it
is an importable module; this module is that name. torch enables every submodule of a package it is given, so
``TORCH_LOGS="moe_inductor"`` would enable this channel too: it writes only when TORCH_LOGS names it.
"""
from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("moe_inductor")
_channel = logging.getLogger(__name__)
_last_graph: list = [None]


def rewritten_regions(code: str) -> str:
    """The lines of a graph's code that call moe_inductor's ops (what the rewrites put in), not the whole graph."""
    return "\n".join(line for line in code.splitlines() if "torch.ops.moe_inductor." in line)


@functools.lru_cache(maxsize=None)
def _named_in_torch_logs() -> bool:
    names = (n.strip().lstrip("+-") for n in os.environ.get("TORCH_LOGS", "").split(","))
    return __name__ in names


def log_rewrites(report_line: str, code: str) -> None:
    """Log one rewrite: its line (``moe_inductor``, naming the layer), the rewritten regions of its graph once per
    graph (``+moe_inductor``), and both on the ``moe_inductor.rewrites`` channel when TORCH_LOGS names it."""
    log.info("%s", report_line)
    first_of_graph = _last_graph[0] != code
    _last_graph[0] = code
    channel = _named_in_torch_logs() and _channel.isEnabledFor(logging.INFO)
    if not first_of_graph or not (channel or log.isEnabledFor(logging.DEBUG)):
        if channel:
            _channel.info("%s", report_line)
        return
    region = rewritten_regions(code)
    log.debug("the rewritten regions of this graph:\n%s", region)
    if channel:
        _channel.info("%s\nthe rewritten regions of this graph:\n%s", report_line, region)
