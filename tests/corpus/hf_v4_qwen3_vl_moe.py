"""transformers v4.57's Qwen3-VL-MoE text MoE block, mirrored from huggingface/transformers (v4.57,
``src/transformers/models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``: ``Qwen3VLMoeTextRouter``,
``Qwen3VLMoeTextExperts``, ``Qwen3VLMoeTextSparseMoeBlock``; v4's GPT-OSS experts split train and eval the same
way), the last v4 release before v5's experts interface.

Style: the router *is* an ``nn.Linear`` subclass (``super().forward``), softmax in fp32, top-k renormalised and cast
back, then scattered into a dense (T, E) weight table ``zeros_like(logits).scatter_(1, ids, weights)``; the router
returns the table, the logits and the ids. The experts are two stacked parameters laid out (in, out):
``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H), applied by ``@`` / ``bmm`` with no transpose. The experts
module gets the (B, S, H) hidden states and branches on ``self.training``:

- training (``hf_v4_qwen3_vl_moe_train``): under ``no_grad`` a one-hot of the ids permuted (E, k, T) and the hit
  experts ``greater(mask.sum((-1, -2)), 0).nonzero()``; for each hit row (a 1-element tensor) ``torch.where`` of
  the expert's mask gives the token rows, ``x[tok] @ gate_up_proj[expert_idx]`` (indexing by the 1-element tensor
  keeps a leading 1), ``chunk(2, -1)``, ``up * act(gate)``, ``@ down_proj[expert_idx]``, ``out[0] *
  weights[tok, expert_idx, None]`` from the dense table, ``index_add_`` into ``zeros_like``.
- eval (``hf_v4_qwen3_vl_moe_eval``): dense over every expert: ``x.repeat(E, 1).view(E, -1, H)``, two ``bmm``,
  reshaped (E, B, S, H), scaled by ``weights.transpose(0, 1).view(E, B, -1)[..., None]`` and summed over E.

The block returns ``(routed_out, router_logits)``.

Today: both are rewritten: eval as dense_experts' expert-major spelling (passes/dense_repeated.py), training as
unrolled_loop, as transformers v4.55's GPT-OSS loop is (tests/corpus/hf_v4_gpt_oss.py says how each part is read).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 2


class Qwen3VLMoeTextRouter(nn.Linear):
    def __init__(self):
        super().__init__(H, E, bias=False)
        self.hidden_size, self.top_k = H, K

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        router_logits = super().forward(hidden_states)
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        routing_weights, router_indices = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        router_weights = torch.zeros_like(router_logits).scatter_(1, router_indices, routing_weights)
        return router_weights, router_logits, router_indices


class Qwen3VLMoeTextExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.hidden_size, self.expert_dim = E, H, I
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, routing_weights, router_indices):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        if self.training:
            next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
            with torch.no_grad():
                expert_mask = F.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)
                expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in expert_hit[:]:
                with torch.no_grad():
                    _, token_idx = torch.where(expert_mask[expert_idx[0]])
                current_state = hidden_states[token_idx]
                gate, up = (current_state @ self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
                out = (up * self.act_fn(gate)) @ self.down_proj[expert_idx]
                weighted_output = out[0] * routing_weights[token_idx, expert_idx, None]
                next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
            return next_states.view(batch_size, -1, self.hidden_size)
        hidden_states = hidden_states.repeat(self.num_experts, 1).view(self.num_experts, -1, self.hidden_size)
        gate, up = torch.bmm(hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        next_states = torch.bmm(up * self.act_fn(gate), self.down_proj)
        next_states = next_states.reshape(self.num_experts, batch_size, -1, self.hidden_size)
        next_states = next_states * routing_weights.transpose(0, 1).view(self.num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)


class Qwen3VLMoeTextSparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.num_experts = H, E
        self.gate = Qwen3VLMoeTextRouter()
        self.experts = Qwen3VLMoeTextExperts()

    def forward(self, hidden_states):
        router_weights, router_logits, router_indices = self.gate(hidden_states)
        routed_out = self.experts(hidden_states, router_weights, router_indices)
        return routed_out, router_logits


class Wrapped(nn.Module):
    """The decoder layer keeps the hidden states and drops the router logits."""

    def __init__(self):
        super().__init__()
        self.mlp = Qwen3VLMoeTextSparseMoeBlock()

    def forward(self, x):
        hidden_states, _router_logits = self.mlp(x)
        return hidden_states


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


_SRC = "huggingface/transformers models/qwen3_vl_moe/modeling_qwen3_vl_moe.py Qwen3VLMoeTextSparseMoeBlock"
CASES = [
    Case("hf_v4_qwen3_vl_moe_train", _SRC + " (training: hit-experts loop)", Wrapped, _input, form="unrolled_loop"),
    Case("hf_v4_qwen3_vl_moe_eval", _SRC + " (eval: dense bmm over every expert)", lambda: Wrapped().eval(), _input,
         form="dense_experts"),
]
