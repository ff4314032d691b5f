"""Step-3.7's clamped silu-glu, ``silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)``, as the op's
"clamped_silu_glu" on the CPU path: the activation and its gradient against eager autograd (at the bounds too), the
op forward and backward against Step-3.7's experts loop written out in eager torch, opcheck, and the edge shapes.

The pre-activations of ``make_problem`` are about N(0, 1): a limit of 0.5 binds on both factors.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import moe_inductor
from moe_inductor.ops import experts_backward, experts_forward
from moe_inductor.ops.activations import activation_backward, apply_activation
from tests.helpers import assert_close, assert_matches_rounded_reference, make_problem

ACT = "clamped_silu_glu"
LIMIT = 0.5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def step3p7_experts(x, ids, tw, gate_up, down, limit):
    """Step-3.7's experts (transformers v5.24 ``Step3p7Experts``) over every expert: (E, 2I, H) ``gate_up`` chunked
    into gate and up, (E, H, I) ``down``, each expert's output scaled by its routing weight and added at its rows."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, pos = torch.where(ids == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
        out.index_add_(0, tok, F.linear(h, down[e]) * tw[tok, pos, None])
    return out


def _bounds(limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up values on both sides of each clamp and exactly at its bounds: silu(3) is the limit itself for
    the gate (where the limit is silu(3)), up at -limit and +limit."""
    gate = torch.tensor([3.0, -1.0, 10.0, 0.5, 2.0, -20.0, 3.5, 0.0], dtype=torch.float64)
    up = torch.tensor([limit, -limit, 20.0, 0.1, -30.0, limit, -limit * 1.5, 0.0], dtype=torch.float64)
    return gate, up


@pytest.mark.parametrize("at", ["silu3", "inf"], ids=["limit-silu3", "limit-inf"])
def test_activation_and_gradient_equal_eager_autograd_at_the_bounds(at):
    """Forward and both gradients bitwise equal to autograd through the eager expression in fp32 (the backward's
    own precision): zero where a clamp binds, the gradient passed where the value lies on a bound (autograd's
    clamp passes it there)."""
    dtype = torch.float32
    limit = float(F.silu(torch.tensor(3.0, dtype=dtype))) if at == "silu3" else math.inf
    gate, up = (t.to(dtype).requires_grad_() for t in _bounds(limit if at == "silu3" else 2.0))
    want = F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    grad_out = torch.linspace(-1.5, 2.0, gate.numel(), dtype=dtype)
    want_gate, want_up = torch.autograd.grad(want, (gate, up), grad_out)
    got = apply_activation(ACT, gate.detach(), up.detach(), 1.702, limit)
    got_gate, got_up = activation_backward(ACT, gate.detach(), up.detach(), grad_out, 1.702, limit)
    assert torch.equal(got, want.detach())
    torch.testing.assert_close(got_gate.to(dtype), want_gate, rtol=0, atol=0)
    torch.testing.assert_close(got_up.to(dtype), want_up, rtol=0, atol=0)
    if at == "silu3":  # the cases this test is about are there: on the bound, and past it
        assert want_gate[0] != 0 and want_gate[2] == 0 and want_up[0] != 0 and want_up[1] != 0 and want_up[2] == 0


def _step(p, limit=LIMIT, **kw):
    """(y, gradients of every leaf) of the op through ``fused_experts`` for one upstream gradient."""
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, activation=ACT, layout="nk",
                                   gate_up="concat", limit=limit, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy) if y.numel() else ()
    return y, dy, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("T,E,k,routing", [
    pytest.param(0, 4, 2, "random", id="T0"),
    pytest.param(1, 4, 2, "random", id="T1"),
    pytest.param(13, 6, 2, "skip_odd", id="empty-experts"),
    pytest.param(11, 7, 2, "random", id="E7-prime"),
    pytest.param(9, 5, 1, "one_expert", id="E5-all-on-one-expert"),
])
def test_op_forward_and_backward_equal_step3p7_eager(T, E, k, routing, dtype, nan_empty):
    """The op against Step-3.7's experts loop in float64 on the same leaves: output and every gradient (tokens,
    routing weights, gate_up, down)."""
    p = make_problem(T, 16, 8, E, k, dtype=dtype, activation=ACT, routing=routing)
    y, dy, grads = _step(p)
    leaves64 = [t.detach().double().requires_grad_() for t in p.leaves()]
    ref = step3p7_experts(leaves64[0], p.topk_ids, *leaves64[1:], LIMIT)
    assert_close(y, ref, dtype, "y")
    if T == 0:
        return
    for name, a, b in zip(("x", "topk_weights", "gate_up", "down"), grads,
                          torch.autograd.grad(ref, leaves64, dy.double())):
        assert_close(a, b.to(a.dtype), dtype, f"d{name}")


def test_op_at_limit_inf_is_silu_glu():
    """At ``inf`` the clamps return their input: the op's output and gradients equal plain silu_glu's, bitwise."""
    p = make_problem(9, 16, 8, 5, 2, activation=ACT)
    y, dy, grads = _step(p, limit=math.inf)
    plain = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, activation="silu_glu")
    assert torch.equal(y, plain)
    for a, b in zip(grads, torch.autograd.grad(plain, p.leaves(), dy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("position", ["between", "input"])
def test_op_with_biases_and_other_weight_positions(position):
    """Biases on both projections and the routing weight between the projections or on the input: against the
    reference (``moe_reference`` through autograd)."""
    from moe_inductor.ops import moe_reference

    p = make_problem(10, 16, 8, 5, 2, activation=ACT, bias=True, seed=4)
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2, activation=ACT,
                                   weight_position=position, limit=LIMIT)
    g, u, d, bg, bu = p.views()
    ref = moe_reference(p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, ACT, position, 1.702, LIMIT)
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(y, p.leaves(), dy), torch.autograd.grad(ref, p.leaves(), dy)):
        assert_close(a, b, torch.float32, "grad")


def _opcheck_args(dtype=torch.float32, bias=False, capacity=None, T=7):
    p = make_problem(T, 16, 8, 5, 2, bias=bias, dtype=dtype, activation=ACT)
    g, u, d, bg, bu = p.views()
    return (p.x, p.topk_ids, p.topk_weights, g, u, d, bg, bu, p.b2, ACT, "output", 1.702, LIMIT, capacity, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bias,capacity", [(False, None), (True, 3)], ids=["plain", "bias-capacity"])
def test_opcheck_experts_forward(dtype, bias, capacity):
    torch.library.opcheck(experts_forward, _opcheck_args(dtype, bias, capacity))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_opcheck_experts_backward(dtype):
    args = _opcheck_args(dtype)
    with torch.no_grad():
        y, pre, order, sorted_expert, offsets = experts_forward(*args)
    x, ids, tw, g, u, d = args[:6]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.library.opcheck(experts_backward, (dy, x.detach(), ids, tw.detach(), g.detach(), u.detach(), d.detach(),
                                             None, None, None, pre, order, sorted_expert, offsets, ACT, "output",
                                             1.702, LIMIT, False, [True] * 4 + [False] * 5))


def test_the_list_op_runs_it_at_its_default_limit():
    """The per-expert list op's schema takes no limit: it runs the activation at the default (7, Step-3.7-Flash's
    own bound), against the reference at 7 on inputs wide enough for it to bind; another limit is refused there
    (the passes stack such weights for the stacked op instead: ``emit.list_op_runs``)."""
    from moe_inductor.ops import expert_lists, moe_reference
    from moe_inductor.ops.call import ExpertsCall, ExpertWeights, Routing, op_call
    from moe_inductor.ops.activations import Activation

    gen = torch.Generator().manual_seed(5)
    T, H, I, E, k = 9, 16, 8, 4, 2
    x = (torch.randn(T, H, generator=gen) * 12).requires_grad_()
    ids = torch.randn(T, E, generator=gen).topk(k).indices
    w = torch.rand(T, k, generator=gen).requires_grad_()
    w1, w3, w2 = ([(torch.randn(*s, generator=gen) * 0.3).requires_grad_() for _ in range(E)]
                  for s in ((I, H), (I, H), (H, I)))
    y, *_ = expert_lists.experts_forward_list(x, ids, w, w1, w3, w2, [], [], [], ACT, True, "output", "nk", None)
    stacks = [torch.stack(ws).transpose(1, 2) for ws in (w1, w3, w2)]
    gate = torch.einsum("th,ehi->tei", x.detach(), stacks[0].detach())
    assert (F.silu(gate) > 7).any()  # the bound binds somewhere
    ref = moe_reference(x, ids, w, *stacks, activation=ACT, limit=7.0)
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn(y.shape, generator=gen)
    leaves = [x, w] + w1 + w3 + w2
    for a, b in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy)):
        assert_close(a, b, torch.float32, "grad")
    call = ExpertsCall(x, Routing(ids, w), ExpertWeights(tuple(w1), tuple(w3), tuple(w2), layout="nk"),
                       Activation(ACT, limit=LIMIT))
    with pytest.raises(ValueError, match="default alpha and limit only"):
        op_call(call)


_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm") or (
    torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0)),
    reason="torch._grouped_mm is missing, or runs on Hopper only")
@pytest.mark.parametrize("gate_up,layout,bias", [("concat", "nk", False), ("interleaved", "kn", True)],
                         ids=["step3p7-concat", "interleaved-biases"])
def test_the_grouped_mm_engine_runs_it(gate_up, layout, bias, triton_kernels, nan_empty, monkeypatch):
    """The compute-bound engine (``torch._grouped_mm`` GEMMs, ops/grouped_mm_engine.py): the activation pass
    (kernels/activation.py) and the backward middle apply the clamps, bf16, against the float64 reference. The
    engine's own forward and backward are counted, so a fallback to the fused kernels cannot pass for it."""
    from moe_inductor import config
    from moe_inductor.ops import grouped_mm_engine

    monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    calls = []
    for attr in ("forward", "middle_grads"):
        real = getattr(grouped_mm_engine, attr)
        monkeypatch.setattr(grouped_mm_engine, attr,
                            lambda *a, _real=real, _attr=attr, **kw: calls.append(_attr) or _real(*a, **kw))
    p = make_problem(6, 32, 16, 4, 2, dtype=torch.bfloat16, device=_DEVICE, activation=ACT, layout=layout,
                     gate_up=gate_up, bias=bias, routing="skip_odd")
    y = moe_inductor.fused_experts(p.x, p.topk_ids, p.topk_weights, p.w1, p.w2, b1=p.b1, b2=p.b2, activation=ACT,
                                   layout=layout, gate_up=gate_up, limit=LIMIT)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    grads = torch.autograd.grad(y, p.leaves(), dy)
    assert calls == ["forward", "middle_grads"], calls
    assert_matches_rounded_reference(p, y, grads, dy, torch.bfloat16, limit=LIMIT)
