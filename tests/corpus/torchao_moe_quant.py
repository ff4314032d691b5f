"""torchao's quantizable MoE feed-forward, mirrored from pytorch/ao
(``torchao/prototype/moe_quant/quantizable_moe_modules.py``: ``MOEFeedForwardAOQuantizable``,
``ConditionalFeedForwardAOQuantizable``; the same classes lived in ``torchao/_models/mixtral-moe/model.py``; both
were removed in January 2026, read at the parent of pytorch/ao c4ca58dbb), the layer torchao's MoE quantization
examples swap into Mixtral and Llama 4.

Style: a bias-free ``nn.Linear`` router, softmax in the input's dtype, top-k, renormalised in place
(``scores /= scores.sum(-1, keepdim=True).to(x.dtype)``). The experts are three stacked (E, I, H)/(E, H, I)
parameters. For more than one token: a stable ``argsort`` of the flat ids, ``order.div(k).floor().to(int64)`` for
the token rows, counts by ``torch.bincount(ids + 1, minlength=E + 1)`` (the CPU path; a leading zero so the
cumulative sums index both ends), ``cumsum(0)``; the per-expert index lists are cut from the sorted token rows by
those cumulative sums inside a local function under ``@torch._dynamo.disable()``; then ``x[indices]`` per expert,
``F.linear(silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])``, ``torch.cat``, the weights gathered in sorted
order ``weights.view(-1, 1)[order]``, and an out-of-place ``zeros_like(x).scatter_add`` with the row index
expanded to (T*k, H). A single token runs its k experts unrolled on gathered weights. An optional shared expert is
added in place; the result is reshaped to (B, -1, H).

Departures: none in the computation; the ``FakeExtraDimTensor`` check of the single-token branch (a quantization
wrapper type) is dropped, the corpus never calls with one token.

Today: a graph break, by the source's own ``@torch._dynamo.disable()`` (as OLMo-core's); no pass sees the routing and
the per-expert loop in one graph. Equal to eager. The break is the same under ``backend="inductor"``, which also
breaks at the ``bincount`` (a dynamic-shape op that moe_inductor's capture traces). The backend leaves a function the
user disabled untraced. With the decorator removed the layer traces as one graph and is left alone at the router: no
form reads per-expert index lists cut from the sorted rows at ``cumsum`` bounds of ``bincount(ids + 1)``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 2


class ConditionalFeedForwardAOQuantizable(nn.Module):
    def __init__(self, num_experts, hidden_dim, expert_dim, act_fn=F.silu):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, expert_dim, hidden_dim) * hidden_dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_dim, expert_dim) * expert_dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, expert_dim, hidden_dim) * hidden_dim ** -0.5)
        self.num_experts, self.act_fn, self.hidden_dim, self.expert_dim = num_experts, act_fn, hidden_dim, expert_dim

    def forward(self, x, expert_indices, expert_weights, top_k):
        num_tokens, _ = x.shape
        num_token_activations = num_tokens * top_k
        if x.shape[0] == 1:
            expert_indices = expert_indices.view(top_k)
            w1, w2, w3 = self.w1[expert_indices], self.w2[expert_indices], self.w3[expert_indices]
            outs = [F.linear(F.silu(F.linear(x, w1[j])) * F.linear(x, w3[j]), w2[j]) for j in range(top_k)]
            return (torch.cat(outs, dim=0) * expert_weights.view(-1, 1)).sum(dim=0).reshape(x.shape)

        expert_list = list(range(self.num_experts))
        ordered_token_activations = expert_indices.view(-1).argsort(stable=True)
        ordered_token_indices = ordered_token_activations.div(top_k).floor().to(torch.int64)
        num_tokens_per_expert = torch.bincount(expert_indices.view(-1) + 1, minlength=self.num_experts + 1)
        cum_tokens_per_expert = num_tokens_per_expert.cumsum(0).to(torch.int64)

        @torch._dynamo.disable()
        def group_tokens_by_expert(ordered_token_indices, cum_tokens_per_expert, expert_list):
            return [ordered_token_indices[cum_tokens_per_expert[e]: cum_tokens_per_expert[e + 1]].to(torch.int64)
                    for e in expert_list]

        token_indices_per_expert = group_tokens_by_expert(ordered_token_indices, cum_tokens_per_expert, expert_list)
        tokens_grouped_by_expert = [x[indices] for indices in token_indices_per_expert]
        outs = []
        for cur_x, expert in zip(tokens_grouped_by_expert, expert_list):
            y1 = F.silu(F.linear(cur_x, self.w1[expert]))
            y3 = F.linear(cur_x, self.w3[expert])
            outs.append(F.linear(y1 * y3, self.w2[expert]))
        ordered_outs = torch.cat(outs, dim=0)
        ordered_weights = expert_weights.view(-1, 1)[ordered_token_activations].view(-1, 1)
        weighted_ordered_outs = ordered_outs * ordered_weights
        final_out = torch.zeros_like(x)
        index = ordered_token_indices.unsqueeze(-1).expand(num_token_activations, self.hidden_dim).to(torch.int64)
        return final_out.scatter_add(dim=0, index=index, src=weighted_ordered_outs)


class SharedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MOEFeedForwardAOQuantizable(nn.Module):
    def __init__(self, shared_expert=None):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = ConditionalFeedForwardAOQuantizable(E, H, I)
        self.hidden_dim, self.top_k, self.shared_expert = H, K, shared_expert

    def forward(self, x):
        batch_size = x.shape[0]
        x = x.view(-1, self.hidden_dim)
        scores = F.softmax(self.router(x), dim=-1)
        scores, expert_indices = torch.topk(scores, self.top_k, dim=-1)
        scores /= scores.sum(dim=-1, keepdim=True).to(x.dtype)
        out = self.experts(x, expert_indices, scores, self.top_k)
        if self.shared_expert:
            out += self.shared_expert(x)
        return out.reshape(batch_size, -1, self.hidden_dim)


_SRC = ("pytorch/ao torchao/prototype/moe_quant/quantizable_moe_modules.py MOEFeedForwardAOQuantizable"
        " + ConditionalFeedForwardAOQuantizable")
CASES = [
    Case("torchao_moe_quant", _SRC, MOEFeedForwardAOQuantizable, lambda T, g: torch.randn(2, T, H, generator=g),
         form="split_loop", expect=("graph_break",)),
    Case("torchao_moe_quant_shared", _SRC + " (with a shared expert)", lambda: MOEFeedForwardAOQuantizable(SharedMLP()),
         lambda T, g: torch.randn(1, T, H, generator=g), form="split_loop", expect=("graph_break",)),
]
