"""torchtune's MoE, written after pytorch/torchtune (``torchtune/modules/moe/moe.py``: ``MoE``,
``TokenChoiceTopKRouter``; ``experts.py``: ``GroupedExperts``).

Style: sigmoid scores in fp32 cast back to the input's dtype, top-k without renormalising, the router keeping its
chosen ids on the module (``self.selected_experts_indices = ...``), ``histc`` counts per expert, a stable
``argsort`` of the flat ids, the scores reordered by it and the token index ``order // k``; the routed rows by
``torch.gather`` with an expanded index, scaled by their score before the experts; the experts' (E, dim, hidden)
weights applied with ``torch.matmul`` in a loop over ``torch.split(x, counts.tolist())``, inside a forward
decorated ``@torch.inference_mode(mode=False)``; the outputs ``cat``ed and added back by ``scatter_add_`` under an
``if routed_output.numel() > 0`` test; a shared expert or zeros.

Departure (as in torchtitan_moe.py): ``histc`` gets the ids as floats and its counts are cast to integers, which
``torch.split`` needs.

Under moe_inductor's capture the ``.tolist()`` counts trace as unbacked sizes, so the ``cat``ed output's row count
is their sum, which Dynamo alone cannot compare with 0: ``if routed_output.numel() > 0`` would break the graph
before the combine. The counts are a histogram of the top-k ids, so they add up to T*k, and the capture decides the
test with that (``count_totals.decide_by_totals``, checked at run time too). With a shared expert the outputs are
added into the shared expert's result (a view of it) rather than into zeros; the split-loop form reads that as the
shared expert's output plus the op's.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 2


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).to(torch.float32)).to(x.dtype)
        top, ids = torch.topk(scores, k=K, dim=1)
        self.selected_experts_indices = ids
        counts = torch.histc(ids.view(-1).float(), bins=E, min=0, max=E).to(ids.dtype)
        order = torch.argsort(ids.view(-1), stable=True)
        return top.view(-1)[order], order // K, counts


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.up_proj = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)

    @torch.inference_mode(mode=False)
    def forward(self, x, counts):
        outs = []
        for e, xe in enumerate(torch.split(x, split_size_or_sections=counts.tolist(), dim=0)):
            h = F.silu(torch.matmul(xe, self.gate_proj[e])) * torch.matmul(xe, self.up_proj[e])
            outs.append(torch.matmul(h, self.down_proj[e]))
        return torch.cat(outs, dim=0)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.router, self.experts = Router(), Experts()
        self.shared_expert = Shared() if shared else None

    def forward(self, x):
        bs, slen, dim = x.shape
        scores, tok, counts = self.router(x.reshape(bs * slen, dim))
        tok = tok.reshape(-1, 1).expand(-1, dim)
        routed = torch.gather(x.view(-1, dim), dim=0, index=tok) * scores.reshape(-1, 1)
        routed_out = self.experts(routed, counts)
        if self.shared_expert is not None:
            out = self.shared_expert(x).reshape(bs * slen, dim)
        else:
            out = torch.zeros_like(x.reshape(bs * slen, dim))
        if routed_out.numel() > 0:
            out.scatter_add_(dim=0, index=tok, src=routed_out)
        return out.reshape(bs, slen, dim)


def _input(T, g):
    return torch.randn(1, T, H, generator=g)


SOURCE = "pytorch/torchtune torchtune/modules/moe/moe.py MoE + TokenChoiceTopKRouter, experts.py GroupedExperts"
CASES = [
    Case("torchtune_moe", SOURCE, lambda: MoE(False), _input, form="split_loop"),
    Case("torchtune_moe_shared", SOURCE + " (a shared expert)", lambda: MoE(True), _input, form="split_loop"),
]
