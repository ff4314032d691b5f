"""lowerings/unshared_buffers.py: AOT autograd's CSE merges the identical ``empty_strided`` gradient buffers of two
same-shaped layers' visible backwards into one node, which Inductor would copy before every write but the last. The
pass gives each write its own buffer again; on the GPU the gradients stay what they were."""
import operator

import pytest
import torch

from moe_inductor import config
from moe_inductor.lowerings.unshared_buffers import UNSHARED_BUFFERS, unshare_written_buffers

WRAPPER = torch.ops.higher_order.triton_kernel_wrapper_functional


def _writes_into_one_buffer(writes: int = 3):
    """A graph as AOT's CSE leaves it: one ``empty_strided`` (a transposed gradient's layout) that ``writes``
    functional Triton launches each take as the output they clone and write, the results summed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        val = torch.empty_strided((5, 16, 8), (128, 1, 16))
        x.meta["val"] = torch.empty(3)
    e = graph.call_function(torch.ops.aten.empty_strided.default, ((5, 16, 8), (128, 1, 16)),
                            {"dtype": torch.float32, "device": torch.device("cpu")})
    e.meta["val"] = val
    outs = []
    for i in range(writes):
        w = graph.call_function(WRAPPER, (), {"kernel_idx": i, "constant_args_idx": i, "grid": [(1, 1, 1)],
                                              "tma_descriptor_metadata": {}, "kwargs": {"out": e, "x": x},
                                              "tensors_to_clone": ["out"]})
        outs.append(graph.call_function(operator.getitem, (w, "out")))
    graph.output(tuple(outs))
    return graph, e


def test_a_buffer_several_writes_share_gets_a_twin_per_write_after_the_first():
    graph, e = _writes_into_one_buffer(3)
    assert unshare_written_buffers(graph) == 2
    graph.lint()
    allocations = [n for n in graph.nodes if n.target is torch.ops.aten.empty_strided.default]
    assert len(allocations) == 3
    writes = [n for n in graph.nodes if n.target is WRAPPER]
    assert [w.kwargs["kwargs"]["out"] for w in writes] == allocations  # each write its own, in order
    assert all(w.kwargs["kwargs"]["x"].name == "x" for w in writes)  # the inputs it only reads are untouched
    vals = [n.meta["val"] for n in allocations]
    assert len({v.untyped_storage()._cdata for v in vals}) == 3  # storages of their own: alias analysis reads them
    assert all(v.stride() == (128, 1, 16) and v.shape == (5, 16, 8) for v in vals)
    assert all(n.args == e.args and n.kwargs == e.kwargs for n in allocations)
    assert unshare_written_buffers(graph) == 0  # nothing left to split
    one, _ = _writes_into_one_buffer(1)
    assert unshare_written_buffers(one) == 0


def test_a_buffer_a_write_only_reads_is_left_shared():
    """A launch that reads the buffer without writing it (not in its ``tensors_to_clone``) keeps it: the twin would
    be a different tensor to read."""
    graph, e = _writes_into_one_buffer(2)
    last = [n for n in graph.nodes if n.target is WRAPPER][-1]
    last.kwargs = {**last.kwargs, "tensors_to_clone": []}
    assert unshare_written_buffers(graph) == 0


def test_other_uses_of_an_empty_buffer_are_left_alone():
    """An empty tensor read by anything but a functional Triton write (here a plain add) keeps its one node."""
    graph = torch.fx.Graph()
    e = graph.call_function(torch.ops.aten.empty_strided.default, ((2, 3), (1, 2)), {"dtype": torch.float32})
    a = graph.call_function(torch.ops.aten.add.Tensor, (e, e))
    b = graph.call_function(torch.ops.aten.mul.Tensor, (e, a))
    graph.output((a, b))
    assert unshare_written_buffers(graph) == 0
    assert len(list(e.users)) == 2


def test_the_pass_rides_our_inductor_compiles_unless_the_user_has_one(monkeypatch):
    from moe_inductor.backend import _with_our_passes

    assert _with_our_passes(None) == {"post_grad_custom_pre_pass": UNSHARED_BUFFERS}
    assert _with_our_passes({"max_autotune": True})["post_grad_custom_pre_pass"] is UNSHARED_BUFFERS
    theirs = object()
    assert _with_our_passes({"post_grad_custom_pre_pass": theirs})["post_grad_custom_pre_pass"] is theirs
    monkeypatch.setattr(torch._inductor.config, "post_grad_custom_pre_pass", theirs)
    assert _with_our_passes(None) is None
    monkeypatch.setattr(torch._inductor.config, "post_grad_custom_pre_pass", None)
    monkeypatch.setattr(config, "unshared_buffers", False)
    assert _with_our_passes({"max_autotune": True}) == {"max_autotune": True}
    assert isinstance(UNSHARED_BUFFERS.uuid(), bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_compiled_step_with_the_pass_gives_the_same_gradients_with_fewer_copies(dtype, monkeypatch):
    """The gathered-weights MoE (gate and up weights held apart: two identical transposed gradient buffers) in a
    compiled training step, with the pass on and off: the same output and gradients to the bit, the pass made its
    twins, and the step's backward code has fewer Inductor kernels (the copies gone)."""
    from torch._dynamo.utils import counters

    from tests.test_pass_gathered_weights import GatheredMoE
    from tests.test_visible_backward import _compiled_copy_step, _traced_afresh

    _traced_afresh(monkeypatch)  # the counts below are made while AOT autograd and Inductor trace
    torch.manual_seed(0)
    x = torch.randn(33, 16, device="cuda", dtype=dtype)
    ref_model = GatheredMoE("gptfast").to("cuda", dtype)
    results, kernels = {}, {}
    for on in (True, False):
        monkeypatch.setattr(config, "unshared_buffers", on)
        model, out, codes = _compiled_copy_step(ref_model, x)
        assert counters["moe_inductor_visible"]["backward"] == 1
        assert (counters["moe_inductor_visible"]["unshared_buffers"] > 0) == on
        results[on] = [out, *(p.grad for p in model.parameters())]
        kernels[on] = sum(code.count("@triton.jit") for code in codes)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    assert kernels[True] < kernels[False], kernels
