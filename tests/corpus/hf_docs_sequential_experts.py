"""A top-1 boolean-mask expert loop, mirrored from huggingface/transformers' model patching guide
(``docs/source/en/model_patching.md``: ``SequentialExperts``, the experts of Qwen1.5-MoE restructured as an
``nn.ModuleList`` of MLPs for quantization libraries; read in the TonyRHouston/huggingface-transformers mirror).

Style: per expert, ``expert_mask = router_logits.argmax(dim=-1) == expert_idx`` (the argmax computed afresh in each
iteration), skipped unless ``expert_mask.any()``, then ``final_hidden[expert_mask] = expert(hidden_states
[expert_mask])`` into ``torch.zeros_like``; no routing weight. The experts are Qwen2-MoE's MLP (gate, up and down
``nn.Linear`` without biases, SiLU on the gate). The guide hands the experts the router's logits; here the block's
own ``nn.Linear`` router makes them, as Qwen2-MoE's does.

Outcome: the ``if expert_mask.any():`` guard is a branch on a tensor's value, which Dynamo cannot trace; it is the
"this expert got no tokens" skip, answered "has rows" while tracing and proven afterwards
(``moe_inductor/mask_guards.py``), and the loop is the top-1 masked-writes spelling of form "unrolled_loop"
(``passes/top1_masks.py``). It is rewritten with gradients too: an expert skipped in eager leaves its
weights without a gradient, which the compiled step copies by testing the guard's ids for each expert after the
rewrite (``grad_gate.py``); the argmax this loop recomputes in every iteration is gone from the rewritten graph but
for the one the op reads, and the gate tests that one, which computes the same ids (``fx_utils.same_value_key``).
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E = 16, 12, 4


class ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SequentialExperts(nn.ModuleList):
    def __init__(self):
        super().__init__(ExpertMLP() for _ in range(E))

    def forward(self, hidden_states, router_logits, top_k):
        final_hidden = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self):
            expert_mask = router_logits.argmax(dim=-1) == expert_idx
            if expert_mask.any():
                final_hidden[expert_mask] = expert(hidden_states[expert_mask])
        return final_hidden


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = SequentialExperts()

    def forward(self, x):
        return self.experts(x, self.gate(x), top_k=1)


CASES = [Case("hf_docs_sequential_experts", "huggingface/transformers docs/source/en/model_patching.md "
              "SequentialExperts", Block, lambda T, g: torch.randn(T, H, generator=g), form="unrolled_loop")]
