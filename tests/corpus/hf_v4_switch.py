"""transformers v4.x SwitchTransformers, mirrored from huggingface/transformers
(``src/transformers/models/switch_transformers/modeling_switch_transformers.py``: ``SwitchTransformersTop1Router``,
``SwitchTransformersSparseMLP``, ``SwitchTransformersDenseActDense``), in its two v4 forms.

Style: the router casts the input to ``router_dtype`` (float32), re-casts its ``classifier`` in the forward
(``_cast_classifier``), softmaxes with ``dtype=self.dtype`` and casts back; ``argmax`` -> ``one_hot`` (B, S, E);
expert capacity by ``cumsum(dim=-2)`` over each sequence, ``token_priority <= expert_capacity`` multiplied in;
``router_probs = max(probs).values.unsqueeze(-1)``. The block writes each expert's output through a boolean mask,
``next_states[router_mask[:, :, idx]] = expert(hidden_states[router_mask[:, :, idx]])``, and scales the whole
result by ``router_probs``; it returns ``(hidden_states, (router_logits, expert_index))``. The experts are
``wo(dropout(relu(wi(x))))`` without biases, with T5's cast to ``wo``'s dtype. Eval mode (no jitter, no dropout).

- ``hf_v4_switch`` (v4.4x-v4.5x): ``next_states`` starts as zeros (dropped tokens give 0) and the loop runs over
  the hit experts only, ``torch.nonzero(router_mask.reshape(B*S, E).sum(dim=0), as_tuple=True)[0].tolist()``,
  reaching each expert by ``getattr(self.experts, f"expert_{idx}")``. The list is traced as every expert
  (``moe_inductor/hit_lists.py``), the masks are the columns of a one-hot with the drops in it
  (``passes/kept_masks.py``), a dropped row the op's out-of-range id: rewritten, ``router_probs *`` left to the graph.
- ``hf_v4_switch_v427`` (v4.2x-v4.3x): ``next_states = hidden_states.clone()`` (a dropped token passes through,
  scaled by its probability) and the loop is ``for idx, expert in enumerate(self.experts.values())``, each mask a
  column of the integer one-hot cast on its own, ``router_mask[:, :, idx].bool()``: rewritten, the op's result
  taken where a row was kept and the token where it was dropped (``torch.where``), ``router_probs *`` left to the
  graph.
"""
import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, I, E, CAPACITY = 16, 24, 4, 3  # a small capacity per sequence, so longer inputs drop tokens


class SwitchTransformersTop1Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.expert_capacity = E, CAPACITY
        self.classifier = nn.Linear(H, E, bias=False)
        self.jitter_noise = 0.01
        self.dtype = getattr(torch, "float32")

    def _compute_router_probabilities(self, hidden_states):
        self.input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.dtype)
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        self._cast_classifier()
        router_logits = self.classifier(hidden_states)
        router_probabilities = nn.functional.softmax(router_logits, dim=-1, dtype=self.dtype).to(self.input_dtype)
        return router_probabilities, router_logits

    def _cast_classifier(self):
        if not (hasattr(self.classifier, "SCB") or hasattr(self.classifier, "CB")):
            self.classifier = self.classifier.to(self.dtype)

    def forward(self, hidden_states):
        router_probs, router_logits = self._compute_router_probabilities(hidden_states)
        expert_index = torch.argmax(router_probs, dim=-1)
        expert_index = torch.nn.functional.one_hot(expert_index, num_classes=self.num_experts)
        token_priority = torch.cumsum(expert_index, dim=-2)
        expert_capacity_mask = token_priority <= self.expert_capacity
        expert_index = expert_index * expert_capacity_mask
        router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
        return expert_index, router_probs, router_logits


class SwitchTransformersDenseActDense(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(H, I, bias=False)
        self.wo = nn.Linear(I, H, bias=False)
        self.dropout = nn.Dropout(0.1)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        hidden_states = self.act(self.wi(hidden_states))
        hidden_states = self.dropout(hidden_states)
        if (isinstance(self.wo.weight, torch.Tensor) and hidden_states.dtype != self.wo.weight.dtype
                and self.wo.weight.dtype != torch.int8):
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return self.wo(hidden_states)


class SwitchTransformersSparseMLP(nn.Module):
    def __init__(self, hit_experts_only=True):
        super().__init__()
        self.hit_experts_only = hit_experts_only
        self.router = SwitchTransformersTop1Router()
        self.experts = nn.ModuleDict()
        for idx in range(E):
            self.experts[f"expert_{idx}"] = SwitchTransformersDenseActDense()

    def forward(self, hidden_states):
        router_mask, router_probs, router_logits = self.router(hidden_states)
        expert_index = torch.argmax(router_mask, dim=-1)
        if self.hit_experts_only:  # v4.4x+
            next_states = torch.zeros(hidden_states.shape, device=hidden_states.device, dtype=hidden_states.dtype)
            router_mask = router_mask.bool()
            batch_size, seq_len, num_experts = router_mask.shape
            idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
            idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
            for idx in idx_mask:
                next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                    hidden_states[router_mask[:, :, idx]])
        else:  # v4.2x-v4.3x
            next_states = hidden_states.clone()
            for idx, expert in enumerate(self.experts.values()):
                token_indices = router_mask[:, :, idx].bool()
                next_states[token_indices] = expert(hidden_states[token_indices])
        hidden_states = router_probs * next_states
        return hidden_states, (router_logits, expert_index)


class Wrapped(nn.Module):
    """``SwitchTransformersLayerFF`` unpacks ``forwarded_states, router_tuple = self.mlp(...)``."""

    def __init__(self, hit_experts_only=True):
        super().__init__()
        self.mlp = SwitchTransformersSparseMLP(hit_experts_only)

    def forward(self, x):
        forwarded_states, _router_tuple = self.mlp(x)
        return forwarded_states


_SRC = "huggingface/transformers models/switch_transformers/modeling_switch_transformers.py SwitchTransformersSparseMLP"
CASES = [
    Case("hf_v4_switch", f"{_SRC} (v4.4x, hit experts)", lambda: Wrapped(True).eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop",
         # 2.11 breaks the graph at the router's classifier.to(dtype) (README): the frame after the break gets the
         # mask as an input, whose one-hot it cannot see, and falls back as before
         before_2_13=("fell_back",)),
    Case("hf_v4_switch_v427", f"{_SRC} (v4.27, every expert)", lambda: Wrapped(False).eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop",
         before_2_13=("graph_break",)),  # the router's classifier.to(dtype) breaks 2.11's graph (README)
]
