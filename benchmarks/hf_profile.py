"""What ``bench_hf.py --profile`` records of a timed cell: its top kernels and the step's time outside them
(``Profiler``), the host's time by package (``--host-profile``), and the garbage collector's time in a decode
(``GcClock``)."""
from __future__ import annotations

import gc
import re
import time
from pathlib import Path

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Profiler:
    """torch.profiler over a few steps of a compiled column: its top kernels by device time, and the step's wall time
    outside them (launch gaps, host work the GPU waits on)."""

    def __init__(self, path, rows: int = 12, host: bool = False):
        self.path, self.rows, self.host = path, rows, host

    def __call__(self, title: str, step, steps: int, device: str, per: str = "step") -> None:
        self._kernels(title, step, steps, device, per)
        if self.host:
            self._host(title, step, steps, device, per)

    def _emit(self, lines) -> None:
        text = "\n".join(lines)
        print(text, flush=True)
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(text + "\n")

    def _host(self, title: str, step, steps: int, device: str, per: str) -> None:
        """cProfile over the same steps: the host's own time by where it is spent (self time per package, then the
        top functions), which says whether a host-bound cell waits on the model's code, generate's loop, Dynamo's
        guards or the CUDA-graph replay."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        sync(device)
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            step()
        sync(device)
        prof.disable()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        stats = pstats.Stats(prof).stats
        buckets: dict = {}
        funcs = []
        for (filename, line, name), (_, calls, self_s, cum_s, _) in stats.items():
            where = host_bucket(filename, name)
            buckets[where] = buckets.get(where, 0.0) + self_s
            funcs.append((self_s, cum_s, calls, f"{where}: {Path(filename).name}:{line}({name})"))
        total = sum(buckets.values())
        lines = [f"== host {title}: per {per}: wall {wall_ms:.3f} ms under cProfile, self time {total * 1e3 / steps:.3f}"
                 f" ms"]
        lines += [f"  {s * 1e3 / steps:9.3f} ms  {where}"
                  for where, s in sorted(buckets.items(), key=lambda kv: -kv[1])[:self.rows]]
        lines.append("  top functions by self time (ms per step, cumulative ms, calls per step):")
        lines += [f"  {s * 1e3 / steps:9.3f} {c * 1e3 / steps:9.3f} x{n // steps:<6} {name[:110]}"
                  for s, c, n, name in sorted(funcs, reverse=True)[:self.rows]]
        self._emit(lines)

    def _kernels(self, title: str, step, steps: int, device: str, per: str) -> None:
        acts = [torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU]
        step()
        sync(device)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        events = []
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", None)
            if us is None or device != "cuda":
                us = getattr(evt, "self_cuda_time_total", 0) if device == "cuda" else evt.self_cpu_time_total
            if us > 0:  # kernels, copies and sets (the runtime calls that launch them take no device time)
                events.append((us / 1e3 / steps, evt.count // steps, evt.key))
        events.sort(reverse=True)
        busy = sum(ms for ms, _, _ in events) if device == "cuda" else float("nan")
        lines = [f"== {title}: per {per}: wall {wall_ms:.3f} ms, kernels {busy:.3f} ms, outside kernels "
                 f"{wall_ms - busy:.3f} ms, {sum(n for _, n, _ in events)} launches"]
        lines += [f"  {ms:9.3f} ms  x{n:<5} {name[:110]}" for ms, n, name in events[:self.rows]]
        self._emit(lines)


_HOST_BUCKETS = (("torchinductor_", "compiled graphs (Inductor's generated code)"),
                 ("/transformers/generation/", "transformers generate"), ("/transformers/", "transformers model code"),
                 ("/torch/_dynamo/", "torch._dynamo (frame entry, guards' Python)"),
                 ("/torch/_inductor/cudagraph", "cudagraph trees"), ("/torch/_inductor/", "torch._inductor (other)"),
                 ("/torch/_functorch/", "aot_autograd runtime"), ("/moe_inductor/", "moe_inductor"),
                 ("/torch/", "torch (other Python)"))


def host_bucket(filename: str, name: str) -> str:
    """The package a profiled function belongs to, for ``Profiler``'s host split: C functions by their name."""
    if filename == "~":
        return "C: " + re.sub(r"^<(built-in method|method) (\S+).*", r"\2", name).strip("'>")
    path = filename.replace("\\", "/")
    return next((label for part, label in _HOST_BUCKETS if part in path), "other Python")


class GcClock:
    """The time Python's cyclic garbage collector runs inside the block (``ms``): a host-bound decode pays it per
    step, and a process that compiled an earlier column has more objects for it to walk."""

    def __enter__(self):
        self.ms, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._tick)
        return self

    def _tick(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._tick)
