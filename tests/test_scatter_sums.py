"""``scatter_reduce(..., reduce="sum")`` read as ``scatter_add`` (passes/scatter_sums.py): DeepSeek-MoE 16B's
``moe_infer`` combine. The respelling itself on small graphs, and a host-walked expert loop combined by it, rewritten
and equal to eager. Look-alikes, left as they are: ``include_self=False`` (each expert's write then replaces the
rows the experts before it wrote: not a sum over the top-k) and the other reductions."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor.passes.scatter_sums import scatter_sums_as_adds
from tests.helpers import compile_moe

E, H, I, K = 4, 8, 6, 2


class _Traced(torch.fx.Interpreter):
    """Runs the graph once, keeping each node's value where Dynamo's graphs keep theirs (``meta["val"]``)."""

    def run_node(self, n):
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def _graph(fn, needs_grad=False):
    gm = torch.fx.symbolic_trace(fn)
    src = torch.randn(3, 2, requires_grad=needs_grad)
    _Traced(gm).run(torch.ones(3, 2), torch.tensor([[0, 1], [0, 1], [2, 0]]), src.clone() if not needs_grad else src)
    return gm, scatter_sums_as_adds(gm.graph)


@pytest.mark.parametrize("spelling", ["positional", "keyword", "include_self"])
def test_a_sum_reduction_is_respelled_as_scatter_add(spelling):
    def fn(acc, idx, src):
        if spelling == "positional":
            return acc.scatter_reduce_(0, idx, src, "sum")
        if spelling == "keyword":
            return acc.scatter_reduce(0, idx, src, reduce="sum")
        return acc.scatter_reduce_(0, idx, src, reduce="sum", include_self=True)

    gm, done = _graph(fn)
    gm.recompile()
    assert done == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert targets == ["scatter_add" if spelling == "keyword" else "scatter_add_"], targets
    idx = torch.tensor([[0, 1], [0, 1], [2, 0]])
    src = torch.randn(3, 2)
    torch.testing.assert_close(gm(torch.ones(3, 2), idx, src), fn(torch.ones(3, 2), idx, src))


def test_a_sum_reduction_a_backward_runs_through_stays():
    """``scatter_reduce`` saves its result for its backward, so a buffer reduced into twice makes eager's backward
    raise where ``scatter_add_`` would not: with a gradient, the user's spelling (and error) stays."""
    def fn(acc, idx, src):
        return acc.scatter_reduce(0, idx, src, reduce="sum")

    gm, done = _graph(fn, needs_grad=True)
    assert done == 0
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["scatter_reduce"]


@pytest.mark.parametrize("kwargs", [dict(reduce="sum", include_self=False), dict(reduce="amax"), dict(reduce="prod"),
                                    dict(reduce="mean")])
def test_other_reductions_stay(kwargs):
    def fn(acc, idx, src):
        return acc.scatter_reduce_(0, idx, src, **kwargs)

    gm, done = _graph(fn)
    assert done == 0
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["scatter_reduce_"]


class HostWalked(nn.Module):
    """DeepSeek-MoE's inference path in small: host end offsets, rows by ``idxs // k``, the output scaled in place
    and combined by ``scatter_reduce_`` (``include_self`` as given)."""

    def __init__(self, include_self=True):
        super().__init__()
        self.include_self = include_self
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.ModuleList([nn.Linear(H, I, bias=False) for _ in range(E)])
        self.w2 = nn.ModuleList([nn.Linear(I, H, bias=False) for _ in range(E)])

    def forward(self, x):
        x = x.view(-1, H)
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1, sorted=False)
        flat_ids, flat_w = ids.view(-1), w.view(-1, 1)
        cache = torch.zeros_like(x)
        idxs = flat_ids.argsort()
        ends = flat_ids.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // K
        for i, end in enumerate(ends):
            start = 0 if i == 0 else ends[i - 1]
            if start == end:
                continue
            tok = token_idxs[start:end]
            out = self.w2[i](F.silu(self.w1[i](x[tok])))
            out.mul_(flat_w[idxs[start:end]])
            cache.scatter_reduce_(0, tok.view(-1, 1).repeat(1, H), out, reduce="sum", include_self=self.include_self)
        return cache


def test_a_host_walked_loop_combined_by_a_sum_reduction_is_rewritten():
    torch.manual_seed(0)
    model = HostWalked().eval()
    x = torch.randn(10, H)
    with torch.no_grad():
        torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["moe_inductor"]["split_loop"] == 1, dict(counters["moe_inductor"])


def test_include_self_false_is_not_a_sum_over_the_top_k_and_stays():
    torch.manual_seed(0)
    model = HostWalked(include_self=False).eval()
    x = torch.randn(10, H)
    with torch.no_grad():
        want = model(x)
        assert not torch.allclose(want, _summed(model, x))  # the two reductions differ on these tokens
        torch.testing.assert_close(compile_moe(model, x), want, rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


def _summed(model: HostWalked, x: torch.Tensor) -> torch.Tensor:
    model.include_self = True
    try:
        return model(x)
    finally:
        model.include_self = False


def test_a_differentiable_walk_keeps_its_reduction():
    """With a gradient through the combine (eager's backward raises on the buffer reduced into twice), the
    reduction is not respelled, so the loop is not rewritten: the forward equals eager's."""
    torch.manual_seed(0)
    model = HostWalked()
    x = torch.randn(10, H)
    torch.testing.assert_close(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
