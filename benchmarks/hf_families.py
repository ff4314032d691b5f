"""The model families ``bench_hf.py`` builds (real and tiny widths), its modes and its columns."""

MODES = ("prefill", "decode", "train")
#: backend="moe_inductor" with its speed rule off (every proven layer rewritten), and with no MoE form rewritten (the
#: experts left to Inductor; attention and masks still moe_inductor's). Their ratio is what rewriting the experts
#: buys with everything else in the model compiled alike: the speed rule's value (``rule_values``)
RULE_OFF, EXPERTS_KEPT = "moe_inductor_rule_off", "moe_inductor_experts_kept"
#: backend="moe_inductor" with ``config.gemm_tail_split`` off: every forward grouped GEMM in one launch of one tile
#: size. Against "moe_inductor" it measures what running each expert's partial last tile apart buys in the model
TAIL_OFF = "moe_inductor_tail_off"
#: backend="moe_inductor" with ``config.gemm_tma_weights = "auto"``: the forward grouped GEMM reads its weights (and
#: the down projection its sorted token rows) through TMA descriptors at >= 128 rows per expert, made as
#: ``config.gemm_tma_descriptors`` says (in the kernel by default: the calls stay visible to Inductor)
TMA_AUTO = "moe_inductor_tma_auto"
#: backend="moe_inductor" with ``config.gemm_tma_weights = "off"``: pointer loads for every key, whatever the tuned
#: table says. Against "moe_inductor" ("tuned", the default) it measures what the table's TMA entries buy in the model
TMA_OFF = "moe_inductor_tma_off"
#: backend="moe_inductor" with ``config.gemm_engine = "triton"``: every rewritten layer's GEMMs on our fused kernels,
#: where "auto" would give the large ones to ``torch._grouped_mm`` (Mixtral at T >= 4096). Against "moe_inductor" it
#: measures what the engine rule buys in the model
FUSED = "moe_inductor_fused"
#: backend="moe_inductor" with ``config.gemm_engine = "grouped_mm"``: every rewritten layer's GEMMs on
#: ``torch._grouped_mm`` wherever the layout allows, with our routing, activation and combine around them, where "auto"
#: keeps the smaller experts (Qwen1.5-MoE's, about 273 rows each at T = 4096) on our fused kernels
ENGINE = "moe_inductor_grouped_mm"
#: ``RULE_OFF`` with ``config.gemm_engine_backward = "triton"``: every rewritten layer's backward on our fused kernels,
#: where "auto" gives the backward GEMMs to ``torch._grouped_mm`` from 128 rows per expert. A static count's backward
#: is then launched from Inductor's wrapper (lowerings/visible_backward.py) where the engine would run it in the
#: opaque ops. Against ``RULE_OFF`` it measures which of the two a whole training step should take
BW_FUSED = "moe_inductor_bw_fused"
#: ``RULE_OFF`` with ``config.visible_engine_backward`` on (the default; the column holds it whatever the process's):
#: a static count's backward that the engine takes traced into Inductor's graph (its GEMMs as ``aten._grouped_mm``
#: nodes, our kernels launched from Inductor's wrapper)
BW_TRACED = "moe_inductor_bw_traced"
#: ``RULE_OFF`` with ``config.visible_engine_backward`` off: that backward in the opaque ops. Against ``BW_TRACED`` it
#: measures what the opaque ops' host time costs
BW_OPAQUE = "moe_inductor_bw_opaque"
MOE_COLUMNS = ("moe_inductor", RULE_OFF, EXPERTS_KEPT, TAIL_OFF, TMA_AUTO, TMA_OFF, FUSED, ENGINE, BW_FUSED, BW_TRACED, BW_OPAQUE)
COLUMNS = ("eager", "inductor", "max-autotune-no-cudagraphs", *MOE_COLUMNS)
DEFAULT_COLUMNS = ("eager", "inductor", "moe_inductor")

# (transformers class name, real widths, default layers, tiny widths). The real widths are the named checkpoints';
# the layer counts keep one family's compiles and timings inside a few minutes of the H200.
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", "Qwen3-30B-A3B", 4, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("Mixtral", "Mixtral-8x7B", 2, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128), dict(
        hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)),
    "gpt_oss": ("GptOss", "GPT-OSS-20B", 2, dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128), dict(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8)),
    # GPT-OSS with transformers v4.55-4.57's MoE block code (hf_v4_code.py): the same model and weights, the experts
    # spelled as those releases did (dense over every expert in eval, a loop over the hit experts in training)
    "gpt_oss_v4": ("GptOss", "GPT-OSS-20B, v4.55 MoE code", 2, dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128), dict(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "olmoe": ("Olmoe", "OLMoE-1B-7B", 2, dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, num_attention_heads=16,
        num_key_value_heads=16), dict(
        hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=4)),
    "qwen2_moe": ("Qwen2Moe", "Qwen1.5-MoE-A2.7B", 2, dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=16), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4)),
    "deepseek_v3": ("DeepseekV3", "DeepSeek-V3", 1, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=0,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5), dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=2.5)),
    # the control: a dense model, nothing to rewrite. moe_inductor must equal Inductor here (its capture settings and
    # hooks are all it adds); a gap is harm to every non-MoE model a user compiles with it
    "llama": ("Llama", "Llama-3-8B (dense)", 2, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128), dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}
