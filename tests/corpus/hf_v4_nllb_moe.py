"""transformers v4.x NLLB-MoE, mirrored from huggingface/transformers (v4.4x-v4.5x,
``src/transformers/models/nllb_moe/modeling_nllb_moe.py``: ``NllbMoeTop2Router``, ``NllbMoeSparseMLP``,
``NllbMoeDenseActDense``), fairseq's NLLB-200 MoE as transformers runs it.

Style: the router casts the tokens to ``router_dtype`` (float32) and re-casts its ``classifier`` in the forward;
softmax with ``dtype=self.dtype`` cast back; ``argmax`` -> ``one_hot`` for the first expert, the logits with it
masked to ``-inf`` -> ``argmax`` -> ``one_hot`` for the second (``second_expert_policy="all"``); positions by
``cumsum(mask, 0) - 1`` (the second's offset by the first's totals), or, with ``batch_prioritized_routing``, by the
same cumsum over the tokens sorted by their top probability and unsorted again (``argsort().argsort()``); the
capacity is a Python int written back onto the router (``self.expert_capacity``): in eval
``ceil(moe_eval_capacity_token_fraction * T)``, in training ``2 * ceil(T / E)`` unless the config set one;
``mask * torch.lt(locations, capacity)`` drops the overflow; the two kept probabilities renormalised by their
clamped sum after the drop; ``router_probs = p1[:, None] * mask1 + p2[:, None] * mask2`` (T, E). The block takes
``router_mask = router_probs.bool()``, spreads the tokens to every expert with ``torch.einsum("bm,be->ebm", x,
router_mask)`` (a float-by-bool einsum, (E, T, H)), and for each expert of an ``nn.ModuleDict`` reads its rows by
the boolean column ``router_mask[:, idx]``, runs ``fc2(dropout(relu(fc1(x))))`` (biased linears, T5's cast to
``fc2``'s dtype), scales by ``1 - moe_token_dropout`` in place in eval, and writes ``einsum("b,be->be", weights,
out)`` back through the same boolean mask; the result is ``masked_hidden_states.sum(dim=0)``. It returns
``(hidden_states, (router_probs, top_1_expert_index))``.

- ``hf_v4_nllb_moe``: eval (the config's defaults: the capacity is every token, the outputs scaled by 0.8).
- ``hf_v4_nllb_moe_train_capacity``: training with a small ``expert_capacity`` and batch-prioritised routing, so
  longer inputs drop tokens; ``moe_token_dropout=0`` (a random dropout cannot be compared with eager).

Departures: no padding mask (the encoder passes ``attention_mask=None`` when nothing is padded).

Both rewritten (``passes/table_writes.py``): the (T, E) table is a sum of two gates times one-hots with the drops in
them, so a row has at most 2 nonzeros, which ``topk`` of its mask finds; the op runs over those (a picked zero the
out-of-range id), weighted by the table there times the eval scale, plus eager's ``x * 0`` of the experts a row does
not pick. Under torch 2.11 both are left alone: its Dynamo breaks the graph at the router's
``self.classifier.to(self.dtype)`` (an ``nn.Parameter`` made while tracing ``Module.to``), so the table reaches the
experts' graph as an input whose making no proof sees (plain capture, eager's numbers).
"""
import math

import torch
import torch.nn as nn

from tests.corpus.harness import Case

H, FFN, E = 16, 24, 4


class NllbMoeTop2Router(nn.Module):
    def __init__(self, expert_capacity, batch_prioritized_routing):
        super().__init__()
        self.num_experts = E
        self.expert_capacity = expert_capacity
        self.classifier = nn.Linear(H, E, bias=False)
        self.router_ignore_padding_tokens = False
        self.dtype = getattr(torch, "float32")
        self.second_expert_policy = "all"
        self.normalize_router_prob_before_dropping = False
        self.batch_prioritized_routing = batch_prioritized_routing
        self.moe_eval_capacity_token_fraction = 1.0

    def _cast_classifier(self):
        if not (hasattr(self.classifier, "SCB") or hasattr(self.classifier, "CB")):
            self.classifier = self.classifier.to(self.dtype)

    def normalize_router_probabilities(self, router_probs, top_1_mask, top_2_mask):
        top_1_max_probs = (router_probs * top_1_mask).sum(dim=1)
        top_2_max_probs = (router_probs * top_2_mask).sum(dim=1)
        denom_s = torch.clamp(top_1_max_probs + top_2_max_probs, min=torch.finfo(router_probs.dtype).eps)
        return top_1_max_probs / denom_s, top_2_max_probs / denom_s

    def route_tokens(self, router_logits, input_dtype=torch.float32, padding_mask=None):
        nb_tokens = router_logits.shape[0]
        router_probs = nn.functional.softmax(router_logits, dim=-1, dtype=self.dtype).to(input_dtype)
        top_1_expert_index = torch.argmax(router_probs, dim=-1)
        top_1_mask = torch.nn.functional.one_hot(top_1_expert_index, num_classes=self.num_experts)
        if self.second_expert_policy == "sampling":
            router_logits += torch.distributions.gumbel.Gumbel(0, 1).rsample(router_logits.shape)
        logits_except_top_1 = router_logits.masked_fill(top_1_mask.bool(), float("-inf"))
        top_2_expert_index = torch.argmax(logits_except_top_1, dim=-1)
        top_2_mask = torch.nn.functional.one_hot(top_2_expert_index, num_classes=self.num_experts)
        if self.normalize_router_prob_before_dropping:
            top_1_max_probs, top_2_max_probs = self.normalize_router_probabilities(router_probs, top_1_mask,
                                                                                   top_2_mask)
        if padding_mask is not None and not self.router_ignore_padding_tokens:
            non_padding = ~padding_mask.bool()
            top_1_mask = top_1_mask * non_padding.unsqueeze(-1).to(top_1_mask.dtype)
            top_2_mask = top_2_mask * non_padding.unsqueeze(-1).to(top_1_mask.dtype)

        if self.batch_prioritized_routing:
            importance_scores = -1 * router_probs.max(dim=1)[0]
            sorted_top_1_mask = top_1_mask[importance_scores.argsort(dim=0)]
            sorted_cumsum1 = (torch.cumsum(sorted_top_1_mask, dim=0) - 1) * sorted_top_1_mask
            locations1 = sorted_cumsum1[importance_scores.argsort(dim=0).argsort(dim=0)]
            sorted_top_2_mask = top_2_mask[importance_scores.argsort(dim=0)]
            sorted_cumsum2 = (torch.cumsum(sorted_top_2_mask, dim=0) - 1) * sorted_top_2_mask
            locations2 = sorted_cumsum2[importance_scores.argsort(dim=0).argsort(dim=0)]
            locations2 += torch.sum(top_1_mask, dim=0, keepdim=True)
        else:
            locations1 = torch.cumsum(top_1_mask, dim=0) - 1
            locations2 = torch.cumsum(top_2_mask, dim=0) - 1
            locations2 += torch.sum(top_1_mask, dim=0, keepdim=True)

        if not self.training and self.moe_eval_capacity_token_fraction > 0:
            self.expert_capacity = math.ceil(self.moe_eval_capacity_token_fraction * nb_tokens)
        else:
            capacity = 2 * math.ceil(nb_tokens / self.num_experts)
            self.expert_capacity = capacity if self.expert_capacity is None else self.expert_capacity

        top_1_mask = top_1_mask * torch.lt(locations1, self.expert_capacity)
        top_2_mask = top_2_mask * torch.lt(locations2, self.expert_capacity)
        if not self.normalize_router_prob_before_dropping:
            top_1_max_probs, top_2_max_probs = self.normalize_router_probabilities(router_probs, top_1_mask,
                                                                                   top_2_mask)
        gates1 = top_1_max_probs[:, None] * top_1_mask
        gates2 = top_2_max_probs[:, None] * top_2_mask
        return top_1_mask, gates1 + gates2

    def forward(self, hidden_states, padding_mask=None):
        self.input_dtype = hidden_states.dtype
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        hidden_states = hidden_states.to(self.dtype)
        self._cast_classifier()
        router_logits = self.classifier(hidden_states)
        return self.route_tokens(router_logits, self.input_dtype, padding_mask)


class NllbMoeDenseActDense(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)
        self.dropout = nn.Dropout(0.0)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        hidden_states = self.dropout(self.act(self.fc1(hidden_states)))
        if (isinstance(self.fc2.weight, torch.Tensor) and hidden_states.dtype != self.fc2.weight.dtype
                and (self.fc2.weight.dtype != torch.int8 and self.fc2.weight.dtype != torch.uint8)):
            hidden_states = hidden_states.to(self.fc2.weight.dtype)
        return self.fc2(hidden_states)


class NllbMoeSparseMLP(nn.Module):
    def __init__(self, expert_capacity=64, batch_prioritized_routing=False, moe_token_dropout=0.2):
        super().__init__()
        self.router = NllbMoeTop2Router(expert_capacity, batch_prioritized_routing)
        self.moe_token_dropout = moe_token_dropout
        self.token_dropout = nn.Dropout(self.moe_token_dropout)
        self.num_experts = E
        self.experts = nn.ModuleDict()
        for idx in range(E):
            self.experts[f"expert_{idx}"] = NllbMoeDenseActDense()

    def forward(self, hidden_states, padding_mask=None):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        top_1_mask, router_probs = self.router(hidden_states, padding_mask)
        router_mask = router_probs.bool()
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        masked_hidden_states = torch.einsum("bm,be->ebm", hidden_states, router_mask)
        for idx, expert in enumerate(self.experts.values()):
            token_indices = router_mask[:, idx]
            combining_weights = router_probs[token_indices, idx]
            expert_output = expert(masked_hidden_states[idx, token_indices])
            if self.moe_token_dropout > 0:
                if self.training:
                    expert_output = self.token_dropout(expert_output)
                else:
                    expert_output *= 1 - self.moe_token_dropout
            masked_hidden_states[idx, token_indices] = torch.einsum("b,be->be", combining_weights, expert_output)
        hidden_states = masked_hidden_states.sum(dim=0).reshape(batch_size, sequence_length, hidden_dim)
        top_1_expert_index = torch.argmax(top_1_mask, dim=-1)
        return hidden_states, (router_probs, top_1_expert_index)


class Wrapped(nn.Module):
    """``NllbMoeEncoderLayer`` unpacks ``hidden_states, router_states = self.ffn(hidden_states, attention_mask)``."""

    def __init__(self, **kwargs):
        super().__init__()
        self.ffn = NllbMoeSparseMLP(**kwargs)

    def forward(self, x):
        hidden_states, _router_states = self.ffn(x, None)
        return hidden_states


_SRC = "huggingface/transformers models/nllb_moe/modeling_nllb_moe.py NllbMoeSparseMLP + NllbMoeTop2Router"
CASES = [
    Case("hf_v4_nllb_moe", _SRC + " (eval, config defaults)", lambda: Wrapped().eval(),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop",
         before_2_13=("left_alone", "moe_region", "no MoE form proves")),
    Case("hf_v4_nllb_moe_train_capacity", _SRC + " (training, expert_capacity=3, batch_prioritized_routing)",
         lambda: Wrapped(expert_capacity=3, batch_prioritized_routing=True, moe_token_dropout=0.0),
         lambda T, g: torch.randn(2, T, H, generator=g), form="unrolled_loop",
         # every step drops tokens and keeps both choices of some; from T=10 on (this seed) nearly every token keeps
         # at most one choice, whose weight p / p is 1: the router's gradient is then 0 (1e-16 in float64), and a
         # relative comparison of it measures float32 rounding only
         token_counts=(4, 6, 7, 9),
         before_2_13=("left_alone", "moe_region", "no MoE form proves")),
]
