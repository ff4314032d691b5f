"""The list op on the CPU path (ops/expert_lists.PerExpert, ops/cpu_path.py): the forward computes with each expert's
own weight tensors, as eager's loop does, instead of a stack of every expert's weights at each call (at
DeepSeek-V2-Lite's widths a stack copies 64 experts' 2.9M weights a projection, about 740 MB in fp32, per call).

Against the plain-torch reference: T = 0, 1 and several, E not a power of two, one hot expert, experts without tokens,
fp32/fp16/bf16, both layouts, gated and plain activations, every weight position, the backward, and a write into a
weight through ``.data`` between calls; weights of mixed shapes still take the stack, which refuses them as eager's
``torch.stack`` does.
"""
import pytest
import torch

from moe_inductor import config
from moe_inductor.ops import expert_lists
from moe_inductor.ops.reference import moe_reference
from tests.helpers import assert_close

H, I, E = 16, 8, 5


@pytest.fixture(autouse=True)
def _plain_cpu_path(monkeypatch):
    monkeypatch.setattr(config, "triton_on_cpu", False)  # the plain-torch path, not the kernels' interpreter


@pytest.fixture
def no_stack(monkeypatch):
    """Fails the test if the forward stacks the experts' weights."""
    def refuse(ws):
        raise AssertionError("the CPU forward stacked the experts' weights")
    monkeypatch.setattr(expert_lists, "stacked", refuse)


def _weights(layout, dtype=torch.float32, gated=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I)) if layout == "nk" else ((H, I), (H, I), (I, H))
    ws = [[(torch.randn(*s, generator=g) * 0.3).to(dtype).requires_grad_() for _ in range(E)] for s in shapes]
    if not gated:
        ws[1] = []
    return ws


def _reference(x, ids, w, w1, w3, w2, layout, position="output", activation="silu_glu"):
    stacks = [torch.stack(ws) if ws else None for ws in (w1, w3, w2)]
    if layout == "nk":
        stacks = [s.transpose(1, 2) if s is not None else None for s in stacks]
    return moe_reference(x, ids, w, *stacks, activation=activation, weight_position=position)


def _routing(T, k, hot=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randn(T, E, generator=g).topk(k).indices if hot is None else torch.full((T, k), hot)
    return ids, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_reads_each_experts_own_weights(T, layout, dtype, no_stack):
    torch.manual_seed(0)
    x = torch.randn(T, H).to(dtype)
    ids, w = _routing(T, 2)
    w1, w3, w2 = _weights(layout, dtype)
    with torch.no_grad():
        y, *_ = expert_lists.experts_forward_list(x, ids, w.to(dtype), w1, w3, w2, [], [], [], "silu_glu", False,
                                                  "output", layout, None)
        ref = _reference(x.float(), ids, w, *([t.float() for t in ws] for ws in (w1, w3, w2)), layout)
    assert y.shape == (T, H) and y.dtype == dtype
    assert_close(y.float(), ref, dtype, f"T={T}")


@pytest.mark.parametrize("position", ["output", "between", "input"])
@pytest.mark.parametrize("gated", [True, False])
def test_forward_and_backward_with_a_hot_expert_and_empty_ones(position, gated):
    """Every token on expert 3 (top-1): the others get no rows; gradients of x, the routing weights and every
    expert's weights against the reference (the backward stacks, as before)."""
    torch.manual_seed(0)
    x = torch.randn(6, H, requires_grad=True)
    ids, w = _routing(6, 1, hot=3)
    w.requires_grad_()
    w1, w3, w2 = _weights("nk", gated=gated)
    activation = "silu_glu" if gated else "relu"
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], activation, True, position, "nk", None)
    ref = _reference(x, ids, w, w1, w3, w2, "nk", position, activation)
    assert_close(y, ref, torch.float32, "y")
    leaves = [x, w, *w1, *w3, *w2]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    want = torch.autograd.grad(ref, leaves, dy, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None or not a.any(), i
        else:
            assert_close(a, b, torch.float32, f"grad {i}")


def test_a_write_through_data_is_read_at_the_next_call(no_stack):
    x = torch.randn(4, H)
    ids, w = _routing(4, 2)
    w1, w3, w2 = _weights("nk")
    with torch.no_grad():
        expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk", None)
        for t in w2:
            t.data.mul_(2.0)  # bumps no version counter
        y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                  "nk", None)
        ref = _reference(x, ids, w, w1, w3, w2, "nk")
    assert_close(y, ref, torch.float32, "after the write")


def test_weights_of_mixed_shapes_fail_as_a_stack_does():
    x = torch.randn(4, H)
    ids, w = _routing(4, 2)
    w1, w3, w2 = _weights("nk")
    w2[1] = torch.randn(H, I + 1)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk", None)
