"""Profile DeepSeek-V2's remote-code MoE layer (``bench_moe_infer.py``'s) compiled with moe_inductor, the list op
stacking its experts' weights against reading them through tables (``config.list_weight_tables``), at one token
count: the CUDA kernels of 10 calls each, torch.profiler tables sorted by CUDA time.

    python benchmarks/profile_moe_infer_tables.py --tokens 4096
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_moe_infer import H, MoeInferLayer  # noqa: E402
from moe_inductor import config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    assert moe_inductor.__name__  # the backend's name is registered on import
    torch.manual_seed(0)
    layer = MoeInferLayer().to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, args.tokens, H, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, backend="moe_inductor")
    config.list_weight_tables_min_rows_per_expert = 0.0
    with torch.no_grad():
        for tables in (False, True, False, True):
            config.list_weight_tables = tables  # the list op reads it at each call: one graph serves both
            for _ in range(5):
                compiled(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    compiled(x)
                torch.cuda.synchronize()
            print("=====", "tables" if tables else "stack", f"T={args.tokens}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
