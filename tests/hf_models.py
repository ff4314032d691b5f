"""Tiny random HF MoE models (no downloads) for the backend tests."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def tiny(family: str, experts_implementation: str = "grouped_mm", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=128)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=5,
                                          num_experts_per_tok=2, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=3, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(intermediate_size=16, num_local_experts=5, num_experts_per_tok=2,
                                        sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                                        **common)
        model = transformers.GptOssForCausalLM(cfg)
        with torch.no_grad():  # random biases, so that a dropped bias would show
            for name, p in model.named_parameters():
                if "bias" in name and "experts" in name:
                    p.normal_(0, 0.1)
    elif family == "qwen2_moe":  # shared expert with a sigmoid gate, outside the experts module
        cfg = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=5,
                                          shared_expert_intermediate_size=24, num_experts_per_tok=2, **common)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=16, num_experts=5, num_experts_per_tok=2, **common)
        model = transformers.OlmoeForCausalLM(cfg)
    elif family == "deepseek_v3":  # group-limited routing, shared expert, routed scaling; MLA needs kv heads = heads
        cfg = transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
            **dict(common, num_key_value_heads=4))
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif family == "granitemoe":
        cfg = transformers.GraniteMoeConfig(intermediate_size=16, num_local_experts=5, num_experts_per_tok=2, **common)
        model = transformers.GraniteMoeForCausalLM(cfg)
    elif family == "phimoe":
        cfg = transformers.PhimoeConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.PhimoeForCausalLM(cfg)
    elif family == "llama4":  # dense all-experts, routing weight on the expert input
        cfg = transformers.Llama4TextConfig(intermediate_size=16, intermediate_size_mlp=32, num_local_experts=4,
                                            num_experts_per_tok=1, interleave_moe_layer_step=1, **common)
        model = transformers.Llama4ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises gate_up_proj to zeros; zeros would hide a wrong rewrite
            for layer in model.model.layers:
                layer.feed_forward.experts.gate_up_proj.normal_(0, 0.2)
        return model.eval()
    elif family == "switch":  # top-1 with an expert capacity, applied per sequence by the router
        cfg = transformers.SwitchTransformersConfig(
            vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
            num_experts=4, expert_capacity=3, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)
        return transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
    elif family == "dbrx":  # flat (E*I, H) expert weights, its own experts class
        cfg = transformers.DbrxConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=128,
                                      ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
                                      attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0})
        model = transformers.DbrxForCausalLM(cfg)
        with torch.no_grad():  # HF leaves the flat expert weights uninitialised
            for name, p in model.named_parameters():
                if ".experts.mlp." in name:
                    p.normal_(0, 0.2)
        return model.eval()
    else:
        raise ValueError(family)
    model.set_experts_implementation(experts_implementation)
    return model.eval()
