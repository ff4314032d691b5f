"""In-place arithmetic on a tensor the graph has just made, read as the out-of-place op it equals
(``passes/private_writes.py``), as GPTQModel's MiniMax-M2 port writes its MoE block::

    scores = torch.sigmoid(logits); scores.add_(bias)              # the routing bias, before topk
    weights = scores.gather(1, ids); weights.div_(weights.sum(-1, keepdim=True))
    gate = act(w1(x)); gate.mul_(w3(x))                            # the expert MLP
    expert_output = expert(x[tok]); expert_output.mul_(w[tok, pos, None])   # the routing weight

Genuine: each spelling alone, and all four together, under ``torch.no_grad()``: rewritten, equal to eager (each
was left alone before, by the reason its parametrisation names). Look-alikes, each still written in place and equal
to eager: a write into a view taken before it (``v = y.view(-1, H); y.mul_(w)`` then ``v`` read), a write into a
view (``h[:, :I].mul_(up)``, and ``c[i].mul_(2)`` with a 0-d tensor ``i``, a view though the index is a tensor), a
write into the module's input or its buffer, a write whose out-of-place result would promote (bf16 output times an
fp32 weight), two names of one memory (``scores.detach()`` read after ``scores.add_``), a write a backward runs
through (eager's "modified by an inplace operation" error kept: the sigmoid's scores biased in place with gradients
on leave the MoE alone, and its compiled backward raises as eager's; without the grad rule it was rewritten), and a
write over a tensor that a product with a weight saved for its backward. A written tensor the module returns is
respelled, and returned with the written values.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from moe_inductor.passes.private_writes import respell_private_writes
from moe_inductor.passes.stale_reads import UNSEEN
from tests.helpers import assert_close, compile_moe

H, I, E, K = 16, 8, 4, 2

#: each spelling, and what the driver said of it before it was respelled
SPELLINGS = {
    "output_mul_": "no routing weight weights[tok, pos, None] scales the output",
    "gate_mul_": UNSEEN,
    "scores_add_": UNSEEN,
    "weights_div_": "an input of the region is changed in place elsewhere in the graph",
}


class Expert(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        gate = F.silu(self.w1(x))
        up = self.w3(x)
        s = self.spelling
        if s in ("gate_mul_", "all"):
            gate.mul_(up)
        elif s == "gate_view_before":  # a view of gate taken before the write, read after it
            seen = gate.view(-1, I)
            gate.mul_(up)
            gate = seen
        elif s == "gate_into_view":  # the write goes into a view of gate
            gate[:, :I].mul_(up)
        else:
            gate = gate * up
        return self.w2(gate)


class InPlaceMoE(nn.Module):
    """A sigmoid-scored top-k MoE with a routing bias, a loop over the experts, ``index_add_`` into zeros; ``spelling``
    picks which step is written in place (``all``: every one, as MiniMax-M2's port does)."""

    def __init__(self, spelling, dtype=torch.float32):
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(H, E, bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(E))
        self.experts = nn.ModuleList([Expert(spelling) for _ in range(E)])
        self.to(dtype)

    def forward(self, x):
        s = self.spelling
        scores = torch.sigmoid(self.gate(x).float())
        original = scores.detach() if s == "scores_two_names" else scores
        if s in ("scores_add_", "all", "scores_two_names"):
            scores.add_(self.bias.float())
        else:
            scores = scores + self.bias.float()
            original = scores
        ids = torch.topk(scores, K, dim=-1)[1]
        weights = original.gather(1, ids)
        if s in ("weights_div_", "all"):
            weights.div_(weights.sum(dim=-1, keepdim=True).clamp(min=1e-12))
            weights.mul_(1.5)
        else:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-12) * 1.5
        if s != "output_promotes":  # else the weights stay fp32 while the experts run in x's dtype
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            y = self.experts[e](x[tok])
            w = weights[tok, pos, None]
            if s in ("output_mul_", "all", "output_promotes"):
                y.mul_(w)
            elif s == "output_view_before":  # a view of y taken before the write, read after it
                seen = y.view(-1, H)
                y.mul_(w)
                y = seen
            else:
                y = y * w
            out.index_add_(0, tok, y)
        return out


def _eager_and_compiled(model, x):
    """eager's output, the compiled one, the rewrites counted by that compile, and explain()'s report, under
    no_grad."""
    with torch.no_grad():
        ref = model(x.clone())
        out = compile_moe(model, x.clone())
        rewrites = dict(counters["moe_inductor"])
        report = moe_inductor.explain(model, x.clone())
    return ref, out, rewrites, report


@pytest.mark.parametrize("spelling", [*SPELLINGS, "all"])
@pytest.mark.parametrize("T", [1, 9], ids=lambda t: f"T{t}")
def test_a_private_write_is_read_out_of_place_and_rewritten(spelling, T):
    torch.manual_seed(T)
    model = InPlaceMoE(spelling)
    ref, out, rewrites, report = _eager_and_compiled(model, torch.randn(T, H))
    assert rewrites == {"unrolled_loop": 1}, rewrites
    assert not report.left_alone, report.left_alone
    assert_close(out, ref, torch.float32, spelling)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_without_the_respelling_each_was_left_alone(spelling, monkeypatch):
    """The driver's step turned off: the region is left alone, saying why, and still equal to eager (so the test
    above fails without it)."""
    from moe_inductor.passes import driver

    monkeypatch.setattr(driver, "respell_private_writes", lambda graph: 0)
    torch.manual_seed(9)
    ref, out, rewrites, report = _eager_and_compiled(InPlaceMoE(spelling), torch.randn(9, H))
    assert not rewrites, rewrites
    assert any(SPELLINGS[spelling] in left.reason for left in report.left_alone), report.left_alone
    assert_close(out, ref, torch.float32, spelling)


def _written_by_respell(model, x) -> tuple[int, int]:
    """(in-place nodes in the Dynamo graph of ``model(x)`` under no_grad, how many ``respell_private_writes``
    respells on it)."""
    from moe_inductor.passes.aliases import tensors_written

    gm = _dynamo_graph(model, x)
    writes = [n for n in gm.graph.nodes if tensors_written(n)]
    return len(writes), respell_private_writes(gm.graph)


def test_each_genuine_write_is_respelled():
    """The four spellings, all in one graph: 3 + 2E writes (scores, the weights twice, gate and output per expert),
    every one respelled; the E ``index_add_`` into the zeros buffer stay."""
    torch.manual_seed(0)
    assert _written_by_respell(InPlaceMoE("all"), torch.randn(9, H)) == (3 + 3 * E, 3 + 2 * E)


# --- look-alikes: the write stays, equal to eager -------------------------------------------------------------


@pytest.mark.parametrize("spelling,kept", [
    # v = y.view(-1, H); y.mul_(w): v, read after, sees the weighted values (an out-of-place y * w would not)
    ("output_view_before", E), ("gate_view_before", E),
    # h[:, :I].mul_(up) writes h through a view
    ("gate_into_view", E),
    # bf16 y times fp32 w: in place keeps bf16, out of place would be fp32
    ("output_promotes", E),
    # scores.detach() is a second name of scores' memory, read after the add
    ("scores_two_names", 1),
])
def test_a_write_others_see_is_left_in_place(spelling, kept):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if spelling == "output_promotes" else torch.float32
    model = InPlaceMoE(spelling, dtype)
    x = torch.randn(9, H, dtype=dtype)
    # the look-alike's writes and the E index_add_ into the zeros buffer, none respelled
    assert _written_by_respell(model, x) == (kept + E, 0)
    ref, out, rewrites, _ = _eager_and_compiled(model, x)
    assert not rewrites, rewrites
    assert_close(out, ref, dtype, spelling)


class InputWrite(nn.Module):
    """The router's scores handed in by the caller and written in place (the caller's tensor changes), and a
    buffer of the module's decayed in place (a load statistic)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(0.1 * torch.randn(E))
        self.register_buffer("load", torch.ones(E))

    def forward(self, scores):
        scores.add_(self.bias)
        self.load.mul_(0.5)
        return torch.topk(scores, K, dim=-1)[1] * 1


def test_a_write_into_an_input_or_a_buffer_is_left_in_place():
    torch.manual_seed(0)
    s = torch.rand(9, E)
    assert _written_by_respell(InputWrite(), s.clone()) == (2, 0)
    model, twin = InputWrite(), InputWrite()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        a, b = s.clone(), s.clone()
        ref = twin(a)
        out = compile_moe(model, b)
    assert torch.equal(out, ref) and torch.equal(a, b)  # the caller's scores carry the bias in both
    assert torch.equal(model.load, twin.load)


class SavedWrite(nn.Module):
    """A tensor autograd saved, then written in place: the sigmoid's output (``sigmoid``), or a tensor of no grad of
    its own read by a product with a weight (``product``)."""

    def __init__(self, saved):
        super().__init__()
        self.saved = saved
        self.gate = nn.Linear(H, E, bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(E))

    def forward(self, x):
        if self.saved == "sigmoid":
            scores = torch.sigmoid(self.gate(x))
            scores.add_(self.bias)
            return scores.sum(-1)
        plain = x * 2
        r = plain * self.bias.sum()
        plain.mul_(2)
        return r + plain.sum(-1, keepdim=True)


@pytest.mark.parametrize("saved", ["sigmoid", "product"])
def test_a_write_a_backward_runs_through_keeps_eagers_error(saved):
    """Out of place, the backward would run; in place (eager's) it raises, and so does the compiled graph."""
    torch.manual_seed(0)
    model, x = SavedWrite(saved), torch.randn(9, H)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with torch.enable_grad():
        torch._dynamo.reset()
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm
        torch.compile(model, backend=keep, fullgraph=True)(x)
    assert respell_private_writes(graphs[0].graph) == 0
    out = compile_moe(model, x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _dynamo_graph(fn, *args):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keep, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def _row_of_a_product(a, i):
    c = a * 2
    c[i].mul_(2)  # a 0-d index selects a row: a view of c, so the write doubles c's row
    return c


def test_a_write_into_a_row_selected_by_a_0d_tensor_is_left_in_place():
    """``c[i]`` with a 0-d integer tensor is a view (a select), not the copy a tensor index makes: its traced value
    says so, and the write stays."""
    a, i = torch.arange(6.0).view(2, 3), torch.tensor(1)
    gm = _dynamo_graph(_row_of_a_product, a, i)
    assert respell_private_writes(gm.graph) == 0
    gm.recompile()
    assert torch.equal(gm(a, i)[0], _row_of_a_product(a, i))


class ReturnsScores(InPlaceMoE):
    """MiniMax-M2's router with the biased scores also returned: the caller sees the written tensor."""

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        scores.add_(self.bias)
        ids = torch.topk(scores, K, dim=-1)[1]
        weights = scores.gather(1, ids)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, pos, None])
        return out, scores


def test_a_written_tensor_returned_is_the_written_values():
    """The respelled ``scores + bias`` is what the caller gets, as eager's written ``scores``."""
    torch.manual_seed(0)
    model, x = ReturnsScores("plain"), torch.randn(9, H)
    with torch.no_grad():
        ref = model(x)
        out = compile_moe(model, x)
    assert dict(counters["moe_inductor"]) == {"unrolled_loop": 1}, dict(counters["moe_inductor"])
    assert_close(out[0], ref[0], torch.float32, "output")
    assert torch.equal(out[1], ref[1])


def test_with_gradients_the_biased_scores_stay_in_place():
    """MiniMax-M2's ``scores.add_(bias)`` writes over the sigmoid's saved output: eager's backward raises. With
    gradients the write stays, so the region is left alone and the compiled backward raises too (read out of place,
    the MoE would be rewritten and the backward would run)."""
    torch.manual_seed(0)
    model, x = InPlaceMoE("scores_add_"), torch.randn(9, H)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert counters["moe_inductor_left_alone"] == {"unrolled_loop": 1}, dict(counters["moe_inductor_left_alone"])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
