"""DeepSeek-V2's MoE as its Hugging Face remote code runs it in inference, written after deepseek-ai/DeepSeek-V2
(``modeling_deepseek.py``: ``DeepseekV2MoE.forward`` with ``self.training`` False, and ``moe_infer``, which
DeepSeek-V3's remote code, Kimi/Moonlight and many fine-tuning repositories carry unchanged).

Style: the gate of ``deepseek_v2.py``; the module in ``eval()``, so ``forward`` calls ``moe_infer`` under
``@torch.no_grad()``: each expert's tokens counted by ``scatter_`` of ones into ``new_zeros((T, E))`` and a column
sum, the flat ids ``argsort``ed, the token rows gathered by ``idxs // k``, the counts brought to the host
(``.cpu().numpy()``) and walked with ``enumerate``, a running ``start_idx``/``end_idx`` slice per expert, experts
with no tokens skipped by ``continue``, outputs appended to a list, ``torch.cat`` if the list is not empty, put back
by ``new_x[idxs] = outs`` into ``empty_like``, then ``view(T, k, -1).type(w.dtype).mul_(w.unsqueeze(-1)).sum(1)``;
shared experts added. Look-alikes of the walk, each left as Dynamo traces it (a graph break on the array), are in
``tests/test_host_counts.py``.
"""
import torch
import torch.nn as nn

from tests.corpus.deepseek_v2 import DeepseekV2MLP, E, H, I, K, MoEGate
from tests.corpus.harness import Case


class DeepseekV2MoEInfer(nn.Module):
    def __init__(self, shared: bool = True):
        super().__init__()
        self.num_experts_per_tok = K
        self.ep_rank, self.experts_per_rank = 0, E
        self.experts = nn.ModuleList([DeepseekV2MLP(I) for _ in range(E)])
        self.gate = MoEGate()
        self.shared_experts = DeepseekV2MLP(2 * I) if shared else None

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, _ = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        if self.training:
            raise RuntimeError("this case mirrors the inference path; deepseek_v2.py has the training one")
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        marks = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        marks.scatter_(1, topk_ids, 1)
        per_expert = marks.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        per_expert = per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            outputs.append(expert(sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(new_x.dtype))


_SRC = "deepseek-ai/DeepSeek-V2 modeling_deepseek.py DeepseekV2MoE.moe_infer (inference path, host counts)"

CASES = [
    Case("deepseek_v2_infer", _SRC, lambda: DeepseekV2MoEInfer().eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="sorted_grouped_mm"),
    Case("deepseek_v2_infer_bf16", _SRC + ", bf16", lambda: DeepseekV2MoEInfer().eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="sorted_grouped_mm", dtype=torch.bfloat16),
]
