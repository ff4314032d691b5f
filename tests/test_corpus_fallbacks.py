"""Corpus layers that no form rewrites, and why: the reason each one falls back to plain capture or is split by a graph
break is pinned here, beside the outcome that tests/corpus/test_corpus.py declares for it.

- ``hobby_gumbel_straight_through``: the straight-through one-hot ``hard - p.detach() + p`` is exact (1 at the argmax,
  0 elsewhere) for every probability in [0, 1], so on finite rows the ``== 1`` selection is the argmax. A token whose
  probabilities are NaN is selected by no expert, and eager leaves its row zero where a top-1 MoE of its argmax
  writes NaN. This is the look-alike that must never be rewritten as top-1: compiled, it stays eager's zero row. The
  frame falls back on its data-dependent branch, whose no-tokens side runs the expert on a dummy row.
- ``scattermoe_reference``: indexing a weight by a 0-d id tensor is a select at an unbacked symbol that Dynamo
  cannot specialise, inside a per-token loop; the frame falls back.
- ``olmo_core_dropless``, ``torchao_moe_quant``: the layers' own ``@torch._dynamo.disable()`` functions split them.
  Every graph break is a call of one (OLMo-core's ``self.gmm``) or the decorator itself (torchao applies it inside
  the traced forward). The backend never traces what the user disabled.
"""
import copy
import inspect

import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from tests.corpus import hobby_loops, megatron_alltoall, olmo_core_dropless, scattermoe_reference, torchao_moe_quant
from tests.helpers import compile_beside_eager, rel_err

#: the bit patterns of the floats in [0, 1] (the last one is 1.0), by how the dtype's bits are stored
_UNIT_BITS = {torch.float32: (torch.int32, 0x3F800000), torch.bfloat16: (torch.int16, 0x3F80),
              torch.float16: (torch.int16, 0x3C00)}


def _unit_floats(dtype: torch.dtype, stride: int) -> torch.Tensor:
    bits_dtype, one = _UNIT_BITS[dtype]
    bits = torch.cat([torch.arange(0, one + 1, stride), torch.arange(one - 4096, one + 1)])
    return bits.to(bits_dtype).view(dtype)


@pytest.mark.parametrize("dtype, stride", [
    (torch.bfloat16, 1),  # every value
    (torch.float16, 1),
    (torch.float32, 61),  # every 61st pattern: each binade down to the subnormals, plus the run just below 1
], ids=["bf16-all", "fp16-all", "fp32-strided"])
def test_straight_through_one_hot_is_exact(dtype, stride):
    """GumbelMoE's ``hard - probs.detach() + probs`` in the dtype: 1 where hard is 1 and 0 where it is 0, for any p in
    [0, 1] (round to nearest even: 1 - p is exact from 1/2 up, and below it its rounding error is at most half the
    spacing just under 1, which a tie takes back to 1)."""
    p = _unit_floats(dtype, stride)
    assert ((torch.ones_like(p) - p) + p == 1).all()
    assert ((torch.zeros_like(p) - p) + p == 0).all()


def _top1_of_argmax(m: hobby_loops.GumbelMoE, x: torch.Tensor) -> torch.Tensor:
    """What a rewrite reading GumbelMoE as a top-1 MoE of its router's argmax would compute, token by token."""
    flat = x.view(-1, x.shape[-1])
    ids = torch.softmax(m.gate(flat), dim=-1).argmax(dim=-1)
    return torch.stack([m.experts[int(e)](row) for row, e in zip(flat, ids)]).view(x.shape)


@pytest.mark.slow
def test_gumbel_nan_token_stays_zero_as_in_eager():
    torch.manual_seed(0)
    model = hobby_loops.GumbelMoE().eval()
    eager = copy.deepcopy(model)
    clean = torch.randn(1, 6, hobby_loops.H, generator=torch.Generator().manual_seed(1))
    poisoned = clean.clone()
    poisoned[0, 3, 0] = float("nan")  # token 3's probabilities are NaN; row 0 is left finite

    outputs, _, _, seen = compile_beside_eager(model, eager, [clean, poisoned])

    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_fallback"], "the data-dependent branch must send the frame to plain capture"
    branch = "hobby_loops.py:" + str(_line_in(hobby_loops.GumbelMoE.forward, "if token_indices.numel() > 0:"))
    assert any(branch in f.reason and "not assumed away" in f.reason for f in seen.fallbacks), (
        branch, [f.reason for f in seen.fallbacks])
    (got, ref), (got_nan, ref_nan) = outputs
    assert rel_err(got, ref) < 1e-5
    with torch.no_grad():
        top1 = _top1_of_argmax(eager, poisoned)
    assert torch.equal(ref_nan[0, 3], torch.zeros_like(ref_nan[0, 3]))  # eager: no expert took token 3
    assert torch.isnan(top1[0, 3]).all()  # a top-1 reading would not be eager's function here
    assert torch.equal(got_nan[0, 3], ref_nan[0, 3])
    keep = [0, 1, 2, 4, 5]
    assert rel_err(got_nan[0, keep], ref_nan[0, keep]) < 1e-5
    assert rel_err(top1[0, keep], ref_nan[0, keep]) < 1e-5  # on the finite tokens the selection is the argmax


@pytest.mark.slow
def test_scattermoe_reference_falls_back_at_its_weight_index():
    torch.manual_seed(0)
    x = torch.randn(1, 5, scattermoe_reference.H, generator=torch.Generator().manual_seed(1))
    report = moe_inductor.explain(scattermoe_reference.RoutedReference(), x)
    assert not report.rewrites and not report.left_alone, report.summary()
    assert report.fallbacks, report.summary()
    index_line = "scattermoe_reference.py:" + str(_line_of(scattermoe_reference, "m.experts.weight[expert_idxs[i, j]]"))
    assert any("data-dependent expression u0" in b and b.endswith(index_line) for b in report.graph_breaks), (
        report.graph_breaks)


@pytest.mark.slow
@pytest.mark.parametrize("module, build, make_input, called", [
    (olmo_core_dropless, olmo_core_dropless.DroplessMoE, lambda g: torch.randn(1, 5, olmo_core_dropless.D, generator=g),
     "self.gmm("),
    (torchao_moe_quant, torchao_moe_quant.MOEFeedForwardAOQuantizable,
     lambda g: torch.randn(2, 5, torchao_moe_quant.H, generator=g), "@torch._dynamo.disable()"),
], ids=["olmo_core_dropless", "torchao_moe_quant"])
def test_disabled_dispatch_is_every_graph_break(module, build, make_input, called):
    torch.manual_seed(0)
    report = moe_inductor.explain(build(), make_input(torch.Generator().manual_seed(1)))
    assert not report.rewrites and not report.fallbacks and not report.left_alone, report.summary()
    calls = {f"{module.__name__.rsplit('.', 1)[-1]}.py:{n}" for n in _lines_of(module, called)}
    assert report.graph_breaks, report.summary()
    for line in report.graph_breaks:
        assert ("disable()`d function" in line or "marked as skipped" in line) and line.rsplit(" ", 1)[-1].rsplit(
            "/", 1)[-1] in calls, (line, calls)


def _lines_of(module, text: str) -> list[int]:
    with open(module.__file__) as f:
        return [n for n, line in enumerate(f, start=1) if text in line]


def _line_of(module, text: str) -> int:
    (line,) = _lines_of(module, text)
    return line


def test_megatron_fallback_says_which_line_failed_and_that_it_ran_as_plain_compile():
    """Megatron's dropless dispatcher indexes its chunks by ``sorted_idxs.tolist()``: every fallback names that line
    of the user's, its source, what the capture settings did to the number, and that the frame ran as plain
    torch.compile runs it."""
    case = megatron_alltoall.CASES[0]
    assert case.expect == ("fell_back",)
    torch.manual_seed(0)
    report = moe_inductor.explain(case.build(), case.make_input(case.token_counts[0], torch.Generator().manual_seed(1)))
    assert report.fallbacks and not report.rewrites
    line = _line_in(megatron_alltoall.sort_chunks_by_idxs, "output = torch.cat([input[i] for i in sorted_idxs")
    at = f"megatron_alltoall.py:{line} in <listcomp>, `output = torch.cat([input[i] for i in sorted_idxs.tolist()]"
    first = report.fallbacks[0]
    assert at in first.reason, first.reason
    assert "a value that depends on a tensor's data (a number read by `.tolist()` or `.item()`" in first.reason
    assert "capture_scalar_outputs" in first.reason and "cannot be traced" in first.reason
    text = str(report)
    assert ("failed to compile under moe_inductor's capture settings, so it ran as plain torch.compile runs it "
            "(what backend='inductor' does), without rewrites: ") in text, text
    # the plain words come first; Dynamo's own message follows them
    assert first.reason.index(at) < first.reason.index("GuardOnDataDependentSymNode")


def _line_in(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    (line,) = [first + n for n, source in enumerate(lines) if text in source]
    return line
