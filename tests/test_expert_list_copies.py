"""Per-expert weights at decode sizes (ops/expert_lists.py, kernels/gather_weights.py): with ``config.list_weight_copies``
on (off by default until a GPU run measures it), no gradient wanted and T*k below E (and at most GATHER_MAX_ROWS), the
list op copies only the chosen experts' weights through a table of
their addresses instead of stacking every expert. Checked against the reference (and the stacking path) under the
Triton interpreter on the CPU, for T = 1 and 2, E not a power of two, top-1 and top-2, every weight position and
both layouts; a write into a weight between calls (even through ``.data``) is seen, the table being of addresses
only; T = 0, a call that wants gradients and T*k >= E take the stack. On the GPU: bf16 against the stack.
"""
import pytest
import torch

from moe_inductor.kernels import gather_weights as gather_module
from moe_inductor.ops import expert_lists
from moe_inductor.ops.reference import moe_reference
from tests.helpers import assert_close

H, I, E = 16, 8, 5


def _weights(layout: str, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I)) if layout == "nk" else ((H, I), (H, I), (I, H))
    return [[(torch.randn(*s, generator=g) * 0.3).to(device, dtype) for _ in range(E)] for s in shapes]


def _reference(x, ids, w, w1, w3, w2, layout, position="output"):
    stacks = [torch.stack(ws) for ws in (w1, w3, w2)]
    if layout == "nk":
        stacks = [s.transpose(1, 2) for s in stacks]
    return moe_reference(x, ids, w, *stacks, weight_position=position)


@pytest.fixture
def copies_counted(monkeypatch):
    """How many times the copies ran (the path taken, not only its result), with the copies on."""
    from moe_inductor import config

    monkeypatch.setattr(config, "list_weight_copies", True)
    calls = []
    real = gather_module.gather_weights

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gather_module, "gather_weights", counted)
    return calls


@pytest.mark.parametrize("T,k,position,layout", [(1, 2, "output", "nk"), (2, 2, "input", "nk"),
                                                 (1, 1, "between", "nk"), (2, 1, "output", "kn")])
def test_decode_sized_calls_copy_the_chosen_weights_and_match_the_reference(triton_kernels, copies_counted, T, k,
                                                                            position, layout):
    torch.manual_seed(T + k)
    x = torch.randn(T, H)
    ids = torch.randn(T, E).topk(k).indices
    w = torch.rand(T, k)
    w1, w3, w2 = _weights(layout)
    y, pre, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", False, position, layout)
    assert copies_counted == [T * k] * 3 and pre.numel() == 0
    assert_close(y, _reference(x, ids, w, w1, w3, w2, layout, position), torch.float32, "y")


def test_a_weight_changed_between_calls_is_read_as_it_is_now(triton_kernels, copies_counted):
    """The address table is reused (same addresses) and the kernel reads the weights themselves: a write through
    ``.data``, which no version counter sees, shows in the next call."""
    x, ids, w = torch.randn(1, H), torch.tensor([[0, 3]]), torch.rand(1, 2)
    w1, w3, w2 = _weights("nk")
    first, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", False, "output", "nk")
    w2[3].data.mul_(2.0)
    second, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", False, "output", "nk")
    assert copies_counted == [2] * 6
    assert_close(second, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "after the write")
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("T,save_pre", [(0, False), (1, True), (3, False)], ids=["T0", "wants-grad", "T*k>=E"])
def test_other_calls_stack_the_weights(triton_kernels, copies_counted, T, save_pre):
    x, w = torch.randn(T, H), torch.rand(T, 2)
    ids = torch.randn(T, E).topk(2).indices
    w1, w3, w2 = _weights("nk")
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", save_pre, "output", "nk")
    assert copies_counted == []
    assert_close(y, _reference(x, ids, w, w1, w3, w2, "nk"), torch.float32, "y")


def test_the_copy_kernel_reads_each_address_and_zeros_an_id_out_of_range(triton_kernels):
    ws = [torch.randn(3, 5) for _ in range(4)]
    table = torch.tensor([t.data_ptr() for t in ws], dtype=torch.int64)
    experts = torch.tensor([2, 0, 4, 3], dtype=torch.int32)  # 4 is past E = 4: a dropped or invalid assignment
    out = gather_module.gather_weights(table, experts, ws[0], 4)
    assert torch.equal(out[:2], torch.stack([ws[2], ws[0]])) and torch.equal(out[3], ws[3])
    assert torch.equal(out[2], torch.zeros(3, 5))


def test_a_compiled_remote_code_moe_at_decode_size_takes_the_copies(triton_kernels, copies_counted):
    """DeepSeek-V2's ``moe_infer`` compiled (its ModuleList experts reach the list op, no gradient under its
    ``no_grad``): at two tokens the op copies the 4 chosen experts' weights of 8, and the output is eager's."""
    from tests.corpus.deepseek_v2_infer import H as HIDDEN
    from tests.corpus.deepseek_v2_infer import DeepseekV2MoEInfer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DeepseekV2MoEInfer().eval()
    x = torch.randn(1, 2, HIDDEN)
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    assert copies_counted == [4] * 3
    assert_close(got, ref, torch.float32, "compiled with copies")


def test_the_copies_are_off_unless_asked_for(triton_kernels):
    """Off by default until a GPU run has measured them (config.list_weight_copies); the environment may ask."""
    import os

    from moe_inductor import config

    assert config.list_weight_copies is (os.environ.get("MOE_INDUCTOR_LIST_COPIES", "0") == "1")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_copies_match_the_stack_bf16(T, copies_counted):
    torch.manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randn(T, E, device="cuda").topk(2).indices
    w = torch.rand(T, 2, device="cuda")
    w1, w3, w2 = _weights("nk", "cuda", torch.bfloat16)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", False, "output", "nk")
    stacked, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, "silu_glu", True, "output", "nk")
    assert copies_counted == [T * 2] * 3
    assert_close(y.float(), stacked.float(), torch.bfloat16, "copies against the stack")
