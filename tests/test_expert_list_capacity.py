"""The list op with a capacity (ops/expert_lists.py): per-expert weights and biases read where they lie, each
expert keeping its first ``capacity`` assignments in choice-major order, as the stacked op does. A padded-capacity
layer over a ModuleList of nn.Linear experts (fairseq, DeepSpeed) is rewritten into it instead of into the stacked
op with every expert's weights torch.stack-ed in the graph at each call.

The op against the stacked op and the plain-torch reference at the same capacity: forward and every gradient (fp32)
at T = 0 and 1, a capacity that drops rows (rows never computed read as zeros, not as stale memory), a capacity of
T*k that drops none, a capacity of 0, one hot expert, E = 5, gated and plain activations, with and without biases;
opcheck; one tiny case through the address tables under the Triton interpreter. The FX route: fairseq- and
DeepSpeed-style chunked ModuleList experts (and a gated variant) rewritten into the list op with their capacity,
equal to eager forward and backward, with no stack or cat of weights in the graph handed to the inner compiler.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_inductor import config
from moe_inductor.ops import expert_lists
from moe_inductor.ops.activations import GPTOSS_ALPHA, GPTOSS_LIMIT
from moe_inductor.ops.experts import experts_forward_impl
from moe_inductor.ops.reference import moe_reference
from tests.helpers import assert_close, assert_rewritten_like_eager

H, I, E = 16, 8, 5  # E = 5: not a power of two


def _params(gated: bool, biased: bool, seed: int = 0) -> tuple[list, list]:
    """Per-expert nn.Linear-style ("nk") weights and biases, each a leaf that wants its gradient."""
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = ([(torch.randn(*s, generator=g) * 0.3).requires_grad_() for _ in range(E)]
                  for s in ((I, H), (I, H), (H, I)))
    b1, b3, b2 = ([(torch.randn(n, generator=g) * 0.1).requires_grad_() for _ in range(E)] for n in (I, I, H))
    weights = [w1, w3 if gated else [], w2]
    biases = [b1, b3 if gated else [], b2] if biased else [[], [], []]
    return weights, biases


def _stacks(weights: list, biases: list) -> tuple:
    """The stacked op's (E, K, N) weights and (E, N) biases, differentiable back to the per-expert leaves."""
    w1, w3, w2 = (torch.stack(ws).transpose(1, 2) if ws else None for ws in weights)
    b1, b3, b2 = (torch.stack(bs) if bs else None for bs in biases)
    return w1, w3, w2, b1, b3, b2


def _ids(T: int, k: int, hot: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, k, dtype=torch.long)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if hot:  # every token's first choice is expert 2 (its other choices elsewhere): the capacity bites there
        ids = torch.where(ids == 2, ids[:, :1], ids)
        ids[:, 0] = 2
    return ids


def _leaves(x, w, weights, biases) -> list:
    return [x, w, *(t for ws in weights for t in ws), *(t for bs in biases for t in bs)]


@pytest.mark.parametrize("T,k,capacity,hot", [
    (0, 2, 2, False),   # no tokens
    (1, 2, 1, False),   # one token, two experts, nothing to drop
    (9, 2, 2, False),   # drops: 18 assignments over 5 experts of at most 2 each
    (9, 2, 18, False),  # capacity T*k: drops none
    (6, 2, 3, True),    # one hot expert: its later first choices are dropped, second choices all kept
    (7, 1, 2, False),   # top-1 with drops
    (5, 2, 0, False),   # capacity 0: every assignment dropped, y and every gradient zero
], ids=["T0", "T1", "drops", "capacity-Tk-no-drop", "one-hot-expert", "top1-drops", "capacity0"])
@pytest.mark.parametrize("gated,biased", [(True, False), (False, True), (True, True)],
                         ids=["gated", "plain-biased", "gated-biased"])
def test_list_op_with_capacity_matches_the_stacked_op_and_the_reference(nan_empty, T, k, capacity, hot, gated,
                                                                        biased):
    """Forward and every gradient (x, routing weights, each expert's weights and biases); ``nan_empty`` makes any
    row of a dropped assignment that the op reads without writing show up as NaN."""
    torch.manual_seed(T + k)
    x = torch.randn(T, H, requires_grad=True)
    ids = _ids(T, k, hot, seed=T)
    w = torch.rand(T, k, requires_grad=True)
    weights, biases = _params(gated, biased)
    activation = "silu_glu" if gated else "relu"
    leaves = _leaves(x, w, weights, biases)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, activation, True, "output", "nk",
                                              capacity)
    stacks = _stacks(weights, biases)
    ref = moe_reference(x, ids, w, *stacks, activation=activation, capacity=capacity)
    with torch.no_grad():  # (the op's body itself, which computes with out= buffers: no autograd through it)
        stacked, *_ = experts_forward_impl(x, ids, w, *stacks, activation, "output", GPTOSS_ALPHA, GPTOSS_LIMIT,
                                           capacity, True)
    assert_close(y, ref, torch.float32, "y against the reference")
    assert_close(y, stacked, torch.float32, "y against the stacked op")
    if T == 0:
        return
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    if capacity == 0:  # (the reference computes nothing, so it has no graph to differentiate)
        assert all(g.abs().sum() == 0 for g in got)
        return
    want = torch.autograd.grad(ref, leaves, dy)
    for i, (a, b) in enumerate(zip(got, want)):
        assert not a.isnan().any(), f"grad {i}"
        assert_close(a, b, torch.float32, f"grad {i}")


@pytest.mark.parametrize("position", ["between", "input"])
def test_list_op_with_capacity_at_every_weight_position(position):
    torch.manual_seed(3)
    x = torch.randn(8, H, requires_grad=True)
    ids, w = _ids(8, 2, False, seed=3), torch.rand(8, 2, requires_grad=True)
    weights, biases = _params(True, True)
    leaves = _leaves(x, w, weights, biases)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, "silu_glu", True, position, "nk", 2)
    ref = moe_reference(x, ids, w, *_stacks(weights, biases), weight_position=position, capacity=2)
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy))):
        assert_close(a, b, torch.float32, f"grad {i}")


def test_opcheck_with_capacity():
    """Schema, fake, autograd and aot dispatch with a capacity that drops rows."""
    torch.manual_seed(2)
    x = torch.randn(7, H, requires_grad=True)
    ids, w = _ids(7, 2, False, seed=2), torch.rand(7, 2, requires_grad=True)
    weights, biases = _params(True, True)
    torch.library.opcheck(expert_lists.experts_forward_list,
                          (x, ids, w, *weights, *biases, "silu_glu", True, "output", "nk", 2))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain-engine-grouped_mm"])
def test_the_tables_with_capacity_under_the_interpreter(triton_kernels, monkeypatch, gated):
    """The GPU kernels' path (the forward reading the weights through their address tables; the backward) with a
    capacity that drops rows, on the CPU under the Triton interpreter: 4 tokens, top-2, capacity 1. The plain
    activation runs with ``gemm_engine="grouped_mm"``, which takes no call with a capacity: the forward reads the
    tables rather than stacking the weights for an engine that would not run them."""
    from moe_inductor.kernels import weight_table as table_module

    if not gated:
        monkeypatch.setattr(config, "gemm_engine", "grouped_mm")
    monkeypatch.setattr(config, "list_weight_tables", True)
    monkeypatch.setattr(config, "list_weight_tables_min_rows_per_expert", 0.0)
    made, real = [], table_module.weight_table

    def counted(ws, *args, **kwargs):
        got = real(ws, *args, **kwargs)
        made.append(got is not None)
        return got

    monkeypatch.setattr(table_module, "weight_table", counted)
    torch.manual_seed(5)
    x = torch.randn(4, H, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 0], [0, 4], [2, 4]])  # expert 0 and 2 keep one of three, 4 one of two
    w = torch.rand(4, 2, requires_grad=True)
    weights, biases = _params(gated, False)
    activation = "silu_glu" if gated else "relu"
    leaves = _leaves(x, w, weights, biases)
    y, *_ = expert_lists.experts_forward_list(x, ids, w, *weights, *biases, activation, True, "output", "nk", 1)
    assert made == [True] * (3 if gated else 2)
    ref = moe_reference(x, ids, w, *_stacks(weights, biases), activation=activation, capacity=1)
    assert_close(y, ref, torch.float32, "y")
    dy = torch.randn_like(y)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(ref, leaves, dy))):
        assert_close(a, b, torch.float32, f"grad {i}")


class _GatedFFN(nn.Module):
    """A SwiGLU expert of three nn.Linear layers."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _gated_chunked_moe():
    from tests.test_pass_padded_capacity import ChunkedExpertsMoE

    model = ChunkedExpertsMoE("fairseq")
    model.experts = nn.ModuleList(_GatedFFN() for _ in range(model.E))
    return model


def _models():
    from tests.test_pass_padded_capacity import ChunkedExpertsMoE

    return {"fairseq-biased-relu": lambda: ChunkedExpertsMoE("fairseq"),
            "deepspeed-gelu": lambda: ChunkedExpertsMoE("deepspeed"),
            "fairseq-swiglu": _gated_chunked_moe}


@pytest.mark.parametrize("name", ["fairseq-biased-relu", "deepspeed-gelu", "fairseq-swiglu"])
def test_a_capacity_module_list_runs_the_list_op_without_a_stack(monkeypatch, name):
    """Capacity 3 of 4 experts at T=13 drops tokens; the rewritten graph calls the list op with that capacity and
    the experts' own weights, and stacks or concatenates none of them."""
    from moe_inductor import backend

    torch.manual_seed(4)
    model = _models()[name]()
    graphs, inner = [], backend._inner_compile

    def keep(inner_name, gm, *args, **kwargs):
        graphs.append(gm)
        return inner(inner_name, gm, *args, **kwargs)

    monkeypatch.setattr(backend, "_inner_compile", keep)
    assert_rewritten_like_eager(model, torch.randn(13, H), "padded_capacity", name)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    ops = [n for n in calls if n.target == torch.ops.moe_inductor.experts_forward_list.default]
    # biased experts' outputs on an empty slot are not zero: a second call, over one zero row per expert, gives
    # the gradient eager gives to a zero routing weight (passes/zero_weights.py)
    assert len(ops) == (2 if name == "fairseq-biased-relu" else 1), gm.code
    (op,) = [n for n in ops if n.args[13] is not None]
    assert op.args[13] == 3
    per_expert = [t for group in op.args[3:9] for t in group]
    assert len(op.args[3]) == model.E and all(isinstance(t, torch.fx.Node) for t in per_expert)
    joined = [n for n in calls if n.target in (torch.stack, torch.cat, torch.concat)]
    assert not [n for n in joined if set(n.all_input_nodes) & set(per_expert)], gm.code
    # (the routing's (T, k) ids and weights are the only stacks left, of computed columns: no graph input in them)
    assert not [n for n in joined if any(i.op in ("placeholder", "get_attr") for i in n.all_input_nodes)], gm.code


@pytest.mark.parametrize("module", ["deepspeed_top2", "fairseq_top2"])
def test_corpus_capacity_layers_pass_a_symbolic_capacity_to_the_list_op(monkeypatch, module):
    """DeepSpeed's capacity (a 0-d tensor of sizes) and fairseq's ``2 * ceil(T / E)``: after the recompile for a
    second token count the capacity is a size expression, handed to the list op as a node; forward and gradients
    equal eager's at every count, and the weights are never stacked."""
    import importlib

    from moe_inductor import backend

    case = importlib.import_module(f"tests.corpus.{module}").CASES[0]
    graphs, inner = [], backend._inner_compile

    def keep(inner_name, gm, *args, **kwargs):
        graphs.append(gm)
        return inner(inner_name, gm, *args, **kwargs)

    monkeypatch.setattr(backend, "_inner_compile", keep)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.build()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in case.token_counts:
        x = case.make_input(T, torch.Generator().manual_seed(T))
        got, want = [], []
        for run, into in ((compiled, got), (model, want)):
            xi = x.clone().requires_grad_(True)
            y = run(xi)
            into += [y, *torch.autograd.grad(y.square().sum(), [xi, *model.parameters()])]
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, torch.float32, f"T={T} output {i}")
    capacities = []
    for gm in graphs:
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        ops = [n for n in calls if n.target == torch.ops.moe_inductor.experts_forward_list.default]
        # fairseq's experts are biased: one more call, over a zero row per expert, with no capacity
        # (passes/zero_weights.py)
        assert len(ops) == (2 if module == "fairseq_top2" else 1)
        (op,) = [n for n in ops if n.args[13] is not None]
        capacities.append(op.args[13])
        joined = [n for n in calls if n.target in (torch.stack, torch.cat, torch.concat)]
        assert not [n for n in joined if any(i.op in ("placeholder", "get_attr") for i in n.all_input_nodes)]
    assert isinstance(capacities[0], int) and isinstance(capacities[-1], torch.fx.Node), capacities
    # a size, not DeepSpeed's 0-d capacity tensor: a traced graph (AOTAutograd, Inductor) reads a tensor given as
    # the op's int as garbage, and the layer's output turned to zeros
    assert isinstance(capacities[-1].meta.get("example_value"), torch.SymInt), capacities[-1].meta


def test_explain_says_the_capacity_layer_reads_its_experts_in_place():
    from moe_inductor import explain
    from tests.test_pass_padded_capacity import ChunkedExpertsMoE

    torch._dynamo.reset()
    torch.manual_seed(4)
    with torch.no_grad():
        report = explain(ChunkedExpertsMoE("fairseq"), torch.randn(13, H))
    (rewrite,) = report.rewrites
    assert rewrite.form == "padded_capacity" and "read where they lie (the list op)" in rewrite.note, rewrite.note
    assert "stacked" not in rewrite.note


def test_the_emitter_refuses_a_capacity_that_is_not_a_size():
    """A pass that hands the op a tensor's node (or a raw SymInt) as its capacity is a pass's bug: the emitter
    raises, and the driver leaves the graph as it was (a traced graph would read the tensor as a garbage int)."""
    from moe_inductor.passes.emit import _check_capacity

    graph = torch.fx.Graph()
    cap = graph.placeholder("capacity")
    cap.meta["example_value"] = torch.tensor(4)
    with pytest.raises(TypeError, match="capacity"):
        _check_capacity(cap)
    _check_capacity(None)
    _check_capacity(3)
