"""A few optimiser steps of a tiny MoE model, compiled with moe_inductor and in eager, side by side.

    python examples/train_step.py
"""
from __future__ import annotations

import copy

import torch
from transformers import MixtralConfig, MixtralForCausalLM


def main(steps: int = 3, inner: str = "inductor") -> list[tuple[float, float]]:
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2)
    eager = MixtralForCausalLM(cfg).train()
    ours = copy.deepcopy(eager)
    compiled = torch.compile(ours, backend="moe_inductor", options={"inner": inner})
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(step))
        for model, opt in ((eager, opt_eager), (compiled, opt_ours)):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()
        with torch.no_grad():
            l_e, l_o = eager(ids, labels=ids).loss.item(), ours(ids, labels=ids).loss.item()
        losses.append((l_e, l_o))
        print(f"step {step}: loss eager {l_e:.6f}  moe_inductor {l_o:.6f}")
    return losses


if __name__ == "__main__":
    main()
