"""LLaMA-MoE's ``UniversalCalculator`` (pjlab-sys4nlp/llama-moe, mirrored in tests/corpus/pjlab_llama_moe.py) in the
frame it runs in: its gate breaks the graph in the user's own code, so the calculator gets the router's ids and
scores as inputs of its frame. There the bincount's length E is asserted at run time (ids of E or more fail it),
the list comprehension's skip of an empty expert is speculated away, and the split loop is rewritten.

Rewritten and equal to eager, forward and backward (an expert with no rows keeps no gradient, as in eager); bad ids
raise, as in eager; look-alikes are left alone (compiled as plain capture would) and equal to eager: a skip that
drops experts with rows, counts of other ids, the list reordered or read by index, pieces read by other experts,
another scale factor, tokens tiled instead of interleaved, counts read as numbers beside the split."""
import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.corpus.pjlab_llama_moe import E, H, LinearGLUExperts
from tests.helpers import assert_close

K = 2


class Calculator(nn.Module):
    """``UniversalCalculator.forward`` (``multiply_gate_scores``, a literal ``score_scale_factor``), its spelling
    changed by ``style`` for the look-alikes."""

    def __init__(self, style="llama", factor=1.0):
        super().__init__()
        self.experts, self.style, self.score_scale_factor, self.num_experts = LinearGLUExperts(), style, factor, E

    def forward(self, x, topK_indices, topK_scores, other_ids=None):
        s = self.style
        batch_size, num_selects = topK_indices.size(0), topK_indices.size(1)
        topK_indices = topK_indices.flatten()
        topK_scores = topK_scores.flatten()
        batch_indices = torch.arange(batch_size, device=topK_scores.device)
        # tiled (0, 1, ..., T-1, 0, 1, ...): not the token of each flat choice
        batch_indices = batch_indices.repeat(num_selects) if s == "tiled" else batch_indices.repeat_interleave(
            num_selects)
        _, index_sorted_topK_indices = topK_indices.sort(0)
        sorted_topK_scores = topK_scores.index_select(0, index_sorted_topK_indices)
        sorted_batch_indices = batch_indices.index_select(0, index_sorted_topK_indices)
        counted = other_ids.flatten() if s == "other_ids" else topK_indices
        expert_batch_size = counted.bincount(minlength=self.num_experts).tolist()
        sorted_x = x.index_select(0, sorted_batch_indices).squeeze(1)
        split_x = torch.split(sorted_x, expert_batch_size, dim=0)
        # one comprehension per function: Python 3.12 inlines them (PEP 709), and a function with more than one is
        # refused (skipped_state.py)
        cat_expert_outputs = (self._skips_rows if s == "skips_rows" else self._other_pieces if s == "other_pieces"
                              else self._outputs)(split_x)
        cat_expert_outputs = torch.mul(cat_expert_outputs, sorted_topK_scores.reshape(-1, 1) * self.score_scale_factor)
        zeros = torch.zeros((batch_size, cat_expert_outputs.size(1)), device=cat_expert_outputs.device,
                            dtype=cat_expert_outputs.dtype)
        y = zeros.index_add(0, sorted_batch_indices, cat_expert_outputs)
        if s == "counts_read":  # the counts as numbers beside the split
            y = y * expert_batch_size[0]
        return y

    def _outputs(self, split_x):
        expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 0]
        return torch.cat(expert_outputs, 0)

    def _skips_rows(self, split_x):  # drops an expert with one row too
        expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 1]
        return torch.cat(expert_outputs, 0)

    def _other_pieces(self, split_x):  # expert i runs on the piece of expert E-1-i
        expert_outputs = [self.experts(split_x[E - 1 - i], i) for i in range(E) if split_x[i].shape[0] > 0]
        return torch.cat(expert_outputs, 0)

    def sorted_rows(self, x, topK_indices, topK_scores):
        """The calculator up to the split: (T, sorted scores, sorted tokens, the pieces)."""
        batch_size, num_selects = topK_indices.shape
        order = topK_indices.flatten().sort(0)[1]
        tok = torch.arange(batch_size).repeat_interleave(num_selects).index_select(0, order)
        split_x = torch.split(x.index_select(0, tok), topK_indices.flatten().bincount(minlength=E).tolist(), dim=0)
        return batch_size, topK_scores.flatten().index_select(0, order), tok, split_x

    def combined(self, cat, scores, tok, batch_size):
        return torch.zeros((batch_size, H)).index_add(0, tok, torch.mul(cat, scores.reshape(-1, 1)))


class Helpers(Calculator):
    """The calculator through the helpers that the two look-alikes below use, the list read only by the cat."""

    def forward(self, x, topK_indices, topK_scores):
        T, scores, tok, split_x = self.sorted_rows(x, topK_indices, topK_scores)
        expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 0]
        return self.combined(torch.cat(expert_outputs, 0), scores, tok, T)


class Reordered(Calculator):
    """The list read by a slice: the outputs in another order than the weights."""

    def forward(self, x, topK_indices, topK_scores):
        T, scores, tok, split_x = self.sorted_rows(x, topK_indices, topK_scores)
        expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 0]
        expert_outputs = expert_outputs[::-1]
        return self.combined(torch.cat(expert_outputs, 0), scores, tok, T)


class Indexed(Calculator):
    """The list read by index: with a skipped expert, entry 0 is not expert 0's."""

    def forward(self, x, topK_indices, topK_scores):
        T, scores, tok, split_x = self.sorted_rows(x, topK_indices, topK_scores)
        expert_outputs = [self.experts(split_x[i], i) for i in range(E) if split_x[i].shape[0] > 0]
        expert_outputs[0] = expert_outputs[0] * 2.0
        return self.combined(torch.cat(expert_outputs, 0), scores, tok, T)


def _routing(T, seed, avoid=None):
    """(x, ids, scores) of a top-2 router over E experts; ``avoid``: an expert no token chooses."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    if avoid is not None:
        logits[:, avoid] = -1e4
    scores, ids = logits.topk(K, dim=1)
    return x, ids, scores.softmax(-1)


def _compiled(model):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="moe_inductor", options={"inner": "eager"})


def _step(fn, model, x, ids, scores, probe, *extra):
    """Output and the gradients of x, the scores and every parameter (None where none was made)."""
    model.zero_grad(set_to_none=True)
    x, scores = x.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    out = fn(x, ids, scores, *extra)
    (out * probe).sum().backward()
    return out.detach(), [x.grad, scores.grad] + [None if p.grad is None else p.grad.clone()
                                                   for p in model.parameters()]


def _assert_like_eager(compiled, model, inputs, what):
    x, ids, scores, *extra = inputs
    probe = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(7))
    got, got_grads = _step(compiled, model, x, ids, scores, probe, *extra)
    want, want_grads = _step(model, model, x, ids, scores, probe, *extra)
    assert_close(got, want, torch.float32, f"{what} forward")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if w is not None:
            assert_close(g, w, torch.float32, f"{what} gradient {i}")


def test_calculator_is_rewritten_and_equal_to_eager():
    """One split loop per compile (static, then dynamic), no fallback, forward and backward equal to eager; an
    expert no token chose gets no gradient, as in eager; the bincount and its length assertion stay in the graph."""
    torch.manual_seed(0)
    model = Calculator()
    compiled = _compiled(model)
    for T, avoid in ((5, None), (11, None), (9, 2)):
        _assert_like_eager(compiled, model, _routing(T, T, avoid), f"T={T}")
    assert dict(counters["moe_inductor"]) == {"split_loop": 2}, dict(counters["moe_inductor"])
    assert not counters["moe_inductor_fallback"], dict(counters["moe_inductor_fallback"])
    assert sum(counters["graph_break"].values()) == 0
    model.zero_grad(set_to_none=True)
    x, ids, scores = _routing(9, 9, avoid=2)
    compiled(x, ids, scores.requires_grad_(True)).sum().backward()
    assert model.experts.weight_gate[2].grad is None and model.experts.weight_down[1].grad is not None


def test_the_look_alikes_helpers_alone_are_rewritten():
    """The spelling Reordered and Indexed share, without their change to the list: rewritten, equal to eager."""
    torch.manual_seed(0)
    model = Helpers()
    _assert_like_eager(_compiled(model), model, _routing(7, 5), "helpers")
    assert dict(counters["moe_inductor"]) == {"split_loop": 1}, dict(counters["moe_inductor"])


def test_rewritten_graph_keeps_the_bincount_and_its_length_check():
    """The op reads the ids as given; the graph keeps eager's bincount (which rejects negative ids) and the
    assertion that it has E entries (which rejects ids of E or more)."""
    import moe_inductor

    torch.manual_seed(0)
    report = moe_inductor.explain(Calculator(), *_routing(6, 0))
    assert len(report.graphs) == 1 and report.graphs[0].moe_ops == 1 and not report.fallbacks
    code = report.graphs[0].code
    assert ".bincount(minlength = 4)" in code and re.search(rf"Eq\(u\d+, {E}\)", code), code
    assert ".item()" not in code and "split" not in code, code


@pytest.mark.parametrize("bad", [E, -1], ids=["id-E", "negative-id"])
def test_ids_out_of_range_raise_as_in_eager(bad):
    torch.manual_seed(0)
    model = Calculator()
    compiled = _compiled(model)
    x, ids, scores = _routing(8, 1)
    with torch.no_grad():
        compiled(x, ids, scores)  # compiled and rewritten with good ids
        assert counters["moe_inductor"]["split_loop"] == 1
        ids = ids.clone()
        ids[:3, 0] = bad  # three rows leave the experts' cat short of the weights: eager fails
        with pytest.raises(RuntimeError):
            model(x, ids, scores)
        with pytest.raises(RuntimeError):
            compiled(x, ids, scores)


@pytest.mark.parametrize("style", ["skips_rows", "other_ids", "reordered", "indexed", "other_pieces", "tiled",
                                   "counts_read", "factor"])
def test_look_alikes_are_not_rewritten(style):
    torch.manual_seed(0)
    classes = {"reordered": Reordered, "indexed": Indexed}
    model = classes[style]() if style in classes else Calculator(
        "llama" if style == "factor" else style, factor=2.0 if style == "factor" else 1.0)
    compiled = _compiled(model)
    x, ids, scores = _routing(10, 3)
    extra = (_routing(10, 4)[1],) if style == "other_ids" else ()
    if style == "other_ids":  # the same number of rows, split by another router's counts
        _assert_like_eager(compiled, model, (x, ids, scores, *extra), style)
    else:
        _assert_like_eager(compiled, model, (x, ids, scores), style)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


class Gate(nn.Module):
    """LLaMA-MoE's gate up to its graph break: the logits and the top-k go to the caller, no expert in this graph."""

    def __init__(self, experts_here=False):
        super().__init__()
        self.proj, self.experts_here = nn.Linear(H, E, bias=False), experts_here
        self.w = nn.Parameter(torch.randn(E, H, H))

    def forward(self, x):
        logits = self.proj(x)
        scores, ids = logits.topk(K, dim=1)
        if self.experts_here:  # a look-alike: the ids do feed per-expert work in this graph
            return logits, x @ self.w[ids[:, 0]].sum(0)
        return logits, ids, scores.softmax(-1)


@pytest.mark.parametrize("experts_here", [False, True], ids=["ids-returned", "ids-feed-work"])
def test_a_router_graph_alone_says_its_ids_leave_it(experts_here):
    """The router's frame (LLaMA-MoE's gate breaks the graph after its top-k) is noted as handing its ids on, not as
    feeding per-expert work: its only matmul is the router's own. Ids that do reach work keep the usual note."""
    import moe_inductor

    torch.manual_seed(0)
    report = moe_inductor.explain(Gate(experts_here), torch.randn(6, H))
    assert [m.form for m in report.left_alone] == ["moe_region"], report.left_alone
    reason = report.left_alone[0].reason
    assert ("leave this graph" in reason) != experts_here and ("feed per-expert work" in reason) == experts_here, (
        reason)
