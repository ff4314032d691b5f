"""Per-expert nn.Linear experts with biases run as the list op, which takes each expert's weights and biases
(ops/expert_lists.py): no stack of every expert's weights in the rewritten graph at each call, which made such a
loop 36x slower than eager at one token on the CPU (E=32, H=1024, I=2048) when the rewrite stacked them for the op
with stacked weights.

The op against the plain-torch reference with biases: forward and every gradient (biases included) for gated and
plain activations, every weight position, both layouts, T = 0 and 1, one hot expert with empty ones, E not a power
of two; opcheck; the Triton kernels' table path under the interpreter. The FX route: a biased ModuleList loop is rewritten into the list op with its biases, equal to eager
forward and backward, and its graph stacks no weight.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_inductor import config
from moe_inductor.ops import expert_lists
from moe_inductor.ops.reference import moe_reference
from tests.helpers import assert_close, assert_rewritten_like_eager

H, I, E = 16, 8, 5


@pytest.fixture(autouse=True)
def _plain_cpu_path(monkeypatch):
    monkeypatch.setattr(config, "triton_on_cpu", False)


def _params(layout, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, H), (I, H), (H, I)) if layout == "nk" else ((H, I), (H, I), (I, H))
    w1, w3, w2 = ([(torch.randn(*s, generator=g) * 0.3).requires_grad_() for _ in range(E)] for s in shapes)
    b1, b3 = ([(torch.randn(I, generator=g) * 0.1).requires_grad_() for _ in range(E)] for _ in range(2))
    b2 = [(torch.randn(H, generator=g) * 0.1).requires_grad_() for _ in range(E)]
    return (w1, w3 if gated else [], w2), (b1, b3 if gated else [], b2)


def _reference(x, ids, w, weights, biases, layout, position, activation):
    w1, w3, w2 = (torch.stack(ws) if ws else None for ws in weights)
    if layout == "nk":
        w1, w3, w2 = (t.transpose(1, 2) if t is not None else None for t in (w1, w3, w2))
    b1, b3, b2 = (torch.stack(bs) if bs else None for bs in biases)
    return moe_reference(x, ids, w, w1, w3, w2, b1, b3, b2, activation=activation, weight_position=position)


@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("position", ["output", "between", "input"])
@pytest.mark.parametrize("layout,gated", [("nk", True), ("nk", False), ("kn", True)])
def test_list_op_with_biases_matches_the_reference_forward_and_backward(T, position, layout, gated):
    torch.manual_seed(T)
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.randn(T, E).topk(2).indices
    w = torch.rand(T, 2, requires_grad=True)
    weights, biases = _params(layout, gated)
    activation = "silu_glu" if gated else "gelu"
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, activation, True, position, layout, None)
    ref = _reference(x, ids, w, weights, biases, layout, position, activation)
    assert_close(y, ref, torch.float32, "y")
    leaves = [x, w, *(t for g in (*weights, *biases) for t in g)]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    if T == 0:  # no token: every gradient is zero (the reference makes no graph at all)
        assert all(not g.any() for g in got)
        return
    for i, (a, b) in enumerate(zip(got, torch.autograd.grad(ref, leaves, dy))):
        assert_close(a, b, torch.float32, f"grad {i}")


def test_list_op_with_biases_one_hot_expert():
    """Every token on expert 3: the other experts' biases get zero gradients (the op's, as a stacked op's)."""
    x = torch.randn(4, H, requires_grad=True)
    ids, w = torch.full((4, 1), 3), torch.rand(4, 1)
    weights, biases = _params("nk", True)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, "silu_glu", True, "output", "nk", None)
    ref = _reference(x, ids, w, weights, biases, "nk", "output", "silu_glu")
    assert_close(y, ref, torch.float32, "y")
    db2 = torch.autograd.grad(y.sum(), biases[2])
    assert all(not g.any() for e, g in enumerate(db2) if e != 3) and db2[3].abs().sum() > 0


def test_opcheck_list_op_with_biases():
    x = torch.randn(6, H, requires_grad=True)
    ids = torch.randn(6, E).topk(2).indices
    w = torch.rand(6, 2, requires_grad=True)
    weights, biases = _params("nk", True)
    torch.library.opcheck(expert_lists.experts_forward_list,
                          (x, ids, w, *weights, *biases, "silu_glu", True, "output", "nk", None))


class BiasedLoopMoE(nn.Module):
    """A top-2 loop over a ModuleList of biased nn.Linear MLPs (fairseq/NLLB-style experts)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.fc1 = nn.ModuleList(nn.Linear(H, I) for _ in range(E))
        self.fc2 = nn.ModuleList(nn.Linear(I, H) for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.fc2[e](F.gelu(self.fc1[e](x[tok]))) * w[tok, pos, None])
        return out


def test_biased_module_list_loop_runs_the_list_op_without_a_stack(monkeypatch):
    from moe_inductor import backend

    torch.manual_seed(0)
    model = BiasedLoopMoE()
    graphs, inner = [], backend._inner_compile

    def keep(name, gm, *args, **kwargs):
        graphs.append(gm)
        return inner(name, gm, *args, **kwargs)

    monkeypatch.setattr(backend, "_inner_compile", keep)
    assert_rewritten_like_eager(model, torch.randn(7, H), "unrolled_loop", "biased loop")
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    (op,) = [n for n in calls if n.target == torch.ops.moe_inductor.experts_forward_list.default]
    assert not [n for n in calls if n.target in (torch.stack, torch.cat)], gm.code
    b1, b1_up, b2 = op.args[6:9]
    assert len(b1) == E and b1_up == [] and len(b2) == E


def test_kernels_read_the_weights_through_tables_and_add_the_biases(triton_kernels, monkeypatch):
    """The Triton path (under the interpreter here): weights read through their address tables, the stacked biases
    added by the GEMMs' epilogues; forward against the reference, and the backward's bias gradients."""
    from moe_inductor.kernels import weight_table as table_module

    monkeypatch.setattr(config, "list_weight_tables", True)
    monkeypatch.setattr(config, "list_weight_tables_min_rows_per_expert", 0.0)
    made, real = [], table_module.weight_table
    monkeypatch.setattr(table_module, "weight_table", lambda ws, *a, **k: made.append(len(ws)) or real(ws, *a, **k))
    torch.manual_seed(3)
    x = torch.randn(3, H, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 4], [4, 1]])
    w = torch.rand(3, 2)
    weights, biases = _params("nk", True)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, "silu_glu", True, "output", "nk", None)
    ref = _reference(x, ids, w, weights, biases, "nk", "output", "silu_glu")
    assert made == [E] * 3
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(y, biases[2], dy), torch.autograd.grad(ref, biases[2], dy))):
        assert_close(a, b, torch.float32, f"db2 {i}")
