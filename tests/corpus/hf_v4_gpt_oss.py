"""transformers v4.55-4.57's GPT-OSS MoE block, mirrored from huggingface/transformers (v4.55,
``src/transformers/models/gpt_oss/modeling_gpt_oss.py``: ``GptOssTopKRouter``, ``GptOssExperts``, ``GptOssMLP``),
the release GPT-OSS came out with, before v5's experts interface.

Style: the router is an (E, H) weight and (E,) bias read by ``F.linear``; ``topk`` of the logits, a softmax over
the k values in their own dtype, scattered into a dense (T, E) table ``zeros_like(logits).scatter_(1, ids, w)``.
The experts hold ``gate_up_proj`` (E, H, 2I) with gate and up in interleaved columns, its (E, 2I) bias, ``down_proj``
(E, I, H) and its (E, H) bias; the activation is the clamped glu (gate clamped above at 7, up to [-7, 7],
``gate * sigmoid(1.702 * gate)``, times ``up + 1``). The experts module branches on ``self.training``:

- eval (``hf_v4_gpt_oss_eval``): every expert on every token: ``x.repeat(E, 1).view(E, -1, H)``, ``torch.bmm`` with
  ``+ bias[..., None, :]`` for both projections, viewed (E, B, -1, H), scaled by ``table.transpose(0, 1).view(E, B,
  -1)[..., None]`` and summed over the experts.
- training (``hf_v4_gpt_oss_train``): a loop ``for expert_idx in expert_hit[:]`` over the hit experts, a ``with
  torch.no_grad():`` around the ``torch.where`` of the expert's mask, ``x[tok] @ gate_up_proj[expert_idx]`` by the
  (1,) index tensor (a (1, n, 2I) result), ``out[0] * table[tok, expert_idx, None]``, ``index_add_``.

Today: both are rewritten. Eval: dense_experts, expert-major (passes/dense_repeated.py), k of E experts run per
token. Training: unrolled_loop; the loop over ``hit[:]`` is the loop over the nonzero, the ``with torch.no_grad():``
around the row-finding ``torch.where`` changes nothing a gradient reaches (loop_bytecode.py allows it around such
code only), the (1,) index reads the weights as ``w[e:e+1]`` and the one-expert batch is read without its leading
1 (passes/leading_ones.py), and the dense table at the index is the choice's weight (passes/loop_rows.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 4, 2
ALPHA, LIMIT = 1.702, 7.0


class TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = K, E, H
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.bias = nn.Parameter(torch.randn(E) * 0.1)

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(flat, self.weight, self.bias)
        top_values, top_ids = torch.topk(logits, self.top_k, dim=-1)
        top_values = F.softmax(top_values, dim=1, dtype=top_values.dtype)
        table = torch.zeros_like(logits).scatter_(1, top_ids, top_values)
        return table, top_ids


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.hidden_size, self.expert_dim = E, H, I
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.1)
        self.alpha, self.limit = ALPHA, LIMIT

    def _glu(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states, router_indices, routing_weights):
        batch = hidden_states.shape[0]
        flat = hidden_states.reshape(-1, self.hidden_size)
        experts = routing_weights.shape[1]
        if self.training:
            result = torch.zeros_like(flat, dtype=flat.dtype, device=flat.device)
            with torch.no_grad():
                mask = F.one_hot(router_indices, num_classes=experts).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in hit[:]:
                with torch.no_grad():
                    _, tok = torch.where(mask[expert_idx[0]])
                rows = flat[tok]
                gate_up = rows @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
                out = self._glu(gate_up) @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
                result.index_add_(0, tok, (out[0] * routing_weights[tok, expert_idx, None]).to(flat.dtype))
            return result.view(batch, -1, self.hidden_size)
        repeated = flat.repeat(experts, 1).view(experts, -1, self.hidden_size)
        gate_up = torch.bmm(repeated, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        out = torch.bmm(self._glu(gate_up), self.down_proj) + self.down_proj_bias[..., None, :]
        out = out.view(experts, batch, -1, self.hidden_size)
        out = out * routing_weights.transpose(0, 1).view(experts, batch, -1)[..., None]
        return out.sum(dim=0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = Experts()

    def forward(self, hidden_states):
        table, ids = self.router(hidden_states)
        return self.experts(hidden_states, router_indices=ids, routing_weights=table), table


class Layer(nn.Module):
    """The decoder layer's MoE half: the block's output added to its input, the router scores dropped."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        out, _scores = self.mlp(x)
        return x + out


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


_SRC = "huggingface/transformers v4.55 models/gpt_oss/modeling_gpt_oss.py GptOssMLP"
CASES = [
    Case("hf_v4_gpt_oss_eval", _SRC + " (eval: every expert on every token, bmm)", lambda: Layer().eval(), _input,
         form="dense_experts"),
    Case("hf_v4_gpt_oss_train", _SRC + " (training: loop over the hit experts)", Layer, _input, form="unrolled_loop"),
]
