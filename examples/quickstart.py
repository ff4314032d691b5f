"""moe_inductor in one screen: compile an MoE model, see what was rewritten, check it, time it.

    python examples/quickstart.py            # CPU: a tiny random Qwen3-MoE; GPU: real Qwen3-30B-A3B widths, 2 layers

No downloads: the model is built from a config with random weights.
"""
from __future__ import annotations

import time

import torch

import moe_inductor

try:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
except ImportError as exc:  # pragma: no cover
    raise SystemExit("this example needs transformers: pip install -e '.[hf]'") from exc


def build(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.dtype]:
    torch.manual_seed(0)
    if device == "cuda":  # Qwen3-30B-A3B's MoE widths, 2 layers
        cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             num_experts=128, num_experts_per_tok=8)
        dtype, ids = torch.bfloat16, torch.randint(0, 4096, (4, 1024), device=device)
    else:
        cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2)
        dtype, ids = torch.float32, torch.randint(0, 128, (2, 64))
    model = Qwen3MoeForCausalLM(cfg).to(device, dtype).eval()
    return model, ids, dtype


def sample_ms(fn) -> float:
    """One call of ``fn``, in milliseconds (the GPU's queue drained on both sides)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def compare(fns: dict, warmup_s: float = 1.0, reps: int = 30) -> dict:
    """Median and interquartile range (ms) of each of ``fns``, after ``warmup_s`` seconds of warm-up calls each.

    The calls are interleaved, so that a busy machine slows every candidate alike, and the median with its spread
    is printed rather than a mean, which one stalled call can move by several times.
    """
    for fn in fns.values():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warmup_s:
            fn()
    samples: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(sample_ms(fn))
    out = {}
    for name, ms in samples.items():
        q = torch.tensor(ms).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
        out[name] = (q[1], q[0], q[2])
    return out


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, ids, dtype = build(device)
    print(moe_inductor.explain(model, ids).summary())  # print(report) adds the graphs before and after

    ours = torch.compile(model, backend="moe_inductor")
    default = torch.compile(model)
    with torch.no_grad():
        ref = model(ids).logits.float()
        out = ours(ids).logits.float()
        default(ids)  # compile the default backend too, outside the timing
        err = ((out - ref).norm() / ref.norm()).item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        print(f"logits vs eager: relative error {err:.2e} ({'OK' if err < tol else 'MISMATCH'}, bound {tol:.0e})")
        times = compare({"moe_inductor": lambda: ours(ids), "torch.compile default": lambda: default(ids)})
    print(f"forward on {device}, median [interquartile range] of 30 interleaved calls after 1 s of warm-up each:")
    for name, (median, low, high) in times.items():
        print(f"  {name:<22} {median:8.2f} ms  [{low:.2f}, {high:.2f}]")
    print(f"  speedup (ratio of medians) {times['torch.compile default'][0] / times['moe_inductor'][0]:.2f}x")
    if device == "cpu":
        print("(on CPU the experts run as plain torch: under Inductor, the routing, gather, activation and combine "
              "fused by Inductor around one per-expert matmul op; the fused Triton kernels are on the GPU)")
    if err >= tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
