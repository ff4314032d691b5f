"""The MoE of a ``trust_remote_code`` DeepSeek-style model in inference, as its modeling file writes it
(``moe_infer``: each expert's tokens counted, the counts brought to the host with ``.cpu().numpy()`` and walked in
Python, one slice of the sorted tokens per expert). DeepSeek-V2/V3, Kimi, Moonlight and Ling ship this code.

Under ``torch.compile``'s default the host walk breaks the graph and the expert loop runs between graphs, with a
host sync. Under ``backend="moe_inductor"`` the walk is traced, proven to be the experts' loop, and the layer runs
as one graph with the experts op: no graph break and no host sync. This script shows the report and checks the
compiled output against eager.

    python examples/remote_code_moe.py
    python -m moe_inductor inspect examples/remote_code_moe.py:make
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_inductor


class Mlp(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RemoteCodeMoE(nn.Module):
    """Greedy softmax top-k over E experts (one nn.Linear set each), shared experts beside them, and the remote code's
    inference walk (``moe_infer``)."""

    def __init__(self, hidden: int = 64, inner: int = 32, experts: int = 16, top_k: int = 4, shared: int = 2):
        super().__init__()
        self.hidden, self.top_k = hidden, top_k
        self.gate = nn.Parameter(torch.randn(experts, hidden) * hidden ** -0.5)
        self.experts = nn.ModuleList([Mlp(hidden, inner) for _ in range(experts)])
        self.shared_experts = Mlp(hidden, shared * inner)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # (B, T, H)
        shape = hidden_states.shape
        x = hidden_states.view(-1, self.hidden)
        scores = F.linear(x, self.gate).softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return self.moe_infer(x, topk_ids, topk_weight).view(*shape) + self.shared_experts(hidden_states)

    @torch.no_grad()
    def moe_infer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs, start_idx = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(new_x.dtype))


def make(tokens: int = 24) -> tuple[RemoteCodeMoE, tuple[torch.Tensor]]:
    """For the CLI: ``python -m moe_inductor inspect examples/remote_code_moe.py:make``."""
    torch.manual_seed(0)
    return RemoteCodeMoE().eval(), (torch.randn(1, tokens, 64),)


def main(tokens: int = 24, inner_compiler: str = "inductor") -> moe_inductor.Report:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, (x,) = make(tokens)
    model, x = model.to(device), x.to(device)
    report = moe_inductor.explain(model, x)
    print(report.summary())
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": inner_compiler})
    with torch.no_grad():
        y, y_ref = compiled(x), model(x)
    err = ((y - y_ref).norm() / y_ref.norm()).item()
    print(f"output vs eager: relative error {err:.1e}")
    if err > 1e-4:
        raise SystemExit("compiled results differ from eager")
    return report


if __name__ == "__main__":
    main()
