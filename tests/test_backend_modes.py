"""The inner Inductor compile is the one ``backend="inductor"`` makes: each ``torch.compile`` mode stands for the
same Inductor settings under both backends, and ``torch._dynamo.reset()`` frees what a CUDA-graph mode recorded."""
import pytest
import torch
from torch._inductor import compile_fx, list_mode_options


def _patches_seen(monkeypatch) -> list:
    """Stand in for compile_fx: record the config patches each compile gets, run the graph as traced. Our own
    post-grad pass (``config.unshared_buffers``, which only ever adds to Inductor's settings) is checked and taken
    out of a record, so what is left is the mode's and the options' settings."""
    from moe_inductor.lowerings.unshared_buffers import UNSHARED_BUFFERS

    seen = _Seen()

    def record(gm, inputs, config_patches=None, **_):
        patches = dict(config_patches or {})
        ours = patches.get("post_grad_custom_pre_pass") is UNSHARED_BUFFERS
        if ours:
            del patches["post_grad_custom_pre_pass"]
        seen.append(patches)
        seen.ours.append(ours)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", record)
    return seen


class _Seen(list):
    """The config patches of each compile, and (``ours``) whether each carried our post-grad pass."""

    def __init__(self) -> None:
        super().__init__()
        self.ours: list[bool] = []


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("mode", [None, *list_mode_options()])
def test_every_mode_means_what_it_means_for_inductor(mode, monkeypatch):
    """max-autotune-no-cudagraphs once compiled with no setting at all under moe_inductor, and max-autotune without
    coordinate descent: the same mode gave Inductor's column more tuning than ours."""
    seen = _patches_seen(monkeypatch)
    x = torch.randn(3, 8)
    for backend in ("inductor", "moe_inductor"):
        torch._dynamo.reset()
        out = torch.compile(_mlp(), backend=backend, mode=mode)(x)
        torch.testing.assert_close(out, _mlp()(x))
    assert len(seen) == 2 and seen[0] == seen[1], seen
    assert seen.ours == [False, True]  # Inductor's compile has no pass of ours, ours has
    assert seen[1] == {k: v for k, v in list_mode_options(mode or "default").items()} or mode is None


def test_options_go_on_top_of_the_mode_as_for_inductor(monkeypatch):
    import moe_inductor

    seen = _patches_seen(monkeypatch)
    torch._dynamo.reset()
    backend = moe_inductor.with_options(epilogue_fusion=False)
    torch.compile(_mlp(), backend=backend, mode="max-autotune-no-cudagraphs")(torch.randn(3, 8))
    assert seen == [{**list_mode_options("max-autotune-no-cudagraphs"), "epilogue_fusion": False}]
    assert seen.ours == [True]


@pytest.mark.parametrize("mode,resets", [("reduce-overhead", True), ("max-autotune", True), (None, False)])
def test_dynamo_reset_frees_the_cuda_graph_trees_as_for_inductor(mode, resets, monkeypatch):
    """Under backend="inductor", torch._dynamo.reset() frees the CUDA-graph trees (and their memory pools) that a
    CUDA-graph mode recorded; a moe_inductor compile in such a mode is freed the same way."""
    from torch._inductor import cudagraph_trees

    from moe_inductor import backend as moe_backend

    _patches_seen(monkeypatch)
    # a CUDA-graph compile of another test, through a wrapper without reset, leaves its compiler to be reset
    monkeypatch.setattr(moe_backend._state, "wrappers", [])
    freed = []
    monkeypatch.setattr(cudagraph_trees, "reset_cudagraph_trees", lambda: freed.append(True))
    import moe_inductor

    seen = {}
    for backend in ("inductor", "moe_inductor", moe_inductor.with_options(epilogue_fusion=False)):
        torch._dynamo.reset()
        freed.clear()
        torch.compile(_mlp(), backend=backend, mode=mode)(torch.randn(3, 8))
        torch._dynamo.reset()
        seen[str(backend)] = bool(freed)
    # without a CUDA-graph mode whether Inductor frees the trees depends on the torch version (2.11 on a CUDA
    # machine does, 2.13 on the CPU does not): ours must do what Inductor does either way
    inductor = seen.pop("inductor")
    assert inductor or not resets, (mode, inductor)
    assert all(got == inductor for got in seen.values()), (mode, inductor, seen)


def test_a_cuda_graph_mode_sets_the_profiler_settings_inductor_sets(monkeypatch):
    """With CUDA graphs on, Inductor's wrapper sets CUPTI's environment so that torch.profiler does not crash on a
    CUDA graph (where this CUDA needs it); a moe_inductor compile in the same mode leaves the same environment."""
    import os

    names = ("DISABLE_CUPTI_LAZY_REINIT", "TEARDOWN_CUPTI")
    _patches_seen(monkeypatch)
    envs = []
    for backend in ("inductor", "moe_inductor"):
        for name in names:
            monkeypatch.delenv(name, raising=False)
        torch._dynamo.reset()
        torch.compile(_mlp(), backend=backend, mode="reduce-overhead")(torch.randn(3, 8))
        envs.append({name: os.environ.get(name) for name in names})
    assert envs[0] == envs[1]
