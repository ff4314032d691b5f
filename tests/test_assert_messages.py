"""Device-side asserts take messages shorter than 255 bytes: CUDA's ``_assert_async`` raises on a longer one when the
compiled code first runs (which the per-frame fallback then answers by dropping the rewrite). CPU accepts any
length, so the bound is checked here on the messages themselves."""
from __future__ import annotations

import re

import pytest

import torch
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor.ops.routing import DEVICE_MESSAGE_BYTES, device_assert_message
from tests.test_pass_unrolled_loop import LoopMoE


def test_a_long_message_is_cut_to_the_device_bound_keeping_its_start():
    text = "moe_inductor: index values must lie in [0, 8) " + "é" * 300  # two bytes each: the cut is on a character
    cut = device_assert_message(text)
    assert len(cut.encode()) <= DEVICE_MESSAGE_BYTES < len(text.encode())
    assert cut.startswith("moe_inductor: index values must lie in [0, 8)") and cut.endswith("...")
    assert device_assert_message("short") == "short"


def test_the_checks_a_rewrite_keeps_fit_the_device_bound():
    """HF v4's one-hot mask is made dead by the rewrite, so its bound is kept as a device-side assert."""
    torch.manual_seed(0)
    model = LoopMoE("hf_v4_mask", 4, 2)
    x = torch.randn(9, 16)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        code = moe_inductor.explain(model, x).graphs[-1].code
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    messages = [m for _, m in re.findall(r"_assert_async\(\w+, (['\"])(.*?)\1\)", code)]
    assert messages, code
    for message in messages:
        assert len(message.encode()) <= DEVICE_MESSAGE_BYTES, message
        assert "must lie in [0, 4)" in message


def test_compiled_fused_experts_with_a_long_layer_name_asserts_a_short_message(monkeypatch):
    from tests.helpers import make_problem

    seen = []
    real = torch._assert_async

    def spy(cond, message=None):
        seen.append(message)
        return real(cond, message) if message is not None else real(cond)

    monkeypatch.setattr(torch, "_assert_async", spy)
    p = make_problem(6, 16, 8, 5, 2, requires_grad=False)
    name = "model." + ".".join(f"block_{i}" for i in range(60)) + ".experts"
    moe_inductor.ops.routing.assert_ids_in_range(p.topk_ids, 5, name)
    assert seen and all(len(m.encode()) <= DEVICE_MESSAGE_BYTES for m in seen), seen


def test_a_message_is_safe_inside_generated_string_literals():
    """Inductor's C++ kernels put the message in ``"..."`` as it is: a source line with a double quote or a
    backslash (an einsum's subscripts) failed the compile, and the fallback then dropped the rewrite."""
    text = 'at layer.py:9: up = torch.einsum("th,tkih->tki", x, w[ids])  # a \\ b\n\tc'
    safe = device_assert_message(text)
    assert '"' not in safe and "\\" not in safe and "\n" not in safe and "\t" not in safe
    assert "einsum('th,tkih->tki', x, w[ids])" in safe

    def check(ids):
        torch._assert_async((ids < 4).all(), safe)
        return ids + 1

    torch._dynamo.reset()
    compiled = torch.compile(check, backend="inductor")
    assert torch.equal(compiled(torch.tensor([0, 3])), torch.tensor([1, 4]))
    with pytest.raises(RuntimeError, match="einsum"):
        compiled(torch.tensor([0, 5]))


def test_gathered_weights_spelled_by_einsum_are_rewritten_under_inductor_on_the_cpu():
    """bench_fx_forms.py's gathered layer (its einsum lines carry quotes) in bf16 under Inductor: the rewrite runs,
    with no fallback to plain capture."""
    from tests.test_fx_forms_gpu import run_form

    rewrites, fallbacks, err = run_form("gathered", (32, 48, 8, 2), 5, False, device="cpu")
    assert not fallbacks, fallbacks
    assert rewrites == 1 and err < 2e-2
