"""CPU: the op's plain-torch path against transformers' eager experts loop (the issue asks for "no slower than
eager"). Wall-clock means over repeated calls; fp32; random data.

    python benchmarks/bench_cpu.py
"""
from __future__ import annotations

import time

import torch

import moe_inductor

SHAPES = [(16, 64, 32, 8, 2), (256, 256, 128, 16, 4), (1024, 512, 256, 32, 4), (64, 2048, 768, 128, 8)]  # T H I E k


def mean_ms(fn, reps: int = 40) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| T | H | I | E | k | HF eager ms | ours ms | ours / HF | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, H, I, E, k in SHAPES:
        torch.manual_seed(0)
        experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                 num_experts_per_tok=k))
        experts.config._experts_implementation = "eager"
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.05)
        x, w = torch.randn(T, H), torch.rand(T, k)
        ids = torch.randn(T, E).topk(k, -1).indices
        ours = lambda: moe_inductor.fused_experts(x, ids, w, experts.gate_up_proj, experts.down_proj)  # noqa: E731
        with torch.no_grad():
            t_hf, t_ours = mean_ms(lambda: experts(x, ids, w)), mean_ms(ours)
            diff = (experts(x, ids, w) - ours()).abs().max().item()
        print(f"| {T} | {H} | {I} | {E} | {k} | {t_hf:.3f} | {t_ours:.3f} | {t_ours / t_hf:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
