"""DeepSeek-V3's MoE as its Hugging Face remote code runs it in inference, written after deepseek-ai/DeepSeek-V3
(``modeling_deepseek.py``: ``MoEGate`` with ``topk_method="noaux_tc"``, ``DeepseekV3MoE.forward`` with
``self.training`` False, and ``moe_infer``, the same walk as DeepSeek-V2's; Kimi-K2 and Moonlight ship this file).

Style: the router of ``hf_v4_deepseek_v3.py`` (sigmoid scores, a correction bias for the choice only, groups scored
by their top-2 sum, ``topk_group`` groups kept, weights gathered from the uncorrected scores, renormalised and
scaled); ``moe_infer`` walks the counts on the host (``deepseek_v2_infer.py``'s, shared here: the remote files hold
the same function); shared experts on the residual. In bf16 the weights stay fp32 and the unsort's product is taken
in fp32 (``.type(topk_weight.dtype)``) before the cast back.
"""
import torch
import torch.nn as nn

from tests.corpus.deepseek_v2_infer import DeepseekV2MoEInfer
from tests.corpus.harness import Case
from tests.corpus.hf_v4_deepseek_v3 import E, H, I, DeepseekV3MLP, DeepseekV3TopkRouter


class DeepseekV3MoEInfer(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(DeepseekV3MLP(I) for _ in range(E))
        self.gate = DeepseekV3TopkRouter()
        self.shared_experts = DeepseekV3MLP(I)

    def forward(self, hidden_states):
        identity, orig_shape = hidden_states, hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        return y + self.shared_experts(identity)

    moe_infer = DeepseekV2MoEInfer.moe_infer
    ep_rank, experts_per_rank = 0, E


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


_SRC = "deepseek-ai/DeepSeek-V3 modeling_deepseek.py DeepseekV3MoE.moe_infer + MoEGate (noaux_tc, inference path)"
CASES = [
    Case("deepseek_v3_remote_infer", _SRC + " (E=6, 2 groups, top-2)", lambda: DeepseekV3MoEInfer().eval(), _input,
         form="sorted_grouped_mm"),
    Case("deepseek_v3_remote_infer_bf16", _SRC + " (bf16)", lambda: DeepseekV3MoEInfer().eval(), _input,
         form="sorted_grouped_mm", dtype=torch.bfloat16),
]
