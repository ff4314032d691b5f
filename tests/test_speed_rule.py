"""The speed rule: a rewrite is taken only where it was measured faster than Inductor on the same layer kind."""
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from moe_inductor import speed_rule
from moe_inductor.speed_rule import LayerKind, keeps_inductor

GPT_OSS = LayerKind("gptoss_glu", "interleaved", True, (2880, 2880, 32, 4))
QWEN3 = LayerKind("silu_glu", "concat", False, (2048, 768, 128, 8))
CUDA = torch.device("cuda")


def _on(gpu):
    return mock.patch.object(speed_rule, "_gpu_tag", return_value=gpu)


def test_a_layer_kind_measured_slower_keeps_inductors_path():
    with _on("NVIDIA_H200"):
        reason = keeps_inductor(GPT_OSS, CUDA, "prefill", "inductor")
        assert reason and "0.93x" in reason and "NVIDIA_H200" in reason
        assert "0.83x" in keeps_inductor(GPT_OSS, CUDA, "decode", "inductor")  # not measured: the worst mode decides
        assert keeps_inductor(QWEN3, CUDA, "prefill", "inductor") is None  # measured faster: rewritten
        assert keeps_inductor(QWEN3, CUDA, "train", "inductor") is None  # a tie is not a loss


def test_the_nearest_measured_shape_of_a_kind_decides():
    mixtral_like = LayerKind("silu_glu", "concat", False, (4096, 14336, 8, 2))
    with _on("NVIDIA_H200"):
        assert keeps_inductor(mixtral_like, CUDA, "prefill", "inductor") is None  # Mixtral's 1.00x
    with _on("NVIDIA_A100-SXM4-80GB"):  # no measurements: a margin is asked
        assert "Mixtral" in keeps_inductor(mixtral_like, CUDA, "prefill", "inductor")
        assert keeps_inductor(QWEN3, CUDA, "prefill", "inductor") is None  # Qwen3 won by 1.11x


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
def test_the_rule_applies_to_inductor_on_cuda_only(inner):
    with _on("NVIDIA_H200"):
        assert keeps_inductor(GPT_OSS, CUDA, "prefill", inner) is None
        assert keeps_inductor(GPT_OSS, torch.device("cpu"), "prefill", "inductor") is None


def test_never_measured_kinds_are_rewritten():
    with _on("NVIDIA_H200"):
        assert keeps_inductor(LayerKind("gelu", "separate", False, (1024, 4096, 8, 2)), CUDA, "train",
                              "inductor") is None


def test_hf_experts_the_rule_keeps_are_left_to_inductor_with_the_reason():
    """On CPU the rule never fires; here it is made to, to check that the HF substitution obeys it."""
    from hf_models import tiny
    import moe_inductor

    model = tiny("gpt_oss").eval()
    ids = torch.randint(0, 64, (1, 9))
    with mock.patch.object(speed_rule, "keeps_inductor", return_value="kept Inductor's path: measured slower"):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(ids).logits
            torch.testing.assert_close(out, model(ids).logits)
        assert sum(counters["moe_inductor"].values()) == 0
        report = moe_inductor.explain(model, ids)
    assert not report.rewrites
    assert any("measured slower" in m.reason for m in report.left_alone)


def test_mode_of_reads_grad_only():
    """No token count is read: under dynamic shapes a comparison on it would add a guard and a recompile."""
    w = torch.zeros(2, 2, requires_grad=True)
    assert speed_rule.mode_of(torch.zeros(8, 4), (w,)) == "train"
    with torch.no_grad():
        assert speed_rule.mode_of(torch.zeros(8, 4), (w,)) == "inference"
        assert speed_rule.mode_of(torch.zeros(4096, 4), (w,)) == "inference"


def test_inference_takes_the_worse_of_prefill_and_decode():
    with _on("NVIDIA_H200"):
        assert "0.93x" in keeps_inductor(GPT_OSS, CUDA, "inference", "inductor")
        assert keeps_inductor(QWEN3, CUDA, "inference", "inductor") is None  # min(1.11, 1.06)
