"""What AOT autograd traces for a tiny HF model's compiled training step, on a machine without a GPU.

The visible ops (lowerings/visible.py, visible_backward.py) launch Triton kernels through ``wrap_triton``, whose
trace asks Triton's front end which arguments each kernel writes. Without a GPU driver that analysis fails and
every argument counts as written, the weights included, and AOT autograd then refuses the trace of a whole HF
model (its weights are views). The front end needs no device, only a target: ``stand_in_sm90_driver`` names an
sm_90 one, so the trace is the one an H100 sees. Nothing is compiled for, or launched on, a GPU: the compile is
stopped at the partitioner, once the joint graph is read.

Run it in a process without TRITON_INTERPRET (``helpers.run_without_interpreter``): the stand-in driver replaces
the active one for the whole process.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch


class StopTrace(BaseException):
    """Raised once AOT autograd has traced (``stopped_at_the_partitioner``). A BaseException, so that the backend's
    do-no-harm fallback (which catches Exception and compiles the frame again without rewrites) lets it through."""


class _StandInSm90Driver:
    """Enough of a Triton driver for torch's TTIR mutation analysis: a current target and device."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def stand_in_sm90_driver() -> None:
    import triton

    triton.runtime.driver.set_active(_StandInSm90Driver())


@contextlib.contextmanager
def stopped_at_the_partitioner(read_joint: Optional[Callable[[torch.fx.Graph], None]] = None) -> Iterator[None]:
    """Inside, moe_inductor's Inductor compiles run AOT autograd alone and stop once it has traced: a training
    graph at the partitioner (after ``read_joint`` of its joint graph), a forward-only one at its compiler. The
    compiled call raises ``StopTrace``; catch it around the call."""
    from torch._dynamo.backends.common import aot_autograd

    from moe_inductor import backend

    def partition(joint, *_args, **_kwargs):
        if read_joint is not None:
            read_joint(joint.graph)
        raise StopTrace

    def forward_only(*_args, **_kwargs):
        raise StopTrace

    def inner(name, gm, example_inputs, mode, inductor_options=None):
        assert name == "inductor", name
        return aot_autograd(fw_compiler=forward_only, partition_fn=partition)(gm, example_inputs)

    original, backend._inner_compile = backend._inner_compile, inner
    try:
        yield
    finally:
        backend._inner_compile = original


def hf_training_joint(family: str, traced_engine: bool) -> dict:
    """The joint graph of a tiny HF ``family`` model's bf16 training step compiled by moe_inductor with the
    Inductor inner compiler (so its experts take the visible ops), the engine forced for the backward alone and
    ``config.visible_engine_backward`` = ``traced_engine``: the Triton kernels it launches ("kernels", by name),
    the moe_inductor ops it calls ("ops"), its ``aten._grouped_mm`` nodes ("grouped_mm") and the moe_inductor
    counters ("counters")."""
    from torch._dynamo.utils import counters

    from moe_inductor import config
    from tests.helpers import _kernels_and_ops
    from tests.hf_models import tiny

    stand_in_sm90_driver()
    config.triton_on_cpu, config.speed_rule = True, False
    config.gemm_engine, config.gemm_engine_backward = "triton", "grouped_mm"
    config.visible_engine_backward = traced_engine
    seen: dict = {}

    def read_joint(graph):
        kernels, ops = _kernels_and_ops(graph)
        grouped = sum(1 for n in graph.nodes if n.target is torch.ops.aten._grouped_mm.default)
        seen.update(kernels=sorted(set(kernels)), ops=ops, grouped_mm=grouped)

    torch._dynamo.reset()
    counters.clear()
    with stopped_at_the_partitioner(read_joint):
        model = tiny(family).to(torch.bfloat16)
        ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
        try:
            torch.compile(model, backend="moe_inductor", dynamic=False)(ids, labels=ids).loss.backward()
        except StopTrace:
            pass
    seen["counters"] = {k: dict(v) for k, v in counters.items() if k.startswith("moe_inductor")}
    return seen
