"""Transient memory of one experts backward (above what the forward left behind), fp32 or bf16.

    python benchmarks/mem_backward.py                  # CPU: peak RSS growth during the backward
    python benchmarks/mem_backward.py --device cuda    # GPU: torch.cuda.max_memory_allocated growth

On the CPU the peak counts from the start of the backward (Linux's VmHWM, reset through /proc/self/clear_refs). Do
not read the interpreted Triton path (TRITON_INTERPRET=1) this way: the interpreter's own copies of its arguments
swamp the op's workspace.

Sizes: T=2048 tokens, H=512, I=2048, E=8, k=2 by default; one (T*k, I) fp32 tensor is 32 MiB there.
"""
from __future__ import annotations

import argparse
import re
import resource

import torch

import moe_inductor


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1)) / 1024


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) here, so that the forward's peak does not count; False where
    Linux does not allow it (then the peak is the process's lifetime one)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", nargs=5, type=int, default=[2048, 512, 2048, 8, 2], metavar=("T", "H", "I", "E", "k"))
    args = ap.parse_args(argv)
    T, H, I, E, k = args.shape
    dev, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dtype, requires_grad=True)
    ids = torch.randn(T, E, device=dev).topk(k, -1).indices
    w = torch.rand(T, k, device=dev, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * 0.05).requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev, dtype=dtype) * 0.05).requires_grad_()
    y = moe_inductor.fused_experts(x, ids, w, w1, w2)
    dy = torch.randn_like(y)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _status_mib("VmRSS")
        peak_is_backwards = _reset_peak_rss()
    grads = torch.autograd.grad(y, [x, w, w1, w2], dy)
    if dev == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    elif peak_is_backwards:
        peak = _status_mib("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out_mib = sum(g.numel() * g.element_size() for g in grads) / 2**20
    unit = T * k * I * 4 / 2**20
    print(f"backward transient {peak - before:.0f} MiB (of which the gradients themselves {out_mib:.0f} MiB); "
          f"one (T*k, I) fp32 tensor = {unit:.0f} MiB; device {dev}, {args.dtype}, T H I E k = {args.shape}")


if __name__ == "__main__":
    main()
