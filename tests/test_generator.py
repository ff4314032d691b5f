"""The randomised generator of genuine MoE variants and look-alikes (tests/generator/): every genuine variant is
rewritten as its form and equal to eager (forward and gradients); every look-alike is left alone and equal to eager.

CI runs a few dozen recipes; ``MOE_GENERATOR_EXAMPLES=300`` runs more. ``python -m tests.generator --examples 300``
runs recipes without stopping at the first failure and prints the rewrite rate per form and per idiom.
``--hypothesis-show-statistics`` shows the verdicts per form from this test too (``hypothesis.event``).
"""
import os
from typing import Optional

import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from tests.generator.check import run
from tests.generator.recipe import Recipe, draw_recipe, hypothesis_draw

EXAMPLES = int(os.environ.get("MOE_GENERATOR_EXAMPLES", 0))


def known_miss(r: Recipe) -> Optional[str]:
    """Why a genuine variant is not rewritten yet, for the variants whose proof needs more than a local change (the
    generator's report lists each with a repro). Such a variant must still be left alone and equal to eager; once
    it is rewritten, this test fails until the entry goes (a strict expectation). The measured rate counts them as
    missed."""
    return None


def _check(r: Recipe) -> None:
    o = run(r)
    event(f"{r.form} {'genuine' if r.genuine else 'look-alike'}: {o.verdict}")
    assert o.crash is None, o.describe()
    assert o.equal, o.describe()
    if r.genuine and not known_miss(r):
        assert o.verdict == "rewritten", o.describe()
    else:
        assert not o.rewritten, o.describe()


_SETTINGS = dict(deadline=None, derandomize=not EXAMPLES, suppress_health_check=list(HealthCheck),
                 print_blob=True)


@settings(max_examples=EXAMPLES or 20, **_SETTINGS)
@given(data=st.data())
def test_genuine_variants_are_rewritten_and_equal_to_eager(data):
    r = draw_recipe(hypothesis_draw(data), lookalike=False)
    assume(r.form != "sorted" or hasattr(torch, "_grouped_mm"))
    _check(r)


@settings(max_examples=EXAMPLES or 10, **_SETTINGS)
@given(data=st.data())
def test_lookalikes_are_left_alone_and_equal_to_eager(data):
    r = draw_recipe(hypothesis_draw(data), lookalike=True)
    assume(r.form != "sorted" or hasattr(torch, "_grouped_mm"))
    _check(r)
