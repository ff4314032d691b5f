"""vLLM's Gaudi (HPU) static MoE, mirrored from vllm-project/vllm (``vllm/hpu/ops.py`` at 017e7a4c:
``static_fused_moe``, ``silu_and_mul_wrapper``, ``silu_and_mul``; the same file in HabanaAI/vllm-fork), the
torch path ``FusedMoE`` took on HPU for Mixtral before the fused kernels: written for a graph compiler that wants
static shapes, so every expert runs on every token.

Style: the router's logits come in as ``score``; softmax in float32 over all experts, ``topk``, renormalised in
place, cast back; a dense (T, E) table ``padded_weights = zeros(T, E).scatter_(-1, ids, weights)``, reshaped to
(1, T, E) and ``permute(2, 0, 1).unsqueeze(-1)`` to (E, 1, T, 1); ``final_hidden_states = zeros(1, T, H)``;
``for expert_idx in range(num_experts)``: ``matmul`` of all the tokens with ``w1[e].transpose(0, 1)`` (w1 is the
stacked (E, 2I, H) gate/up weight), the activation through an out-parameter helper (``out = torch.empty(..)``,
``silu_and_mul(out, x)`` doing ``torch.split`` in halves and ``output.copy_(silu(x) * y)``), ``matmul`` with
``w2[e].transpose(0, 1)`` ((E, H, I)), times ``padded_weights[e]`` and ``+=`` into the (1, T, H) sum; returned
``.view(-1, H)``. The layer around it holds a bias-free gate and the two 3D parameters (vLLM's ``w13_weight``,
``w2_weight``). E = 8 for Mixtral; here 6, k = 2; input (T, H) as vLLM's flattened tokens.

Outcome: rewritten (dense_experts, ``passes/dense_tables.py``). The table is read as what it is, ``scatter_`` of
distinct topk ids into fresh zeros (its only write, before every read), and each ``padded_weights[e]`` as its
column e: the reshape/permute/unsqueeze chain is replayed dim by dim on the traced shapes. The ``+=`` into the
(1, T, H) zeros buffer adds one term per expert of range(E), nothing reading the buffer between, and the
out-parameter ``copy_`` into a fresh ``torch.empty`` is read as the value copied; the op's (T, H) result is
reshaped to (1, T, H) for the final ``.view(-1, H)``.

Departures: the ``htorch.core.mark_step()`` calls (Gaudi's lazy-mode graph cuts) are left out.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 6, 2


def silu_and_mul(output, input):
    d = input.shape[-1] // 2
    silu = torch.nn.SiLU().to(input.device)
    x, y = torch.split(input, d, dim=-1)
    output.copy_(silu(x) * y)


def silu_and_mul_wrapper(x):
    d = x.shape[-1] // 2
    output_shape = x.shape[:-1] + (d,)
    out = torch.empty(output_shape, dtype=x.dtype, device=x.device)
    silu_and_mul(out, x)
    return out


def static_fused_moe(hidden_states, w1, w2, score, topk):
    B, D = hidden_states.shape
    num_experts = w1.shape[0]
    routing_weights = F.softmax(score, dim=1, dtype=torch.float32)
    routing_weights, selected_experts = torch.topk(routing_weights, topk, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    final_hidden_states = torch.zeros((1, B, D), dtype=hidden_states.dtype, device=hidden_states.device)
    padded_weights = torch.zeros((B, num_experts), dtype=hidden_states.dtype, device=hidden_states.device)
    padded_weights.scatter_(-1, selected_experts, routing_weights)
    padded_weights = padded_weights.reshape(-1, B, w1.shape[0])
    padded_weights = padded_weights.permute(2, 0, 1).unsqueeze(-1)
    for expert_idx in range(num_experts):
        padded_weight = padded_weights[expert_idx]
        current_state_static = hidden_states.reshape(-1, D)
        w_output = silu_and_mul_wrapper(torch.matmul(current_state_static, w1[expert_idx].transpose(0, 1)))
        w_output = torch.matmul(w_output, w2[expert_idx].transpose(0, 1))
        current_hidden_states_static = w_output * padded_weight
        final_hidden_states += current_hidden_states_static
    return final_hidden_states.view(-1, D)


class HpuMixtralMoE(nn.Module):
    """A Mixtral MoE layer as vLLM's HPU path holds it: the gate, then ``static_fused_moe`` on the 3D weights."""

    def __init__(self):
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(H, E, bias=False)
        self.w13_weight = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2_weight = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)
        return static_fused_moe(hidden_states, self.w13_weight, self.w2_weight, router_logits, self.top_k)


CASES = [
    Case("vllm_hpu_static_moe", "vllm-project/vllm vllm/hpu/ops.py static_fused_moe (every expert on every token, "
         "(E, 1, T, 1) padded weights)", HpuMixtralMoE, lambda T, g: torch.randn(T, H, generator=g),
         form="dense_experts"),
]
