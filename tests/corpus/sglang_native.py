"""SGLang's two torch-native MoE paths, written after sgl-project/sglang
(``python/sglang/srt/layers/moe/fused_moe_native.py``: ``fused_moe_forward_native`` and ``moe_forward_native``, with
the ``fused_topk_native`` router and the ``SiluAndMul`` / ``GeluAndMul`` activations they call).

Style, gathered: one stacked gate/up weight ``w13`` (E, 2I, H) indexed by the (T, k) ids, the (T, k, 2I, H) copy
split with ``torch.chunk(.., 2, dim=2)``, einsums ``"ti,taoi -> tao"`` / ``"tao, taio -> tai"`` / ``"tai,ta -> ti"``,
the activation picked by name (SiLU or GELU), the routing weights cast to the experts' dtype for the combine.

Style, sorted loop: DeepSeek-V2's ``moe_infer`` as SGLang runs it: per-expert counts by ``scatter_`` of ones and a
column sum, the flat ids ``argsort``ed, the token rows gathered by ``idxs // k``, the counts brought to the host
(``.cpu().numpy()``) and walked with ``enumerate``, skipping experts with no tokens, each expert's slice through
one fused gate/up ``F.linear`` and a half-split activation, the outputs ``cat``ed and put back by ``new_x[idxs] =``,
then ``view(T, k, H).type(..).mul_(weights[..., None]).sum(1)``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 6, 2


def _route(x: torch.Tensor, gate: nn.Linear):
    """fused_topk_native as SGLang writes it: softmax in fp32, top-k, renormalised."""
    probs = torch.softmax(gate(x).float(), dim=-1)
    weights, ids = torch.topk(probs, K, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _glu(h: torch.Tensor, activation: str) -> torch.Tensor:
    """SiluAndMul / GeluAndMul: the first half activated, times the second."""
    half = h.shape[-1] // 2
    act = F.silu if activation == "silu" else F.gelu
    return act(h[..., :half]) * h[..., half:]


class GatheredNative(nn.Module):
    def __init__(self, activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.gate = nn.Linear(H, E, bias=False)
        self.w13_weight = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2_weight = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = _route(x, self.gate)
        w13 = self.w13_weight[ids]
        w1, w3 = torch.chunk(w13, 2, dim=2)
        w2 = self.w2_weight[ids]
        x1 = torch.einsum("ti,taoi -> tao", x, w1)
        x1 = F.silu(x1) if self.activation == "silu" else F.gelu(x1)
        x3 = torch.einsum("ti, taoi -> tao", x, w3)
        outs = torch.einsum("tao, taio -> tai", x1 * x3, w2)
        return torch.einsum("tai,ta -> ti", outs, weights.to(outs.dtype))


class SortedLoopNative(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w13_weight = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2_weight = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = _route(x, self.gate)
        counts = ids.new_zeros((ids.shape[0], E))
        counts.scatter_(1, ids.to(torch.int64), 1)
        per_expert = counts.sum(dim=0)
        order = ids.view(-1).argsort()
        rows = x[order // ids.shape[1]]
        per_expert = per_expert.cpu().numpy()
        outs, start = [], 0
        for e, n in enumerate(per_expert):
            end = start + n
            if n == 0:
                continue
            h = _glu(F.linear(rows[start:end], self.w13_weight[e]), "silu")
            outs.append(F.linear(h, self.w2_weight[e]))
            start = end
        out = torch.cat(outs, dim=0) if len(outs) else rows.new_empty(0)
        placed = torch.empty_like(out)
        placed[order] = out
        return placed.view(*ids.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(dim=-1)).sum(dim=1).type(
            placed.dtype)


def _tokens(T, g):
    return torch.randn(T, H, generator=g)


CASES = [
    Case("sglang_native_gathered", "sgl-project/sglang fused_moe_native.py fused_moe_forward_native (SiLU)",
         GatheredNative, _tokens, form="gathered_weights"),
    Case("sglang_native_gathered_gelu", "sgl-project/sglang fused_moe_native.py fused_moe_forward_native (GELU)",
         lambda: GatheredNative("gelu"), _tokens, form="gathered_weights"),
    # the host counts walked as integers (host_counts.py), the skip speculated, the loop read as sorted pieces
    Case("sglang_native_sorted_loop", "sgl-project/sglang fused_moe_native.py moe_forward_native (moe_infer)",
         SortedLoopNative, _tokens, form="sorted_grouped_mm"),
]
