"""LLaMA-MoE's MoE layer, mirrored from pjlab-sys4nlp/llama-moe (``smoe/modules/moe/moe_layers.py``:
``BaseMoELayer``, ``LinearGLUMoELayer``; ``moe_gates.py``: ``TopKBalancedNoisyGate``, ``SwitchBalancedGate``;
``moe_calculators.py``: ``UniversalCalculator``, ``SwitchDropTokenCalculator``; ``moe_experts.py``:
``LinearGLUExperts``), the layer LLaMA-MoE's checkpoints (a LLaMA FFN split into experts) run.

Style: the experts are one module holding ``nn.ParameterList``s of per-expert (I, H) / (H, I) weights (and biases),
called as ``experts(x, i)``: ``F.linear`` by ``weight_gate[i]``, ``act(gate) * up``, ``F.linear`` by
``weight_down[i]``. The gate network is ``Linear(H, E) -> Tanh -> Linear(E, E)`` (``gate_network="mlp"``). The gate
returns a dict; its load and importance go to the host (``.tolist()``).

- ``pjlab_llama_moe_topk``: ``TopKBalancedNoisyGate`` in eval (no noise): ``topk(k + 1)`` sliced to k, a softmax over
  the k (``nn.Softmax(1)``), the scores ``scatter``ed into ``zeros_like(logits, requires_grad=True)`` for the
  importance, the load ``(scores_filtered > 0).sum(0)``, a cv-squared balance loss. ``UniversalCalculator``: the flat
  ids ``sort``ed, scores and ``arange(T).repeat_interleave(k)`` token ids ``index_select``ed in that order, the
  per-expert counts ``bincount(minlength=E).tolist()``, ``torch.split`` of the sorted rows by the counts, a list
  comprehension over the experts that skips empty splits, ``torch.cat``, ``torch.mul`` by the sorted scores times
  ``score_scale_factor``, and ``zeros.index_add(0, sorted_batch_indices, out)`` (out of place). The gate's breaks
  hand the ids to the calculator's frame as inputs, so the bincount's length E is asserted at run time there (an id
  of E or more fails it, where eager's split of more pieces than its loop reads fails too), and the loop is read as
  a split loop with its skips of empty experts speculated (tests/test_llama_moe_calculator.py).
- ``pjlab_llama_moe_switch``: ``SwitchBalancedGate`` (top-1: ``torch.max`` of the raw logits, so the expert's output is
  scaled by its LOGIT, not a probability; ``add_noise=False``, as the source's ``gumbel_rsample`` import is
  commented out) and ``SwitchDropTokenCalculator`` with ``drop_tokens=False``: ``for i in range(E)``, ``(ids ==
  i).nonzero(as_tuple=True)[0]``, ``if num_assigned_tokens > 0``, ``y[token_indices, :] = expert(...)``, then ``y *
  scores.reshape(-1, 1) * factor``. (Token dropping shuffles with ``torch.randperm``, which a compiled step and an
  eager step cannot share.) The loop is read as a top-1 MoE with weights of 1 (each row written once by its expert,
  a row of no expert left zero as the op leaves an out-of-range id), the scale after it left to the graph.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E = 16, 12, 4


def _gate_network():
    return nn.Sequential(nn.Linear(H, E, bias=False), nn.Tanh(), nn.Linear(E, E, bias=False))


class LinearGLUExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_features, self.out_features, self.num_experts = H, H, E
        self.act_fn = nn.SiLU()
        self.weight_gate = nn.ParameterList([nn.Parameter(torch.randn(I, H) * H ** -0.5) for _ in range(E)])
        self.weight_up = nn.ParameterList([nn.Parameter(torch.randn(I, H) * H ** -0.5) for _ in range(E)])
        self.weight_down = nn.ParameterList([nn.Parameter(torch.randn(H, I) * I ** -0.5) for _ in range(E)])
        self.bias_gate = nn.ParameterList([nn.Parameter(torch.randn(I) * 0.1) for _ in range(E)])
        self.bias_up = nn.ParameterList([nn.Parameter(torch.randn(I) * 0.1) for _ in range(E)])
        self.bias_down = nn.ParameterList([nn.Parameter(torch.randn(H) * 0.1) for _ in range(E)])

    def forward(self, input, i):
        gate = self.act_fn(F.linear(input, self.weight_gate[i], self.bias_gate[i] if self.bias_gate is not None
                                    else None))
        up = F.linear(input, self.weight_up[i], self.bias_up[i] if self.bias_up is not None else None)
        return F.linear(gate * up, self.weight_down[i], self.bias_down[i] if self.bias_down is not None else None)


class TopKBalancedNoisyGate(nn.Module):
    def __init__(self, num_selects):
        super().__init__()
        self.num_experts, self.num_selects = E, num_selects
        self.gate_network = _gate_network()
        self.use_softmax, self.softmax = True, nn.Softmax(1)
        self.use_balance, self.balance_loss_weight = True, 1e-2
        self.add_noise, self.noise_epsilon = True, 1e-2
        self.weight_noise = nn.Linear(H, E, bias=False)
        self.softplus = nn.Softplus()

    def cv_squared(self, x, eps=1e-10):
        if x.shape[0] == 1:
            return torch.tensor(0.0, device=x.device)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def forward(self, x):
        logits_gate = self.gate_network(x)
        if self.training and self.add_noise:
            noise_control = self.softplus(self.weight_noise(x)) + self.noise_epsilon
            logits_noise = torch.randn_like(logits_gate) * noise_control
            logits = logits_gate + logits_noise
        else:
            logits = logits_gate
        top_logits, top_indices = logits.topk(min(self.num_selects + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, :self.num_selects]
        top_k_indices = top_indices[:, :self.num_selects]
        top_k_scores = self.softmax(top_k_logits) if self.use_softmax else top_k_logits
        zeros = torch.zeros_like(logits, requires_grad=True, device=logits.device)
        scores_filtered = zeros.scatter(dim=1, index=top_k_indices, src=top_k_scores)
        importance = scores_filtered.sum(0)
        load = (scores_filtered > 0).sum(0)
        balance_loss = None
        if self.use_balance:
            balance_loss = self.cv_squared(importance) + self.cv_squared(load)
            balance_loss *= self.balance_loss_weight
        return {"topK_indices": top_k_indices, "topK_scores": top_k_scores, "balance_loss": balance_loss,
                "load": load.tolist(), "importance": importance.tolist()}


class SwitchBalancedGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.num_selects = E, 1
        self.gate_network = _gate_network()
        self.use_softmax, self.softmax = True, nn.Softmax(1)
        self.use_balance, self.balance_loss_weight, self.add_noise = True, 1e-1, False

    def forward(self, x):
        batch_size = x.shape[0]
        logits = self.gate_network(x)
        scores = self.softmax(logits) if self.use_softmax else logits
        top1_scores, top1_indices = torch.max(logits, dim=1)
        importance_mean = scores.mean(0)
        load = top1_indices.bincount(minlength=self.num_experts)
        assert load.shape[0] == self.num_experts
        load_mean = load / batch_size
        balance_loss = self.num_experts * torch.sum(importance_mean * load_mean)
        balance_loss *= self.balance_loss_weight
        return {"topK_indices": top1_indices, "topK_scores": top1_scores, "expert_batch_size": load.tolist(),
                "balance_loss": balance_loss, "load": load_mean.tolist(), "importance": importance_mean.tolist()}


@dataclass
class CalculatorOutput:
    hidden_states: Optional[torch.Tensor] = None
    num_dropped_tokens: Optional[int] = None


class UniversalCalculator(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts, self.multiply_gate_scores, self.score_scale_factor = experts, True, 1.0
        self.num_experts = experts.num_experts

    def forward(self, x, topK_indices, topK_scores, expert_batch_size=None, **kwargs):
        batch_size = topK_indices.size(0)
        num_selects = topK_indices.size(1)
        topK_indices = topK_indices.flatten()
        topK_scores = topK_scores.flatten()
        batch_indices = torch.arange(batch_size, device=topK_scores.device).repeat_interleave(num_selects)
        _, index_sorted_topK_indices = topK_indices.sort(0)
        sorted_topK_scores = topK_scores.index_select(0, index_sorted_topK_indices)
        sorted_batch_indices = batch_indices.index_select(0, index_sorted_topK_indices)
        if expert_batch_size is None:
            expert_batch_size = topK_indices.bincount(minlength=self.num_experts).tolist()
        sorted_x = x.index_select(0, sorted_batch_indices).squeeze(1)
        split_x = torch.split(sorted_x, expert_batch_size, dim=0)
        expert_outputs = [self.experts(split_x[i], i) for i in range(self.num_experts) if split_x[i].shape[0] > 0]
        cat_expert_outputs = torch.cat(expert_outputs, 0)
        output_dim = cat_expert_outputs.size(1)
        if self.multiply_gate_scores:
            cat_expert_outputs = torch.mul(cat_expert_outputs,
                                           sorted_topK_scores.reshape(-1, 1) * self.score_scale_factor)
        zeros = torch.zeros((batch_size, output_dim), device=cat_expert_outputs.device,
                            dtype=cat_expert_outputs.dtype)
        y = zeros.index_add(0, sorted_batch_indices, cat_expert_outputs)
        return CalculatorOutput(hidden_states=y)


class SwitchDropTokenCalculator(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts, self.multiply_gate_scores, self.score_scale_factor = experts, True, 1.0
        self.num_experts, self.out_features = experts.num_experts, experts.out_features
        self.drop_tokens, self.dropped_padding, self.capacity_factor = False, "zero", 1.25

    def forward(self, x, topK_indices, topK_scores, **kwargs):
        batch_size = topK_indices.size(0)
        capacity = int(self.capacity_factor * batch_size / self.num_experts)
        dropped_indices = []
        y = torch.zeros((batch_size, self.out_features), device=x.device, dtype=x.dtype)
        num_dropped_tokens = -1
        for i in range(self.num_experts):
            token_indices = (topK_indices == i).nonzero(as_tuple=True)[0]
            num_assigned_tokens = token_indices.numel()
            if self.drop_tokens and num_assigned_tokens > capacity:
                token_indices = token_indices[torch.randperm(num_assigned_tokens, device=x.device)]
                dropped_indices.append(token_indices[capacity:])
                token_indices = token_indices[:capacity]
                num_dropped_tokens = num_assigned_tokens - capacity
            if num_assigned_tokens > 0:
                y[token_indices, :] = self.experts(x[token_indices, :], i)
        if self.dropped_padding == "input" and len(dropped_indices) > 0:
            dropped_indices = torch.cat(dropped_indices, dim=0)
            y[dropped_indices, :] = x[dropped_indices, :]
        if self.multiply_gate_scores:
            y = torch.mul(y, topK_scores.reshape(-1, 1) * self.score_scale_factor)
        return CalculatorOutput(hidden_states=y, num_dropped_tokens=num_dropped_tokens)


class LinearGLUMoELayer(nn.Module):
    def __init__(self, gate_type="TopKBalancedNoisyGate", num_selects=2):
        super().__init__()
        self.input_size, self.output_size, self.num_experts, self.num_selects = H, H, E, num_selects
        experts = LinearGLUExperts()
        if gate_type == "TopKBalancedNoisyGate":
            self.gate = TopKBalancedNoisyGate(num_selects)
            self.calculator = UniversalCalculator(experts)
        else:
            self.gate = SwitchBalancedGate()
            self.calculator = SwitchDropTokenCalculator(experts)

    def forward(self, x):
        original_shape = x.shape[:-1]
        x = x.reshape(-1, self.input_size)
        gate_outputs = self.gate(x)
        calc_outs = self.calculator(x, **gate_outputs)
        y = calc_outs.hidden_states.reshape(original_shape + (self.output_size,))
        return y, gate_outputs.get("balance_loss", None)


class Layer(nn.Module):
    """The decoder layer's MLP half: the MoE output added to the residual, the balance loss set aside."""

    def __init__(self, **kwargs):
        super().__init__()
        self.mlp = LinearGLUMoELayer(**kwargs)

    def forward(self, x):
        out, _balance_loss = self.mlp(x)
        return x + out


def _input(T, g):
    return torch.randn(2, T, H, generator=g)


_SRC = "pjlab-sys4nlp/llama-moe smoe/modules/moe/moe_layers.py LinearGLUMoELayer"
CASES = [
    Case("pjlab_llama_moe_topk", _SRC + " + TopKBalancedNoisyGate + UniversalCalculator (eval, top-2)",
         lambda: Layer().eval(), _input, form="split_loop",
         # the gate breaks the graph (zeros_like(requires_grad=True), a float .tolist()), as under backend="inductor",
         # so the calculator gets the ids as an input of its frame; there the bincount's length E is asserted at run
         # time (ids of E or more fail it, where eager's split fails), the skip of an empty expert in the list
         # comprehension is speculated away, and the split loop is rewritten, once per compile of the frame (static,
         # then dynamic); the gate's frames hold no MoE (its router's frame is noted as handing its ids on)
         expect=("partly_rewritten", "2 of 10")),
    Case("pjlab_llama_moe_switch", _SRC + " + SwitchBalancedGate + SwitchDropTokenCalculator (top-1, no drops)",
         lambda: Layer(gate_type="SwitchBalancedGate").eval(), _input, form="unrolled_loop",
         # the gate's float .tolist() breaks the graph (as under backend="inductor"); the calculator's frame, compiled
         # twice (static, then dynamic), is rewritten each time; the gate's frames hold no MoE
         expect=("partly_rewritten", "2 of 9")),
]
