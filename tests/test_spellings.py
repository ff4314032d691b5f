"""Every form is still found when the graph spells tensor operators as dunder method calls, as Dynamo in torch 2.11
does (``call_method __eq__`` for ``ids == e``, where 2.13 records ``operator.eq``)."""
import operator

import pytest
import torch
from torch._dynamo.utils import counters

from moe_inductor import capture
from moe_inductor.backend import moe_inductor_backend
from tests.test_pass_dense_experts import DenseMoE
from tests.test_pass_gathered_weights import GatheredMoE
from tests.test_pass_padded_capacity import CapacityMoE
from tests.test_pass_sorted_grouped_mm import SortedMoE
from tests.test_pass_unrolled_loop import LoopMoE

_DUNDER = {operator.eq: "__eq__", operator.ne: "__ne__", operator.lt: "__lt__", operator.le: "__le__",
           operator.gt: "__gt__", operator.ge: "__ge__", operator.add: "__add__", operator.sub: "__sub__",
           operator.mul: "__mul__", operator.truediv: "__truediv__", operator.floordiv: "__floordiv__",
           operator.matmul: "__matmul__", operator.getitem: "__getitem__", operator.setitem: "__setitem__"}

MODELS = {  # name: (form, model, input width, dtype)
    "unrolled_loop": ("unrolled_loop", lambda: LoopMoE("where_matmul", 4, 2), 16, torch.float32),
    "gathered_weights": ("gathered_weights", lambda: GatheredMoE("gptfast"), 16, torch.float32),
    "dense_experts": ("dense_experts", lambda: DenseMoE("einsum"), 16, torch.float32),
    "sorted_grouped_mm": ("sorted_grouped_mm", lambda: SortedMoE("hf", 2).bfloat16(), 32, torch.bfloat16),
    "padded_capacity": ("padded_capacity", lambda: CapacityMoE("top2"), 16, torch.float32),
}


def _as_torch_2_11(gm, example_inputs):
    """Respell every operator call on a tensor as the tensor's dunder method, then hand over to moe_inductor."""
    for node in gm.graph.nodes:
        receiver = node.args[0] if node.args else None
        is_tensor = isinstance(receiver, torch.fx.Node) and isinstance(
            receiver.meta.get("example_value", receiver.meta.get("val")), torch.Tensor)
        if node.op == "call_function" and node.target in _DUNDER and is_tensor:
            node.op, node.target = "call_method", _DUNDER[node.target]
    gm.recompile()
    return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})


setattr(_as_torch_2_11, capture.BACKEND_MARKER, True)  # scoped capture on, as for the real backend


@pytest.mark.parametrize("name", list(MODELS))
def test_every_form_survives_the_dunder_spelling(name):
    if name == "sorted_grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("needs torch._grouped_mm")
    form, make, width, dtype = MODELS[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(11, width, dtype=dtype)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend=_as_torch_2_11)(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, model(x), rtol=tol, atol=tol)
    assert counters["moe_inductor"][form] == 1


LOOK_ALIKES = {
    "shifted_expert": lambda: LoopMoE("shifted_expert", 4, 2),
    "extra_write": lambda: LoopMoE("extra_write", 4, 2),
    "soft_dense": lambda: DenseMoE("soft"),
    "no_drop_capacity": lambda: CapacityMoE("top1_no_drop"),
}


@pytest.mark.parametrize("name", list(LOOK_ALIKES))
def test_look_alikes_stay_untouched_in_the_dunder_spelling(name):
    torch.manual_seed(0)
    model = LOOK_ALIKES[name]()
    x = torch.randn(11, 16)
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(torch.compile(model, backend=_as_torch_2_11)(x), model(x), rtol=1e-5, atol=1e-5)
    assert not counters["moe_inductor"]


class _ReassignedLoop(torch.nn.Module):
    """``out = out.index_add_(...)`` (or the in-place result returned): the same accumulator under another name."""

    def __init__(self, returned: bool, E: int = 4, k: int = 2, H: int = 16, I: int = 8):
        super().__init__()
        self.returned, self.E, self.k = returned, E, k
        self.router = torch.nn.Linear(H, E, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), -1), self.k)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, pos = torch.where(ids == e)
            y = torch.relu(x[tok] @ self.w1[e].T) @ self.w2[e].T * weights[tok, pos, None]
            if self.returned and e == self.E - 1:
                return out.index_add_(0, tok, y)
            out = out.index_add_(0, tok, y)
        return out


@pytest.mark.parametrize("returned", [False, True], ids=["reassigned", "returned"])
def test_a_loop_that_reads_the_in_place_result_is_rewritten(returned):
    from tests.helpers import rel_err

    torch.manual_seed(0)
    model = _ReassignedLoop(returned)
    x = torch.randn(9, 16, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = model(ref_x)
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert rel_err(out, ref) < 1e-5
    out.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref.square().sum().backward()
    for got, want in zip(grads, [ref_x.grad] + [p.grad for p in model.parameters()]):
        assert rel_err(got, want) < 1e-5
