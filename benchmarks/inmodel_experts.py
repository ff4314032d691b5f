"""Why an experts forward is slower inside a whole model than alone: the same layer's fused op, timed four ways.

For one bench_hf family (real widths, random weights) and each T:
  1. captured  the op alone (do_bench) on the exact arguments the model's first experts module received in an eager
               prefill (hidden states, routing ids and weights), with that module's weights;
  2. uniform   the op alone on the same hidden states and module with uniform random routing;
  3. eager     the whole model eagerly with ``experts_implementation="moe_inductor"`` (the op on the model's own
               arguments, launched by our Python wrapper): kernels per step;
  4. compiled  the whole model under ``backend="moe_inductor"`` with the speed rule off (every proven layer
               rewritten): kernels per step, and the specialisation Inductor compiled our GEMM kernel with, against
               the one Triton's JIT used in 1-3.
Per-launch kernel times that differ between 1 and 2 point at the data (routing skew, strides, alignment); between
1 and 3 at the model's state around the call (clocks, caches); between 3 and 4 at the binary Inductor built.

    python benchmarks/inmodel_experts.py --family gpt_oss --tokens 1024 2048
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_hf  # noqa: E402

KERNEL = "grouped_gemm_kernel"


def describe(name: str, t: torch.Tensor) -> str:
    """Shape, dtype, strides, offset and the data pointer's alignment: what a Triton specialisation reads."""
    return (f"  {name}: {tuple(t.shape)} {t.dtype} strides {t.stride()} offset {t.storage_offset()} "
            f"ptr%16={t.data_ptr() % 16} contiguous={t.is_contiguous()}")


def kernel_ms(step, steps: int = 5) -> tuple[float, int, float]:
    """(ms of ``KERNEL`` launches per step, launches per step, ms of every kernel per step)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ours, count, every = 0.0, 0, 0.0
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0)
        every += us
        if KERNEL in evt.key:
            ours += us
            count += evt.count
    return ours / 1e3 / steps, count // steps, every / 1e3 / steps


def jit_specialisations() -> list[str]:
    """The cache keys of Triton's JIT for our GEMM kernel (the signature specialisation of each eager launch)."""
    from moe_inductor.kernels import launch

    kernel = launch.grouped_gemm_kernel.resolve()
    keys = []
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        keys += [str(k) for k in cache]
    return keys


def inductor_specialisations(code: str) -> list[str]:
    """The decorator Inductor compiled each of our GEMM kernels with (its triton_meta: signature, constants,
    divisibility), the text before each ``def grouped_gemm_kernel``."""
    out = []
    for m in re.finditer(r"def " + KERNEL + r"\w*\(", code):
        head = code[max(0, m.start() - 6000):m.start()]
        at = head.rfind("triton_meta")
        if at >= 0:
            out.append(head[at:at + 3000].replace("\n", " "))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="gpt_oss", choices=sorted(bench_hf.FAMILIES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", nargs="*", type=int, default=[1024, 2048])
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled model (4)")
    args = ap.parse_args(argv)
    from triton.testing import do_bench

    from moe_inductor import hf

    model, cfg = bench_hf.build(args.family, args.layers, False, "cuda", torch.bfloat16)
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    captured = {}

    def hook(module, a, kw):
        if module is experts[0] and "args" not in captured:
            names = ("hidden_states", "top_k_index", "top_k_weights")
            values = list(a) + [kw[n] for n in names[len(a):]]
            captured["args"] = [v.detach().clone() for v in values]
            captured["raw"] = [(n, v) for n, v in zip(names, values)]
            captured["desc"] = [describe(n, v) for n, v in zip(names, values)]

    handle = experts[0].register_forward_pre_hook(hook, with_kwargs=True)
    for T in args.tokens:
        ids = bench_hf.tokens(cfg, (1, T), "cuda")
        model.set_experts_implementation("grouped_mm")
        captured.clear()
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
        hs, top_idx, top_w = captured["args"]
        print(f"=== {args.family} T={T}: the first experts module's arguments in the model", flush=True)
        print("\n".join(captured["desc"]))
        E, k = hf.experts_spec(experts[0])["w1"].shape[0], top_idx.shape[-1]
        counts = torch.bincount(top_idx.reshape(-1), minlength=E).float()
        print(f"  rows per expert: mean {counts.mean():.1f}, max {counts.max():.0f}, min {counts.min():.0f}, "
              f"empty {(counts == 0).sum().item()}")
        kw = hf.experts_spec(experts[0])
        print("  spec: " + ", ".join(f"{n}={describe('', v).strip() if torch.is_tensor(v) else v}"
                                     for n, v in kw.items()))

        def op(idx, w):
            return lambda: hf.moe_inductor_experts_forward(experts[0], hs, idx, w)

        gen = torch.Generator(device="cpu").manual_seed(T)
        uniform = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(hs.shape[0])]).to(top_idx)
        with torch.no_grad():
            for label, call in (("captured", op(top_idx, top_w)), ("uniform", op(uniform, top_w))):
                ms = do_bench(call, warmup=25, rep=200, return_mode="median")
                kms, n, every = kernel_ms(call)
                print(f"  {label:9s} op alone: do_bench {ms:.3f} ms; {KERNEL} {kms:.3f} ms in {n} launches "
                      f"({kms / max(n, 1):.3f} each); all kernels {every:.3f} ms", flush=True)
            model.set_experts_implementation("moe_inductor")
            step = lambda: model(input_ids=ids, logits_to_keep=1)  # noqa: E731
            ms = do_bench(step, warmup=10, rep=200, return_mode="median")
            kms, n, every = kernel_ms(step)
            print(f"  eager model (experts_implementation=moe_inductor): do_bench {ms:.3f} ms; {KERNEL} {kms:.3f} ms "
                  f"in {n} launches ({kms / max(n, 1):.3f} each); all kernels {every:.3f} ms", flush=True)
            model.set_experts_implementation("grouped_mm")
        print("  JIT specialisations so far:")
        for key in jit_specialisations():
            print("   ", key[:1500])
        if args.no_compiled:
            continue
        from torch._inductor.utils import run_and_get_code

        with bench_hf.speed_rule_off(True), torch.no_grad():
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, backend="moe_inductor", dynamic=False)
            _, codes = run_and_get_code(fwd, input_ids=ids, logits_to_keep=1)
            step = lambda: fwd(input_ids=ids, logits_to_keep=1)  # noqa: E731
            ms = do_bench(step, warmup=10, rep=200, return_mode="median")
            kms, n, every = kernel_ms(step)
        print(f"  compiled (rule off): do_bench {ms:.3f} ms; {KERNEL} {kms:.3f} ms in {n} launches "
              f"({kms / max(n, 1):.3f} each); all kernels {every:.3f} ms")
        code = "\n".join(codes)
        for meta in inductor_specialisations(code):
            print("  inductor triton_meta:", meta)
        for line in code.splitlines():
            if KERNEL in line and ".run(" in line:
                print("  launch:", line.strip()[:600])
    handle.remove()


if __name__ == "__main__":
    main()
