"""The corpus: MoE layers written in the styles of public codebases (one module per source, beside this file),
each compiled with moe_inductor and checked against eager (harness.py says what is checked).

Every case declares its outcome today (``Case.expect``): rewritten, or a miss with its reason. The test asserts the
declared outcome exactly, so a matcher that starts to recognise a module (or stops) forces an update here.
"""
import importlib
import pkgutil
from pathlib import Path

import pytest

from tests.corpus.harness import check_rewritten, check_unchanged, matches_declared, run_case

_HERE = Path(__file__).parent
_NOT_CORPUS = {"harness", "test_corpus", "conftest"}
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(_HERE)]) if m.name not in _NOT_CORPUS)
CASES = [c for name in MODULES for c in importlib.import_module(f"tests.corpus.{name}").CASES]


def test_corpus_is_large_enough():
    assert len(MODULES) >= 12, MODULES
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


@pytest.mark.slow  # every case compiles a model: the full suite (.ci/run) runs the corpus
@pytest.mark.parametrize("case", CASES, ids=str)
def test_corpus_module(case):
    outcome = run_case(case)
    assert matches_declared(outcome, case.expect), (
        f"{case.name} ({case.source}): declared {case.expect}, got {outcome.declared()}; "
        f"rewrites {outcome.rewrites}, left alone {outcome.left_alone}, {outcome.graph_breaks} graph break(s)")
    if outcome.kind == "rewritten":
        check_rewritten(case, outcome)
    elif outcome.kind != "crash":
        check_unchanged(case, outcome)
