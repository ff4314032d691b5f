"""Shape tensors (moe_inductor/shape_tensors.py): 0-d tensors of literals and sizes are branched on, converted and
used as one_hot widths as shape expressions under moe_inductor, in one graph and with eager's values; everything
that only looks like one (data, a value float32 would round, a tensor written in place) is left to Dynamo."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from moe_inductor.backend import moe_inductor_backend
from moe_inductor.capture import BACKEND_MARKER
from tests.corpus import deepspeed_top2
from tests.corpus.harness import Case, check_rewritten, run_case


def _compiled(fn, sizes, make=lambda T: torch.randn(T, 3)):
    """fn compiled with moe_inductor (light inner compiler) at each size: (graphs, graph breaks), after checking
    every output against eager."""
    torch._dynamo.reset()
    counters.clear()
    graphs, breaks = [], []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            breaks.append(reason)
        return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})

    setattr(backend, BACKEND_MARKER, True)
    compiled = torch.compile(fn, backend=backend)
    for T in sizes:
        x = make(T)
        got, want = compiled(x), fn(x)
        assert got.shape == want.shape and torch.equal(got, want), (T, got, want)
    assert not counters["moe_inductor_fallback"], dict(counters["moe_inductor_fallback"])
    return graphs, breaks


def deepspeed_capacity(x):
    # DeepSpeed's _capacity: T=3 and T=5 take the min_capacity branch (capacity 2 and 3 raised to 4), 9 and 12 not
    capacity = torch.ceil((x.shape[0] / 4) * torch.tensor(2.0)).to(torch.int64)
    if capacity < torch.tensor(4):
        capacity = torch.tensor(4).to(torch.int64)
    slots = torch.arange(x.shape[0]) % capacity
    return x.sum(-1, keepdim=True) * F.one_hot(slots, num_classes=capacity).float()


def test_capacity_branch_and_one_hot_width_are_one_graph():
    graphs, breaks = _compiled(deepspeed_capacity, (3, 5, 9, 12))
    assert not breaks
    # T=3 static, T=5 dynamic under the guard "capacity < 4", T=9 and 12 under its negation
    assert len(graphs) == 3


def test_int_and_item_of_a_shape_tensor_are_backed_sizes():
    def fn(x):
        capacity = torch.clamp(torch.tensor(x.shape[0]) * 2 - 1, min=4)
        n = capacity.item()
        if n > 7:  # a guard on the size: an unbacked item() would fail here and fall back
            return x.new_zeros(int(capacity), 2) + 1
        return x.new_zeros(n, 2)

    graphs, breaks = _compiled(fn, (2, 3, 5, 8))
    assert not breaks and len(graphs) <= 3


def test_literal_rounded_to_float32_as_eager_rounds_it():
    def fn(x):
        # 16777217.0 is 16777216 in float32: eager takes the else branch, float64 arithmetic would not
        if torch.tensor(16777217.0) > 16777216:
            return x + 1
        return x - 1

    graphs, breaks = _compiled(fn, (2, 3))
    assert not breaks


@pytest.mark.parametrize("spelling", ["data", "float32_rounds", "not_power_of_two", "written_through_cast"])
def test_look_alikes_still_graph_break(spelling):
    def fn(x):
        if spelling == "data":  # equal to the size expression for finite x, but read from x
            capacity = torch.ceil(x.shape[0] / 4 * torch.tensor(2.0) + x.sum() * 0)
        elif spelling == "float32_rounds":  # T * float32(0.1): an odd numerator beyond 2**24, float32 rounds it
            capacity = torch.ceil(x.shape[0] * torch.tensor(0.1))
        elif spelling == "not_power_of_two":  # T / 3 is not exact in float32
            capacity = torch.ceil(x.shape[0] / 3 * torch.tensor(2.0))
        else:
            capacity = torch.tensor(2)
            alias = capacity.to(torch.int64)  # the same tensor
            alias.add_((x > 0).sum())
        if capacity < 4:
            return x * 2
        return x * 3

    graphs, breaks = _compiled(fn, (3, 9, 12), make=lambda T: torch.randn(T, 3).abs())
    assert breaks


def test_capacity_used_as_data_keeps_its_values():
    def fn(x):
        capacity = torch.ceil((x.shape[0] / 2) * torch.tensor(1.5)).to(torch.int64)
        if capacity > 5:
            return x + capacity  # the tensor itself, as data
        return x - capacity

    graphs, breaks = _compiled(fn, (2, 3, 8, 11))
    assert not breaks


def test_item_of_data_stays_unbacked():
    def fn(x):
        k = (x > 0).sum().item()
        return x * k

    graphs, breaks = _compiled(fn, (3, 5))
    assert not breaks and len(graphs) <= 2
    unbacked = [n for g in graphs for n in g.graph.nodes if n.op == "call_method" and n.target == "item"]
    assert unbacked, "the data tensor's item() is Dynamo's unbacked read"


def test_inductor_backend_unchanged():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(deepspeed_capacity, backend=counter)
    x = torch.randn(9, 3)
    torch.testing.assert_close(compiled(x), deepspeed_capacity(x))
    assert counter.frame_count >= 2  # the branch on the tensor still breaks the graph


class _MinCapacityLayer(deepspeed_top2.MOELayer):
    """DeepSpeed's layer with min_capacity 16: the other side of ``if capacity < min_capacity`` at these sizes."""

    def forward(self, x):
        reshaped_input = x.reshape(-1, x.shape[-1])
        combine_weights, dispatch_mask = deepspeed_top2.top2gating(self.wg(reshaped_input), 1.0, 16)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(x), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, x.shape[-1])
        expert_output = self.experts(dispatched_input)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, x.shape[-1])
        return torch.einsum("sec,ecm->sm", combine_weights.type_as(x), expert_output).reshape(x.shape)


def test_deepspeed_min_capacity_branch_rewritten():
    case = Case("deepspeed_min_capacity", "deepspeed_top2 with min_capacity 16", _MinCapacityLayer,
                lambda T, g: torch.randn(2, T, deepspeed_top2.H, generator=g), form="padded_capacity")
    outcome = run_case(case)
    assert outcome.kind == "rewritten", outcome.declared()
    check_rewritten(case, outcome)
