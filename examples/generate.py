"""Greedy generation with a moe_inductor-compiled model, checked token for token against eager.

    python examples/generate.py
"""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main(max_new_tokens: int = 8, inner: str = "inductor") -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg).to(device).eval()
    prompt = torch.randint(0, 128, (1, 12), device=device)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        # generate() calls self.forward: compile that, so every prefill and decode step runs through moe_inductor
        model.forward = torch.compile(model.forward, backend="moe_inductor", options={"inner": inner})
        got = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    print("eager     :", expected[0, -max_new_tokens:].tolist())
    print("compiled  :", got[0, -max_new_tokens:].tolist())
    print("rewrites  :", dict(counters["moe_inductor"]))
    if not torch.equal(expected, got):
        raise SystemExit("generated tokens differ from eager")


if __name__ == "__main__":
    main()
