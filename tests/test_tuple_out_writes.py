"""An op can write more than one tensor: ``torch.topk(x, k, out=(values, indices))`` (``torch.sort``, ``torch.max``
with a dim, ``torch._foreach_mul_([a, b], s)`` too) writes each tensor of the tuple, and its result's parts are
those tensors (``res[1]`` is ``indices``). ``passes/aliases.py`` (``tensors_written``, ``alias_source``) sees every
one of them, so a pass sees the routing ids changed through either name, and the dead-code removal after a
rewrite keeps a write that nothing reads but through the tuple's tensors.

Each look-alike below is equal to eager and not rewritten (or keeps its write); beside each, its twin without the
change is rewritten and equal to eager."""
import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor.passes.aliases import alias_mutations, alias_source, base_of, is_impure, tensors_written
from moe_inductor.passes.driver import CHANGED_IN_PLACE
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 4, 2


class GatheredExperts(nn.Module):
    """gpt-fast's gathered experts (``ConditionalFeedForward``), with the routing's tensors made and changed
    through tuple ``out=`` in the ways ``spelling`` names:

    - ``plain``: no ``out=`` (the genuine form);
    - ``ids-overwritten``: a second router's choice is written into ``ids`` by ``topk(..., out=(spare, ids))``
      between the gate's and the down projection's gathers, so the two gather other experts' weights;
    - ``topk-out``: the router writes preallocated buffers (``topk(..., out=(w_buf, i_buf))``) and the experts read
      the result's parts (genuine: nothing changes them afterwards);
    - ``buffer-clamped``: as ``topk-out``, and ``i_buf`` (the name, not the part the experts read) is clamped
      between the two gathers, so the down projection reads other experts than the gate did."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(H, E, bias=False)
        self.other = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        if self.spelling in ("topk-out", "buffer-clamped"):
            w_buf, i_buf = probs.new_zeros(x.shape[0], K), torch.zeros(x.shape[0], K, dtype=torch.long)
            weights, ids = torch.topk(probs, K, dim=-1, out=(w_buf, i_buf))
        else:
            weights, ids = torch.topk(probs, K, dim=-1)
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        if self.spelling == "ids-overwritten":
            torch.topk(self.other(x), K, dim=-1, out=(torch.zeros_like(weights), ids))
        elif self.spelling == "buffer-clamped":
            i_buf.clamp_(max=E - 3)
        out = torch.einsum("tao,taio->tai", h, self.w2[ids])
        return torch.einsum("tai,ta->ti", out, weights)


def _forward(model: nn.Module, x: torch.Tensor):
    with torch.no_grad():  # out= into a tensor made from one that records a gradient raises in eager
        return compile_moe(model, x), model(x)


@pytest.mark.parametrize("spelling", ["ids-overwritten", "buffer-clamped"])
def test_ids_written_through_a_tuple_out_are_left_alone(spelling):
    torch.manual_seed(0)
    model, x = GatheredExperts(spelling), torch.randn(9, H)
    out, ref = _forward(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, spelling)
    with torch.no_grad():
        (left,) = moe_inductor.explain(model, x).left_alone
    assert (left.form, left.reason) == ("gathered_weights", CHANGED_IN_PLACE), left


def test_ids_read_through_a_tuple_out_result_are_rewritten():
    torch.manual_seed(0)
    model, x = GatheredExperts("topk-out"), torch.randn(9, H)
    out, ref = _forward(model, x)
    assert counters["moe_inductor"]["gathered_weights"] == 1, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, "topk-out")


def test_the_genuine_twin_is_rewritten_forward_and_backward():
    torch.manual_seed(0)
    assert_rewritten_like_eager(GatheredExperts("plain"), torch.randn(9, H), "gathered_weights", "plain")


class MaxBeside(nn.Module):
    """gpt-fast's gathered experts, beside a record of each token's top probability and expert written by
    ``torch.max(probs, -1, out=(p, e))`` whose result nobody reads: into graph-local tensors that the output reads
    afterwards (``local``), or into the module's buffers (``buffers``). The dead-code removal after the rewrite must
    keep the write in both."""

    def __init__(self, into: str):
        super().__init__()
        self.into = into
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)
        self.register_buffer("top_p", torch.full((9,), -5.0))
        self.register_buffer("top_e", torch.full((9,), -1, dtype=torch.long))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        weights, ids = torch.topk(probs, K, dim=-1)
        if self.into == "local":
            p, e = torch.full((x.shape[0],), -5.0), torch.full((x.shape[0],), -1, dtype=torch.long)
        else:
            p, e = self.top_p, self.top_e
        torch.max(probs.detach(), -1, out=(p, e))
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        out = torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", h, self.w2[ids]), weights)
        return out + p[:, None] + e[:, None] if self.into == "local" else out


@pytest.mark.parametrize("into", ["local", "buffers"])
def test_a_tuple_out_write_nobody_reads_the_result_of_is_kept(into):
    torch.manual_seed(0)
    model, ref_model = MaxBeside(into), MaxBeside(into)
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(9, H)
    out, ref = compile_moe(model, x), ref_model(x)
    assert counters["moe_inductor"]["gathered_weights"] == 1, dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, into)
    assert torch.equal(model.top_p, ref_model.top_p) and torch.equal(model.top_e, ref_model.top_e)


def _graph(fn, *args) -> torch.fx.Graph:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def _named(graph: torch.fx.Graph) -> dict:
    return {n.name: n for n in graph.nodes}


def test_every_tensor_of_a_tuple_out_is_written_and_is_a_part_of_the_result():
    def sort_into(x, v, i):
        res = torch.sort(x, -1, out=(v, i))
        return res[1] + 1

    g = _named(_graph(sort_into, torch.randn(3, 5), torch.empty(3, 5), torch.empty(3, 5, dtype=torch.long)))
    sort, v, i = g["sort"], g["l_v_"], g["l_i_"]
    (part,) = [u for u in sort.users if u.args[1] == 1]
    assert tensors_written(sort) == (v, i)
    assert alias_source(part) is i and base_of(part) is i and alias_source(sort) is None
    assert alias_mutations(v) == [sort] and alias_mutations(i) == [sort]
    assert alias_mutations(part) == []  # what the part's readers see is what the sort made
    assert is_impure(sort)  # it changes the caller's tensors


def test_every_tensor_of_a_foreach_write_is_written():
    def scale(x):
        a, b = x.clone(), x.clone()
        torch._foreach_mul_([a, b], 2.0)
        return a + b

    g = _named(_graph(scale, torch.randn(3)))
    write, a, b = g["_foreach_mul_"], g["a"], g["b"]
    assert tensors_written(write) == (a, b)
    assert alias_mutations(a) == [write] and alias_mutations(b) == [write]
    assert is_impure(write)  # a and b are read after it


def test_dunder_methods_write_only_where_they_are_in_place():
    """A graph as Dynamo may hand it before the driver's canonical form: ``x.__iadd__(y)`` and ``x.__setitem__(i, v)``
    write x; ``x.__getitem__(0)`` and ``x.__add__(y)`` end in ``_`` too, and write nothing."""
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    calls = {name: g.call_method(name, (x, y) if name != "__setitem__" else (x, 0, y))
             for name in ("__iadd__", "__setitem__", "__getitem__", "__add__", "add_")}
    assert {name: tensors_written(n) for name, n in calls.items()} == {
        "__iadd__": (x,), "__setitem__": (x,), "__getitem__": (), "__add__": (), "add_": (x,)}


class MaskWrittenByOut(nn.Module):
    """A loop over experts whose rows come from a (T, k, E) hit mask that ``torch.eq(..., out=hit)`` writes from
    the router's ids: no form proves it, and the ids reach the experts only through that write, so explain() names
    the region (``unrecognised.py`` follows every tensor a write changes)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        hit = torch.zeros(x.shape[0], K, E, dtype=torch.bool)
        torch.eq(ids[..., None], torch.arange(E), out=hit)
        y = torch.zeros_like(x)
        for e in range(E):
            w_e = (weights * hit[..., e]).sum(-1, keepdim=True)  # 0 where the token did not choose e
            y = y + w_e * (F.silu(x @ self.w1[e].T) @ self.w2[e].T)
        return y


def test_ids_that_reach_the_experts_through_an_out_write_are_named():
    torch.manual_seed(0)
    model, x = MaskWrittenByOut(), torch.randn(9, H)
    with torch.no_grad():
        out, ref = compile_moe(model, x), model(x)
        report = moe_inductor.explain(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, ref, torch.float32, "mask written by out=")
    assert [m.form for m in report.left_alone] == ["moe_region"], report.left_alone
