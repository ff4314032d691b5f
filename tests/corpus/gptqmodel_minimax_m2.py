"""MiniMax-M2's sparse MoE block as GPTQModel ports it for quantisation, mirrored from ModelCloud/GPTQModel
(``gptqmodel/hf_minimax_m2/modeling_minimax_m2.py`` at 0ba1419d: ``MiniMaxM2SparseMoeBlock``, ``MiniMaxM2MLP``), a
memory-lean rewrite of MiniMaxAI's remote code.

Style, in-place throughout:

- the router: ``gate`` in the weight's dtype, logits to float32, ``sigmoid`` scores (``scoring_func``), the
  ``e_score_correction_bias`` parameter added **in place** (``scores.add_(bias)``) after ``original_scores =
  scores``, so the "original" scores the weights are ``gather``ed from carry the bias too (the port's aliasing,
  kept); ``topk(sorted=True)``; the weights divided in place by their clamped sum (``div_``), scaled in place when
  ``routed_scaling_factor != 1``, cast to the tokens' dtype; ``del`` of the spent tensors;
- the experts: an ``nn.ModuleList`` of ``w1``/``w2``/``w3`` MLPs whose forward multiplies in place
  (``gate = act(w1(x)); gate.mul_(w3(x))``);
- the loop: ``one_hot(..).permute(2, 1, 0)``, ``expert_hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten()``,
  ``for expert_idx in expert_hit.tolist()`` (the hit experts as Python ints), and inside it a chunk loop ``for i in
  range(0, top_x_full.size(0), 1024)`` over the expert's rows; ``index_select`` of the rows, the expert output
  scaled in place by ``routing_weights[top_x, idx].unsqueeze(-1)`` (``mul_``), ``index_add_`` into
  ``zeros_like``. It returns ``(hidden, router_logits)``.

MiniMax-M2 runs 256 experts, top-8, sigmoid with the routing bias; here E = 6, k = 2, a scaling factor of 1.5 (the
in-place branch taken). The port is inference-only: ``scores.add_`` writes over the sigmoid's saved output, so a
backward through the block raises in eager; the case runs the block under ``torch.no_grad()`` inside the decoder
layer's residual add (the gradient is the residual's). Departures: the train-time jitter
(``hidden_states.mul_(noise)``) and the grouped top-k branch (off in the config) are left out.

Outcome: rewritten. ``expert_hit.tolist()`` of the top-k one-hot's hit vector is traced as the list of every
expert (``hit_lists.py``, with the hit loops' proof of the vector), and inside the body the chunk loop ``range(0,
top_x_full.size(0), 1024)`` over an expert's data-dependent row count is traced as one pass over all the rows
(``chunked_rows.py``: ``i`` is read only as ``t[i:i + chunk]`` of tensors of those rows, no local or Python state
carries from chunk to chunk), kept only where the rewrite takes the body. The four in-place spellings write tensors
the block has just made, under ``torch.no_grad()``, with no view of them taken before the write, so
each is read as the out-of-place op it equals (``passes/private_writes.py``): ``expert_output.mul_(weights)`` is
the routing weight on the output, ``gate.mul_(up)`` the gated activation, ``scores.add_(bias)`` the biased scores
``topk`` and ``gather`` read (``original_scores`` is the same tensor), ``routing_weights.div_(...)`` and
``.mul_(routed_scaling_factor)`` the normalised weights. Each alone kept the unrolled_loop proof from the body before
(the output weight: "no routing weight weights[tok, pos, None] scales the output, the input or the hidden state";
the gate and the scores: "a tensor the region computes from its inputs is changed in place before the region reads
it"; the weights: "an input of the region is changed in place elsewhere in the graph"); tests/test_private_inplace.py
has each spelling alone.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 6, 2


class MiniMaxM2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        gate = self.act_fn(self.w1(hidden_states))
        up = self.w3(hidden_states)
        gate.mul_(up)
        del up
        return self.w2(gate)


class MiniMaxM2SparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_dim = H
        self.experts = nn.ModuleList([MiniMaxM2MLP() for _ in range(E)])
        self.num_experts, self.top_k = E, K
        self.scoring_func = "sigmoid"
        self.routed_scaling_factor = 1.5
        self.gate = nn.Linear(H, E, bias=False)
        self.e_score_correction_bias = nn.Parameter(0.1 * torch.randn(E))

    def forward(self, hidden_states):
        batch_size, seq_len, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        gate_dtype = self.gate.weight.dtype
        router_logits = self.gate(hidden_states.to(gate_dtype)).to(torch.float32)
        correction_bias = self.e_score_correction_bias.to(router_logits.device, router_logits.dtype)
        if self.scoring_func == "sigmoid":
            scores = torch.sigmoid(router_logits)
        else:
            scores = torch.softmax(router_logits, dim=-1)
        original_scores = scores
        scores.add_(correction_bias)
        topk_scores, selected_experts = torch.topk(scores, self.top_k, dim=-1, sorted=True)
        routing_weights = original_scores.gather(1, selected_experts)
        del scores, original_scores, topk_scores
        routing_weights.div_(routing_weights.sum(dim=-1, keepdim=True).clamp(min=1e-12))
        if self.routed_scaling_factor != 1.0:
            routing_weights.mul_(self.routed_scaling_factor)
        routing_weights = routing_weights.to(hidden_states.dtype)
        selected_experts = selected_experts.to(torch.long)

        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        del selected_experts
        expert_hit = torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()
        chunk = 1024
        for expert_idx in expert_hit.tolist():
            expert_layer = self.experts[expert_idx]
            idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))
            for i in range(0, top_x_full.size(0), chunk):
                top_x = top_x_full[i: i + chunk]
                idx = idx_full[i: i + chunk]
                token_states = hidden_states.index_select(0, top_x)
                expert_output = expert_layer(token_states)
                weights = routing_weights[top_x, idx].unsqueeze(-1)
                expert_output.mul_(weights)
                final_hidden_states.index_add_(0, top_x, expert_output.to(final_hidden_states.dtype))
                del expert_output, token_states, idx, top_x, weights
            del idx_full, top_x_full
        final_hidden_states = final_hidden_states.view(batch_size, seq_len, hidden_dim)
        return final_hidden_states, router_logits


class Wrapped(nn.Module):
    """The decoder layer's ``hidden_states, router_logits = self.block_sparse_moe(hidden_states)`` and residual add,
    the block under ``torch.no_grad()`` as GPTQModel runs it (calibration and generation): its in-place ``add_`` on
    the sigmoid's output leaves no backward (eager raises "modified by an inplace operation")."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = MiniMaxM2SparseMoeBlock()

    def forward(self, x):
        residual = x
        with torch.no_grad():
            out, _router_logits = self.block_sparse_moe(x)
        return residual + out


CASES = [
    # the hit list is traced as every expert, the chunk loop as one pass over the rows, and the in-place writes on
    # the block's own fresh tensors as the out-of-place ops they equal
    Case("gptqmodel_minimax_m2", "ModelCloud/GPTQModel gptqmodel/hf_minimax_m2/modeling_minimax_m2.py "
         "MiniMaxM2SparseMoeBlock (hit list, row chunks, in-place)", Wrapped,
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop"),
]
