"""The experts backward as two ops (ops/backward.py): the middle, the last reader of the forward's saved ``pre``,
then dW1 / dx / d(routing weights) from its d_pre. That the compiled backward frees ``pre`` between them is
checked on a traced training graph in test_ops.py (test_traced_training_passes_the_gate_up_weight_whole)."""
from __future__ import annotations

import pytest
import torch

from moe_inductor import config
from moe_inductor.ops import expert_weight_views, experts_backward, experts_forward
from moe_inductor.ops.backward import experts_backward_middle, experts_backward_up
from helpers import make_problem


def _args(activation: str = "silu_glu", bias: bool = True, gate_up: str = "concat", T: int = 7, E: int = 5,
          dtype: torch.dtype = torch.float32, needs=None, device: str = "cpu", layout: str = "nk",
          limit: float = 7.0):
    """Forward outputs and the backward's arguments of one call, as ``experts_backward`` takes them (``layout``:
    the weights as held, ``make_problem``'s; ``limit``: the clamped glus' bound)."""
    p = make_problem(T, 16, 8, E, 2, dtype=dtype, activation=activation, bias=bias, gate_up=gate_up,
                     requires_grad=False, device=device, layout=layout)
    views = expert_weight_views(p.w1, p.w2, p.b1, activation=activation, layout=p.layout, gate_up=gate_up)
    w1, w1_up, w2, b1, b1_up = views
    b2 = p.b2 if bias else None
    fw = (p.x, p.topk_ids, p.topk_weights, w1, w1_up, w2, b1, b1_up, b2, activation, "output", 1.702, limit, None,
          True)
    with torch.no_grad():
        y, pre, order, sorted_expert, offsets = experts_forward(*fw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
    gated = w1_up is not None
    if needs is None:
        needs = [True, True, True, gated, True, bias, bias and gated, bias, False, False]
    return (dy, p.x, p.topk_ids, p.topk_weights, w1, w1_up, w2, b1, b1_up, b2, pre, order, sorted_expert, offsets,
            activation, "output", 1.702, limit, False, needs)


def _split(args):
    dy, *shared, pre, order, sorted_expert, offsets, activation, position, alpha, limit, dropped, needs = args
    options = (order, sorted_expert, offsets, activation, position, alpha, limit, dropped, needs)
    d_pre, d_scale, dw2, db1, db1_up, db2 = experts_backward_middle(dy, *shared, pre, *options)
    dx, dtw, dw1, dw1_up = experts_backward_up(d_pre, d_scale, *shared, *options)
    return dx, dtw, dw1, dw1_up, dw2, db1, db1_up, db2


@pytest.mark.parametrize("activation,bias,gate_up", [
    ("silu_glu", True, "concat"), ("silu", False, "concat"), ("gptoss_glu", True, "interleaved"),
    ("clamped_silu_glu", False, "concat")])
def test_opcheck_the_two_halves(activation, bias, gate_up):
    args = _args(activation, bias, gate_up, limit=0.5)  # a bound that binds (the projections are about N(0, 1))
    dy, *shared, pre, order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs = args
    options = (order, sorted_expert, offsets, act, position, alpha, limit, dropped, needs)
    torch.library.opcheck(experts_backward_middle, (dy, *shared, pre, *options))
    d_pre, d_scale, *_ = experts_backward_middle(dy, *shared, pre, *options)
    torch.library.opcheck(experts_backward_up, (d_pre, d_scale, *shared, *options))


PATHS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton-interpreter"),
         pytest.param("engine", id="engine")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T,E", [(0, 4), (1, 3), (7, 5), (12, 6)], ids=["T0", "T1", "T7-E5", "T12-E6"])
@pytest.mark.parametrize("gate_up,needs_pairs", [("concat", False), ("interleaved", True)], ids=["halves", "pairs"])
def test_the_two_halves_give_the_one_ops_gradients(path, T, E, gate_up, needs_pairs, monkeypatch):
    """Every path (plain torch, our Triton kernels, torch._grouped_mm), with d_pre in either layout: the halves
    composed give exactly what the single op gives, and that is the float64 reference's gradient."""
    if path == "engine" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    if torch.cuda.is_available():
        pytest.skip("the CPU's paths; the GPU's run in the compiled training tests")
    monkeypatch.setattr(config, "triton_on_cpu", path != "torch")
    monkeypatch.setattr(config, "gemm_engine", "grouped_mm" if path == "engine" else "triton")
    dtype = torch.bfloat16 if path == "engine" else torch.float32  # the engine takes bf16 only
    activation = "gptoss_glu" if gate_up == "interleaved" else "silu_glu"
    needs = [True] * 8 + [needs_pairs, needs_pairs]
    args = _args(activation, True, gate_up, T=T, E=E, dtype=dtype, needs=needs)
    whole = experts_backward(*args)
    halves = _split(args)
    for name, a, b in zip(["dx", "dtw", "dw1", "dw1_up", "dw2", "db1", "db1_up", "db2"], whole, halves):
        assert a.shape == b.shape and a.stride() == b.stride(), name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    if T > 0:
        assert whole[2].abs().sum() > 0  # a real gradient, not an empty one twice
