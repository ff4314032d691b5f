"""The graphs of a tiny HF MoE model before and after moe_inductor, for one experts implementation.

    python examples/inspect_hf.py [grouped_mm|eager|batched_mm]
"""
from __future__ import annotations

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moe_inductor


def main(implementation: str = "grouped_mm") -> moe_inductor.Report:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation(implementation)
    report = moe_inductor.explain(model, torch.randint(0, 64, (1, 6)))
    print(report)
    return report


if __name__ == "__main__":
    main(*sys.argv[1:])
