"""The forward grouped GEMM split in two launches: each expert's whole tiles, then its tail rows in smaller tiles
(``SPLIT`` in kernels/grouped_gemm.py, chosen by a ``|tail`` entry of the tuned table).

The split is forced here through the table lookup, with the interpreter's small blocks on the CPU (full tiles of 32
rows, tails of 16) and Hopper-sized ones on the GPU. Every row must be computed once: the ``nan_empty`` fixture
fills fresh buffers with NaN, so a row that neither launch writes shows up.
"""
import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor import config
from moe_inductor.kernels import configs, launch
from moe_inductor.ops import expert_weight_views, grouped_mm, grouped_mm_reference, moe_reference
from tests.helpers import assert_close, make_problem, record_launch_meta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
FULL = configs.LaunchConfig(64, 32, 32, 4, 2) if ON_GPU else configs.LaunchConfig(32, 32, 32, 1, 1)
TAIL = configs.LaunchConfig(16, 32, 32, 4, 2) if ON_GPU else configs.LaunchConfig(16, 32, 32, 1, 1)


@pytest.fixture
def forced_split(monkeypatch):
    """Every forward-GEMM key gets FULL, and its tail TAIL; returns the SPLIT constexpr of every GEMM launch, (run,
    traced by Inductor)."""
    def lookup(key):
        if key.startswith("gemm|") and not key.endswith("|tma"):  # (no TMA entry: the pointer launches)
            return TAIL if key.endswith("|tail") else FULL
        return None

    monkeypatch.setattr(configs.TABLE, "lookup", lookup)
    monkeypatch.setattr(launch, "_GEMM_DECISIONS", {})
    return record_launch_meta(monkeypatch, "SPLIT")


# rows per expert around the full tile (32 on the CPU, 64 on the GPU): none, a tail only, exactly whole tiles, whole
# tiles and one row more, a lone row
SIZES = {
    "ragged": lambda f: [0, f - 1, f, f + 1, 2 * f + 1, 1, 2 * f],
    "one-hot": lambda f: [0, 3 * f + 5, 0],
    "whole-tiles-only": lambda f: [f, 2 * f, 0, f],
    "tails-only": lambda f: [f - 1, 1, 17, 0, 5],
}


@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_launches_compute_every_row_once(sizes, dtype, forced_split, triton_kernels, nan_empty):
    counts = SIZES[sizes](FULL.BLOCK_M)
    gen = torch.Generator().manual_seed(2)
    M = sum(counts)
    a = torch.randn(M, 32, generator=gen).to(DEVICE, dtype)
    b = torch.randn(len(counts), 32, 24, generator=gen).to(DEVICE, dtype)  # N = 24: a partial n-tile too
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    out = grouped_mm(a, b, offs)
    assert forced_split[0] == [1, 2], "one launch of whole tiles, then one of tails"
    assert_close(out, grouped_mm_reference(a.double(), b.double(), offs), dtype, "out")


def test_split_off_or_a_tail_as_big_as_the_tile_is_one_launch(forced_split, triton_kernels, monkeypatch):
    counts = SIZES["ragged"](FULL.BLOCK_M)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(sum(counts), 32, generator=gen).to(DEVICE)
    b = torch.randn(len(counts), 32, 16, generator=gen).to(DEVICE)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    want = grouped_mm_reference(a.double(), b.double(), offs)

    monkeypatch.setattr(config, "gemm_tail_split", False)
    splits = forced_split[0]
    assert_close(grouped_mm(a, b, offs), want, torch.float32, "out, split off")
    assert splits == [0]

    # the tuner's "no split" answer is the full config stored as the tail
    monkeypatch.setattr(config, "gemm_tail_split", True)
    monkeypatch.setattr(configs.TABLE, "lookup",
                        lambda key: FULL if key.startswith("gemm|") and not key.endswith("|tma") else None)
    splits.clear()
    assert_close(grouped_mm(a, b, offs), want, torch.float32, "out, tail = full")
    assert splits == [0]


@pytest.mark.parametrize("T,E,k,dtype,activation,bias,capacity,routing", [
    (37, 5, 2, torch.float32, "silu_glu", False, None, "random"),
    (29, 3, 2, torch.bfloat16, "gptoss_glu", True, None, "random"),
    (33, 6, 2, torch.float32, "gelu", True, 7, "skip_odd"),
    (1, 5, 2, torch.float32, "silu_glu", False, None, "random"),
    (40, 3, 2, torch.float32, "silu_glu", False, None, "one_expert"),
], ids=["fp32-silu-glu", "bf16-gptoss", "fp32-capacity-empty-experts", "T1", "one-hot-expert"])
def test_fused_experts_with_split_launches_equal_the_reference(T, E, k, dtype, activation, bias, capacity, routing,
                                                               forced_split, triton_kernels, nan_empty,
                                                               monkeypatch):
    """The whole op, forward and backward, on our kernels only (the backward's dX GEMM is split too)."""
    monkeypatch.setattr(config, "gemm_engine", "triton")
    layout, gate_up = ("kn", "interleaved") if activation == "gptoss_glu" else ("nk", "concat")
    p = make_problem(T, 32, 16, E, k, dtype=dtype, device=DEVICE, activation=activation, bias=bias, layout=layout,
                     gate_up=gate_up, routing=routing)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2,
                                   activation=activation, layout=layout, gate_up=gate_up, capacity=capacity)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    if T * k >= FULL.BLOCK_M:
        assert 1 in forced_split[0] and 2 in forced_split[0]

    names = ["x", "topk_weights", "w1", "w2"] + (["b1", "b2"] if bias else [])
    leaves64 = {n: t.detach().double().requires_grad_() for n, t in zip(names, p.leaves())}
    views = expert_weight_views(leaves64["w1"], leaves64["w2"], leaves64.get("b1"), activation=activation,
                                layout=layout, gate_up=gate_up)
    ref = moe_reference(leaves64["x"], p.topk_ids, leaves64["topk_weights"], *views, leaves64.get("b2"), activation,
                        "output", 1.702, 7.0, capacity)
    assert_close(y, ref, dtype, "y")
    for name, got, want in zip(names, grads, torch.autograd.grad(ref, list(leaves64.values()), dy.double())):
        assert_close(got, want.to(got.dtype), dtype, f"d{name}")


@pytest.mark.gpu
def test_gpu_split_launches_from_inductors_wrapper(forced_split, monkeypatch):
    """Traced into Inductor's generated code (the visible op, a symbolic token count): both launches are there, the
    tail grid a static bound, and the compiled model equals eager at token counts on both sides of the tile."""
    from tests.test_pass_gathered_weights import GatheredMoE

    monkeypatch.setattr(config, "visible_kernels", True)
    torch.manual_seed(0)
    model = GatheredMoE("gptfast").cuda()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor")
    for T in (5, 40, 97, 200):
        x = torch.randn(T, 16, device="cuda", requires_grad=True)
        out, ref = compiled(x), model(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0],
                                   rtol=1e-4, atol=1e-4)
    assert counters["moe_inductor"], "the layer was rewritten"
    splits = forced_split[0] + forced_split[1]
    assert 1 in splits and 2 in splits


@pytest.mark.parametrize("sizes", ["ragged", "one-hot"])
def test_split_launches_read_through_descriptors_made_in_the_kernel(sizes, forced_split, triton_kernels, nan_empty,
                                                                   monkeypatch):
    """Both launches of the split with the TMA path forced (descriptors made in the kernel, persistent programs,
    the sorted rows through a descriptor too): every row computed once, as with pointer loads. On the CPU the
    interpreter runs it, a few programs each walking several tiles."""
    if ON_GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("a GPU without TMA")
    monkeypatch.setattr(config, "gemm_tma_descriptors", "device")
    monkeypatch.setattr(config, "gemm_tma_weights", "on")  # (the rule forced below; "tuned" would ask the table)
    monkeypatch.setattr(launch, "tma_weights_apply", lambda *args, **kwargs: True)
    persistent, _ = record_launch_meta(monkeypatch, "PERSISTENT")
    rows_desc, _ = record_launch_meta(monkeypatch, "A_DESC")
    counts = SIZES[sizes](FULL.BLOCK_M)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(sum(counts), 32, generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randn(len(counts), 32, 24, generator=gen).to(DEVICE, torch.bfloat16)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    out = grouped_mm(a, b, offs)
    assert forced_split[0] == [1, 2] and persistent == [True, True] and rows_desc == [True, True]
    assert_close(out, grouped_mm_reference(a.double(), b.double(), offs), torch.bfloat16, "out")
