"""Snowflake's ArcticTraining MoE, mirrored from snowflakedb/ArcticTraining (``arctic_training/model/moe/moe.py``:
``ArcticMoE``, ``torch_group_gemm_fn``, ``MoEConfig``), its pure-torch path (``use_triton=False``).

Style: the router and the experts are raw parameters: ``F.linear(x, router_gate)`` with an (E, H) gate; softmax in
fp32, ``topk``, optional renormalisation (``normalize_topk_scores``), the scores cast to the input dtype and made
k-major (``.t().reshape(-1)``); an (E, T*k) one-hot ``.t()`` whose rows give the slots of each expert by
``torch.cat([torch.where(mask[i])[0] for i in range(E)])``, the scores picked at those slots and the token of each
slot as ``slots % T``; a load-balancing gradient hook (``probs.register_hook``) instead of an auxiliary loss. The
expert-sorted rows ``x[slots]`` go through ``torch_group_gemm_fn`` twice: a ``zeros((rows_cumsum[-1], N))`` output
filled by ``C[start:end, :] = A[start:end, :] @ B[i]`` per expert, the bounds read from the token counts'
``cumsum``; the first with the (E, H, 2I) ``expert_gate_up`` whose gate and up columns are interleaved
(``intermediate[..., 0::2]`` / ``[..., 1::2]``, ``(up + up_scale) * act(gate * gate_scale)``), the second with the
(E, I, H) ``expert_down``. The combine is ``zeros.index_add_(0, slots, out * scores[:, None])``.

Departures: one rank (``ep_size=1``: no all-to-all, no ``local_ep_transpose``) and no ``torch.cuda.Stream`` (a CPU
test); the weights are randomly initialised (the source leaves them ``torch.empty`` for its initialiser). E = 6
(not a power of two), k = 2, SiLU.

Outcome: one graph per shape, no graph break (the hook and the ``cumsum``-bounded slices trace), rewritten by the
split_loop form's bounded-slices proof (``passes/bounded_gemm.py``): each ``torch_group_gemm_fn`` buffer is proven
the grouped GEMM of the expert-sorted rows over the counts' running sums, the slots the cat of one one-hot's
``where`` rows, and the interleaved gate/up, the scores and the ``index_add_`` read at those slots. The
load-balancing hook stays in the graph (a rewrite must not drop it: ``aliases.is_impure``).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 8, 6, 2


@dataclass(kw_only=True)
class MoEConfig:
    act_fn: object
    ep_size: int
    input_dtype: torch.dtype
    intermediate_dim: int
    is_gated: bool = True
    loss_coeff: float = 0.01
    model_dim: int
    normalize_topk_scores: bool
    num_experts: int
    return_router_scores: bool
    top_k: int
    use_triton: bool = True


def torch_group_gemm_fn(A, B, rows_cumsum):
    C = torch.zeros((rows_cumsum[-1], B.shape[-1]), device=A.device, dtype=A.dtype)
    for i in range(len(rows_cumsum)):
        start = 0 if i == 0 else rows_cumsum[i - 1]
        end = rows_cumsum[i]
        C[start:end, :] = torch.matmul(A[start:end, :], B[i])
    return C


class ArcticMoE(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self._config = config
        self.act_fn, self.ep_size, self.input_dtype = config.act_fn, config.ep_size, config.input_dtype
        self.intermediate_dim, self.model_dim = config.intermediate_dim, config.model_dim
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.num_local_experts = self.num_experts // self.ep_size
        self.router_gate = nn.Parameter(torch.randn(self.num_experts, self.model_dim) * self.model_dim ** -0.5)
        gate_up_dim = (2 * self.intermediate_dim) if config.is_gated else self.intermediate_dim
        self.expert_gate_up = nn.Parameter(
            torch.randn(self.num_local_experts, self.model_dim, gate_up_dim) * self.model_dim ** -0.5)
        self.gate_scale = 1.0
        self.up_scale = 0.0
        self.expert_down = nn.Parameter(
            torch.randn(self.num_local_experts, self.intermediate_dim, self.model_dim) * self.intermediate_dim ** -0.5)
        # the Triton grouped GEMM is the source's default; this mirror takes its torch fallback
        assert not config.use_triton
        self.moegemm = torch_group_gemm_fn

    def GroupGeMM(self, x, expert_token_count_cumsum):
        intermediate = self.moegemm(x, self.expert_gate_up, expert_token_count_cumsum)
        if self._config.is_gated:
            gate, up = intermediate[..., 0::2], intermediate[..., 1::2]
            gate = self.act_fn(gate * self.gate_scale)
            intermediate = (up + self.up_scale) * gate
        return self.moegemm(intermediate, self.expert_down, expert_token_count_cumsum)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(hidden_states, self.router_gate)
        moe_input, expert_token_count, expert_token_rcv_count, scores, token_mapped_slots = self.MoERouter(
            hidden_states, logits)
        expert_token_count_cumsum = expert_token_count.cumsum(0)  # ep_size == 1: no exchange of tokens
        moe_output = self.GroupGeMM(moe_input, expert_token_count_cumsum)
        output = self.MoECombine(moe_output, token_mapped_slots, scores)
        output = output.reshape(orig_shape)
        return (output, scores) if self._config.return_router_scores else output

    def MoERouter(self, hidden_states, logits):
        scores, token_mapped_slots, expert_token_count, expert_token_rcv_count = self._gate(logits)
        moe_input = hidden_states[token_mapped_slots]
        return moe_input, expert_token_count, expert_token_rcv_count, scores, token_mapped_slots

    def _gate(self, logits):
        logits = logits.view(-1, self.num_experts)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        topk_scores, topk_expert_indices = torch.topk(probs, k=self.top_k, dim=-1)
        if self._config.normalize_topk_scores:
            topk_scores = topk_scores / torch.sum(topk_scores, dim=-1, keepdim=True)
        topk_scores = topk_scores.to(self._config.input_dtype)
        topk_scores = topk_scores.t().reshape(-1)
        topk_expert_indices = topk_expert_indices.t().reshape(-1)
        T = probs.shape[0]
        topk_expert_mask = F.one_hot(topk_expert_indices, num_classes=self.num_experts).t()
        token_mapped_slots = torch.cat([torch.where(topk_expert_mask[i])[0] for i in range(topk_expert_mask.shape[0])])
        topk_scores = topk_scores[token_mapped_slots]
        token_mapped_slots = token_mapped_slots % T
        expert_token_count = topk_expert_mask.sum(dim=-1)
        total_count = expert_token_count.sum()
        expert_freq = expert_token_count / total_count
        expert_token_rcv_count = expert_token_count

        def _load_balance_grad_hook(grad):
            # the gradient of sum(mean(probs) * freq), added to the router's instead of an auxiliary loss
            coeff = self._config.loss_coeff / T / 1
            return grad + expert_freq.unsqueeze(0) * coeff / self.ep_size

        if probs.requires_grad:
            probs.register_hook(_load_balance_grad_hook)
        return topk_scores, token_mapped_slots, expert_token_count, expert_token_rcv_count

    def MoECombine(self, moe_output, token_mapped_slots, scores):
        output = torch.zeros(
            (moe_output.shape[0] // self.top_k, self.model_dim), dtype=moe_output.dtype, device=moe_output.device)
        output.index_add_(0, token_mapped_slots, moe_output * scores[:, None])
        return output


def _build(normalize=True):
    return ArcticMoE(MoEConfig(act_fn=F.silu, ep_size=1, input_dtype=torch.float32, intermediate_dim=I, model_dim=H,
                               normalize_topk_scores=normalize, num_experts=E, return_router_scores=False, top_k=K,
                               use_triton=False))


CASES = [Case("arctic_training_moe", "snowflakedb/ArcticTraining arctic_training/model/moe/moe.py ArcticMoE "
              "(torch_group_gemm_fn)", _build, lambda T, g: torch.randn(1, T, H, generator=g), form="split_loop",
              expect=("rewritten",),
              before_2_13=("fell_back",))]  # 2.11's Dynamo fails inside its own tracing here (README)
