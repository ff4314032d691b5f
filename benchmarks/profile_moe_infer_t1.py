import sys, torch
sys.path.insert(0, ".")
from benchmarks.bench_moe_infer import MoeInferLayer, H
import moe_inductor
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
layer = MoeInferLayer().to("cuda", torch.bfloat16).eval()
x = torch.randn(1, 1, H, device="cuda", dtype=torch.bfloat16)
ours = torch.compile(layer, backend="moe_inductor")
with torch.no_grad():
    for fn, name in ((layer, "eager"), (ours, "moe_inductor")):
        for _ in range(5): fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(10): fn(x)
            torch.cuda.synchronize()
        print("=====", name)
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(p.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
