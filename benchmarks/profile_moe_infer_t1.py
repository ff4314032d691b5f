"""Profile DeepSeek-V2's remote-code MoE layer (``bench_moe_infer.py``'s) at one token, eager against moe_inductor:
the CUDA kernels and the host time of 10 calls each, torch.profiler tables sorted by CUDA and by CPU time.

    python benchmarks/profile_moe_infer_t1.py
"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_moe_infer import H, MoeInferLayer  # noqa: E402


def main() -> None:
    assert moe_inductor.__name__  # the backend's name is registered on import
    torch.manual_seed(0)
    layer = MoeInferLayer().to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, 1, H, device="cuda", dtype=torch.bfloat16)
    ours = torch.compile(layer, backend="moe_inductor")
    with torch.no_grad():
        for fn, name in ((layer, "eager"), (ours, "moe_inductor")):
            for _ in range(5):
                fn(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn(x)
                torch.cuda.synchronize()
            print("=====", name)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
