"""Expert-offloading forks of transformers' v4 sparse MoE block (Qwen2-MoE with its shared expert), in the style
found in several public repositories through the code index (CPU-offload and prefetch variants of
``Qwen2MoeSparseMoeBlock.forward``; the index hits did not name their repositories).

Style: the v4 loop over the experts that got tokens (``greater(expert_mask.sum((-1, -2)), 0).nonzero()``), whose
body first turns the (1,) row into an int (``expert_idx = expert_idx_tensor.item()``), selects the rows with
``torch.where(expert_mask[expert_idx].squeeze(0))`` at that int, and skips an expert left without rows (``if
len(top_x) == 0: continue``) before running ``experts[expert_idx]`` on them; the routing weights are moved to
the expert output's device (``.to(out.device)``, a no-op on one device), the weighted rows ``index_add_``-ed into
a zeros buffer; a shared expert with a sigmoid gate after the loop. The forks' other device moves and bookkeeping
(prefetch caches, hit counters) are left out: counters of Python state would make the loop body impure, and the
rewrite rightly refuses such bodies.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.corpus.harness import Case

H, I, E, K = 16, 12, 7, 2


class ExpertMLP(nn.Module):
    def __init__(self, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OffloadingSparseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(I) for _ in range(E))
        self.shared_expert = ExpertMLP(2 * I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        batch, seq, hidden_dim = hidden_states.shape
        flat = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(flat)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(flat.dtype)
        final = torch.zeros((batch * seq, hidden_dim), dtype=flat.dtype, device=flat.device)
        expert_mask = F.one_hot(selected, num_classes=E).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx_tensor in expert_hit:
            expert_idx = expert_idx_tensor.item()
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            if len(top_x) == 0:
                continue
            rows = flat[None, top_x].reshape(-1, hidden_dim)
            out = self.experts[expert_idx](rows)
            out = out * routing_weights[top_x, idx, None].to(out.device)  # the forks' move to the expert's device
            final.index_add_(0, top_x, out.to(final.dtype))
        shared = self.shared_expert(flat) * torch.sigmoid(self.shared_expert_gate(flat))
        return (final + shared).view(batch, seq, hidden_dim), router_logits


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = OffloadingSparseBlock()

    def forward(self, x):
        return self.mlp(x)[0]


CASES = [Case("offload_hit_loop_item_skip", "expert-offloading forks of transformers v4 Qwen2MoeSparseMoeBlock "
              "(.item() index, len(top_x) == 0 skip)", Wrapped, lambda T, g: torch.randn(1, T, H, generator=g),
              form="unrolled_loop", token_counts=(1, 3, 7, 12))]
