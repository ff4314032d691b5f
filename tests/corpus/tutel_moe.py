"""Tutel's MoE layer on one device, written after microsoft/tutel (``tutel/impls/moe_layer.py``: ``MOELayer.forward``;
``tutel/impls/fast_dispatch.py``: ``extract_critical``, ``GatingEncoder``/``GatingDecoder``, ``fast_encode``,
``fast_decode``; ``tutel/custom/custom_kernel.cpp``: ``invoke_cpu``, the CPU dispatch kernel; ``tutel/gates/top.py``:
``LinearTopKGate``; ``tutel/experts/ffn.py``: ``FusedExpertsNetwork``).

Style: index-based capacity. ``extract_critical`` takes ``topk(scores, k).indices`` of the softmax, ``chunk``s them
into k (T,) id vectors, builds a one-hot per choice (zeros + ``scatter_``), the gates ``(scores * mask).sum(1)``,
queue positions ``cumsum(mask, 0) - 1`` with choice j queued behind the counts of choices < j, each token's position
``sum(locations * mask, 1)`` as int32, the gates renormalised (``clamp(sum(gates), min=eps)``), and an int capacity
``k * int(capacity_factor * ceil(T / E))``. Unlike GShard/fairseq (padded_capacity) there is no (T, E, C) dispatch
tensor: tokens are written straight into an (E*C, H) buffer at row ``id * C + location`` (``+=``, kept only where
``location < C``), the experts run on its (E, C, H) view, and the combine reads the rows back per choice, times the
gate (post-score), zero for dropped tokens, summed over the choices.

Departure: tutel runs the dispatch and combine in its own C++ (CPU) / CUDA kernels under ``autograd.Function``s;
this module writes the CPU kernel's loops with torch ops (``index_add_`` at the kept rows for the encode, a masked
row read for the decode), which is what a pure-torch port of it does, and lets autograd make the backward (the
kernels' hand-written backward computes the same gradients).

Rewritten: ``passes/indexed_capacity.py`` proves the index dispatch (the rows, the drop at the slots' C, the
choice-major queue) and the row reads of the combine, and reads the experts as padded_capacity does (the mixed
weight layouts of ``FusedExpertsNetwork`` as transposed views).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 32, 24, 5, 2


def one_hot_with_dtype(data, num_classes, dtype):
    result = torch.zeros([data.size(0), num_classes], device=data.device, dtype=dtype)
    result.scatter_(1, data.unsqueeze(-1), 1)
    return result


def cumsum_sub_one(mask):
    return torch.cumsum(mask, dim=0) - 1


def extract_critical(scores, top_k, capacity_factor=1.0, normalize_gate=True):
    num_global_experts = int(scores.size(1))
    top_k = min(top_k, num_global_experts)
    topk_indices = torch.topk(scores, top_k, dim=1).indices
    indices_s = [x.view(-1) for x in topk_indices.chunk(top_k, dim=1)]
    masks_se = [one_hot_with_dtype(x, num_global_experts, x.dtype) for x in indices_s]
    gates_s = [(scores * x).sum(dim=1) for x in masks_se]

    locations1 = cumsum_sub_one(masks_se[0])
    locations_s = [torch.sum(locations1 * masks_se[0], dim=1).to(torch.int32)]
    if top_k > 1:
        acc_base = None
        for k in range(1, top_k):
            step = torch.sum(masks_se[k - 1], dim=0, keepdim=True)
            acc_base = step if acc_base is None else acc_base + step
            locations2 = cumsum_sub_one(masks_se[k])
            locations2 += acc_base
            locations_s.append(torch.sum(locations2 * masks_se[k], dim=1).to(torch.int32))
        if normalize_gate:
            denom_s = torch.clamp(sum(gates_s), min=torch.finfo(gates_s[0].dtype).eps)
            gates_s = [x / denom_s for x in gates_s]
    indices_s = [x.to(torch.int32) for x in indices_s]

    num_samples = int(scores.size(0))
    samples_per_expert = (num_samples + num_global_experts - 1) // num_global_experts
    capacity = top_k * int(capacity_factor * samples_per_expert)
    return num_global_experts, indices_s, locations_s, gates_s, capacity


def fast_encode(data, crit):
    """The CPU kernel's forward: ``dispatched[id * C + loc] += x`` for every choice whose ``loc < C`` (post-score:
    the gate is 1 here)."""
    num_global_experts, indices_s, locations_s, _, capacity = crit
    dispatched = torch.zeros([num_global_experts * capacity, data.size(-1)], dtype=data.dtype, device=data.device)
    for ids, locs in zip(indices_s, locations_s):
        kept = (locs < capacity) & (ids >= 0)
        rows = (ids.long() * capacity + locs.long())[kept]
        dispatched.index_add_(0, rows, data[kept])
    return dispatched.view(num_global_experts, -1, data.size(-1))


def fast_decode(data, crit):
    """The CPU kernel's backward-data loop, used as the decode: ``out[i] = gate * y[id * C + loc]`` where kept, zero
    elsewhere; summed over the choices."""
    num_global_experts, indices_s, locations_s, gates_s, capacity = crit
    data = data.reshape(num_global_experts * capacity, -1)
    last_result = None
    for ids, locs, gates in zip(indices_s, locations_s, gates_s):
        kept = (locs < capacity) & (ids >= 0)
        rows = (ids.long() * capacity + locs.long())[kept]
        single_output = torch.zeros([ids.size(0), data.size(-1)], dtype=data.dtype, device=data.device)
        single_output[kept] = gates[kept].unsqueeze(-1) * data[rows]
        last_result = single_output if last_result is None else last_result + single_output
    return last_result


class LinearTopKGate(nn.Module):
    def __init__(self, model_dim, num_global_experts, k, capacity_factor):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False)
        self.top_k, self.capacity_factor = k, capacity_factor

    def forward(self, x):
        return self.wg(x.to(dtype=self.wg.weight.dtype))


class FusedExpertsNetwork(nn.Module):
    def __init__(self, model_dim, hidden_size, num_experts):
        super().__init__()
        self.batched_fc1_w = nn.Parameter(torch.randn(num_experts, hidden_size, model_dim) * model_dim ** -0.5)
        self.batched_fc2_w = nn.Parameter(torch.randn(num_experts, hidden_size, model_dim) * hidden_size ** -0.5)
        self.batched_fc1_bias = nn.Parameter(torch.randn(num_experts, hidden_size) * 0.1)
        self.batched_fc2_bias = nn.Parameter(torch.randn(num_experts, model_dim) * 0.1)

    def forward(self, x):
        fc1_bias = self.batched_fc1_bias.unsqueeze(1)
        fc2_bias = self.batched_fc2_bias.unsqueeze(1)
        y = torch.matmul(x, self.batched_fc1_w.permute(0, 2, 1))
        y = torch.add(y, fc1_bias)
        y = F.relu(y)
        y = torch.matmul(y, self.batched_fc2_w)
        return torch.add(y, fc2_bias)


class MOELayer(nn.Module):
    def __init__(self, capacity_factor=1.0):
        super().__init__()
        self.gate = LinearTopKGate(H, E, K, capacity_factor)
        self.experts = FusedExpertsNetwork(H, I, E)

    def forward(self, input):
        original_shape = input.shape
        x = input.reshape(-1, original_shape[-1:].numel())
        logits = self.gate(x)
        scores = F.softmax(logits, dim=1)
        crit = extract_critical(scores, top_k=self.gate.top_k, capacity_factor=self.gate.capacity_factor)
        y = fast_encode(x.to(logits.dtype), crit).to(x.dtype)
        y = self.experts(y)
        y = fast_decode(y.to(logits.dtype), crit)
        return y.view(list(original_shape[:-1]) + [y.size(-1)]).to(input.dtype)


SOURCE = ("microsoft/tutel tutel/impls/moe_layer.py MOELayer + fast_dispatch.py extract_critical/fast_encode/"
          "fast_decode (custom_kernel.cpp invoke_cpu, in torch) + experts/ffn.py FusedExpertsNetwork")
CASES = [
    Case("tutel_moe", SOURCE + " (E=5, top-2, capacity_factor 1.0)", MOELayer,
         lambda T, g: torch.randn(1, T, H, generator=g), form="padded_capacity"),
]
