"""The examples run as they are (light inner compiler where Inductor adds nothing to what they check)."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_generate_matches_eager_token_for_token():
    load("generate").main(max_new_tokens=5, inner="eager")  # raises on a mismatch


@pytest.mark.slow
def test_train_step_tracks_eager():
    losses = load("train_step").main(steps=2, inner="aot_eager")
    for eager, ours in losses:
        assert abs(eager - ours) <= 1e-4 * abs(eager)


@pytest.mark.slow
def test_inspect_hf_shows_the_rewrite():
    report = load("inspect_hf").main("eager")
    assert [r.form for r in report.rewrites] == ["hf_eager_loop"]


def test_gshard_capacity_example_is_rewritten():
    report = load("gshard_capacity").main(tokens=40, inner_compiler="eager")
    assert [r.form for r in report.rewrites] == ["padded_capacity"]


def test_your_own_loop_is_rewritten_and_its_look_alike_explained():
    report, look_alike = load("your_own_loop").main(tokens=24, inner_compiler="aot_eager")  # raises on a mismatch
    assert [r.form for r in report.rewrites] == ["unrolled_loop"]
    assert "routing weight on the input" in report.rewrites[0].note
    assert not look_alike.rewrites
    assert [m.form for m in look_alike.left_alone] == ["unrolled_loop"]


def test_remote_code_moe_example_is_one_graph_and_rewritten():
    """DeepSeek-style ``moe_infer`` (host counts walked with ``.cpu().numpy()``): one graph, the sorted form."""
    report = load("remote_code_moe").main(tokens=12, inner_compiler="eager")
    assert [r.form for r in report.rewrites] == ["sorted_grouped_mm"]
    assert not report.graph_breaks
