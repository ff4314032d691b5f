"""transformers' causal-mask skip, decided under moe_inductor compiles as eager decides it.

transformers builds an attention mask for SDPA unless ``masking_utils._ignore_causal_mask_sdpa`` says the mask is
plain causal attention (no padding mask, queries and keys of one length, or one query). Then it passes no mask and
SDPA's ``is_causal``, which lets SDPA take its flash kernel; with a (T, T) mask SDPA cannot. The function refuses
whenever it sees tracing (to keep ``torch.export`` from hard-coding ``is_causal``, which is sound only for the example
shapes), and older transformers count every ``torch.compile`` as tracing, so a compiled prefill gets the mask eager
never builds, and an attention slower than eager's.

Under ``torch.compile`` the conditions it checks are facts the graph is specialised on: ``padding_mask is None`` is
a Python fact, and ``q_length == kv_length`` a shape relation Dynamo guards on. So while moe_inductor traces (not in
plain fallbacks, not for other backends), the function is answered from those facts alone, exactly where they make
eager skip the mask:

    padding_mask is None, q_offset a Python int, no local (sliding / chunked) attention window reached, and
    q_length == 1 or q_length == kv_length, or q_offset == 0

and every other case (a padding mask, whose values eager reads; a static cache's tensor offset; a window) calls the
original, which keeps the mask as it does today.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from . import capture, report

_MASKING = "transformers.masking_utils"
#: the parameters of the function as the transformers 5 releases define it; another signature is left alone
_KNOWN_PARAMS = ({"padding_mask", "q_length", "kv_length", "q_offset", "kv_offset", "local_attention_size"},
                 {"padding_mask", "q_length", "kv_length", "q_offset", "local_attention_size"})
NOTE = ("transformers' causal mask is left to SDPA's is_causal where eager leaves it so (no padding mask, "
        "queries and keys of one length): the compiled attention takes the kernel eager takes")


def eager_skip(args: dict) -> bool:
    """Whether eager transformers skips the mask for these arguments, when that follows from facts a compiled graph
    is specialised on; False where it does not (the caller then asks the original)."""
    if args.get("padding_mask") is not None or isinstance(args.get("q_offset"), torch.Tensor):
        return False
    q, kv, window = args["q_length"], args["kv_length"], args.get("local_attention_size")
    if any(isinstance(v, torch.Tensor) for v in (q, kv, window)):
        return False
    if window is not None and kv >= window:
        return False
    return q == 1 or kv == q or args["q_offset"] == 0


def _make_polyfill(names: list[str], defaults: dict) -> Callable[[Callable], Callable]:
    def make(original_clone: Callable) -> Callable:
        def polyfill(*args: Any, **kwargs: Any) -> bool:
            if not capture.capturing_at_trace_time():
                return original_clone(*args, **kwargs)
            bound = dict(defaults)
            bound.update(zip(names, args))
            bound.update(kwargs)
            if eager_skip(bound):
                report.record_note_once(NOTE)
                return True
            return original_clone(*args, **kwargs)

        return polyfill

    return make


def _substitutions() -> list[tuple[Callable, Callable]]:
    masking = sys.modules.get(_MASKING)
    fn = getattr(masking, "_ignore_causal_mask_sdpa", None) if masking is not None else None
    if fn is None:
        return []
    params = inspect.signature(fn).parameters
    if set(params) not in _KNOWN_PARAMS:
        return []
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return [(fn, _make_polyfill(list(params), defaults))]


def install() -> None:
    """Look for transformers' mask function at the start of each moe_inductor compile (imports nothing)."""
    capture.add_substitution_source(_substitutions)
