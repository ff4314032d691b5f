"""How each column of ``bench_hf.py`` compiles and runs: the backend it names and the settings it holds while it
compiles and runs (``hf_families.py`` names the columns)."""
from __future__ import annotations

import contextlib

import torch

from hf_families import BW_FUSED, BW_OPAQUE, BW_TRACED, ENGINE, EXPERTS_KEPT, FUSED, RULE_OFF, TAIL_OFF, TMA_AUTO, TMA_OFF


def moe_backend(column: str):
    """The backend a moe_inductor column compiles with: by name, with no MoE form rewritten (``EXPERTS_KEPT``), or,
    for the columns that differ only in a setting read while tracing (``RULE_OFF`` and every column of
    ``_SETTINGS``), a backend object of their own: Dynamo keeps one compiled entry per backend, so in the
    interleaved rounds a column sharing "moe_inductor" would run the other column's compile."""
    import moe_inductor

    if column == EXPERTS_KEPT:
        return moe_inductor.with_options(forms=())
    if column == RULE_OFF or column in _SETTINGS:
        return moe_inductor.with_options()
    return "moe_inductor"


@contextlib.contextmanager
def speed_rule_off(off: bool):
    """``moe_inductor.config.speed_rule = False`` inside the block where ``off`` (the rule is read while tracing, so
    the whole column runs inside it: a recompile reads it again)."""
    if not off:
        yield
        return
    from moe_inductor import config

    before, config.speed_rule = config.speed_rule, False
    try:
        yield
    finally:
        config.speed_rule = before


#: the moe_inductor setting each column changes (read inside our op while Inductor traces it)
_SETTINGS = {TAIL_OFF: ("gemm_tail_split", False), TMA_AUTO: ("gemm_tma_weights", "auto"),
             TMA_OFF: ("gemm_tma_weights", "off"), FUSED: ("gemm_engine", "triton"),
             ENGINE: ("gemm_engine", "grouped_mm"), BW_FUSED: ("gemm_engine_backward", "triton"),
             BW_TRACED: ("visible_engine_backward", True),
             BW_OPAQUE: ("visible_engine_backward", False)}


@contextlib.contextmanager
def column_options(column: str):
    """The settings a column compiles and runs under: the speed rule off for ``RULE_OFF``, ``BW_FUSED``,
    ``BW_TRACED`` and ``BW_OPAQUE``; for ``TAIL_OFF`` the tail split off, for ``TMA_AUTO`` the TMA weight loads under "auto"
    (``TMA_OFF``: "off"), for ``FUSED`` the fused kernels for every GEMM (``config.gemm_engine = "triton"``;
    ``ENGINE``: "grouped_mm"), for ``BW_FUSED`` for the backward's (``config.gemm_engine_backward``), for
    ``BW_TRACED`` the engine's backward traced (``config.visible_engine_backward``; ``BW_OPAQUE``: not), each with the compile caches
    off too: these settings are read inside our op while Inductor traces it, so the graph handed to the caches is the
    same as the "moe_inductor" column's, whose cache entries would answer."""
    with speed_rule_off(column in (RULE_OFF, BW_FUSED, BW_TRACED, BW_OPAQUE)):
        settings = _SETTINGS.get(column)
        if settings is None:
            yield
            return
        from moe_inductor import config

        name, value = settings
        saved = (getattr(config, name), torch._inductor.config.fx_graph_cache,
                 getattr(torch._functorch.config, "enable_autograd_cache", None))
        setattr(config, name, value)
        torch._inductor.config.fx_graph_cache = False
        if saved[2] is not None:
            torch._functorch.config.enable_autograd_cache = False
        try:
            yield
        finally:
            setattr(config, name, saved[0])
            torch._inductor.config.fx_graph_cache = saved[1]
            if saved[2] is not None:
                torch._functorch.config.enable_autograd_cache = saved[2]
