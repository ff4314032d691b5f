"""The sparsely-gated MoE of the ``mixture-of-experts`` package, mirrored from davidmrau/mixture-of-experts
(``moe.py``: ``SparseDispatcher``, ``MLP``, ``MoE``), a port of tensor2tensor's ``expert_utils`` that many
research repositories vendor.

Style: noisy top-k gating with the gate as raw parameters (``x @ self.w_gate``), ``topk(min(k + 1, E))`` of the
logits, softmax of the first k, scattered into ``zeros_like(logits, requires_grad=True)``; the importance and load
losses (``cv_squared``). The ``SparseDispatcher`` sorts ``torch.nonzero(gates)`` by expert (``.sort(0)``), splits
off the expert column, takes the batch index of each (token, expert) pair, counts ``(gates > 0).sum(0).tolist()``
as the part sizes, ``gather``-s the non-zero gates; ``dispatch`` indexes ``inp[batch_index]`` and
``torch.split``-s it by the part sizes; the experts run in a list comprehension; ``combine`` concatenates, leaves
log space with ``.exp()``, multiplies by the gates, ``index_add``-s into a ``zeros(..., requires_grad=True)``,
replaces exact zeros by ``np.finfo(float).eps`` and returns ``.log()``. Each expert is the package's ``MLP``:
``fc1 -> ReLU -> fc2 -> Softmax(1)`` with biases.

The forward returns ``(y, loss)``; the wrapper keeps ``y``, as a caller adds the loss to its own. Eval mode: the
noise is drawn only in training, so eager is deterministic. ``w_gate`` is randomly initialised (the package's zeros
tie every logit and make the top-k order arbitrary). E = 5 (not a power of two), k = 2.

Outcome: the two tensor creations with ``requires_grad=True`` (the gating's ``zeros_like`` and ``combine``'s
``zeros``) are graph breaks under Dynamo, so the router, the dispatch with the experts and the combine land in
different graphs; no pass sees the layer whole and the region with the router is left alone (eager-equal). The
combine in log space (``exp`` of softmaxed expert outputs, ``log`` of their weighted sum) is not a weighted sum of
expert outputs either, so even one graph would not be a plain MoE form.
"""
import numpy as np
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 5, 2


class SparseDispatcher(object):
    def __init__(self, num_experts, gates):
        self._gates = gates
        self._num_experts = num_experts
        sorted_experts, index_sorted_experts = torch.nonzero(gates).sort(0)
        _, self._expert_index = sorted_experts.split(1, dim=1)
        self._batch_index = torch.nonzero(gates)[index_sorted_experts[:, 1], 0]
        self._part_sizes = (gates > 0).sum(0).tolist()
        gates_exp = gates[self._batch_index.flatten()]
        self._nonzero_gates = torch.gather(gates_exp, 1, self._expert_index)

    def dispatch(self, inp):
        inp_exp = inp[self._batch_index].squeeze(1)
        return torch.split(inp_exp, self._part_sizes, dim=0)

    def combine(self, expert_out, multiply_by_gates=True):
        # the experts end in a softmax; the package combines in log space
        stitched = torch.cat(expert_out, 0).exp()
        if multiply_by_gates:
            stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1), requires_grad=True, device=stitched.device)
        combined = zeros.index_add(0, self._batch_index, stitched.float())
        combined[combined == 0] = np.finfo(float).eps
        return combined.log()

    def expert_to_gates(self):
        return torch.split(self._nonzero_gates, self._part_sizes, dim=0)


class MLP(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.relu = nn.ReLU()
        self.soft = nn.Softmax(1)

    def forward(self, x):
        return self.soft(self.fc2(self.relu(self.fc1(x))))


class MoE(nn.Module):
    def __init__(self, input_size, output_size, num_experts, hidden_size, noisy_gating=True, k=4):
        super().__init__()
        self.noisy_gating, self.num_experts, self.k = noisy_gating, num_experts, k
        self.output_size, self.input_size, self.hidden_size = output_size, input_size, hidden_size
        self.experts = nn.ModuleList([MLP(input_size, output_size, hidden_size) for _ in range(num_experts)])
        # random, not the package's zeros: tied logits would leave the top-k choice to the sort's whim
        self.w_gate = nn.Parameter(torch.randn(input_size, num_experts) * input_size ** -0.5)
        self.w_noise = nn.Parameter(torch.zeros(input_size, num_experts))
        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)
        self.register_buffer("mean", torch.tensor([0.0]))
        self.register_buffer("std", torch.tensor([1.0]))
        assert self.k <= self.num_experts

    def cv_squared(self, x):
        eps = 1e-10
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def _gates_to_load(self, gates):
        return (gates > 0).sum(0)

    def noisy_top_k_gating(self, x, train, noise_epsilon=1e-2):
        clean_logits = x @ self.w_gate
        if self.noisy_gating and train:
            raw_noise_stddev = x @ self.w_noise
            noise_stddev = self.softplus(raw_noise_stddev) + noise_epsilon
            logits = clean_logits + (torch.randn_like(clean_logits) * noise_stddev)
        else:
            logits = clean_logits
        top_logits, top_indices = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, :self.k]
        top_k_indices = top_indices[:, :self.k]
        top_k_gates = self.softmax(top_k_logits)
        zeros = torch.zeros_like(logits, requires_grad=True)
        gates = zeros.scatter(1, top_k_indices, top_k_gates)
        # eval mode only (the case builds the module in eval): the load is the count of routed tokens
        load = self._gates_to_load(gates)
        return gates, load

    def forward(self, x, loss_coef=1e-2):
        gates, load = self.noisy_top_k_gating(x, self.training)
        importance = gates.sum(0)
        loss = self.cv_squared(importance) + self.cv_squared(load)
        loss *= loss_coef
        dispatcher = SparseDispatcher(self.num_experts, gates)
        expert_inputs = dispatcher.dispatch(x)
        gates = dispatcher.expert_to_gates()
        expert_outputs = [self.experts[i](expert_inputs[i]) for i in range(self.num_experts)]
        y = dispatcher.combine(expert_outputs)
        return y, loss


class Wrapped(nn.Module):
    """A caller unpacks ``y, aux_loss = moe(x)`` and adds the loss to its own."""

    def __init__(self):
        super().__init__()
        self.moe = MoE(H, H, E, I, noisy_gating=True, k=K)

    def forward(self, x):
        y, _loss = self.moe(x)
        return y


CASES = [Case("davidmrau_moe", "davidmrau/mixture-of-experts moe.py MoE + SparseDispatcher", lambda: Wrapped().eval(),
              lambda T, g: torch.randn(T, H, generator=g), form="split_loop",
              expect=("left_alone", "moe_region", "no MoE form proves"))]
