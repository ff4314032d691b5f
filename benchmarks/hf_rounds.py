"""A cell's columns timed again in interleaved rounds (``bench_hf.py --interleave R``), and the GPU's clock,
temperature and power while each column is timed (``--clocks``).

Timed one after another in one process, the columns of a cell may not meet the same GPU, and ``bench_hf`` always
times moe_inductor after inductor, so a drift would count against one side. Here every column is timed once per
round, the order reversed every other round (A B C, C B A, ...), and a column's value is the median of its rounds:
a drift then falls on every column alike, and the clocks say whether there was one. On the H200 the ratios did not
move with the order; what the clocks showed is that a faster column draws the card to its power limit and runs at
a lower clock (RESULTS.md, twenty-second session).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import threading
from typing import Callable, Optional


class GpuSampler:
    """Samples the SM clock (MHz), temperature (C) and power (W) of the current GPU every ``period`` seconds in a
    thread while the block runs; ``summary()`` gives their medians (the temperature's maximum). pynvml where it is
    installed, else ``nvidia-smi``; without either (or on the CPU) the summary is empty and nothing fails."""

    def __init__(self, device: str, period: float = 0.1):
        self.device, self.period = device, period
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._read: Optional[Callable[[], Optional[tuple[float, float, float]]]] = None

    def _reader(self) -> Optional[Callable[[], Optional[tuple[float, float, float]]]]:
        if self.device != "cuda":
            return None
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = torch.cuda.current_device()
        physical = visible.split(",")[index] if visible else str(index)
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(physical))

            def read_nvml():
                return (float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                        float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
            return read_nvml
        except Exception:  # no pynvml, or it cannot see the card: nvidia-smi below
            pass
        cmd = ["nvidia-smi", "-i", physical, "--query-gpu=clocks.sm,temperature.gpu,power.draw",
               "--format=csv,noheader,nounits"]

        def read_smi():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                sm, temp, power = (float(x) for x in out.strip().split(",")[:3])
                return sm, temp, power
            except Exception:  # a sample that cannot be read is skipped
                return None
        return read_smi if read_smi() is not None else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            got = self._read()
            if got is not None:
                self.samples.append(got)
            self._stop.wait(self.period)

    def __enter__(self) -> "GpuSampler":
        self._read = self._reader()
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        sm, temp, power = zip(*self.samples)
        return {"sm_mhz": statistics.median(sm), "temp_c": max(temp), "power_w": statistics.median(power)}


def round_orders(columns: list[str], rounds: int) -> list[list[str]]:
    """The columns' order in each round: as given, then reversed, alternating."""
    return [list(columns) if r % 2 == 0 else list(columns)[::-1] for r in range(rounds)]


def interleaved(steps: dict[str, Callable[[], object]], rounds: int, time_ms: Callable[[Callable], float],
                context: Callable[[str], contextlib.AbstractContextManager], device: str,
                clocks: bool = False) -> dict[str, dict]:
    """Each column's step timed by ``time_ms`` once per round, in ``round_orders``; per column, ``value`` (the
    median of its rounds), ``rounds`` (in order) and, with ``clocks``, the GPU's state while it was timed
    (``sm_mhz``: the median over its rounds; ``temp_c``: the maximum; ``power_w``: the median). ``context(column)``
    wraps every call of that column (a setting its compile was traced under, which a recompile would read again)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    times: dict[str, list[float]] = {c: [] for c in steps}
    states: dict[str, list[dict]] = {c: [] for c in steps}
    for order in round_orders(list(steps), rounds):
        for column in order:
            with context(column):
                sampler = GpuSampler(device) if clocks else None
                with sampler if sampler is not None else contextlib.nullcontext():
                    times[column].append(time_ms(steps[column]))
                state = sampler.summary() if sampler is not None else {}
                if state:
                    states[column].append(state)
    out = {}
    for column, ms in times.items():
        row: dict = {"value": statistics.median(ms), "rounds": ms}
        if states[column]:
            row["sm_mhz"] = statistics.median(s["sm_mhz"] for s in states[column])
            row["temp_c"] = max(s["temp_c"] for s in states[column])
            row["power_w"] = statistics.median(s["power_w"] for s in states[column])
        out[column] = row
    return out
