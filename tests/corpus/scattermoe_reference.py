"""ScatterMoE's plain-torch reference MoE, mirrored from shawntan/scattermoe (``tests/test_mlp.py``:
``dumb_forward``, the reference its Triton ``scattermoe.mlp.MLP`` is tested against, over that MLP's
``ParallelExperts`` weights).

Style: the most literal spelling of a top-k MoE there is: a Python loop over the tokens and, inside it, ``sum`` of
a generator over the token's k choices, each ``expert_p[i, j] * F.linear(act(F.linear(x[i],
experts.weight[expert_idxs[i, j]])), output_experts.weight[expert_idxs[i, j]])`` (the (E, out, in) expert weights
indexed by a 0-d id tensor, one token's (H,) row at a time), and ``torch.stack`` of the per-token rows. The
activation is ``nn.GELU()`` and the experts have no biases. The test draws the routing from random logits; here a
bias-free linear router gives them from the input, as ScatterMoE's Mixtral example does: ``softmax`` in fp32 cast
back, ``topk`` of the probabilities, not renormalised (as the test's ``torch.topk(weights, k)``).

Today: the frame falls back to plain capture, equal to eager. Indexing a weight by a 0-d integer tensor,
``weight[expert_idxs[i, j]]``, is eager's select at ``.item()`` of the id; under the capture flags that is an unbacked
symbol that Dynamo's select must specialise ("Could not extract specialized integer from data-dependent expression
u0"), a graph break inside the per-token comprehension, so Dynamo gives up on the frame. Plain Dynamo with the same
two flags stops there too; without them it breaks at the ``.item()`` itself (each a limit of Dynamo, not of a pass).
Were it traced, the loops over ``range(T)`` and ``range(k)`` would unroll into T * k gathered-weight chains,
specialised on T, a graph and a compile per token count: no form fits a per-token unrolling, and none should.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 2


class ParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, output_size, input_size) * input_size ** -0.5)
        self.num_experts, self.input_size, self.output_size = num_experts, input_size, output_size


class MLP(nn.Module):
    """scattermoe.mlp.MLP's parameters; its forward is the Triton kernels, replaced by the test's reference."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.input_size, self.hidden_size, self.top_k = E, H, I, K
        self.experts = ParallelExperts(E, H, I)
        self.output_experts = ParallelExperts(E, I, H)
        self.activation = nn.GELU()


def dumb_forward(m, x, expert_p, expert_idxs):
    return torch.stack([
        sum(expert_p[i, j] * F.linear(m.activation(F.linear(x[i], m.experts.weight[expert_idxs[i, j]])),
                                      m.output_experts.weight[expert_idxs[i, j]])
            for j in range(expert_idxs.size(1)))
        for i in range(expert_idxs.size(0))
    ], dim=0)


class RoutedReference(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.mlp = MLP()

    def forward(self, hidden_states):
        batch, length, dim = hidden_states.shape
        x = hidden_states.view(-1, dim)
        weights = torch.softmax(self.router(x).float(), dim=-1).to(x.dtype)
        k_weights, k_idxs = torch.topk(weights, self.mlp.top_k)
        return dumb_forward(self.mlp, x, k_weights, k_idxs).view(batch, length, dim)


CASES = [
    Case("scattermoe_reference", "shawntan/scattermoe tests/test_mlp.py dumb_forward (per-token loop, sum over k)",
         RoutedReference, lambda T, g: torch.randn(1, T, H, generator=g), form="gathered_weights",
         expect=("fell_back",)),
]
