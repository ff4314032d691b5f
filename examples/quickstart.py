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


def timed(fn, reps: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


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
        reps = 20 if device == "cuda" else 5
        for fn in (lambda: ours(ids), lambda: default(ids)):
            fn()
        t_ours, t_default = timed(lambda: ours(ids), reps), timed(lambda: default(ids), reps)
    print(f"forward on {device}: moe_inductor {t_ours:.2f} ms, torch.compile default {t_default:.2f} ms, "
          f"speedup {t_default / t_ours:.2f}x")
    if device == "cpu":
        print("(on CPU the experts run moe_inductor's plain-torch reference loop, for correctness; the fused Triton "
              "kernels, and the speed, are on the GPU)")
    if err >= tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
