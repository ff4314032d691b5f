"""Every MoE causal LM in transformers that tests/hf_models.py does not build, as transformers itself writes it: a tiny
random model of each (generic small widths, plus what the family needs to build and run), compiled with
``backend="moe_inductor"`` (light inner compiler) next to eager. Each must give eager's logits in inference and
eager's gradients in a training step, and be rewritten (or left alone) as declared, so a transformers release that
changes a family's code shows here first. A family this transformers lacks is skipped.
"""
from __future__ import annotations

import copy
import inspect
from typing import Optional

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers import rel_err

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a model compile per family and mode: the full suite (.ci/run) runs them

SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=128, intermediate_size=32, moe_intermediate_size=16, num_experts=6,
             num_local_experts=6, n_routed_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=16,
             first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=8, moe_layer_freq=1, decoder_sparse_step=1, mlp_only_layers=[],
             n_shared_experts=1, num_shared_experts=1, pad_token_id=0)
MLA = dict(num_key_value_heads=4)  # multi-head latent attention: as many key/value heads as heads
LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)

#: class: (what the family needs beyond SIZES, the moe_inductor counters its compile leaves in inference)
FAMILIES: dict[str, tuple[dict, dict]] = {
    "AfmoeForCausalLM": ({}, {"hf_grouped_mm": 1}),  # its first layer is dense
    "Cohere2MoeForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "DeepseekV2ForCausalLM": (MLA, {"hf_grouped_mm": 2}),
    "Dots1ForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "Ernie4_5_MoeForCausalLM": ({}, {"hf_grouped_mm": 1}),
    "ExaoneMoeForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "FlexOlmoForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "Glm4MoeForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "Glm4MoeLiteForCausalLM": (MLA, {"hf_grouped_mm": 1}),
    "GlmMoeDsaForCausalLM": (MLA, {"hf_grouped_mm": 2}),
    "GraniteMoeHybridForCausalLM": (dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8,
                                         mamba_d_head=16, mamba_chunk_size=8), {"hf_grouped_mm": 2}),
    "GraniteMoeSWAForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "GraniteMoeSharedForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "HunYuanMoEV1ForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "JambaForCausalLM": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                              mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False), {"hf_grouped_mm": 2}),
    # its mixture of attention heads is a split loop too, and is left alone: only the MLP experts are rewritten
    "JetMoeForCausalLM": ({}, {"split_loop": 2}),
    "Lfm2MoeForCausalLM": (dict(layer_types=["conv", "full_attention"], num_dense_layers=0), {"hf_grouped_mm": 2}),
    # its own loop over .item() ids, with zero experts (identity outputs): the routed ones on the op, the zero ones
    # as the tokens times their weights beside it (passes/zero_experts.py)
    "LongcatFlashForCausalLM": (dict(num_layers=2, ffn_hidden_size=32, expert_ffn_hidden_size=16, zero_expert_num=2,
                                     moe_topk=2, **MLA), {"unrolled_loop": 2}),
    "MiniMaxForCausalLM": ({}, {"hf_grouped_mm": 2}),
    "Qwen3NextForCausalLM": (LINEAR_ATTENTION, {"hf_grouped_mm": 2}),
    "Qwen3_5MoeForCausalLM": (LINEAR_ATTENTION, {"hf_grouped_mm": 2}),
}


def _build(name: str) -> Optional[torch.nn.Module]:
    cls = getattr(transformers, name, None)
    if cls is None:
        return None
    extra, _ = FAMILIES[name]
    params = inspect.signature(cls.config_class.__init__).parameters
    kw = {k: v for k, v in SIZES.items() if k in params}
    kw.update(extra)
    torch.manual_seed(0)
    model = cls(cls.config_class(**kw))
    with torch.no_grad():  # random values where the family initialises zeros, so that a dropped term would show
        for p in model.parameters():
            if p.dim() >= 1 and not p.any():
                p.normal_(0, 0.1)
    return model


def _compile(model: torch.nn.Module):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="moe_inductor", options={"inner": "eager"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_inference_logits_are_eagers(name, dtype):
    model = _build(name)
    if model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    model = model.eval().to(dtype)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        out = _compile(model)(ids).logits
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2), rel_err(out, ref)
    assert dict(counters["moe_inductor"]) == FAMILIES[name][1], (dict(counters["moe_inductor"]),
                                                                  dict(counters["moe_inductor_left_alone"]))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_training_step_has_eagers_gradients(name):
    model = _build(name)
    if model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    model.train()
    for m in model.modules():  # dropout would draw different masks in the two runs
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2))
    (eager(ids).logits.float() * probe).sum().backward()
    (_compile(model)(ids).logits.float() * probe).sum().backward()
    pairs = list(zip(model.named_parameters(), eager.named_parameters()))
    # a gradient at the noise level of the whole step's (HunYuan's router: ~1e-10 against ~1) has no relative
    # error worth reading: each is judged against its own size or, when that is tiny, the step's
    scale = torch.cat([q.grad.flatten() for _, (_, q) in pairs if q.grad is not None]).norm()
    for (n, p), (_, q) in pairs:
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            err = (p.grad - q.grad).norm()
            assert err <= 1e-4 * q.grad.norm() + 1e-7 * scale, (n, rel_err(p.grad, q.grad), err.item(), scale.item())
