"""Your own MoE, written as the plain per-expert loop most research code uses: a ModuleList of experts holding raw
(in, out) parameters, the routing weight applied to each expert's input. moe_inductor proves the loop is an MoE and
runs it as one fused op: no per-expert host syncs, no data-dependent shapes.

It also shows what happens to code it cannot prove: a variant whose experts read the routing weight of the wrong
choice is left exactly as written, and explain() says why.

    python examples/your_own_loop.py
    python -m moe_inductor inspect examples/your_own_loop.py:make     # the report, with the graphs before/after
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_inductor


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(hidden, inner) * hidden ** -0.5)
        self.w_up = nn.Parameter(torch.randn(hidden, inner) * hidden ** -0.5)
        self.w_down = nn.Parameter(torch.randn(inner, hidden) * inner ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


class LoopMoE(nn.Module):
    """Top-k routing, then each expert on its own tokens, the routing weight scaling the expert's input.

    ``wrong_choice=True`` scales every row by the token's first choice's weight, whatever choice routed it there:
    a different function, which must not (and does not) become the op."""

    def __init__(self, hidden: int = 64, inner: int = 96, experts: int = 6, top_k: int = 2, wrong_choice=False):
        super().__init__()
        self.top_k, self.wrong_choice = top_k, wrong_choice
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (T, H)
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, choice = torch.where(ids == e)
            if self.wrong_choice:
                choice = torch.zeros_like(choice)
            out.index_add_(0, tok, expert(x[tok] * weights[tok, choice, None]))
        return out


def make(tokens: int = 48) -> tuple[LoopMoE, tuple[torch.Tensor]]:
    """For the CLI: ``python -m moe_inductor inspect examples/your_own_loop.py:make``."""
    torch.manual_seed(0)
    return LoopMoE(), (torch.randn(tokens, 64),)


def main(tokens: int = 48, inner_compiler: str = "inductor") -> tuple[moe_inductor.Report, moe_inductor.Report]:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LoopMoE().to(device)
    x = torch.randn(tokens, 64, device=device, requires_grad=True)
    report = moe_inductor.explain(model, x)
    print(report.summary())

    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner_compiler})
    y, y_ref = compiled(x), model(x)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *model.parameters()], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, *model.parameters()], dy)
    err = ((y - y_ref).norm() / y_ref.norm()).item()
    grad_err = max(((g - r).norm() / r.norm().clamp_min(1e-12)).item() for g, r in zip(grads, grads_ref))
    print(f"output vs eager: relative error {err:.1e}; worst gradient {grad_err:.1e}")
    if err > 1e-4 or grad_err > 1e-4:
        raise SystemExit("compiled results differ from eager")

    print("\nThe same loop with the wrong choice's weight:")
    look_alike = moe_inductor.explain(LoopMoE(wrong_choice=True).to(device), x.detach())
    print(look_alike.summary())
    return report, look_alike


if __name__ == "__main__":
    main()
