import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter; triton reads this when a kernel is decorated, so it
# has to be set before moe_inductor is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# a failing FX pass is a bug the tests must see (users get a warning and an unchanged graph instead)
os.environ.setdefault("MOE_INDUCTOR_STRICT_PASSES", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker itself, not any keyword (a name or an id) spelled "gpu"
            item.add_marker(skip)


@pytest.fixture
def triton_kernels(monkeypatch):
    """Run our Triton kernels on CPU tensors too (under the interpreter); on a GPU they run anyway."""
    from moe_inductor import config

    monkeypatch.setattr(config, "triton_on_cpu", True)


@pytest.fixture
def nan_empty(monkeypatch):
    """Fill fresh float buffers with NaN (ints with a huge value), so rows a kernel never writes show up."""
    real_empty, real_new_empty, real_empty_like = torch.empty, torch.Tensor.new_empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(2**30)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield
