"""DeepSeek-V2's remote-code MoE layer in inference (``moe_infer``: host counts walked by ``.cpu().numpy()``), at
DeepSeek-V2-Lite's widths, random bf16 weights and tokens: eager, ``torch.compile``'s default (which breaks the graph
at the host walk and runs the loop eagerly) and ``backend="moe_inductor"`` (one graph, the experts op), timed in
one process, do_bench medians in ms, the columns interleaved in rounds.

    python benchmarks/bench_moe_infer.py --tokens 1 16 512 4096 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_experts import bench  # noqa: E402

#: DeepSeek-V2-Lite: hidden 2048, moe_intermediate 1408, 64 routed experts, 6 per token, 2 shared
H, I, E, K, SHARED = 2048, 1408, 64, 6, 2


class Mlp(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, width, bias=False)
        self.up_proj = nn.Linear(H, width, bias=False)
        self.down_proj = nn.Linear(width, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeInferLayer(nn.Module):
    """The remote code's inference path: greedy softmax top-k, the experts walked over host counts, shared experts."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, H) * H ** -0.5)
        self.experts = nn.ModuleList([Mlp(I) for _ in range(E)])
        self.shared_experts = Mlp(SHARED * I)

    def forward(self, hidden):
        shape = hidden.shape
        x = hidden.view(-1, H)
        scores = F.linear(x, self.gate).softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(scores, K, dim=-1, sorted=False)
        return self.moe_infer(x, topk_ids, topk_weight).view(*shape) + self.shared_experts(hidden)

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        marks = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        marks.scatter_(1, topk_ids, 1)
        per_expert = marks.sum(dim=0)
        order = topk_ids.view(-1).argsort()
        rows = x[order // topk_ids.shape[1]]
        per_expert = per_expert.cpu().numpy()
        outputs, start = [], 0
        for i, n in enumerate(per_expert):
            end = start + n
            if n == 0:
                continue
            outputs.append(self.experts[i](rows[start:end]))
            start = end
        outs = torch.cat(outputs, dim=0) if len(outputs) else rows.new_empty(0)
        placed = torch.empty_like(outs)
        placed[order] = outs
        return (placed.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                .sum(dim=1).type(placed.dtype))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 16, 512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import triton

    assert moe_inductor.__name__  # the backend's name is registered on import

    print(f"torch {torch.__version__}, triton {triton.__version__}, GPU {torch.cuda.get_device_name()}", flush=True)
    torch.manual_seed(0)
    layer = MoeInferLayer().to("cuda", torch.bfloat16).eval()
    print("| T | eager ms | inductor ms | moe_inductor ms | inductor / moe_inductor | eager / moe_inductor | "
          "max abs err vs eager (inductor, ours) |")
    print("|---|---|---|---|---|---|---|")
    for T in args.tokens:
        torch._dynamo.reset()
        x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        runs = {"eager": layer, "inductor": torch.compile(layer),
                "moe_inductor": torch.compile(layer, backend="moe_inductor")}
        with torch.no_grad():
            ref = layer(x).float()
            err = {name: (fn(x).float() - ref).abs().max().item() for name, fn in runs.items() if name != "eager"}
            times = {name: [] for name in runs}
            for r in range(args.rounds):
                for name in (list(runs) if r % 2 == 0 else list(reversed(list(runs)))):
                    times[name].append(bench(lambda fn=runs[name]: fn(x)))
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {T} | {med['eager']:.3f} | {med['inductor']:.3f} | {med['moe_inductor']:.3f} | "
              f"{med['inductor'] / med['moe_inductor']:.2f}x | {med['eager'] / med['moe_inductor']:.2f}x | "
              f"{err['inductor']:.3g}, {err['moe_inductor']:.3g} |", flush=True)


if __name__ == "__main__":
    main()
