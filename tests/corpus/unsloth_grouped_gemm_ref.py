"""Unsloth's torch-native grouped-GEMM reference of the Qwen3-MoE block, mirrored from unslothai/unsloth
(``unsloth/kernels/moe/grouped_gemm/reference/layers/qwen3_moe.py``: ``Qwen3MoeGroupedGEMMBlock``;
``unsloth/kernels/moe/grouped_gemm/reference/moe_ops.py``: ``permute``, ``unpermute``, ``get_routing_indices``,
``torch_grouped_gemm``), the block Unsloth's Triton grouped GEMM is tested against.

Style: the router is a raw (E, H) parameter called through ``F.linear``; ``softmax(dtype=torch.float)``, top-k,
renormalised in place (``/=``, ``norm_topk_prob``) and cast back to the input's dtype. ``get_routing_indices``
runs under ``@torch.no_grad()``: ``histc`` of the flat expert ids (bins=E, min=0, max=E) for the counts and a
stable ``argsort`` of the flat ids for the gather order. ``permute`` gathers ``X[gather_indices // topk]``. Both
GEMMs go through ``torch_grouped_gemm``: a zero (M, N) result, a Python loop over the experts reading
``m_size = m_sizes[g]`` (a 0-d tensor), ``if m_size > 0:``, slicing ``X[m_start:m_end]`` with tensor bounds,
``X_g @ W[g].T`` written back by slice assignment. The fused gate/up weight is (E, 2I, H), split by slicing the
last dim (``act_fn(x[..., :I]) * x[..., I:]``). ``unpermute`` is ``torch.empty_like`` + ``index_copy_(0,
gather_indices, X)``; the k outputs are merged by ``view(T, k, H) * weights[..., None]`` and ``sum(dim=1)``.
The block returns ``(hidden_states, router_logits)``.

Departures: ``histc`` gets the ids as floats and its counts are cast back to the ids' dtype (CPU's histc has no
integer kernel; on the GPU, where Unsloth runs it, histc of the int64 ids gives int64 counts, which the slicing
needs); the block returns the final tensor rather than the debugging ``GroupedGEMMResult`` of every intermediate.

Rewritten: ``m_sizes[g]`` of the proven per-expert counts (histc of the top-k ids) reads the count as a number,
as eager does at the ``if`` and at each slice (``host_counts.subscript``), and ``if m_size > 0:`` is the skip of an
expert with no rows (``speculation.py``); each ``torch_grouped_gemm`` is then a zeros buffer written expert by
expert at running slices (``passes/sliced_gemm.py``), and the ``index_copy_`` unpermute and the weighted (T, k, H)
merge are the weighted unsort of ``passes/sorted_grouped_mm.py``. The counts and sort run under ``torch.no_grad()``:
integer routing (and its float histc), which carries no gradient in any mode (``passes/grad_modes.py``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 2


def permute(X, gather_indices, topk):
    X = X.view(-1, X.shape[-1])
    if topk == 1:
        return X[gather_indices]
    return X[gather_indices // topk]


def unpermute(X, gather_indices):
    X = X.view(-1, X.shape[-1]) if X.ndim > 2 else X
    out = torch.empty_like(X)
    out.index_copy_(0, gather_indices, X)
    return out.view_as(X)


@torch.no_grad()
def get_routing_indices(selected_experts, num_experts):
    flat = selected_experts.view(-1)
    token_counts_by_expert = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).to(flat.dtype)
    gather_indices = torch.argsort(flat, stable=True)
    return token_counts_by_expert, gather_indices


def torch_grouped_gemm(X, W, m_sizes, transpose=True):
    X = X.view(-1, X.shape[-1])
    M = X.shape[0]
    N = W.shape[1]
    result = torch.zeros((M, N), dtype=X.dtype, device=X.device)
    m_start = 0
    for g in range(m_sizes.shape[0]):
        m_size = m_sizes[g]
        if m_size > 0:
            m_end = m_start + m_size
            W_g = W[g].T if transpose else W[g]
            result[m_start:m_end] = X[m_start:m_end] @ W_g
            m_start = m_end
    return result


class Qwen3MoeGroupedGEMMBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, True
        self.hidden_size, self.moe_intermediate_size = H, I
        self.gate = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def act_and_mul(self, x):
        return self.act_fn(x[..., : self.moe_intermediate_size]) * x[..., self.moe_intermediate_size:]

    def run_router(self, hidden_states):
        router_logits = F.linear(hidden_states, self.gate)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        return router_logits, routing_weights.to(hidden_states.dtype), selected_experts

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        num_tokens = batch_size * sequence_length
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits, routing_weights, selected_experts = self.run_router(hidden_states)
        token_counts_by_expert, gather_indices = get_routing_indices(selected_experts, self.num_experts)
        hidden_states = permute(hidden_states, gather_indices, self.top_k)
        first_gemm = torch_grouped_gemm(hidden_states, self.gate_up_proj, token_counts_by_expert)
        intermediate = self.act_and_mul(first_gemm)
        second_gemm = torch_grouped_gemm(intermediate, self.down_proj, token_counts_by_expert)
        unpermuted = unpermute(second_gemm, gather_indices)
        hidden_states = unpermuted.view(num_tokens, self.top_k, hidden_dim) * routing_weights[..., None]
        hidden_states = hidden_states.sum(dim=1)
        return hidden_states.view(batch_size, sequence_length, hidden_dim), router_logits


class Wrapped(nn.Module):
    """The decoder layer keeps the hidden states and drops the router logits."""

    def __init__(self):
        super().__init__()
        self.mlp = Qwen3MoeGroupedGEMMBlock()

    def forward(self, x):
        out, _router_logits = self.mlp(x)
        return out


_SRC = ("unslothai/unsloth unsloth/kernels/moe/grouped_gemm/reference/layers/qwen3_moe.py Qwen3MoeGroupedGEMMBlock"
        " + reference/moe_ops.py")
CASES = [
    Case("unsloth_grouped_gemm_ref", _SRC, Wrapped, lambda T, g: torch.randn(2, T, H, generator=g),
         form="sorted_grouped_mm",
         # 2.11's Dynamo fails on the count slices (README): the frames holding them fall back, the router's is noted
         before_2_13=("left_alone", "moe_region", "no MoE form proves")),
]
