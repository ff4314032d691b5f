"""The parts every generated module is built from: routers and expert weights in each storage idiom.

Shapes: x (T, H); router logits and probabilities (T, E); ids and weights (T, k); I the expert width.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

H, I = 16, 8

ACT = {"silu_glu": F.silu, "gelu_glu": F.gelu, "relu": F.relu, "gelu": F.gelu}

#: the bound of Step-3.7's clamped silu-glu in generated modules: the projections are about N(0, 1), so it binds on
#: both factors
LIMIT = 0.5

#: Step-3.7's clamped silu-glu (``silu(g).clamp(max=limit) * u.clamp(-limit, limit)``) and its look-alikes, each
#: named for how its clamps differ (recipe.CLAMP_FLAWS: the flaw's name + "_glu"): (gate, up) -> the hidden state
CLAMPED = {
    "clamped_silu_glu": lambda g, u: F.silu(g).clamp(max=LIMIT) * u.clamp(min=-LIMIT, max=LIMIT),
    "clamp_before_silu_glu": lambda g, u: F.silu(g.clamp(max=LIMIT)) * u.clamp(min=-LIMIT, max=LIMIT),
    "clamp_up_max_only_glu": lambda g, u: F.silu(g).clamp(max=LIMIT) * u.clamp(max=LIMIT),
    # a bound below on the silu too (silu's minimum is about -0.28, so -LIMIT / 4 binds)
    "clamp_gate_min_glu": lambda g, u: F.silu(g).clamp(min=-LIMIT / 4, max=LIMIT) * u.clamp(min=-LIMIT, max=LIMIT),
    "clamp_limits_differ_glu": lambda g, u: F.silu(g).clamp(max=LIMIT) * u.clamp(min=-2 * LIMIT, max=2 * LIMIT),
    "silu_doubled_in_place_glu": lambda g, u: _doubled_in_place(F.silu(g)).clamp(max=LIMIT) * u.clamp(min=-LIMIT,
                                                                                                   max=LIMIT),
}


def _doubled_in_place(s: torch.Tensor) -> torch.Tensor:
    """``s`` doubled in place: every later read of the silu's node sees other values than the dataflow shows."""
    s.mul_(2.0)
    return s


def hidden(act: str, gate: torch.Tensor, up: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An expert's hidden state: ``act(gate) * up`` for a gated activation (``up`` given), ``act(gate)`` otherwise;
    the clamped silu-glu and its look-alikes (``CLAMPED``) clamp their factors first."""
    if act in CLAMPED:
        return CLAMPED[act](gate, up)
    h = ACT[act](gate)
    return h if up is None else h * up


class Router(nn.Module):
    """Softmax then top-k, top-k then softmax (Mixtral), sigmoid with a choice-only bias correction (DeepSeek-V3),
    group-limited sigmoid, or max top-1. ``forward`` gives (probs (T, E), weights (T, k), ids (T, k))."""

    def __init__(self, kind: str, E: int, k: int, renorm: bool):
        super().__init__()
        self.kind, self.E, self.k, self.renorm = kind, E, k, renorm
        self.gate = nn.Linear(H, E, bias=False)
        self.bias = nn.Parameter(torch.randn(E) * 0.1, requires_grad=False) if kind in ("sigmoid_bias",
                                                                                         "group_limited") else None

    def forward(self, x: torch.Tensor):
        logits = self.gate(x)
        if self.kind == "softmax_topk":
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.k, dim=-1)
        elif self.kind == "topk_softmax":
            top, ids = torch.topk(logits, self.k, dim=-1)
            weights = F.softmax(top, dim=-1, dtype=torch.float32)
            probs = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, ids, weights)
        elif self.kind == "argmax":
            probs = logits.softmax(-1)
            weights, ids = probs.max(dim=-1, keepdim=True)
        else:
            probs = logits.sigmoid()
            choice = probs + self.bias
            if self.kind == "group_limited":
                groups = choice.view(x.shape[0], 2, -1)
                best = groups.amax(dim=-1).topk(1, dim=-1).indices
                keep = torch.zeros_like(groups[..., 0]).scatter(1, best, 1.0).bool()
                choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
            ids = torch.topk(choice, self.k, dim=-1, sorted=False).indices
            weights = probs.gather(1, ids)
        if self.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), ids


class Expert(nn.Module):
    """One expert as its own module (gate ``w1``, up ``w3``, down ``w2``, nn.Linear each)."""

    def __init__(self, act: str):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(H, I, bias=False)
        self.w3 = nn.Linear(H, I, bias=False) if act.endswith("_glu") else None
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = hidden(self.act, self.w1(x), self.w3(x) if self.w3 is not None else None)
        if scale is not None:
            h = h * scale
        return self.w2(h)


class ExpertBank(nn.Module):
    """E experts stored one way: ``modulelist``, ``moduledict``, ``stacked_nk`` ((E, out, in) parameters),
    ``stacked_kn`` ((E, in, out)), ``slices`` (flat (E*I, H) weights sliced per expert), or one gated
    (E, 2I, H) weight split by chunk / split / slicing / interleaving (``fused_*``).

    ``mlp(e, xe)`` is expert e on rows xe (the routing ``scale`` applied between the projections if given);
    ``matmul`` picks ``F.linear`` or ``@`` for the stacked and sliced weights."""

    def __init__(self, storage: str, E: int, act: str, matmul: str = "linear"):
        super().__init__()
        self.storage, self.E, self.act, self.matmul = storage, E, act, matmul
        self.gated = act.endswith("_glu")
        if storage in ("modulelist", "loop_modulelist"):
            self.experts = nn.ModuleList(Expert(act) for _ in range(E))
        elif storage == "moduledict":
            self.experts = nn.ModuleDict({str(e): Expert(act) for e in range(E)})
        elif storage.startswith("fused"):
            self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
            self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        elif storage == "slices":
            self.w1 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5)
            self.w3 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5) if self.gated else None
            self.w2 = nn.Parameter(torch.randn(E * I, H) * I ** -0.5)  # DBRX: down stored (E*I, H), used as x @ w
        else:
            kn = storage == "stacked_kn"
            up, down = ((E, H, I), (E, I, H)) if kn else ((E, I, H), (E, H, I))
            self.w1 = nn.Parameter(torch.randn(up) * H ** -0.5)
            self.w3 = nn.Parameter(torch.randn(up) * H ** -0.5) if self.gated else None
            self.w2 = nn.Parameter(torch.randn(down) * I ** -0.5)

    def _proj(self, x: torch.Tensor, w: torch.Tensor, kn: bool) -> torch.Tensor:
        if kn:
            return x @ w
        return F.linear(x, w) if self.matmul == "linear" else x @ w.T

    def split_gate_up(self, h: torch.Tensor):
        """Gate and up halves of a fused projection's output, in this bank's spelling."""
        if self.storage == "fused_chunk":
            return h.chunk(2, dim=-1)
        if self.storage == "fused_split":
            return torch.split(h, I, dim=-1)
        if self.storage == "fused_slice":
            return h[..., :I], h[..., I:]
        return h[..., ::2], h[..., 1::2]

    def split_gathered(self, w: torch.Tensor):
        """Gate and up halves of a gathered (T, k, 2I, H) copy of the fused weight, along its output rows, in this
        bank's spelling."""
        if self.storage == "fused_chunk":
            return torch.chunk(w, 2, dim=2)
        if self.storage == "fused_split":
            return w.split(I, dim=2)
        if self.storage == "fused_slice":
            return w[:, :, :I], w[..., I:, :]
        return w[:, :, ::2], w[:, :, 1::2]

    def mlp(self, e: int, xe: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.storage in ("modulelist", "loop_modulelist"):
            return self.experts[e](xe, scale)
        if self.storage == "moduledict":
            return self.experts[str(e)](xe, scale)
        if self.storage.startswith("fused"):
            g, u = self.split_gate_up(self._proj(xe, self.w13[e], False))
            h = hidden(self.act, g, u)
            h = h if scale is None else h * scale
            return self._proj(h, self.w2[e], False)
        if self.storage == "slices":
            rows = slice(e * I, (e + 1) * I)
            h = hidden(self.act, self._proj(xe, self.w1[rows], False),
                       self._proj(xe, self.w3[rows], False) if self.gated else None)
            h = h if scale is None else h * scale
            return h @ self.w2[rows]
        kn = self.storage == "stacked_kn"
        h = hidden(self.act, self._proj(xe, self.w1[e], kn), self._proj(xe, self.w3[e], kn) if self.gated else None)
        h = h if scale is None else h * scale
        return self._proj(h, self.w2[e], kn)

    def stacked(self):
        """(w_up, w_gate_or_None, w_down, kn) as 3-D tensors, for the forms that use all experts at once; a fused
        bank gives its (E, 2I, H) weight as w_up and None."""
        if self.storage.startswith("fused"):
            return self.w13, None, self.w2, False
        return self.w1, self.w3, self.w2, self.storage == "stacked_kn"
