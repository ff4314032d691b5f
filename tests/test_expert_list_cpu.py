"""The list op on the CPU path (ops/expert_lists.PerExpert, ops/cpu_path.py): the forward computes with each expert's
own weight tensors, as eager's loop does, instead of a stack of every expert's weights at each call (at
DeepSeek-V2-Lite's widths a stack copies 64 experts' 2.9M weights a projection, about 740 MB in fp32, per call).

Against the plain-torch reference: T = 0, 1 and several, E not a power of two, one hot expert, experts without tokens,
fp32/fp16/bf16, both layouts, gated and plain activations, every weight position, the backward (which reads each
expert's own weights too, and hands each parameter a gradient in its own layout), and a write into a weight through
``.data`` between calls; weights of mixed shapes still take the stack, which refuses them as eager's ``torch.stack``
does.
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
    """Fails the test if the op stacks the experts' weights (their (N,) biases it stacks: a few numbers each)."""
    real = expert_lists.stacked

    def refuse(ws):
        if ws and ws[0].dim() > 1:
            raise AssertionError("the CPU path stacked the experts' weights")
        return real(ws)
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
    expert's weights against the reference."""
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


def test_weights_of_mixed_dtypes_fail_as_eager_does():
    """One expert's weight in float64 among float32 ones: eager's loop fails in that expert's ``F.linear``, and so does
    the op (its stack promotes, and the GEMM refuses float32 rows against float64 weights); the backward, which
    reads each expert's weights, is never reached with such weights, and says so if called."""
    x = torch.randn(4, H)
    ids, w = _routing(4, 2)
    w1, w3, w2 = _weights("nk")
    w1[1] = w1[1].detach().double()
    with pytest.raises(RuntimeError, match="dtype"):
        torch.nn.functional.linear(x, w1[1])
    with pytest.raises(RuntimeError, match="dtype"):
        expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk", None)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match="share one shape and dtype"):
        expert_lists.experts_backward_per_expert(x, x, ids, w, w1, w3, w2, [], [], [], empty, empty, empty, empty,
                                                 "silu_glu", "output", "nk", False)


@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("biased", [False, True])
def test_backward_reads_each_experts_own_weights(T, layout, gated, biased, no_stack):
    """The backward makes every gradient (x, routing weights, each expert's weights and biases) without a stack of
    the weights, equal to the reference's; each weight's gradient is laid out as the weight is (nn.Linear's (out, in)
    rows contiguous), so autograd takes it as it is. One hot expert at T = 9 leaves others without rows."""
    torch.manual_seed(0)
    x = torch.randn(T, H, requires_grad=True)
    ids, w = _routing(T, 2) if T != 9 else _routing(T, 1, hot=2)
    w.requires_grad_()
    w1, w3, w2 = _weights(layout, gated=gated)
    g = torch.Generator().manual_seed(3)
    b1, b3, b2 = ([(torch.randn(n, generator=g) * 0.1).requires_grad_() for _ in range(E)] for n in (I, I, H))
    biases = [b1, b3 if gated else [], b2] if biased else [[], [], []]
    activation = "silu_glu" if gated else "gelu"
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, *biases, activation, True, "output", layout,
                                              None)
    stacks = [torch.stack(ws) if ws else None for ws in (w1, w3, w2)]
    if layout == "nk":
        stacks = [t.transpose(1, 2) if t is not None else None for t in stacks]
    bstacks = [torch.stack(bs) if bs else None for bs in biases]
    ref = moe_reference(x, ids, w, *stacks, *bstacks, activation=activation)
    assert_close(y, ref, torch.float32, "y")
    leaves = [x, w, *w1, *w3, *w2, *(b for bs in biases for b in bs)]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    # (at T = 0 the reference's output is a constant: every gradient is zero)
    want = torch.autograd.grad(ref, leaves, dy, allow_unused=True) if ref.requires_grad else [
        torch.zeros_like(t) for t in leaves]
    for i, (a, b, leaf) in enumerate(zip(got, want, leaves)):
        if b is None:
            assert a is None or not a.any(), i
            continue
        assert_close(a, b, torch.float32, f"grad {i}")
        assert a.shape == leaf.shape and a.stride() == leaf.stride(), (i, a.stride(), leaf.stride())


def test_a_weight_gradient_into_a_transposed_buffer_is_one_gemm(monkeypatch):
    """``project_weight_grad`` writes an expert's gradient into nn.Linear's (out, in) storage (a transposed view of
    the (in, out) product) as ``g^T a`` in place: no strided copy of the product."""
    from moe_inductor.ops.grouped import project_weight_grad

    a, gr = torch.randn(7, H), torch.randn(7, I)
    dw = torch.empty(2, I, H).transpose(1, 2)  # (E, H, I) views of (E, I, H) storage
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *args, **kw: copies.append(t) or real_copy(t, *args, **kw))
    project_weight_grad(a, gr, [3, 4], dw)
    assert not copies
    assert_close(dw[0], a[:3].t() @ gr[:3], torch.float32, "expert 0")
    assert_close(dw[1], a[3:].t() @ gr[3:], torch.float32, "expert 1")


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_opcheck_of_the_per_expert_backward(layout):
    """``experts_backward_per_expert`` (the CPU backward, a list of per-expert gradients per projection) against its
    fake: schema, no aliasing between its outputs, fake and real alike under AOTAutograd."""
    torch.manual_seed(0)
    x = torch.randn(9, H)
    ids, w = _routing(9, 2)
    w1, w3, w2 = ([t.detach() for t in ws] for ws in _weights(layout))
    _, pre, order, sorted_expert, offsets = expert_lists.experts_forward_list(
        x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, "output", layout, None)
    args = (torch.randn(9, H), x, ids, w, w1, w3, w2, [], [], [], pre, order, sorted_expert, offsets, "silu_glu",
            "output", layout, False)
    torch.library.opcheck(expert_lists.experts_backward_per_expert, args)
    got = expert_lists.experts_backward_per_expert(*args)
    want = expert_lists.experts_backward_list(*args)
    for i in (0, 1):
        assert_close(got[i], want[i], torch.float32, f"output {i}")
    for i, (mine, stacked) in enumerate(zip(got[2:5], want[2:5])):
        assert len(mine) == E and all(m.data_ptr() != n.data_ptr() for m, n in zip(mine, mine[1:]))
        assert_close(torch.stack(mine), stacked, torch.float32, f"weight gradients {i}")
