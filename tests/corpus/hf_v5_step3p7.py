"""transformers v5's StepFun Step-3.7-Flash sparse MoE block, mirrored from huggingface/transformers (v5.24,
``src/transformers/models/step3p7/modeling_step3p7.py``: ``Step3p7TopKRouter``, ``Step3p7Experts``,
``Step3p7MLP``, ``Step3p7SparseMoeBlock``), whose experts keep their own loop (no ``@use_experts_implementation``).

Style: a sigmoid router as MiniMax-M2's: ``F.linear`` on an (E, H) weight in the weight's dtype, ``sigmoid`` of the
logits in float32, the choice on the scores plus an ``e_score_correction_bias`` buffer (``topk(sorted=False)``), the
weights ``gather``ed from the unbiased scores and renormalised in place (``/=``). The experts are 3D parameters,
``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I); ``one_hot(.., num_classes=E + 1)`` (a spare class) and
the hit vector are made under ``torch.no_grad()``; ``for expert_idx in hit:`` with ``expert_idx = expert_idx[0]``
and ``if expert_idx == self.num_experts: continue``; ``_apply_gate`` chunks gate/up and **clamps** them:
``silu(gate).clamp(max=limit)``, ``up.clamp(min=-limit, max=limit)`` (``limit`` is ``inf`` unless the config
lists a bound for the layer: Step-3.7-Flash bounds the routed experts of layers 43-44 at 7); the scaled output is
``index_add_``ed into ``zeros_like``. The block adds ``routed_scaling_factor`` times the routed sum to a shared
``Step3p7MLP`` (its own clamps, bound 16 on those layers, ``inf`` elsewhere).

- ``hf_v5_step3p7``: a layer without a bound (``clamp(max=inf)``, as most layers run).
- ``hf_v5_step3p7_clamped``: a bounded layer (routed limit 7, shared 16; the inputs are scaled so that 7 binds).

E = 6, k = 2, the shared expert as wide as 2 routed ones; input (B, S, H).

Outcome: both rewritten (unrolled_loop, one per compiled graph). The loop over the hit experts is traced over every
expert, and each expert's hidden state reads as the clamped silu-glu (passes/gated_reads.py): with a bound, the op's
"clamped_silu_glu" at limit 7; at ``inf`` both clamps return their input, and the reading is plain "silu_glu".
The shared ``Step3p7MLP`` (its own clamps) stays in the graph for Inductor.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K, SHARED_I = 16, 12, 6, 2, 24


class Step3p7MLP(nn.Module):
    def __init__(self, limit):
        super().__init__()
        self.gate_proj = nn.Linear(H, SHARED_I, bias=False)
        self.up_proj = nn.Linear(H, SHARED_I, bias=False)
        self.down_proj = nn.Linear(SHARED_I, H, bias=False)
        self.act_fn = nn.SiLU()
        self.limit = limit or float("inf")

    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x)).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(gate * up)


class Step3p7Experts(nn.Module):
    def __init__(self, swiglu_limit=None):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.act_fn = nn.SiLU()
        self.limit = float("inf") if swiglu_limit is None else swiglu_limit

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]))
            current = F.linear(current, self.down_proj[expert_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = self.act_fn(gate).clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * up


class Step3p7TopKRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = K, E, H
        self.weight = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.e_score_correction_bias = nn.Buffer(0.1 * torch.randn(E))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
        routing_weights = F.sigmoid(router_logits.float())
        scores_for_choice = routing_weights + self.e_score_correction_bias
        _, top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)
        top_k_weights = routing_weights.gather(1, top_k_index)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights, top_k_index


class Step3p7SparseMoeBlock(nn.Module):
    def __init__(self, swiglu_limit=None, shared_limit=0.0):
        super().__init__()
        self.gate = Step3p7TopKRouter()
        self.experts = Step3p7Experts(swiglu_limit=swiglu_limit)
        self.shared_experts = Step3p7MLP(shared_limit)
        self.routed_scaling_factor = 2.5

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        shared_output = self.shared_experts(hidden_states)
        _, routing_weights, selected_experts = self.gate(hidden_states)
        hidden_states = self.experts(hidden_states, selected_experts, routing_weights)
        hidden_states = hidden_states * self.routed_scaling_factor
        hidden_states = hidden_states + shared_output
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim)


def _input(T, g):
    return 3 * torch.randn(2, T, H, generator=g)  # wide enough that a bound of 7 on silu(gate) and up binds


_SRC = "huggingface/transformers v5.24 models/step3p7/modeling_step3p7.py Step3p7SparseMoeBlock"
# both: the hit loop is traced over every expert and unrolled_loop reads the clamped silu-glu ("silu_glu" at inf)
CASES = [
    Case("hf_v5_step3p7", _SRC + " (no bound: clamp at inf)", Step3p7SparseMoeBlock, _input, form="unrolled_loop"),
    Case("hf_v5_step3p7_clamped", _SRC + " (layers 43-44: routed bound 7, shared 16)",
         lambda: Step3p7SparseMoeBlock(swiglu_limit=7.0, shared_limit=16.0), _input, form="unrolled_loop"),
]
