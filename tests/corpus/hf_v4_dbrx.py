"""transformers v4.x DBRX, mirrored from huggingface/transformers (v4.4x,
``src/transformers/models/dbrx/modeling_dbrx.py``: ``DbrxRouter``, ``DbrxExpertGLU``, ``DbrxExperts``).

Style: softmax in fp32, top-k, weights normalised by their p-norm (``moe_normalize_expert_weights=1``); the experts'
weights are flat (E*I, H) parameters, viewed (E, I, H), ``chunk``-ed per expert and squeezed; the one-hot mask loop
skips an empty expert with ``if token_idx.shape[0] == 0: continue``; ``x.matmul(w1.t())``, ``x.matmul(w2)``;
``index_add_``.

The skip is traced as running every body (speculation.py) and kept because the rewrite takes every body; the
chunked, squeezed views are w[e] of the (E, I, H) views, used transposed by the gate and up projections and as they
are by the down one, so the op gets (E, out, in) views of each (the down one transposed, nothing copied).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2


class DbrxExpertGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.ffn_hidden_size, self.moe_num_experts = H, I, E
        self.w1 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5)
        self.v1 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E * I, H) * I ** -0.5)
        self.activation_fn = nn.SiLU()

    def forward(self, x, expert_w1, expert_v1, expert_w2):
        gate_proj = x.matmul(expert_w1.t())
        up_proj = x.matmul(expert_v1.t())
        gate_proj = self.activation_fn(gate_proj)
        intermediate_states = gate_proj * up_proj
        return intermediate_states.matmul(expert_w2)


class DbrxExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe_num_experts = E
        self.mlp = DbrxExpertGLU()

    def forward(self, x, top_weights, top_experts):
        bsz, q_len, hidden_size = x.shape
        x = x.view(-1, hidden_size)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(top_experts, num_classes=self.moe_num_experts).permute(2, 1, 0)
        shape = (self.mlp.moe_num_experts, self.mlp.ffn_hidden_size, self.mlp.hidden_size)
        w1_chunked = [w.squeeze(dim=0) for w in self.mlp.w1.view(shape).chunk(self.moe_num_experts, dim=0)]
        v1_chunked = [w.squeeze(dim=0) for w in self.mlp.v1.view(shape).chunk(self.moe_num_experts, dim=0)]
        w2_chunked = [w.squeeze(dim=0) for w in self.mlp.w2.view(shape).chunk(self.moe_num_experts, dim=0)]
        for expert_idx in range(0, self.moe_num_experts):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue
            token_list, topk_list = token_idx, topk_idx
            expert_tokens = x[None, token_list].reshape(-1, hidden_size)
            expert_out = self.mlp(expert_tokens, w1_chunked[expert_idx], v1_chunked[expert_idx],
                                  w2_chunked[expert_idx]) * top_weights[token_list, topk_list, None]
            out.index_add_(0, token_idx, expert_out)
        return out.reshape(bsz, q_len, hidden_size)


class DbrxFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(H, E, bias=False)
        self.experts = DbrxExperts()

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        weights = self.layer(hidden_states).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, K, dim=-1)
        top_weights = top_weights / torch.norm(top_weights, p=1, dim=-1, keepdim=True)
        top_weights = top_weights.to(hidden_states.dtype)
        return self.experts(x, top_weights, top_experts)


CASES = [Case("hf_v4_dbrx", "huggingface/transformers v4.4x models/dbrx/modeling_dbrx.py DbrxFFN + DbrxExperts",
              DbrxFFN, lambda T, g: torch.randn(1, T, H, generator=g), form="unrolled_loop")]
