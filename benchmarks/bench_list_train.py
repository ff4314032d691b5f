"""A transformers-v4-style Mixtral layer (a ModuleList of SwiGLU experts, three bias-free nn.Linear each, a loop over
the experts with ``index_add_``) on the GPU: eager, ``torch.compile`` (Inductor) and ``backend="moe_inductor"`` (the
list op, which reads the experts' weights where they lie in the forward and stacks them in its backward), in a
forward and in a training step (forward, then the backward of the output against a fixed random probe).

    python benchmarks/bench_list_train.py --tokens 4096 --widths 4096 14336 8 2 --modes train forward

It runs ``bench_fx_forms.py``'s "list" form, whose table this is: ``triton.testing.do_bench`` medians in ms on random
bf16 weights and inputs, the ratio of Inductor's time over each column's, the output's error against eager, the peak
memory, the first call's seconds and the layers moe_inductor rewrote.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """The router's top-k, renormalised; per expert the rows that chose it, its MLP weighted, ``index_add_``."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inner) for _ in range(experts))

    def forward(self, x):
        probs = self.gate(x).float().softmax(-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, len(self.experts)).permute(2, 1, 0)  # (E, k, T)
        for e, expert in enumerate(self.experts):
            pos, tok = torch.where(mask[e])
            out.index_add_(0, tok, expert(x[tok]) * w[tok, pos, None])
        return out


def main(argv=None) -> list[dict]:
    """``bench_fx_forms.py --forms list`` (one token count, 4096, unless ``--tokens`` names others): its table, with
    the form and the rewrites counted, and its rows."""
    from benchmarks.bench_fx_forms import main as forms_main

    return forms_main(["--forms", "list", "--tokens", "4096", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
