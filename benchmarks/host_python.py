"""Our own host-side Python per op call, measured on the CPU: the GPU code path (routing, config decisions, argument
lists, allocations, combine) with every Triton launch replaced by a no-op, so only our code is timed. Triton's own
launch cost and the GPU time come on top (see host_overhead.py / debug_gpu.py host on the GPU).

    python benchmarks/host_python.py            # Qwen3-30B-A3B experts shape, T = 16
"""
from __future__ import annotations

import time

import torch

from moe_inductor import config
from moe_inductor.kernels import launch
from moe_inductor.ops import grouped, routing
from moe_inductor.ops.experts import experts_forward_impl


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(reps: int = 2000) -> None:
    launch.grouped_gemm_kernel = _NoLaunch()
    routing.route_count_kernel = routing.route_place_kernel = _NoLaunch()
    grouped.combine_kernel = _NoLaunch()
    config.triton_on_cpu = True
    T, H, I, E, k = 16, 2048, 768, 128, 8
    x, w = torch.randn(T, H), torch.rand(T, k)
    ids = torch.randn(T, E).topk(k, -1).indices
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    args = (x, ids, w, w1[:, :I].transpose(1, 2), w1[:, I:].transpose(1, 2), w2.transpose(1, 2), None, None, None,
            "silu_glu", "output", 1.702, 7.0, None, False)
    op = torch.ops.moe_inductor.experts_forward.default
    for name, fn in (("the op's body", lambda: experts_forward_impl(*args)),
                     ("through the dispatcher", lambda: op(*args))):
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        print(f"{name}: {(time.perf_counter() - t0) / reps * 1e6:.1f} us per call (launches stubbed)")


if __name__ == "__main__":
    main()
