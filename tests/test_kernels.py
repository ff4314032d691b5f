"""The Triton kernels against the plain-torch primitives they pair with.

Without a GPU these run under TRITON_INTERPRET=1 (set in conftest) at tiny sizes: about 6 ms per program instance.
With a GPU the same tests run the compiled kernels.
"""
import pytest
import torch

import moe_inductor
from moe_inductor import config
from moe_inductor.ops import expert_weight_views, grouped_mm, grouped_mm_reference, moe_reference
from tests.helpers import assert_close, assert_matches_rounded_reference, make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fwd_bwd(p, **kw):
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2,
                                   activation=p.activation, layout=p.layout, gate_up=p.gate_up, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy) if y.numel() else []
    return y, dy, grads


@pytest.mark.parametrize(
    "T,E,k,dtype,activation,bias,weight_position,capacity,layout,gate_up",
    [
        pytest.param(5, 3, 2, torch.float32, "silu_glu", False, "output", None, "nk", "concat", id="fp32-silu-glu"),
        pytest.param(6, 5, 2, torch.bfloat16, "gptoss_glu", True, "output", None, "kn", "interleaved", id="bf16-gptoss"),
        pytest.param(4, 3, 1, torch.float16, "gelu", True, "input", None, "nk", "concat", id="fp16-gelu-input"),
        pytest.param(7, 3, 2, torch.float32, "relu", True, "between", 3, "kn", "concat", id="fp32-capacity"),
        pytest.param(0, 3, 2, torch.float32, "silu_glu", False, "output", None, "nk", "concat", id="T0"),
        # the fused backward middle (weight on the output): a unary activation with bias and drops, a bf16 glu
        pytest.param(7, 3, 2, torch.float32, "gelu_tanh", True, "output", 3, "nk", "concat", id="fp32-output-capacity"),
        pytest.param(6, 4, 2, torch.bfloat16, "relu_glu", False, "output", None, "nk", "interleaved", id="bf16-relu-glu"),
        # one choice per token: the down GEMM writes y (and dx) directly, no combine; with drops, rows stay zero
        pytest.param(9, 3, 1, torch.float32, "silu_glu", True, "output", 2, "nk", "concat", id="k1-capacity"),
    ],
)
def test_fused_experts_triton_vs_reference(T, E, k, dtype, activation, bias, weight_position, capacity, layout,
                                           gate_up, triton_kernels, nan_empty):
    p = make_problem(T, 32, 16, E, k, dtype=dtype, device=DEVICE, activation=activation, bias=bias, layout=layout,
                     gate_up=gate_up)
    y, dy, grads = _fwd_bwd(p, weight_position=weight_position, capacity=capacity)
    # the reference runs in float64 on the same inputs, forward and backward
    names = ["x", "topk_weights", "w1", "w2"] + (["b1", "b2"] if bias else [])
    leaves64 = {n: t.detach().double().requires_grad_() for n, t in zip(names, p.leaves())}
    views = expert_weight_views(leaves64["w1"], leaves64["w2"], leaves64.get("b1"), activation=activation,
                                layout=layout, gate_up=gate_up)
    ref = moe_reference(leaves64["x"], p.topk_ids, leaves64["topk_weights"], *views, leaves64.get("b2"), activation,
                        weight_position, 1.702, 7.0, capacity)
    assert_close(y, ref, dtype, "y")
    if T == 0:
        return
    ref_grads = torch.autograd.grad(ref, list(leaves64.values()), dy.double())
    for name, a, b in zip(names, grads, ref_grads):
        assert_close(a, b.to(a.dtype), dtype, f"d{name}")


@pytest.mark.parametrize(
    "T,E,dtype,bias,layout,gate_up,routing",
    [
        # Step-3.7's experts: (E, 2I, H) gate_up chunked into [gate | up], no biases
        pytest.param(5, 3, torch.float32, False, "nk", "concat", "random", id="fp32-step3p7"),
        pytest.param(6, 5, torch.bfloat16, True, "kn", "interleaved", "skip_odd", id="bf16-interleaved-empty-experts"),
        pytest.param(1, 3, torch.float16, False, "nk", "concat", "random", id="fp16-T1"),
    ],
)
def test_clamped_silu_glu_triton_vs_reference(T, E, dtype, bias, layout, gate_up, routing, triton_kernels,
                                              nan_empty):
    """Step-3.7's clamped silu-glu through the fused gate/up epilogue and the backward middle, at a bound that
    binds on both factors (the pre-activations are about N(0, 1)), against the float64 reference (its raw
    projections rounded as the kernels keep them: ``assert_matches_rounded_reference``)."""
    p = make_problem(T, 32, 16, E, 2, dtype=dtype, device=DEVICE, activation="clamped_silu_glu", bias=bias,
                     layout=layout, gate_up=gate_up, routing=routing)
    y, dy, grads = _fwd_bwd(p, limit=0.5)
    # the interpreter's fp32 -> bf16 cast truncates: the kernel keeps the raw projections so
    interpreted = DEVICE == "cpu" and dtype == torch.bfloat16
    assert_matches_rounded_reference(p, y, grads, dy, dtype, limit=0.5, toward_zero=interpreted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_triton_vs_reference(dtype, triton_kernels):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10, 32, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(3, 32, 16, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    offs = torch.tensor([4, 4, 9], dtype=torch.int32, device=DEVICE)  # group 1 empty, row 9 past the last group
    out = grouped_mm(a, b, offs)
    ref = grouped_mm_reference(a.double(), b.double(), offs)
    assert_close(out, ref, dtype, "out")
    assert (out[9] == 0).all()
    dout = torch.randn(out.shape, generator=gen).to(out)
    da, db = torch.autograd.grad(out, (a, b), dout)
    ra, rb = torch.autograd.grad(grouped_mm_reference(a, b, offs), (a, b), dout)
    assert_close(da, ra, dtype, "da")
    assert_close(db, rb, dtype, "db")


@pytest.mark.parametrize("activation", ["silu_glu", "gelu_glu", "gelu_tanh_glu", "relu_glu", "gptoss_glu",
                                        "clamped_silu_glu", "silu", "gelu", "gelu_tanh", "relu", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("layout", ["own", "pairs"])
def test_fused_backward_middle_matches_the_torch_formulas(activation, bias, layout, triton_kernels):
    """kernels/backward_middle.py against ops/activations.py's definitions: h, d(scale), d(gate), d(up), with rows
    past the experts (dropped) zeroed, and an I that is not a multiple of the column block. ``pairs``: d_gate and d_up
    written as the even and odd columns of one tensor (the kernel's joined store)."""
    from moe_inductor.ops.activations import activation_backward, apply_activation, is_gated
    from moe_inductor.kernels.launch import SortedRouting
    from moe_inductor.ops.activations import Activation
    from moe_inductor.ops.grouped import backward_middle

    gen = torch.Generator().manual_seed(3)
    E, I, T, k = 3, 40, 9, 2
    M = T * k
    gated = is_gated(activation)
    if layout == "pairs" and not gated:
        pytest.skip("pairs are a gated activation's layout")
    pre = (torch.randn(M, 2 * I if gated else I, generator=gen) * 3).to(DEVICE)  # wide enough to cross the clamps
    g = torch.randn(M, I, generator=gen).to(DEVICE)
    scale = torch.rand(M, generator=gen).to(DEVICE)
    order = torch.randperm(M, generator=gen).to(torch.int32).to(DEVICE)
    sorted_expert = torch.sort(torch.randint(0, E, (M,), generator=gen))[0].to(torch.int32)
    sorted_expert[-3:] = E  # dropped rows
    sorted_expert = sorted_expert.to(DEVICE)
    b1 = torch.randn(E, I, generator=gen).to(DEVICE) if bias else None
    b1_up = torch.randn(E, I, generator=gen).to(DEVICE) if bias and gated else None
    pairs = torch.full((M, 2 * I), float("nan"), device=DEVICE) if layout == "pairs" else None
    h, d_gate, d_up, d_scale = backward_middle(pre, g, SortedRouting(scale, order, sorted_expert, E), (b1, b1_up),
                                                Activation(activation), torch.float32,
                                                out=(pairs[:, 0::2], pairs[:, 1::2]) if pairs is not None else None)
    if pairs is not None:  # every element written, each in its own column
        assert not pairs.isnan().any()
        assert d_gate.data_ptr() == pairs.data_ptr() and d_up.stride() == (2 * I, 2)

    valid = (sorted_expert < E)[:, None]
    expert_c = sorted_expert.long().clamp(max=E - 1)
    p_gate, p_up = pre[:, :I], (pre[:, I:] if gated else None)
    if bias:
        p_gate = p_gate + b1[expert_c]
        p_up = p_up + b1_up[expert_c] if gated else None
    act = apply_activation(activation, p_gate, p_up, 1.702, 7.0)
    g_valid = g.masked_fill(~valid, 0.0)
    s = torch.where(valid[:, 0], scale[order.long()], 0.0)[:, None]
    ref_gate, ref_up = activation_backward(activation, p_gate, p_up, g_valid * s, 1.702, 7.0)
    torch.testing.assert_close(h, act, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_scale, (act * g_valid).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_gate, ref_gate.masked_fill(~valid, 0.0), rtol=1e-5, atol=1e-5)
    if gated:
        torch.testing.assert_close(d_up, ref_up.masked_fill(~valid, 0.0), rtol=1e-5, atol=1e-5)
    else:
        assert d_up is None


@pytest.mark.parametrize("g_rows", [0, 1], ids=["sorted-rows", "token-rows"])
@pytest.mark.parametrize("case", ["uniform", "one-hot", "empty-experts", "dropped", "pairs-column", "T=0"])
def test_expert_row_sums_kernel_matches_the_torch_sum(g_rows, case, nan_empty, monkeypatch):
    """kernels/row_sums.py (a bias gradient) against a plain per-expert sum in fp64, and against the path off the
    kernels (the ones-column GEMM): every expert's row written, zeros where an expert has no rows, rows dropped by a
    capacity left out, a column-strided ``g`` read at its own elements, and the routing weight applied."""
    from moe_inductor import config
    from moe_inductor.ops.grouped import ROWS_SORTED, ROWS_TOKEN, sum_rows_by_expert
    from moe_inductor.ops.call import Routing
    from moe_inductor.ops.routing import prepare_routing

    gen = torch.Generator().manual_seed(5)
    E, k, N = 5, 2, 70
    T = 0 if case == "T=0" else 11
    if case == "one-hot":
        ids = torch.full((T, k), 3)
    elif case == "empty-experts":
        ids = torch.randint(0, 2, (T, k), generator=gen) * 4  # experts 1..3 get nothing
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.long()
    weights = torch.rand(T, k, generator=gen)
    routed = prepare_routing(Routing(ids, weights, capacity=3 if case == "dropped" else None), E)
    M = T * k
    rows_needed = M if g_rows == ROWS_SORTED else T
    if case == "pairs-column":  # d_up: the odd columns of a (rows, 2N) pairs tensor, on either device
        full = torch.randn(rows_needed, 2 * N, generator=gen)
        g, g_d = full[:, 1::2], full.to(DEVICE)[:, 1::2]
    else:
        g = torch.randn(rows_needed, N, generator=gen)
        g_d = g.to(DEVICE)
    scale = routed.scale if g_rows == ROWS_TOKEN else None

    expected = torch.zeros(E, N, dtype=torch.float64)
    order, offsets = routed.order.long(), routed.offsets.tolist()
    for e in range(E):
        for pos in range(offsets[e], offsets[e + 1]):
            assignment = order[pos]
            row = pos if g_rows == ROWS_SORTED else assignment // k
            expected[e] += g[row].double() * (scale[assignment].double() if scale is not None else 1.0)
    if case == "dropped":
        assert offsets[-1] < M  # the capacity dropped rows: they must not count

    monkeypatch.setattr(config, "triton_on_cpu", True)  # the kernel on DEVICE (the interpreter without a GPU)
    routed_d = prepare_routing(Routing(ids.to(DEVICE), weights.to(DEVICE), capacity=3 if case == "dropped" else None), E)
    kernel = sum_rows_by_expert(g_d, routed_d, g_rows, torch.float32,
                                scale=routed_d.scale if scale is not None else None).cpu()
    monkeypatch.setattr(config, "triton_on_cpu", False)  # CPU tensors off the kernels
    off_kernels = sum_rows_by_expert(g, routed, g_rows, torch.float32, scale=scale)
    assert kernel.shape == (E, N) and kernel.is_contiguous()
    torch.testing.assert_close(kernel.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(off_kernels.double(), expected, rtol=1e-5, atol=1e-5)


def test_backward_middle_refuses_column_strided_gradients_that_are_not_pairs(triton_kernels):
    """A stride-2 d_gate is only right as one tensor's even columns with d_up its odd ones; anything else must raise,
    not write the wrong elements."""
    from moe_inductor.kernels.launch import SortedRouting
    from moe_inductor.ops.activations import Activation
    from moe_inductor.ops.grouped import backward_middle

    M, I, E = 6, 8, 2
    pre, g = torch.randn(M, 2 * I, device=DEVICE), torch.randn(M, I, device=DEVICE)
    routing = SortedRouting(torch.rand(M, device=DEVICE), torch.arange(M, dtype=torch.int32, device=DEVICE),
                            torch.zeros(M, dtype=torch.int32, device=DEVICE), E)
    wide = torch.empty(M, 4 * I, device=DEVICE)
    for out in ((wide[:, 0:2 * I:2], wide[:, 2 * I::2]),   # stride 2, but not neighbours
                (wide[:, 1:2 * I:2], wide[:, 0:2 * I:2])):  # neighbours the wrong way round
        with pytest.raises(ValueError, match="even and odd columns"):
            backward_middle(pre, g, routing, (None, None), Activation("silu_glu"), torch.float32, out=out)


@pytest.mark.parametrize("sizes", [[1, 17, 0, 33, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 49, 0]],
                         ids=["ragged", "one-row-each", "one-hot-expert"])
def test_grouped_mm_grid_covers_every_tile(sizes, triton_kernels):
    """The grid has cdiv(M, BLOCK_M) + min(E, M) m-tiles; group sizes of 1 (mod 16, the interpreter's BLOCK_M) are
    the worst case for that bound: every row must still be computed."""
    gen = torch.Generator().manual_seed(1)
    M = sum(sizes)
    a = torch.randn(M, 32, generator=gen).to(DEVICE)
    b = torch.randn(len(sizes), 32, 16, generator=gen).to(DEVICE)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    out = grouped_mm(a, b, offs)
    assert_close(out, grouped_mm_reference(a.double(), b.double(), offs), torch.float32, "out")


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_indexed_combine_matches_the_torch_path(scaled, monkeypatch):
    """combine(rows in expert-sorted order, row_of, scale): the kernel and the CPU path agree with a direct sum, and an
    out-of-range id (-1, say a masked choice) contributes nothing, even where its row holds NaN."""
    from moe_inductor.ops.grouped import combine

    T, k, H, E = 5, 3, 24, 4
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[1, 2] = -1
    order = torch.randperm(T * k, generator=gen).to(torch.int32)
    row_of = torch.empty_like(order).scatter_(0, order.long(), torch.arange(T * k, dtype=torch.int32))
    rows = torch.randn(T * k, H, generator=gen).bfloat16()
    rows[row_of[1 * k + 2]] = float("nan")
    scale = torch.rand(T * k, generator=gen).bfloat16() if scaled else None
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            if ids[t, j] >= 0:
                want[t] += rows[row_of[t * k + j]].float() * (scale[t * k + j].float() if scaled else 1.0)
    for on_triton in (False, True):
        monkeypatch.setattr(config, "triton_on_cpu", on_triton)
        got = combine(rows.to(DEVICE), ids.to(DEVICE), E, row_of=row_of.to(DEVICE),
                      scale=scale.to(DEVICE) if scaled else None)
        torch.testing.assert_close(got.float().cpu(), want, rtol=1e-2, atol=1e-2)


def test_clamped_epilogues_cast_their_scalars_to_fp32_before_use():
    """Inductor's wrapper passes the clamped glus' ``alpha`` and ``limit`` as fp64 scalars (the JIT passes fp32),
    which made the compiled GPT-OSS epilogue, sigmoid included, fp64: its gate/up GEMM took 1.5x the eager launch's
    time inside the model (RESULTS.md, twentieth session). Every branch that computes a clamped glu (GPT-OSS's, id 5;
    Step-3.7's, id 6) casts them first; this reads the kernels' source, since the CPU cannot compile for the GPU to
    see the types."""
    import inspect
    import re

    from moe_inductor.kernels import backward_middle, grouped_gemm

    def code(src: str) -> str:
        return re.sub(r"#.*", "", src)

    # the epilogue: each clamped branch casts before its first use of the scalars
    src = code(inspect.getsource(grouped_gemm._activation.fn))
    for act in (5, 6):
        branch = src[src.index(f"ACT == {act}"):]
        branch = branch[:re.search(r"\n\s*(elif|else)\b", branch).start()]
        lines = [line for line in branch.splitlines() if re.search(r"\b(alpha|limit)\b", line)]
        cast = set(re.findall(r"tl\.cast\((alpha|limit), tl\.float32\)", lines[0]))
        # the first line to name them casts every one the branch reads
        assert cast and cast >= set(re.findall(r"\b(alpha|limit)\b", branch)), (act, branch)
    # the backward middle casts both once, before its loop, into new names, and reads the arguments nowhere else
    src = code(inspect.getsource(backward_middle.backward_middle_kernel.fn))
    body = src[src.index("):\n") + 3:]
    cast = body.index("alpha_f, limit_f = tl.cast(alpha, tl.float32), tl.cast(limit, tl.float32)")
    assert cast < body.index("for i0 in range(")
    assert len(re.findall(r"\balpha\b", body)) == 1 and len(re.findall(r"\blimit\b", body)) == 1
    for act in (5, 6):
        assert "limit_f" in body[body.index(f"ACT == {act}"):]
