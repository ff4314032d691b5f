"""Two per-expert loops from small public training repositories found in the index (a vision-language fine-tune of
Mistral, and a from-scratch "mini LLM"), the kind of MoE code people write for themselves rather than a framework's.

``GumbelMoE`` (two ``MistralMLP``-style experts, "soft" routing): the router's softmax made one-hot by a
straight-through estimator, ``hard - probs.detach() + probs``; each expert takes the tokens whose straight-through
value ``== 1`` (``torch.where(onehot[:, e] == 1)[0]``), scaled by that value ``.unsqueeze(-1)``, ``index_add_``ed
into zeros; an expert with no tokens runs on a one-row dummy input added times 0.0 to the first row (FSDP keeps
every expert in the collective). Eval mode: no Gumbel noise, no router dropout. The frame falls back to plain capture,
equal to eager: the branch on ``token_indices.numel() > 0`` is data-dependent, and its no-tokens side is no skip (it
runs the expert on a dummy row and adds ``0.0 *`` its output to row 0, which is NaN where that output is not finite),
so it is not assumed away. Nor is the loop a top-1 MoE of ``argmax`` for every input. The straight-through value
itself is exact: ``(1 - p) + p`` is exactly 1 and ``(0 - p) + p`` exactly 0 for every p in [0, 1] in fp32, bf16
and fp16 (round to nearest even; test_corpus_fallbacks.py checks it), so on a row of finite probabilities the
``== 1`` selection is the argmax. But a row whose probabilities are NaN (a NaN in its token) is selected by no
expert and stays zero in eager, where a top-1 MoE of its argmax would write NaN.

``MiniLLMMoE``: fp32 softmax over the router, ``topk(sorted=False)``, renormalised with ``clamp_min``; the loop over
``enumerate(self.experts)`` with ``torch.where(topk_indices == e)``, ``if token_indices.numel() > 0:``, the expert on
``index_select`` rows, the weight ``.to(expert_output.dtype).unsqueeze(-1)``, the product cast to the buffer's
dtype and added out of place (``routed = routed.index_add(0, tok, c)``); ``elif self.training:`` links an idle
expert's parameters into the graph at zero (DDP), into ``link = routed.new_zeros(())``, added after the loop. Eval
mode, where that branch never runs: Dynamo reads ``self.training`` as the constant False, so the no-tokens side goes
straight to the next iteration and the skip is assumed away (``loop_bytecode.through_constant_test``); the buffer's
other reader, ``new_zeros``, reads its shape and dtype only (``fx_utils.reads_metadata_only``), so the chain of adds
is rewritten as form "unrolled_loop".
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I = 16, 12


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GumbelMoE(nn.Module):
    def __init__(self, num_experts=2):
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(MLP() for _ in range(num_experts))
        self.gate = nn.Linear(H, num_experts, bias=False)
        self.router_dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, temperature=1.0):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        flat = hidden_states.view(-1, hidden_dim)
        logits = self.router_dropout(self.gate(flat))
        if self.training:
            y = (logits - torch.empty_like(logits).exponential_().log()) / temperature
        else:
            y = logits / temperature
        probs = F.softmax(y, dim=-1)
        hard = torch.zeros_like(probs).scatter_(1, probs.argmax(dim=-1, keepdim=True), 1.0)
        onehot = hard - probs.detach() + probs
        out = torch.zeros_like(flat)
        for expert_idx, expert in enumerate(self.experts):
            token_indices = torch.where(onehot[:, expert_idx] == 1)[0]
            if token_indices.numel() > 0:
                expert_output = expert(flat[token_indices])
                weights = onehot[token_indices, expert_idx].unsqueeze(-1)
                out.index_add_(0, token_indices, (expert_output * weights).to(out.dtype))
            else:
                dummy = expert(flat[:1])
                out[:1] += dummy.to(out.dtype) * 0.0
        return out.view(batch_size, sequence_length, hidden_dim)


class MiniLLMMoE(nn.Module):
    def __init__(self, num_experts=6, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(H, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(num_experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        states = hidden_states.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(states).float(), dim=-1)
        topk_weights, topk_indices = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        routed = torch.zeros_like(states)
        link = routed.new_zeros(())
        for expert_index, expert in enumerate(self.experts):
            token_indices, selected_slots = torch.where(topk_indices == expert_index)
            if token_indices.numel() > 0:
                expert_output = expert(states.index_select(0, token_indices))
                weights = topk_weights[token_indices, selected_slots]
                weighted = expert_output * weights.to(expert_output.dtype).unsqueeze(-1)
                routed = routed.index_add(0, token_indices, weighted.to(routed.dtype))
            elif self.training:
                link = link + sum((p.sum() * 0.0 for p in expert.parameters()), start=routed.new_zeros(()))
        routed = routed + link.to(routed.dtype)
        return routed.reshape(shape)


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


CASES = [
    Case("hobby_gumbel_straight_through", "a Mistral vision-language fine-tune's two-expert MoELayer "
         "(_soft_routing_forward: Gumbel straight-through top-1, FSDP dummy call)", lambda: GumbelMoE().eval(),
         _input, form="unrolled_loop", expect=("fell_back",)),
    Case("hobby_minillm", "a from-scratch mini LLM's sparse MoE (out-of-place index_add, DDP link when training)",
         lambda: MiniLLMMoE().eval(), _input, form="unrolled_loop"),
]
