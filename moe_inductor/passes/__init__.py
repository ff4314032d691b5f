"""FX passes over the Dynamo graph: each recognises one MoE form and rewrites it into moe_inductor ops.

``FX_PASSES`` maps a form name to its pass, ``rewrite(gm) -> list[Rewrite]``: a ``driver.Form`` (anchors and proofs;
the driver does the rest) or, last, the ``driver.Explainer`` that names what no form took. ``driver.run_passes``
runs them. See README.md beside this file for the forms and the invariants every pass keeps.
"""
from __future__ import annotations

from . import (dense_experts, gathered_weights, padded_capacity, sorted_grouped_mm, split_loop, unrecognised,
               unrolled_loop)

FX_PASSES = {
    gathered_weights.FORM: gathered_weights.rewrite,
    dense_experts.FORM: dense_experts.rewrite,
    unrolled_loop.FORM: unrolled_loop.rewrite,
    sorted_grouped_mm.FORM: sorted_grouped_mm.rewrite,
    padded_capacity.FORM: padded_capacity.rewrite,
    split_loop.FORM: split_loop.rewrite,
    # last: notes a router feeding per-expert work that every form above left alone without a word
    unrecognised.FORM: unrecognised.rewrite,
}
