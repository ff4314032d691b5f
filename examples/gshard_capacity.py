"""Your own MoE code, not a transformers model: GShard-style top-2 gating with an expert capacity, written with
dispatch and combine einsums over a padded (E, C, H) buffer. moe_inductor finds it, proves the drops are the op's,
and runs the routed tokens only.

    python examples/gshard_capacity.py
    python -m moe_inductor inspect examples/gshard_capacity.py:make     # the report, with the graphs before/after
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_inductor


class GShardMoE(nn.Module):
    def __init__(self, hidden: int = 64, inner: int = 128, experts: int = 8, capacity: int = 24):
        super().__init__()
        self.experts, self.capacity = experts, capacity
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, inner) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, inner, hidden) * inner ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (T, H)
        E, C = self.experts, self.capacity
        gates = F.softmax(self.router(x), dim=-1)
        mask1 = F.one_hot(torch.argmax(gates, dim=-1), E)
        mask2 = F.one_hot(torch.argmax(gates.masked_fill(mask1.bool(), 0.0), dim=-1), E)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue last
        mask1, mask2 = mask1 * torch.lt(loc1, C), mask2 * torch.lt(loc2, C)      # drop past the capacity
        g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
        slot1 = F.one_hot((loc1 * mask1).sum(1), C)
        slot2 = F.one_hot((loc2 * mask2).sum(1), C)
        combine = (g1[:, None, None] * mask1[:, :, None] * slot1[:, None, :]
                   + g2[:, None, None] * mask2[:, :, None] * slot2[:, None, :])    # (T, E, C)
        dispatch = combine.bool().to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, x)                      # (E, C, H), mostly padding
        h = F.gelu(torch.einsum("ech,ehi->eci", expert_in, self.w_in))
        return torch.einsum("tec,ech->th", combine, torch.einsum("eci,eih->ech", h, self.w_out))


def make(tokens: int = 96) -> tuple[GShardMoE, tuple[torch.Tensor]]:
    """For the CLI: ``python -m moe_inductor inspect examples/gshard_capacity.py:make``."""
    torch.manual_seed(0)
    return GShardMoE(), (torch.randn(tokens, 64),)


def main(tokens: int = 96, inner_compiler: str = "inductor") -> moe_inductor.Report:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GShardMoE().to(device)
    x = torch.randn(tokens, 64, device=device)
    report = moe_inductor.explain(model, x)
    print(report.summary())
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner_compiler})
    with torch.no_grad():
        err = ((compiled(x) - model(x)).norm() / model(x).norm()).item()
    print(f"output vs eager: relative error {err:.1e}")
    if err > 1e-4:
        raise SystemExit("compiled output differs from eager")
    return report


if __name__ == "__main__":
    main()
