"""Do no harm on the corpus of public-codebase MoE layers (tests/corpus/): whatever form a layer takes (rewritten,
left alone or fallen back), the compiled layer sees a weight written through ``p.data`` and behaves as eager on
router ids past its experts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import rel_err


def _corpus_cases():
    from tests.corpus.test_corpus import CASES

    return CASES


def _first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


@pytest.mark.slow  # every case compiles a model (the full suite runs it)
@pytest.mark.parametrize("case", _corpus_cases(), ids=str)
def test_corpus_layers_see_a_weight_written_through_data(case):
    """Whatever form a corpus layer takes (rewritten, left alone or fallen back), a write through ``p.data`` to its
    largest weight (an expert weight) is seen by the next compiled call."""
    from tests.corpus.harness import TOL

    model = case.build().to(case.dtype)  # (in the case's dtype, as the corpus runs it: torch._grouped_mm's fake
    x = case.make_input(7, torch.Generator().manual_seed(0)).to(case.dtype)  # kernel takes bf16 alone, any backend)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        try:
            expected = model(x)
        except Exception:  # the layer's own error: the compiled layer raises too (Dynamo wraps it, any backend)
            with pytest.raises(Exception):
                compiled(x)
            return
        assert rel_err(_first_tensor(compiled(x)), _first_tensor(expected)) < TOL[case.dtype]
        weight = max(model.parameters(), key=lambda p: p.numel())
        weight.data.copy_(torch.randn_like(weight) * weight.std())
        assert rel_err(_first_tensor(compiled(x)), _first_tensor(model(x))) < TOL[case.dtype]


def _router_of(model: nn.Module):
    """(name, nn.Linear) of the router: a Linear with as many outputs as the layer has experts (a ModuleList's length
    or a 3-D weight's first dimension), outside the experts' own container, or None. (By place, not by name: a
    router may be called ``expert_selector``, and an expert's Linear may have E outputs.)"""
    counts = {len(m) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 1}
    counts |= {p.shape[0] for p in model.parameters() if p.dim() == 3}
    experts = [name for name, m in model.named_modules()
               if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) in counts]
    for name, m in model.named_modules():
        if (isinstance(m, nn.Linear) and m.out_features in counts
                and not any(name.startswith(f"{container}.") for container in experts)):
            return name, m
    return None


def _corpus_cases_with_a_router():
    return [c for c in _corpus_cases() if _router_of(c.build()) is not None]


@pytest.mark.slow  # every case compiles a model (the full suite runs it)
@pytest.mark.parametrize("case", _corpus_cases_with_a_router(), ids=str)
def test_corpus_layers_with_a_router_wider_than_the_experts_behave_as_eager(case):
    """Ids past the experts: where the layer's eager code raises, the compiled layer raises; where it skips them
    (selection by ids == e), the compiled layer gives eager's values."""
    from tests.corpus.harness import TOL

    model = case.build().to(case.dtype)
    name, router = _router_of(model)
    wide = nn.Linear(router.in_features, router.out_features + 2, bias=True).to(case.dtype)
    with torch.no_grad():
        wide.weight[: router.out_features] = router.weight
        wide.bias.zero_()
        wide.bias[router.out_features:] = 100.0
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], wide)
    x = case.make_input(7, torch.Generator().manual_seed(0)).to(case.dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        try:
            expected = model(x)
        except Exception:
            with pytest.raises(Exception):
                compiled(x)
            return
        assert rel_err(_first_tensor(compiled(x)), _first_tensor(expected)) < TOL[case.dtype]
