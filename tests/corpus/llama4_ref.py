"""Llama 4's reference MoE, mirrored from meta-llama/llama-models (``models/llama4/moe.py``: ``MoE`` and
``Experts``).

Style: dense over all experts. Router logits (E, T) from ``x @ router_DE``, top-k, scores scattered into a
``-inf``-filled (T, E) and sigmoided (so every expert gets every token, weight 0 off the top-k); the tokens are
gathered once per expert, scaled by their score before the experts (the weight on the input), run through the
experts as bmm over (E, T, H) with (E, H, I) weights, and ``scatter_add_``-ed into the shared expert's output.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 4, 1


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_local_experts = E
        self.w1 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)

    def forward(self, routed_in_egD):
        e = self.num_local_experts
        x_egD = routed_in_egD.view(e, -1, routed_in_egD.shape[-1])
        middle_out_egF = F.silu(torch.bmm(x_egD, self.w1)) * torch.bmm(x_egD, self.w3)
        return torch.bmm(middle_out_egF, self.w2).view(-1, routed_in_egD.shape[-1])


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k = K
        self.experts = Experts()
        self.router_DE = nn.Parameter(torch.randn(H, E) * H ** -0.5)
        self.shared_expert = FeedForward()

    def forward(self, x_bsD):
        _, slen, D = x_bsD.shape
        x_aD = x_bsD.view(-1, D)
        a = x_aD.shape[0]
        router_scores = torch.matmul(x_aD, self.router_DE).transpose(0, 1)
        router_scores_aK, router_indices_aK = torch.topk(router_scores.transpose(0, 1), self.top_k, dim=1)
        router_scores = (torch.full_like(router_scores.transpose(0, 1), float("-inf"))
                         .scatter_(1, router_indices_aK, router_scores_aK).transpose(0, 1))
        router_indices = torch.arange(a, device=x_aD.device).view(1, -1).expand(router_scores.size(0), -1)
        router_scores = torch.sigmoid(router_scores)
        routed_in_EG_D = torch.gather(x_aD, dim=0, index=router_indices.reshape(-1, 1).expand(-1, D))
        routed_in_EG_D = routed_in_EG_D * router_scores.reshape(-1, 1)
        out_aD = self.shared_expert(x_aD)
        routed_out_egg_D = self.experts(routed_in_EG_D)
        router_indices_EG_D = router_indices.reshape(-1, 1).expand(-1, D)
        out_aD.scatter_add_(dim=0, index=router_indices_EG_D, src=routed_out_egg_D.view(-1, D))
        return out_aD.view(-1, slen, D)


CASES = [Case("llama4_ref", "meta-llama/llama-models models/llama4/moe.py MoE", MoE,
              lambda T, g: torch.randn(1, T, H, generator=g), form="dense_experts")]
