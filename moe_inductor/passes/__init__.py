"""FX passes over the Dynamo graph: each recognises one MoE form and rewrites it into moe_inductor ops.

``FX_PASSES`` maps a form name to ``rewrite(gm) -> list[Rewrite]``. See README.md beside this file for the forms and
the invariants every pass keeps.
"""
from __future__ import annotations

from . import dense_experts, gathered_weights, padded_capacity, sorted_grouped_mm, unrolled_loop

FX_PASSES = {
    gathered_weights.FORM: gathered_weights.rewrite,
    dense_experts.FORM: dense_experts.rewrite,
    unrolled_loop.FORM: unrolled_loop.rewrite,
    sorted_grouped_mm.FORM: sorted_grouped_mm.rewrite,
    padded_capacity.FORM: padded_capacity.rewrite,
}
