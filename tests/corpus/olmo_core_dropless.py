"""OLMo-core's dropless MoE without expert parallelism, written after allenai/OLMo-core
(``src/olmo_core/nn/moe/moe.py``: ``DroplessMoE``; ``router.py``: ``MoELinearRouter``,
``MoERouter.forward``/``get_top_k``; ``parallel_mlp.py``: ``ParallelDroplessMLP`` with
``ParallelMLPBase.forward``/``indices_and_bins``; ``mlp.py``: ``DroplessMoEMLP`` and its grouped-GEMM fallback;
``ops/moe.py``: ``batched_histc``; ``kernels/moe.py``: ``gather``/``scatter``).

Style: megablocks' dispatch. The router keeps its (E * d,) weight flat and ``view``s it (E, d) for an ``F.linear`` on
fp32 casts; softmax, ``topk``, the weights divided by their L1 ``torch.norm`` (``normalize_expert_weights=1``); the
per-expert counts by ``batched_histc`` (zeros + ``scatter_add_`` of ones over the (B, S, k) ids, summed over B and
S) under ``torch.no_grad()``. The experts module flattens weights and ids, sorts the flat ids (``torch.sort`` of the
int ids gives ``bin_ids, indices``; ``cumsum(counts, out=bins)``), gathers row ``indices // top_k`` for each sorted
slot, runs the grouped MLP (three (E * I, d) weights viewed (E, I, d): ``gmm(x, w1, trans_b=True)``, ``gmm(x, w3,
trans_b=True)``, ``silu(x1) * x2``, ``gmm(x1, w2)``), and scatters back: slot j's output times ``weights[indices[j]]``
is written to row ``indices[j]`` of a (T * k, d) buffer, viewed (T, k, d) and summed over k.

``DroplessMoEMLP.gmm`` without the ``grouped_gemm`` package is OLMo-core's own torch fallback, kept as written: a loop
over ``batch_sizes.cpu().numpy()`` with ``x[start:start + size] @ w[i].t()`` slices and a ``cat``, under
``@torch._dynamo.disable()``.

Departures: the gather and scatter are Triton kernels in OLMo-core (GPU only); here they are the torch ops that
compute what the kernels do (a row index read, an index write into ``empty`` + ``view(T, k, d).sum(1)``), with
autograd making the backward. The router's metric accumulators (hidden tensors, training only) and the auxiliary
losses are left out.

Today: the ``@torch._dynamo.disable()`` on ``gmm`` splits the layer into graphs around each of the three grouped
GEMMs, so no pass sees the MoE whole (a graph break, as it would be under any torch.compile backend). Without the
decorator the whole layer traces as one graph (the numpy loop included) and is left alone at the router: megablocks'
sort + ``indices // top_k`` gather with a per-expert slice loop is not a form yet.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

D, HID, E, K = 32, 16, 6, 2


def batched_histc(x, num_classes):
    hist = torch.zeros((*x.shape[:-1], num_classes), dtype=x.dtype, device=x.device)
    ones = torch.ones_like(x)
    hist.scatter_add_(-1, x, ones)
    return hist


def gather(x, indices, top_k):
    """The kernel's A-to-B copy without padding: sorted slot j reads token ``indices[j] // top_k``."""
    return x[indices.long() // top_k]


def scatter(x, indices, weights, top_k):
    """The kernel's B-to-A copy: slot j, scaled by ``weights[indices[j]]``, lands in row ``indices[j]`` of (T * k, d);
    then the sum over the k choices."""
    tokens = indices.shape[0] // top_k
    out = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    idx = indices.long()
    out[idx] = x * weights[idx].unsqueeze(-1)
    return out.view(tokens, top_k, x.shape[1]).sum(dim=1)


class MoELinearRouter(nn.Module):
    def __init__(self, d_model, num_experts, top_k):
        super().__init__()
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.normalize_expert_weights = 1.0
        self.weight = nn.Parameter(torch.randn(num_experts * d_model) * d_model ** -0.5)

    def get_expert_logits(self, x):
        return F.linear(x.float(), self.weight.view(self.num_experts, self.d_model).float())

    def forward(self, x):
        logits = self.get_expert_logits(x).float()
        scores = logits.softmax(dim=-1)
        expert_weights, expert_indices = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize_expert_weights is not None:
            expert_weights = expert_weights.div(
                torch.norm(expert_weights, p=self.normalize_expert_weights, dim=-1, keepdim=True))
        with torch.no_grad():
            batched = batched_histc(expert_indices, self.num_experts)
            batched = batched.sum(dim=1)
            batch_size_per_expert = batched.sum(dim=0)
        return expert_weights, expert_indices, batch_size_per_expert


class DroplessMoEMLP(nn.Module):
    def __init__(self, d_model, hidden_size, num_experts):
        super().__init__()
        self.d_model, self.hidden_size, self.num_experts = d_model, hidden_size, num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts * hidden_size, d_model) * d_model ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts * hidden_size, d_model) * hidden_size ** -0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts * hidden_size, d_model) * d_model ** -0.5)

    @torch._dynamo.disable()
    def gmm(self, x, w, batch_sizes, trans_b=False):
        out = []
        start = 0
        for i, size in enumerate(batch_sizes.cpu().numpy()):
            rhs = w[i, :, :].t() if trans_b else w[i, :, :]
            out.append(x[start:start + size, :] @ rhs)
            start += size
        return torch.cat(out)

    def forward(self, x, batch_size_per_expert):
        w1 = self.w1.view(self.num_experts, self.hidden_size, self.d_model)
        w2 = self.w2.view(self.num_experts, self.hidden_size, self.d_model)
        w3 = self.w3.view(self.num_experts, self.hidden_size, self.d_model)
        x1 = self.gmm(x, w1, batch_size_per_expert, trans_b=True)
        x2 = self.gmm(x, w3, batch_size_per_expert, trans_b=True)
        x1 = F.silu(x1) * x2
        return self.gmm(x1, w2, batch_size_per_expert)


class ParallelDroplessMLP(nn.Module):
    def __init__(self, mlp, top_k):
        super().__init__()
        self.mlp, self.top_k = mlp, top_k

    def indices_and_bins(self, expert_indices, batch_size_per_expert):
        expert_indices = expert_indices.int()
        bin_ids, indices = torch.sort(expert_indices)
        bins = torch.empty_like(batch_size_per_expert, dtype=torch.int32)
        torch.cumsum(batch_size_per_expert, 0, out=bins)
        return indices.int(), bin_ids, bins

    def forward(self, x, expert_weights, expert_indices, batch_size_per_expert):
        in_shape = x.size()
        x = x.view(-1, x.shape[-1])
        expert_weights = expert_weights.flatten()
        expert_indices = expert_indices.flatten()
        with torch.no_grad():
            indices, bin_ids, bins = self.indices_and_bins(expert_indices, batch_size_per_expert)
        x = gather(x, indices, self.top_k)
        x = self.mlp(x, batch_size_per_expert)
        x = scatter(x, indices, expert_weights, self.top_k)
        return x.view(in_shape)


class DroplessMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = MoELinearRouter(D, E, K)
        self.experts = ParallelDroplessMLP(DroplessMoEMLP(D, HID, E), K)

    def forward(self, x):
        expert_weights, expert_indices, batch_size_per_expert = self.router(x)
        return self.experts(x, expert_weights.to(x.dtype), expert_indices, batch_size_per_expert)


SOURCE = ("allenai/OLMo-core src/olmo_core/nn/moe/ (moe.py DroplessMoE, router.py MoELinearRouter, parallel_mlp.py "
          "ParallelDroplessMLP, mlp.py DroplessMoEMLP gmm fallback) + ops/moe.py batched_histc")
CASES = [
    Case("olmo_core_dropless", SOURCE + " (E=6, top-2)", DroplessMoE,
         lambda T, g: torch.randn(1, T, D, generator=g), form="sorted_grouped_mm",
         expect=("graph_break",)),
]
