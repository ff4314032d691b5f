"""Per-expert weights read in place through a table of their addresses (ops/expert_lists.py,
kernels/weight_table.py, ``grouped_gemm_kernel``'s ``B_TABLE``): with ``config.list_weight_tables`` on, the list op's
forward makes no stack of the experts' weights (at every count of rows, as by default).

Checked against the plain-torch reference under the Triton interpreter on the CPU: T = 0, 1 and several, E not a
power of two, one hot expert, experts without tokens, top-1 and top-2, every weight position, both layouts, gated and
plain activations, the backward of a forward that read the tables, a write into a weight between calls (even through
``.data``), and the calls that must stack (weights of mixed strides or dtypes). On the GPU: bf16 against the stack,
and a CUDA graph captured after the table was made.
"""
import os

import pytest
import torch

from moe_inductor import config
from moe_inductor.kernels import weight_table as table_module
from moe_inductor.ops import expert_lists
from moe_inductor.ops.reference import moe_reference
from tests.helpers import assert_close

H, I, E = 16, 8, 5


def _weights(layout: str, device="cpu", dtype=torch.float32, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I)) if layout == "nk" else ((H, I), (H, I), (I, H))
    ws = [[(torch.randn(*s, generator=g) * 0.3).to(device, dtype) for _ in range(E)] for s in shapes]
    if not gated:
        ws[1] = []
    return ws


def _reference(x, ids, w, w1, w3, w2, layout, position="output", activation="silu_glu"):
    stacks = [torch.stack(ws) if ws else None for ws in (w1, w3, w2)]
    if layout == "nk":
        stacks = [s.transpose(1, 2) if s is not None else None for s in stacks]
    return moe_reference(x, ids, w, *stacks, activation=activation, weight_position=position)


@pytest.fixture
def tables_counted(monkeypatch):
    """The tables on, and the projections that were read through one (the path taken, not only its result)."""
    monkeypatch.setattr(config, "list_weight_tables", True)
    monkeypatch.setattr(config, "list_weight_tables_min_rows_per_expert", 0.0)  # every count of rows
    made = []
    real = table_module.weight_table

    def counted(ws, *args, **kwargs):
        got = real(ws, *args, **kwargs)
        if got is not None:
            made.append(len(ws))
        return got

    monkeypatch.setattr(table_module, "weight_table", counted)
    return made


def _ids(T, k, hot=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if hot is not None:  # every token's first choice is one expert
        rest = torch.stack([torch.randperm(E - 1, generator=g)[:k - 1] for _ in range(T)]) if k > 1 else None
        rest = None if rest is None else rest + (rest >= hot).long()
        first = torch.full((T, 1), hot)
        return first if rest is None else torch.cat([first, rest], 1)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()


@pytest.mark.parametrize("T,k,position,layout,activation,hot", [
    (1, 2, "output", "nk", "silu_glu", None),
    (2, 2, "input", "nk", "silu_glu", None),
    (1, 1, "between", "nk", "gelu_glu", None),
    (2, 1, "output", "kn", "silu_glu", None),
    (9, 2, "output", "nk", "relu", None),
    (6, 2, "output", "kn", "silu_glu", 3),
    (0, 2, "output", "nk", "silu_glu", None),
], ids=["T1", "T2-input", "T1-top1-between", "kn-top1", "plain-activation", "one-hot-expert", "T0"])
def test_the_forward_reads_the_tables_and_matches_the_reference(triton_kernels, tables_counted, T, k, position,
                                                                layout, activation, hot):
    torch.manual_seed(T + k)
    x = torch.randn(T, H)
    ids = _ids(T, k, hot, seed=T)
    w = torch.rand(T, k)
    gated = activation.endswith("glu")
    w1, w3, w2 = _weights(layout, gated=gated)
    y, pre, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], activation, False, position,
                                                   layout, None)
    assert tables_counted == [E] * (3 if gated else 2) and pre.numel() == 0
    assert_close(y, _reference(x, ids, w, w1, w3, w2, layout, position, activation), torch.float32, "y")


def test_the_backward_of_a_forward_through_the_tables(triton_kernels, tables_counted):
    """Training: the forward reads the tables and keeps the raw up projection; the backward (which stacks) gives
    the reference's gradients for x, the routing weights and every expert's weights (two of five get no token)."""
    torch.manual_seed(1)
    x = torch.randn(3, H, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 4], [4, 0]])
    w = torch.rand(3, 2, requires_grad=True)
    params = [[t.requires_grad_() for t in ws] for ws in _weights("nk")]
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *params, [], [], [], "silu_glu", True, "output", "nk", None)
    assert tables_counted == [E] * 3
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, *params[0], *params[1], *params[2]], dy)
    leaves = [t.detach().clone().requires_grad_() for t in [x, w, *params[0], *params[1], *params[2]]]
    xr, wr, rest = leaves[0], leaves[1], leaves[2:]
    ref = _reference(xr, ids, wr, rest[:E], rest[E:2 * E], rest[2 * E:], "nk")
    want = torch.autograd.grad(ref, leaves, dy)
    for i, (g, r) in enumerate(zip(got, want)):
        assert_close(g, r, torch.float32, f"grad {i}")
    assert got[2 + 1].abs().sum() == 0 and got[2 + 3].abs().sum() == 0  # experts 1 and 3 had no token


def test_a_weight_changed_between_calls_is_read_as_it_is_now(triton_kernels, tables_counted):
    """The table is reused (same addresses) and the kernel reads the weights themselves: a write through ``.data``,
    which no version counter sees, shows in the next call."""
    x, ids, w = torch.randn(1, H), torch.tensor([[0, 3]]), torch.rand(1, 2)
    w1, w3, w2 = _weights("nk")
    first, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                  "nk", None)
    w2[3].data.mul_(2.0)
    second, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                   "nk", None)
    assert tables_counted == [E] * 6
    assert_close(second, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "after the write")
    assert not torch.allclose(first, second)


def test_a_weight_replaced_by_a_new_tensor_gets_a_new_table(triton_kernels, tables_counted):
    """A new tensor in the list (``expert.weight = nn.Parameter(...)``) has a new address, so a new table."""
    x, ids, w = torch.randn(2, H), torch.tensor([[1, 3], [3, 4]]), torch.rand(2, 2)
    w1, w3, w2 = _weights("nk")
    expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk", None)
    w1[3] = torch.randn(I, H)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk",
                                              None)
    assert_close(y, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "after the replacement")


def test_weights_off_16_byte_boundaries_are_stacked(triton_kernels, tables_counted):
    """The kernel tells the compiler every expert starts on a 16-byte boundary (vectorised loads); weights that are
    views one element into a buffer do not, so the call stacks them, and the result is still the reference's."""
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 2], [2, 4]]), torch.rand(2, 2)
    w1, w3, w2 = _weights("nk")
    w2 = [torch.cat([torch.zeros(1), t.flatten()])[1:].view(H, I) for t in w2]
    assert all(t.data_ptr() % 16 for t in w2)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk",
                                              None)
    assert len(tables_counted) < 3
    assert_close(y, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "y")


class _Wrapped(torch.Tensor):
    """A tensor subclass (as DTensor and other wrappers are): its data_ptr need not be where its elements are."""


def test_tensor_subclasses_are_stacked(triton_kernels, tables_counted):
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 2], [2, 4]]), torch.rand(2, 2)
    w1, w3, w2 = _weights("nk")
    w2 = [t.as_subclass(_Wrapped) for t in w2]
    assert table_module.weight_table(w2, "nk", x.dtype, x.device) is None
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk",
                                              None)
    assert len(tables_counted) < 3
    plain = [t.as_subclass(torch.Tensor) for t in w2]
    assert_close(y.as_subclass(torch.Tensor), _reference(x, ids, w, w1, w3, plain, "nk"), torch.float32, "y")


@pytest.mark.parametrize("odd", ["strides", "dtype"])
def test_weights_a_table_cannot_describe_are_stacked(triton_kernels, tables_counted, odd):
    """Every expert is read at the first one's strides, in x's dtype: one expert held transposed (same shape,
    other strides), or in another dtype, sends the call to the stack."""
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 2], [2, 4]]), torch.rand(2, 2)
    w1, w3, w2 = _weights("nk")
    if odd == "strides":
        w3[2] = w3[2].t().contiguous().t()  # (I, H) with strides (1, I)
        assert w3[2].stride() != w3[0].stride()
        y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                  "nk", None)
        assert_close(y, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "y")
    else:
        w2[1] = w2[1].double()
        assert table_module.weight_table(w2, "nk", x.dtype, x.device) is None
        tables_counted.clear()
        assert expert_lists._weight_tables(x, ids, (w1, w3, w2), "nk") is None
    assert len(tables_counted) < 3


def test_opcheck_with_the_tables(triton_kernels, tables_counted):
    """The op's registrations (schema, fake, autograd, aot dispatch) hold on the path through the tables."""
    torch.manual_seed(2)
    x = torch.randn(3, H, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 4], [4, 1]])
    w = torch.rand(3, 2, requires_grad=True)
    w1, w3, w2 = ([t.requires_grad_() for t in ws] for ws in _weights("nk"))
    torch.library.opcheck(expert_lists.experts_forward_list,
                          (x, ids, w, w1, w3, w2, [], [], [], "silu_glu", True, "output", "nk", None))
    assert tables_counted


def test_the_tables_are_on_unless_turned_off():
    """On where measured faster than the stack (an H100); the environment may turn them off."""
    assert config.list_weight_tables is (os.environ.get("MOE_INDUCTOR_LIST_TABLES", "1") == "1")


def test_calls_with_fewer_rows_than_the_row_rule_stack(triton_kernels, tables_counted, monkeypatch):
    """With a row rule of one row per expert on average, 2 tokens x 2 choices over 5 experts stack the weights,
    3 x 2 read the tables; both give the reference."""
    monkeypatch.setattr(config, "list_weight_tables_min_rows_per_expert", 1.0)
    w1, w3, w2 = _weights("nk")
    for T, tables in ((2, 0), (3, 3)):
        x, w, ids = torch.randn(T, H), torch.rand(T, 2), _ids(T, 2, seed=T)
        tables_counted.clear()
        y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                  "nk", None)
        assert len(tables_counted) == tables
        assert_close(y, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, f"T={T}")


def test_a_compiled_remote_code_moe_reads_the_tables(triton_kernels, tables_counted):
    """DeepSeek-V2's ``moe_infer`` compiled (its ModuleList experts reach the list op): the op reads the 8 experts'
    weights through the tables, and the output is eager's."""
    from tests.corpus.deepseek_v2_infer import H as HIDDEN
    from tests.corpus.deepseek_v2_infer import DeepseekV2MoEInfer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DeepseekV2MoEInfer().eval()
    x = torch.randn(1, 3, HIDDEN)
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    assert tables_counted == [8] * 3
    assert_close(got, ref, torch.float32, "compiled through the tables")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 64, 700])
def test_gpu_tables_match_the_stack_bf16(T, tables_counted):
    torch.manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randn(T, E, device="cuda").topk(2).indices
    w = torch.rand(T, 2, device="cuda")
    w1, w3, w2 = _weights("nk", "cuda", torch.bfloat16)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk",
                                              None)
    assert tables_counted == [E] * 3
    config.list_weight_tables = False
    try:
        stacked, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output",
                                                        "nk", None)
    finally:
        config.list_weight_tables = True
    assert_close(y.float(), stacked.float(), torch.bfloat16, "tables against the stack")


@pytest.mark.gpu
def test_gpu_a_cuda_graph_replays_the_tables(tables_counted):
    """A warm-up call makes the tables; a CUDA graph captured after it reads the weights as they are at replay."""
    torch.manual_seed(0)
    x = torch.randn(2, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 4]], device="cuda")
    w = torch.rand(2, 2, device="cuda")
    w1, w3, w2 = _weights("nk", "cuda", torch.bfloat16)
    args = (x, ids, w, w1, w3, w2, [], [], [], "silu_glu", False, "output", "nk", None)
    expert_lists.experts_forward_list(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, *_ = expert_lists.experts_forward_list(*args)
    w2[3].mul_(2.0)
    graph.replay()
    ref = _reference(x.float(), ids, w, [t.float() for t in w1], [t.float() for t in w3], [t.float() for t in w2],
                     "nk")
    assert_close(y.float(), ref, torch.bfloat16, "replayed")
