"""Graph inputs that record a gradient and are changed in place (moe_inductor/input_mutations.py): AOTAutograd saves
such an input for backward and then changes it, so its backward raises where eager runs; our graphs change a clone
instead. Our capture breaks graphs elsewhere than plain capture does, so it can hand a graph such an input where
``backend="inductor"`` never does (the generator's NumPy-walk look-alike, below)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from helpers import rel_err
from moe_inductor.input_mutations import clone_mutated_grad_inputs, own_copy

AOT = {"inner": "aot_eager"}


def _weigh_in_place(a, w, out):
    y = a.to(torch.float32)  # the same tensor: a is changed in place below
    y.mul_(w)  # w's gradient needs a's value from before the change
    out.index_add_(0, torch.arange(a.shape[0], device=a.device), y)


def _run(fn, backend, options=None, leaf=False, device="cpu"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(device)
    w = torch.randn(3, 1, device=device, requires_grad=True)
    a = torch.randn(3, 4, device=device, requires_grad=True) if leaf else lin(torch.randn(3, 4, device=device))
    out = torch.zeros(3, 4, device=device)
    run = fn if backend is None else torch.compile(fn, backend=backend, options=options)
    run(a, w, out)
    (out * torch.arange(12.0, device=device).view(3, 4)).sum().backward()
    return out.detach(), w.grad, lin.weight.grad


def test_an_input_weighted_in_place_runs_backward_as_eager_does():
    ref = _run(_weigh_in_place, None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # AOTAutograd's limit, as it is
        _run(_weigh_in_place, "aot_eager")
    got = _run(_weigh_in_place, "moe_inductor", AOT)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-6


@pytest.mark.slow  # two Inductor compiles
def test_under_inductor_too():
    """Inductor's partitioner recomputes a plain clone in the backward from the input and saves the input itself;
    the copy it cannot see into is saved instead."""
    ref = _run(_weigh_in_place, None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(_weigh_in_place, "inductor")
    got = _run(_weigh_in_place, "moe_inductor", {"inner": "inductor"})
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 4), (1, 4), (5, 3)])
def test_own_copy_is_a_copy_with_the_identity_gradient(dtype, shape):
    x = torch.randn(shape).to(dtype)
    for inp in (x, x.t() if len(shape) == 2 else x):  # a transposed input keeps its strides, as clone's does
        inp = inp.detach().requires_grad_(True)
        y = own_copy(inp)
        assert torch.equal(y, inp) and y.data_ptr() != inp.data_ptr() or inp.numel() == 0
        assert y.stride() == inp.clone().stride()
        g = torch.randn(y.shape).to(dtype)
        (gx,) = torch.autograd.grad(y, inp, g)
        assert torch.equal(gx, g)
        torch.library.opcheck(torch.ops.moe_inductor.own_copy.default, (inp,))


def _residual_in_place(a, w, out):
    a += w  # nothing of a is saved for backward: AOTAutograd runs it without a copy
    out.add_(a * 2.0)


def test_a_change_nothing_saves_runs_without_a_copy():
    ref = _run(_residual_in_place, None)
    for backend, options in (("aot_eager", None), ("moe_inductor", AOT)):
        got = _run(_residual_in_place, backend, options)
        for g, r in zip(got, ref):
            assert rel_err(g, r) < 1e-6


def test_a_leaf_changed_in_place_raises_as_eager_does():
    with pytest.raises(RuntimeError, match="leaf Variable"):
        _run(_weigh_in_place, None, leaf=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        _run(_weigh_in_place, "moe_inductor", AOT, leaf=True)


def _traced(fn, *inputs):
    """(graph, example inputs) of ``fn`` as Dynamo hands them to a backend."""
    seen = {}

    def keep(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    return seen["gm"], seen["inputs"]


def _grad_input():
    return nn.Linear(4, 4)(torch.randn(3, 4))


@pytest.mark.parametrize("spelling", ["view", "iadd", "setitem", "relu_inplace", "relu_positional", "foreach",
                                      "aten_overload"])
def test_every_spelling_of_a_change_in_place_is_seen(spelling):
    def fn(a, b):
        s = (a * b).sum()  # a reader whose gradient needs a's value from before the change
        if spelling == "view":
            a.view(-1).mul_(2.0)
        elif spelling == "iadd":
            v = a[0]
            v += b[0]
        elif spelling == "setitem":
            a[1] = b[1]
        elif spelling == "relu_positional":
            F.relu(a, True)
        elif spelling == "foreach":  # a list of the tensors it writes
            torch._foreach_mul_([b, a], 2.0)
        elif spelling == "aten_overload":
            torch.ops.aten.mul_.Scalar(a, 2.0)
        else:
            F.relu(a, inplace=True)
        return s

    gm, inputs = _traced(fn, _grad_input(), torch.randn(3, 4))
    assert clone_mutated_grad_inputs(gm, inputs) == ["l_a_"]


def _weigh_then_read_view(a, row, w, out):
    a.mul_(w)  # row, another input, views a: it must read the changed values
    out.add_(row * 3.0)


def test_an_input_another_input_views_is_changed_in_place_as_eager_does():
    def run(backend, options=None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        a = lin(torch.randn(3, 4))
        w = torch.randn(3, 1, requires_grad=True)
        out = torch.zeros(4)
        fn = _weigh_then_read_view if backend is None else torch.compile(_weigh_then_read_view, backend=backend,
                                                                          options=options)
        fn(a, a[1], w, out)
        return out

    ref = run(None)
    got = run("moe_inductor", AOT)
    assert rel_err(got, ref) < 1e-6
    a = _grad_input()
    gm, inputs = _traced(_weigh_then_read_view, a, a[1], torch.randn(3, 1), torch.zeros(4))
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][:1] == ["l_a_"]
    assert clone_mutated_grad_inputs(gm, inputs) == []  # a copy of a would hide the change from the view


def test_inputs_it_leaves_alone():
    def returns_alias(a, w):
        a.mul_(w)
        return a

    def reads_only(a, w):
        return (a * w).sum()

    def residual(a, w):  # changes a without reading it: nothing of a is saved
        a += w
        a[0] = w[0]
        return w.sum()

    gm, inputs = _traced(returns_alias, _grad_input(), torch.randn(3, 1))
    assert clone_mutated_grad_inputs(gm, inputs) == []  # the caller would get the clone back
    gm, inputs = _traced(reads_only, _grad_input(), torch.randn(3, 1))
    assert clone_mutated_grad_inputs(gm, inputs) == []
    gm, inputs = _traced(residual, _grad_input(), torch.randn(3, 4))
    assert clone_mutated_grad_inputs(gm, inputs) == []
    gm, inputs = _traced(_weigh_in_place, _grad_input(), torch.randn(3, 1), torch.zeros(3, 4))
    with torch.no_grad():
        assert clone_mutated_grad_inputs(gm, inputs) == []
    assert clone_mutated_grad_inputs(gm, inputs) != []


def test_the_generators_numpy_walk_lookalike_runs_backward_under_aot():
    """The generator's draw that found it: ``--walks-lists --seed 11``, the cumsum walk whose look-alike counts its
    steps after the guarded body (E=6, k=3, T=5, ModuleDict experts, ``y.mul_(w)``)."""
    from tests.generator.check import run
    from tests.generator.recipe import WALKS_LISTS, draw_recipe, random_draw

    rng = random.Random(11)
    for _ in range(200):
        r = draw_recipe(random_draw(rng), lookalike=None, forms=WALKS_LISTS)
        if r.form == "cumsum_walk" and r.flaw == "walk_tail":
            break
    else:
        raise AssertionError("the draw is gone: find another seed with a walk_tail look-alike")
    outcome = run(r, "aot_eager")
    assert outcome.verdict == "kept", outcome.describe()
    assert not counters["moe_inductor"]


@pytest.mark.gpu
def test_gpu_an_input_weighted_in_place_under_inductor():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.moe_inductor.own_copy.default,
                              (torch.randn(5, 3, device="cuda", dtype=dtype, requires_grad=True),))
    ref = _run(_weigh_in_place, None, device="cuda")
    got = _run(_weigh_in_place, "moe_inductor", {"inner": "inductor"}, device="cuda")
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-5
