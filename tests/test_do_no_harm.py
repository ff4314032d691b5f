"""Do no harm: what runs eagerly (or under backend="inductor") runs under moe_inductor, with the same results or the
same errors.

- A frame that fails under the scoped capture settings (a model's own ``.tolist()``, ``.item()``,
  ``one_hot(num_classes=tensor)``) is compiled again as plain capture would, and the fallback is reported.
- A weight changed in place, by any route, is seen on the next call (no stale cache).
- Routing ids outside [0, E) raise where the user's code raises.
- Backends that wrap ours keep the capture.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import moe_inductor
from helpers import rel_err

LIGHT = {"inner": "aot_eager"}


class Expert(nn.Module):
    def __init__(self, H: int, I: int):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ToListMoE(nn.Module):
    """DeepSeek-V3 reference inference style: per-expert counts read back with ``.tolist()``, empty experts skipped."""

    copy_ids = False

    def __init__(self, H=16, I=24, E=5, k=2):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert(H, I) for _ in range(E))
        self.k = k

    def forward(self, x):
        scores = self.gate(x).softmax(-1)
        weights, ids = scores.topk(self.k, -1)
        ids = ids.clone() if self.copy_ids else ids
        y = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        for i, expert in enumerate(self.experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(ids == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        return y


class UnprovenCountsMoE(ToListMoE):
    """ToListMoE with its ids copied before the counts: the counts' length (E only for top-k ids) is not proven, so
    its ``.tolist()`` fails under the capture settings and the frame falls back, with or without gradients."""

    copy_ids = True


class TensorCapacityMoE(nn.Module):
    """DeepSpeed ``top1gating`` style: a capacity computed as a tensor, then ``one_hot(..., num_classes=capacity)``."""

    def __init__(self, H=16, E=4, capacity_factor=1.0, min_capacity=2):
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.Parameter(torch.randn(E, H, H) * H ** -0.5)
        self.capacity_factor = capacity_factor
        self.min_capacity = min_capacity

    def forward(self, x):
        T, E = x.shape[0], self.experts.shape[0]
        gates = self.wg(x).softmax(-1)
        capacity = self.capacity(T, E)
        if capacity < self.min_capacity:  # a branch on a tensor: a graph break under plain capture
            capacity = torch.tensor(self.min_capacity, dtype=torch.int64)
        idx = gates.argmax(-1)
        mask = F.one_hot(idx, num_classes=E)
        locations = torch.cumsum(mask, 0) - 1
        mask = mask * (locations < capacity)
        locations_s = (locations * mask).sum(1)
        gate_s = (gates * mask).sum(1)
        loc_sc = F.one_hot(locations_s, num_classes=capacity).to(x.dtype)
        combine = gate_s[:, None, None] * mask.to(x.dtype)[:, :, None] * loc_sc[:, None, :]
        dispatch = combine.bool().to(x.dtype)
        ex = torch.einsum("sec,sm->ecm", dispatch, x)
        ey = torch.bmm(ex, self.experts)
        return torch.einsum("sec,ecm->sm", combine, ey)

    def capacity(self, T, E):
        return torch.ceil(torch.tensor(T / E * self.capacity_factor)).to(torch.int64)


class BufferCapacityMoE(TensorCapacityMoE):
    """TensorCapacityMoE with its capacity factor in a buffer: a graph input, so data to shape_tensors (with a
    literal factor the branch and the one_hot width are shape expressions: one graph, no fallback), and the
    one_hot width still fails under the capture settings."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.tensor(self.capacity_factor))

    def capacity(self, T, E):
        return torch.ceil(T / E * self.factor).to(torch.int64)


class ItemSliceMoE(nn.Module):
    """A sort + per-expert slice form whose slice lengths come from ``counts[e].item()``."""

    def __init__(self, H=16, I=24, E=4, k=2):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w_up = nn.Parameter(torch.randn(E, H, I) * H ** -0.5)
        self.w_down = nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
        self.k = k

    def forward(self, x):
        T, H = x.shape
        E = self.w_up.shape[0]
        weights, ids = self.router(x).softmax(-1).topk(self.k, -1)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        rows = x[order // self.k]
        outs, start = [], 0
        for e in range(E):
            n = counts[e].item()
            chunk = rows[start:start + n]
            outs.append(F.gelu(chunk @ self.w_up[e]) @ self.w_down[e])
            start += n
        out = torch.cat(outs)
        y = x.new_zeros(T * self.k, H).index_copy(0, order, out)
        return (y.view(T, self.k, H) * weights[..., None]).sum(1)


def _eager_and_compiled(model, x, options=LIGHT, backward=True):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options=options)
    xe, xc = x.clone().requires_grad_(backward), x.clone().requires_grad_(backward)
    ye, yc = model(xe), compiled(xc)
    assert rel_err(yc, ye) < 1e-5
    if backward:
        grads_e = torch.autograd.grad(ye.square().sum(), [xe, *model.parameters()], allow_unused=True)
        grads_c = torch.autograd.grad(yc.square().sum(), [xc, *model.parameters()], allow_unused=True)
        for ge, gc in zip(grads_e, grads_c):
            if ge is not None:
                assert rel_err(gc, ge) < 1e-5
    return compiled


FAILING_STYLES = [UnprovenCountsMoE, BufferCapacityMoE, ItemSliceMoE]
FAILING_IDS = ["tolist", "one_hot_tensor", "item"]


@pytest.mark.parametrize("make", FAILING_STYLES, ids=FAILING_IDS)
@pytest.mark.parametrize("T", [9, *(pytest.param(t, marks=pytest.mark.slow) for t in (1, 0))], ids=lambda t: f"T{t}")
def test_a_frame_that_fails_under_our_settings_falls_back(make, T):
    """Each style fails under the capture settings at T = 9 (a trace error, a compile error inside Inductor, code
    that fails on its first call); T = 1 and T = 0 are edge cases that must run whatever path they take."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(T, 16)
    _eager_and_compiled(model, x, options={"inner": "inductor"}, backward=T > 0)
    if T == 9:
        assert sum(counters["moe_inductor_fallback"].values()) >= 1


def test_explain_reports_a_fallback_and_it_is_logged_once(caplog):
    torch.manual_seed(0)
    model = UnprovenCountsMoE()
    x = torch.randn(7, 16)
    from moe_inductor import capture

    capture._logged_fallbacks.clear()  # earlier tests compiled the same frames
    with caplog.at_level("WARNING", logger="moe_inductor"):
        report = moe_inductor.explain(model, x)
    assert report.fallbacks and report.fallbacks[0].stage == "compile"
    # the counts' bincount is of ids not known to lie below its length: the length asserted while tracing (for a
    # split by the counts, count_totals.py) is not kept where the counts are read as numbers
    assert "SpeculationNotDischarged" in report.fallbacks[0].reason and "bincount" in report.fallbacks[0].reason
    assert "fallback: forward" in str(report)
    logged = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    # once per frame (the forward, then the resumed rest after plain capture's graph break), though explain()
    # compiles twice (with rewrites off, the graphs "before", and on)
    assert len(logged) == 2 and "forward (" in logged[0] and "resume_in_forward" in logged[1]


# --- wrapped backends -------------------------------------------------------------------------------------------------

class LoopMoE(nn.Module):
    """A per-expert loop over ``torch.where``: it needs the capture settings to be one graph and rewritten."""

    def __init__(self, H=16, I=24, E=4, k=2):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert(H, I) for _ in range(E))
        self.k = k

    def forward(self, x):
        weights, ids = self.gate(x).softmax(-1).topk(self.k, -1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, top = torch.where(ids == i)
            y.index_add_(0, idx, expert(x[idx]) * weights[idx, top, None])
        return y


def _lookup_wrapper(gm, example_inputs):
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("moe_inductor")(gm, example_inputs)


def _imported_wrapper(gm, example_inputs):
    return moe_inductor.moe_inductor_backend(gm, example_inputs)


def _wrapped(kind):
    if kind == "compile_counter":
        return torch._dynamo.testing.CompileCounterWithBackend("moe_inductor")
    if kind == "lookup_function":
        return _lookup_wrapper
    if kind == "imported_function":
        return _imported_wrapper
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["compile_counter", "lookup_function", "imported_function", "optimize"])
def test_wrapped_backends_keep_the_capture(kind):
    import torch._dynamo.testing  # noqa: F401

    torch.manual_seed(0)
    model, x = LoopMoE(), torch.randn(9, 16)
    torch._dynamo.reset()
    counters.clear()
    if kind == "optimize":
        compiled = torch._dynamo.optimize("moe_inductor")(model)
    else:
        compiled = torch.compile(model, backend=_wrapped(kind))
    assert rel_err(compiled(x), model(x)) < 1e-5
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_a_wrapper_we_cannot_see_into_is_reported_with_the_fix(caplog):
    from moe_inductor import backend

    class Opaque:  # hides the backend behind an attribute name we do not look at
        def __init__(self):
            self.hidden = moe_inductor.moe_inductor_backend

        def __call__(self, gm, example_inputs):
            return self.hidden(gm, example_inputs)

    torch.manual_seed(0)
    model, x = LoopMoE(), torch.randn(9, 16)
    torch._dynamo.reset()
    backend._warned_unseen_wrapper = False
    with caplog.at_level("WARNING", logger="moe_inductor"):
        out = torch.compile(model, backend=Opaque())(x)
    assert rel_err(out, model(x)) < 1e-5
    assert any("mark_backend" in r.getMessage() for r in caplog.records)
    marked = moe_inductor.mark_backend(Opaque())
    torch._dynamo.reset()
    counters.clear()
    assert rel_err(torch.compile(model, backend=marked)(x), model(x)) < 1e-5
    assert counters["moe_inductor"]["unrolled_loop"] == 1


# --- never stale ------------------------------------------------------------------------------------------------------

def _weights_of(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights (3-D stacks or per-expert matrices), not the router's."""
    return [p for name, p in model.named_parameters() if "experts" in name or (p.dim() == 3)]


def _change(model: nn.Module, how: str, dtype: torch.dtype = torch.float64) -> None:
    """Change one expert weight of ``model`` in place, the way users do."""
    weights = _weights_of(model)
    target = weights[0]
    new = torch.randn_like(target)
    if how == "data_copy":
        target.data.copy_(new)  # bumps no version counter
    elif how == "data_assign":
        target.data = new
    elif how == "copy_no_grad":
        with torch.no_grad():
            target.copy_(new)
    elif how == "load_state_dict":
        state = {k: torch.randn_like(v) if v.dtype.is_floating_point else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif how == "optimizer_step":
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    elif how == "view_in_place":
        with torch.no_grad():
            target.view(-1)[: target.numel() // 2].mul_(-3.0)
    elif how == "data_view_in_place":
        target.data[0].mul_(-3.0)  # through .data and a view: no version counter sees it
    elif how == "to_dtype":
        model.to(dtype)
    else:
        raise AssertionError(how)


CHANGES = ["data_copy", "data_assign", "copy_no_grad", "load_state_dict", "optimizer_step", "view_in_place",
           "data_view_in_place", "to_dtype"]


def _weight_reading_models():
    from test_pass_dense_experts import DenseMoE
    from test_pass_gathered_weights import GatheredMoE
    from test_pass_padded_capacity import CapacityMoE
    from test_pass_unrolled_loop import LoopMoE as StackedLoopMoE, ModuleListMoE

    return {
        "module_list_loop": (lambda: ModuleListMoE("hf_v4"), "unrolled_loop", 16),
        "stacked_loop": (lambda: StackedLoopMoE(), "unrolled_loop", 16),
        "capacity": (lambda: CapacityMoE("top2"), "padded_capacity", 16),
        "dense": (lambda: DenseMoE("einsum"), "dense_experts", 16),
        "gathered": (lambda: GatheredMoE("gptfast"), "gathered_weights", None),
    }


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("name", ["stacked_loop"] + [pytest.param(n, marks=pytest.mark.slow)  # quick: one form
                                                     for n in ("module_list_loop", "capacity", "dense", "gathered")])
def test_every_weight_change_is_seen_on_the_next_call(name, how):
    make, form, H = _weight_reading_models()[name]
    torch.manual_seed(0)
    model = make()
    H = H or next(p for p in model.parameters() if p.dim() == 3).shape[-1]
    x = torch.randn(11, H)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
        assert counters["moe_inductor"][form] >= 1
        _change(model, how)
        xd = x.to(next(model.parameters()).dtype)
        assert rel_err(compiled(xd), model(xd)) < 1e-5, f"stale after {how}"


@pytest.mark.parametrize("how", ["data_copy", *(pytest.param(h, marks=pytest.mark.slow) for h in ("optimizer_step", "to_dtype"))])
@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_hf_experts_see_weight_changes(family, how):
    from hf_models import tiny

    model = tiny(family).eval()
    ids = torch.randint(0, 64, (1, 9))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    with torch.no_grad():
        assert rel_err(compiled(ids).logits, model(ids).logits) < 1e-5
        _change(model, how, torch.bfloat16)  # HF's experts code has no float64 path
        tol = 2e-2 if how == "to_dtype" else 1e-5
        assert rel_err(compiled(ids).logits, model(ids).logits) < tol, f"stale after {how}"


# --- eager's errors on bad routing ------------------------------------------------------------------------------------

def _widen_router(model: nn.Module, extra: int = 3) -> None:
    """Give the router (the one nn.Linear with E outputs outside the experts) ``extra`` more outputs that win the
    top-k: ids >= E, as a router wider than the expert list picks them."""
    experts = {id(m) for name, m in model.named_modules() if "experts" in name}
    router_name, router = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in experts)
    wide = nn.Linear(router.in_features, router.out_features + extra, bias=True)
    with torch.no_grad():
        wide.weight[: router.out_features] = router.weight
        wide.bias.zero_()
        wide.bias[router.out_features:] = 100.0
    setattr(model, router_name, wide)


def _raises_like_eager(model, x, options={"inner": "eager"}):
    """Eager raises on the wide router; the compiled model must raise too. Returns our error."""
    with pytest.raises(Exception):
        model(x)
    torch._dynamo.reset()
    counters.clear()
    with pytest.raises(Exception) as ours:
        torch.compile(model, backend="moe_inductor", options=options)(x)
    return ours.value


@pytest.mark.parametrize("name", ["module_list_loop", "stacked_loop", "capacity", "dense", "gathered"])
def test_a_router_wider_than_the_experts_raises_as_eager_does(name):
    make, form, H = _weight_reading_models()[name]
    torch.manual_seed(0)
    model = make()
    H = H or next(p for p in model.parameters() if p.dim() == 3).shape[-1]
    x = torch.randn(11, H)
    report = moe_inductor.explain(model, x)
    assert any(r.form == form for r in report.rewrites)  # the healthy model is rewritten, and keeps eager's check
    # the op that raises in eager is either still there (the capacity form reads its one_hot masks) or kept as a check
    kept = "one_hot(" if name == "capacity" else "torch._assert_async"
    assert kept in report.graphs[-1].code
    _widen_router(model)
    with torch.no_grad():
        _raises_like_eager(model, x)


def test_a_loop_that_skips_bad_ids_still_skips_them():
    """``torch.where(ids == e)`` over range(E) never selects ids >= E: eager returns values, and so must we."""
    torch.manual_seed(0)
    model = LoopMoE()
    _widen_router(model, extra=1)
    x = torch.randn(11, 16)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(x)
        assert rel_err(out, model(x)) < 1e-5
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    assert "_assert_async" not in moe_inductor.explain(model, x).graphs[-1].code


@pytest.mark.parametrize("bad", [5, -1], ids=["ge_E", "negative"])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compiled_fused_experts_raises_on_ids_outside_the_experts(bad, inner):
    from helpers import make_problem

    p = make_problem(6, 16, 8, 5, 2, requires_grad=False)
    ids = p.topk_ids.clone()
    ids[3, 1] = bad

    def run(ids):
        return moe_inductor.fused_experts(p.x, ids, p.topk_weights, p.w1, p.w2, name="model.layers.0.mlp.experts")

    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.*\[0, 5\).*got values in"):
        run(ids)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="moe_inductor", options={"inner": inner})
    compiled(p.topk_ids)  # healthy ids run
    with pytest.raises(Exception, match=r"model.layers.0.mlp.experts.*must lie in \[0, 5\)"):
        compiled(ids)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_hf_experts_with_a_wide_router_raise(implementation):
    from hf_models import tiny

    model = tiny("qwen3_moe", implementation).eval()
    for layer in model.model.layers:
        gate = layer.mlp.gate
        wide = torch.randn(gate.weight.shape[0] + 3, gate.weight.shape[1])
        wide[gate.weight.shape[0]:] += 100.0
        gate.weight = nn.Parameter(wide)
    ids = torch.randint(0, 64, (1, 9))
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match=r"mlp.experts.*must lie in \[0, 5\)"):
        torch.compile(model, backend="moe_inductor", options={"inner": "eager"})(ids)


# --- on the GPU (bf16) ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("make", FAILING_STYLES, ids=FAILING_IDS)
def test_gpu_a_frame_that_fails_under_our_settings_falls_back(make):
    from helpers import REL_TOL

    torch.manual_seed(0)
    model = make().to("cuda", torch.bfloat16)
    x = torch.randn(9, 16, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = model(xe), compiled(xc)
    assert rel_err(yc, ye) < REL_TOL[torch.bfloat16]
    ge = torch.autograd.grad(ye.float().square().sum(), xe)[0]
    gc = torch.autograd.grad(yc.float().square().sum(), xc)[0]
    assert rel_err(gc, ge) < REL_TOL[torch.bfloat16]
    if make is BufferCapacityMoE and _torch_before(2, 13):
        # under torch 2.11 (the H200's) no fallback is counted for this style (the GPU suite at a7f2e60): what
        # it takes there is not known here, so eager's results and gradients are what it is checked for
        return
    assert sum(counters["moe_inductor_fallback"].values()) >= 1


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split(".")[:2]) < (major, minor)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["data_copy", "data_view_in_place", "optimizer_step"])
def test_gpu_module_list_experts_see_weight_changes(how, monkeypatch):
    from test_pass_unrolled_loop import ModuleListMoE

    from moe_inductor import config

    # the list op itself is under test: the speed rule would keep a ModuleList layer judged by Mixtral's widths
    monkeypatch.setattr(config, "speed_rule", False)
    torch.manual_seed(0)
    model = ModuleListMoE("hf_v4").to("cuda", torch.bfloat16)
    x = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor")
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 2e-2
        assert counters["moe_inductor"]["unrolled_loop"] == 1
        _change(model, how)
        assert rel_err(compiled(x), model(x)) < 2e-2, f"stale after {how}"


_BAD_IDS_ON_THE_GPU = """
import torch, moe_inductor
from helpers import make_problem
p = make_problem(64, 16, 8, 5, 2, dtype=torch.bfloat16, device="cuda", requires_grad=False)
run = torch.compile(lambda ids: moe_inductor.fused_experts(p.x, ids, p.topk_weights, p.w1, p.w2,
                                                           name="model.layers.0.mlp.experts"), backend="moe_inductor")
run(p.topk_ids)
torch.cuda.synchronize()
print("healthy ids ran", flush=True)
bad = p.topk_ids.clone()
bad[3, 1] = 7
run(bad)
torch.cuda.synchronize()
print("bad ids ran")
"""


@pytest.mark.gpu
def test_gpu_bad_ids_raise_on_the_device_in_a_compiled_graph():
    """A device-side assert ends the CUDA context, so it runs in a process of its own."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _BAD_IDS_ON_THE_GPU], capture_output=True, text=True, env=env,
                          timeout=300)
    assert "healthy ids ran" in done.stdout
    assert done.returncode != 0 and "bad ids ran" not in done.stdout
    assert "must lie in [0, 5)" in done.stdout + done.stderr


def test_inductor_compiles_tag_the_cache_with_this_packages_source(monkeypatch):
    """torch's compile caches key a graph by what Dynamo traced, not by what our ops' autograd formulas trace it
    into: without a tag of our source, a graph cached before an upgrade that changed a backward op kept running the
    old one (seen with the list op's CPU backward). Our Inductor compiles run with the tag set, and only they."""
    from moe_inductor import backend

    seen = []
    monkeypatch.setattr(backend, "_state", backend._BackendState())  # (the stand-in compiler has no reset())
    monkeypatch.setattr(backend, "_inductor_wrapper",
                        lambda mode, options: lambda gm, inputs: seen.append(torch.compiler.config.cache_key_tag))
    backend._inner_compile("inductor", None, [], None)
    tag = backend.cache_tag()
    assert seen == [tag] and re.fullmatch(r"moe_inductor-[0-9a-f]{16}-[0-9a-f]{8}", tag), tag
    assert torch.compiler.config.cache_key_tag != tag  # restored after the compile


def test_the_cache_tag_covers_the_shipped_tables(tmp_path):
    """The visible kernels' launch configs come from the tuned table while Inductor traces them: a table changed by
    an upgrade must reach graphs compiled before it, so the tag hashes the package's JSON data as well as its
    source (and changes with either)."""
    import shutil

    from moe_inductor import backend

    root = tmp_path / "pkg"
    shutil.copytree(Path(backend.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__"))
    table = root / "kernels" / "tuned" / "NVIDIA_H200.json"
    source = root / "speed_rule.py"
    before = backend._package_digest(root)
    assert backend.cache_tag().startswith(f"moe_inductor-{before}-")  # the copy is the package as it is
    table.write_text(table.read_text().replace('"num_warps": 4', '"num_warps": 8', 1))
    after_table = backend._package_digest(root)
    source.write_text(source.read_text() + "\n")
    assert len({before, after_table, backend._package_digest(root)}) == 3


def test_the_cache_tag_follows_the_settings_and_the_users_tuned_table(monkeypatch, tmp_path):
    """Settings read while Inductor traces our ops (the engine, TMA, the tail split) and the user's tuned table
    decide the visible kernels' launches: a change to either gives another tag, and changing it back the same."""
    from moe_inductor import backend, config
    from moe_inductor.kernels import configs

    monkeypatch.setenv("MOE_INDUCTOR_CACHE_DIR", str(tmp_path))
    tag = backend.cache_tag()
    monkeypatch.setattr(config, "gemm_tail_split", not config.gemm_tail_split)
    split = backend.cache_tag()
    monkeypatch.setattr(config, "gemm_tail_split", not config.gemm_tail_split)
    assert split != tag and backend.cache_tag() == tag
    path = configs.TABLE.user_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"gemm|key": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}}')
    tuned = backend.cache_tag()
    assert tuned not in (tag, split) and tuned.rsplit("-", 1)[0] == tag.rsplit("-", 1)[0]
