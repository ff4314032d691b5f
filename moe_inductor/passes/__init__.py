"""FX passes over the Dynamo graph: each recognises one MoE form and rewrites it into moe_inductor ops.

``FX_PASSES`` maps a form name to ``rewrite(gm) -> list[Rewrite]``. See README.md beside this file for the forms and
the invariants every pass keeps.
"""
from __future__ import annotations

from . import (dense_experts, gathered_weights, padded_capacity, sorted_grouped_mm, split_loop, unrecognised,
               unrolled_loop)

FX_PASSES = {
    gathered_weights.FORM: unrecognised.track(gathered_weights.rewrite),
    dense_experts.FORM: unrecognised.track(dense_experts.rewrite),
    unrolled_loop.FORM: unrecognised.track(unrolled_loop.rewrite),
    sorted_grouped_mm.FORM: unrecognised.track(sorted_grouped_mm.rewrite),
    padded_capacity.FORM: unrecognised.track(padded_capacity.rewrite),
    split_loop.FORM: unrecognised.track(split_loop.rewrite),
    # last: notes a router feeding per-expert work that every form above left alone without a word
    unrecognised.FORM: unrecognised.rewrite,
}
