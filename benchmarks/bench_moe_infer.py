"""DeepSeek-V2's remote-code MoE layer in inference (``moe_infer``: host counts walked by ``.cpu().numpy()``; the layer
of ``examples/remote_code_moe.py``), at DeepSeek-V2-Lite's widths, random bf16 weights and tokens: eager, ``torch.compile``'s default (which breaks the graph
at the host walk and runs the loop eagerly) and ``backend="moe_inductor"`` (one graph, the experts op), timed in
one process, do_bench medians in ms, the columns interleaved in rounds.

    python benchmarks/bench_moe_infer.py --tokens 1 16 512 4096 --rounds 3

moe_inductor runs twice, from one compiled graph: its list op stacking the 64 experts' weights at each call, and
reading them in place through their address table (``config.list_weight_tables``).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_inductor  # noqa: E402
from benchmarks.bench_experts import bench  # noqa: E402

#: DeepSeek-V2-Lite: hidden 2048, moe_intermediate 1408, 64 routed experts, 6 per token, 2 shared
H, I, E, K, SHARED = 2048, 1408, 64, 6, 2


def _example():
    """``examples/remote_code_moe.py``: the remote code's layer, which this benchmark sizes up."""
    path = Path(__file__).resolve().parent.parent / "examples" / "remote_code_moe.py"
    spec = importlib.util.spec_from_file_location("remote_code_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def MoeInferLayer() -> nn.Module:  # noqa: N802  (named as the layer it builds)
    """The layer at DeepSeek-V2-Lite's widths."""
    return _example().RemoteCodeMoE(hidden=H, inner=I, experts=E, top_k=K, shared=SHARED)


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
    print("| T | eager ms | inductor ms | moe_inductor ms (stack) | moe_inductor ms (tables) | inductor / tables | "
          "eager / tables | stack / tables | max abs err vs eager (inductor, stack, tables) |")
    print("|---|---|---|---|---|---|---|---|---|")
    from moe_inductor import config

    for T in args.tokens:
        torch._dynamo.reset()
        x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(layer, backend="moe_inductor")

        def with_tables(on: bool):
            # the list op reads the setting at each call: one compiled graph serves both columns
            def run(x):
                config.list_weight_tables = on
                config.list_weight_tables_min_rows_per_expert = 0.0  # the tables at every T, to measure them
                return compiled(x)
            return run

        runs = {"eager": layer, "inductor": torch.compile(layer), "stack": with_tables(False),
                "tables": with_tables(True)}
        with torch.no_grad():
            ref = layer(x).float()
            err = {name: (fn(x).float() - ref).abs().max().item() for name, fn in runs.items() if name != "eager"}
            times = {name: [] for name in runs}
            for r in range(args.rounds):
                for name in (list(runs) if r % 2 == 0 else list(reversed(list(runs)))):
                    times[name].append(bench(lambda fn=runs[name]: fn(x)))
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"| {T} | {med['eager']:.3f} | {med['inductor']:.3f} | {med['stack']:.3f} | {med['tables']:.3f} | "
              f"{med['inductor'] / med['tables']:.2f}x | {med['eager'] / med['tables']:.2f}x | "
              f"{med['stack'] / med['tables']:.2f}x | "
              f"{err['inductor']:.3g}, {err['stack']:.3g}, {err['tables']:.3g} |", flush=True)


if __name__ == "__main__":
    main()
