"""Bounded recompiles: over many token counts a rewritten model compiles at most twice with dynamic=None (a static
graph, then one dynamic graph) and once with dynamic=True (T >= 2; Dynamo specialises T = 1 on its own)."""
import pytest
import torch
from torch._dynamo.utils import counters

from tests.test_pass_dense_experts import DenseMoE
from tests.test_pass_gathered_weights import GatheredMoE
from tests.test_pass_unrolled_loop import LoopMoE, ModuleListMoE

MODELS = {  # name: (form counted, model)
    "unrolled_loop": ("unrolled_loop", lambda: LoopMoE("where_matmul", 4, 2)),
    "module_list_loop": ("unrolled_loop", lambda: ModuleListMoE("hf_v4", 4, 2)),
    "gathered_weights": ("gathered_weights", lambda: GatheredMoE("gptfast")),
    "dense_experts": ("dense_experts", lambda: DenseMoE("einsum")),
}
TOKENS = (2, 3, 5, 8, 13, 21, 34, 55)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dynamic,bound", [(None, 2), (True, 1)], ids=["dynamic-None", "dynamic-True"])
def test_compiles_are_bounded(name, dynamic, bound):
    torch.manual_seed(0)
    form, make = MODELS[name]
    model = make()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", dynamic=dynamic, options={"inner": "eager"})
    for T in TOKENS:
        x = torch.randn(T, 16)
        assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= bound
    assert counters["moe_inductor"][form] == counters["stats"]["unique_graphs"]
