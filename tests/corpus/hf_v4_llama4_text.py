"""transformers' Llama 4 text MoE, mirrored from huggingface/transformers
(``src/transformers/models/llama4/modeling_llama4.py``: ``Llama4Router``, ``Llama4TextExperts``, ``Llama4TextMLP``,
``Llama4TextMoe``; the form the later v4.5x releases settled on, before v5's experts interface), and the v4.51
forward Llama 4 was released with (read in a text-generation-inference port that keeps it unchanged).
``llama4_ref.py`` is Meta's reference.

Style: dense over all experts. The router is an ``nn.Linear`` subclass (no bias): ``topk`` of its logits, the k
values ``scatter_``ed into a ``full_like(logits, -inf)`` (T, E) table, ``sigmoid`` in fp32 cast back (so an expert
off the top-k gets weight 0). The input is repeated once per expert (``hidden_states.repeat(E, 1)``) and SCALED BY
THE SCORE before the experts (``routed_in * scores.transpose(0, 1).reshape(-1, 1)``), the experts are two ``bmm``
over the (E, T, H) view with a fused (E, H, 2I) ``gate_up_proj`` split by ``chunk(2, dim=-1)`` and an (E, I, H)
``down_proj`` (``up * act(gate)``), and the (E*T, H) result is summed over the experts and ``add_``ed in place into
the shared expert's output (``hf_v4_llama4_text``). The decoder layer unpacks ``(out, router_logits)`` and adds
the residual.

v4.51 (``hf_v4_51_llama4_text``): the router is a plain bias-free ``nn.Linear`` and the MoE does the routing
itself: the -inf table is transposed to (E, T), the token ids are ``arange(T).view(1, -1).expand(E, -1)``, reshaped
to a column and expanded over H, the input ``torch.gather``ed by them (every token once per expert) and
``.to(device)``, scaled by the sigmoided scores, run through the same experts, and ``scatter_add_``ed by the same
index into the shared expert's output; it returns ``(out, router_scores)``.

Both are rewritten (dense_experts, the weight on the input): the v4.5x spelling by
``dense_repeated.match_input_scaled``, v4.51's by ``dense_experts.match_token_replicated``, the scores read through
their fp32 round trip by ``passes/score_tables.py``.
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 1


class Llama4TextExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.hidden_size, self.expert_dim = E, H, I
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm(up * self.act_fn(gate), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class Llama4TextMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))


class Llama4Router(nn.Linear):
    def __init__(self):
        super().__init__(H, E, bias=False)
        self.num_experts, self.top_k = E, K

    def forward(self, hidden_states):
        router_logits = super().forward(hidden_states)
        top_value, top_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_indices, top_value)
        router_scores = torch.sigmoid(router_scores.float()).to(router_scores.dtype)
        return router_scores, router_logits


class Llama4TextMoe(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = K, H, E
        self.experts = Llama4TextExperts()
        self.router = Llama4Router()
        self.shared_expert = Llama4TextMLP()

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        routed_in = hidden_states.repeat(router_scores.shape[1], 1)
        routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out.add_(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
        return out, router_logits


class Llama4TextMoeV451(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = K, H, E
        self.experts = Llama4TextExperts()
        self.router = nn.Linear(H, E, bias=False)
        self.shared_expert = Llama4TextMLP()

    def forward(self, hidden_states):
        batch, seq_len, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = self.router(hidden_states)
        tokens_per_expert = batch * seq_len
        top_value, top_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = (torch.full_like(router_logits, float("-inf")).scatter_(1, top_indices, top_value)
                         .transpose(0, 1))
        router_indices = (torch.arange(tokens_per_expert, device=hidden_states.device).view(1, -1)
                          .expand(router_scores.size(0), -1))
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)
        router_indices = router_indices.reshape(-1, 1).expand(-1, hidden_dim)
        routed_in = torch.gather(input=hidden_states, dim=0, index=router_indices).to(hidden_states.device)
        routed_in = routed_in * router_scores.reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out.scatter_add_(dim=0, index=router_indices, src=routed_out.view(-1, hidden_dim))
        return out, router_scores


class Layer(nn.Module):
    """The decoder layer's feed-forward half: the MoE's (out, router output) unpacked, the residual added."""

    def __init__(self, moe=Llama4TextMoe):
        super().__init__()
        self.feed_forward = moe()

    def forward(self, x):
        out, _router_logits = self.feed_forward(x)
        return x + out.view(x.shape)


_SRC = "huggingface/transformers v4.5x models/llama4/modeling_llama4.py Llama4TextMoe"
CASES = [
    Case("hf_v4_llama4_text", _SRC + " (top-1, scores on the input, repeat + bmm)", Layer,
         lambda T, g: torch.randn(2, T, H, generator=g), form="dense_experts"),
    Case("hf_v4_51_llama4_text", "huggingface/transformers v4.51 models/llama4/modeling_llama4.py Llama4TextMoe"
         " (top-1, scores on the input, gather by arange + bmm + scatter_add_)", lambda: Layer(Llama4TextMoeV451),
         lambda T, g: torch.randn(2, T, H, generator=g), form="dense_experts"),
]
