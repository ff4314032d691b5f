"""Expert loops that index the expert's rows with Python lists (transformers v4.36-v4.39 Mixtral, Jamba, early
Qwen2-MoE): ``top_x.tolist()`` read only as an index of tensors is traced as ``top_x`` (moe_inductor/list_indices.py),
and the loop is rewritten as its tensor-indexing twin is.

Genuine, rewritten and equal to eager (forward and gradients): ``x[None, rows].reshape(-1, H)`` with
``w[rows, pos, None]``, ``x[rows]`` without the None, the loop without its empty-expert skip, the list made inside the
index (``x[top_x.tolist()]``). Look-alikes, each equal to eager and not rewritten, the frame compiled as plain capture
would with the reason said: the list read by ``len()``, iterated, added to (``+ [0]``), repeated (``* 1``), handed to
a Python function, kept on the module; the tensor changed in place after ``tolist``; an int32 tensor's list; lists
that are not the expert's own rows and choices (its rows reversed, against the order the output is added at; each
row's other choice's weight); a graph break while the lists are held; a look-alike wrapper that compiles elsewhere.
"""
import dis

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moe_inductor import report
from moe_inductor.list_indices import uses_refusal
from tests.corpus.harness import Case, check_rewritten, check_unchanged, run_case
from tests.helpers import rel_err

H, I, E, K = 16, 8, 6, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListRowsMoE(nn.Module):
    """Mixtral v4.36's routing; each subclass's loop reads the row lists its own way (one function each: what the
    list's reads are is read from the function's bytecode)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(E)])

    def route(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=1, dtype=torch.float), K, dim=-1)
        return x, weights.to(x.dtype), F.one_hot(ids, num_classes=E).permute(2, 1, 0), torch.zeros_like(x)

    def same(self, rows):
        return rows


class Mixtral(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            state = x[None, top_x_list].reshape(-1, H)
            y.index_add_(0, top_x, self.experts[i](state) * weights[top_x_list, idx_list, None])
        return y


class Plain(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            pos = idx.tolist()
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, pos, None])
        return y


class NoSkip(ListRowsMoE):
    """Without the empty-expert skip: an empty list and an empty tensor select the same nothing."""

    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            rows = top_x.tolist()
            y.index_add_(0, top_x, self.experts[i](x[None, rows].reshape(-1, H)) * weights[rows, idx.tolist(), None])
        return y


class Inline(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            y.index_add_(0, top_x, self.experts[i](x[top_x.tolist()]) * weights[top_x.tolist(), idx.tolist(), None])
        return y


class Len(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            state = x[rows] * (len(rows) / len(rows))
            y.index_add_(0, top_x, self.experts[i](state) * weights[rows, idx.tolist(), None])
        return y


class Loop(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            state = torch.stack([x[r] for r in rows])
            y.index_add_(0, top_x, self.experts[i](state) * weights[rows, idx.tolist(), None])
        return y


class PlusZero(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            state = x[rows + [0]][:-1]
            y.index_add_(0, top_x, self.experts[i](state) * weights[rows, idx.tolist(), None])
        return y


class Repeated(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            y.index_add_(0, top_x, self.experts[i](x[rows * 1]) * weights[rows, idx.tolist(), None])
        return y


class Function(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            y.index_add_(0, top_x, self.experts[i](x[self.same(rows)]) * weights[rows, idx.tolist(), None])
        return y


class Kept(ListRowsMoE):
    """The list kept on the module (no skip: a skipped body may not store attributes anyway)."""

    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            rows = top_x.tolist()
            self.rows = rows
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, idx.tolist(), None])
        return y


class Mutated(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            pos = idx.tolist()
            idx.zero_()  # the list holds the positions before
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, pos, None])
        return y


class Int32(ListRowsMoE):
    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.int().tolist()
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, idx.tolist(), None])
        return y


class Reversed(ListRowsMoE):
    """The expert's rows gathered in reverse, added back in order: another function than the MoE's."""

    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.flip(0).tolist()
            pos = idx.flip(0).tolist()
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, pos, None])
        return y


class OtherSlot(ListRowsMoE):
    """The expert's rows, with the weights of each row's other choice (a list that is not the expert's positions)."""

    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            if top_x.shape[0] == 0:
                continue
            rows = top_x.tolist()
            pos = (1 - idx).tolist()
            y.index_add_(0, top_x, self.experts[i](x[None, rows].reshape(-1, H)) * weights[rows, pos, None])
        return y


class BrokenHere(ListRowsMoE):
    """The loop without its skip, then a graph break while the last lists are still held."""

    def forward(self, x):
        x, weights, expert_mask, y = self.route(x)
        for i in range(E):
            idx, top_x = torch.where(expert_mask[i])
            rows = top_x.tolist()
            y.index_add_(0, top_x, self.experts[i](x[rows]) * weights[rows, idx.tolist(), None])
        torch._dynamo.graph_break()
        return y


MODULES = {"mixtral": Mixtral, "plain": Plain, "no_skip": NoSkip, "inline": Inline, "len": Len, "loop": Loop,
           "plus_zero": PlusZero, "repeated": Repeated, "function": Function, "kept": Kept, "mutated": Mutated,
           "int32": Int32, "reversed": Reversed, "other_slot": OtherSlot, "graph_break": BrokenHere}


def _case(how: str, expect: tuple) -> Case:
    # 3 tokens with 2 choices each leave some of the 6 experts empty, 9 tokens likely none
    return Case(f"list-rows-{how}", "tests/test_list_indices.py", MODULES[how],
                lambda T, g: torch.randn(T, H, generator=g), form="unrolled_loop", expect=expect, token_counts=(3, 9))


@pytest.mark.slow  # each case compiles a model
@pytest.mark.parametrize("how", ["mixtral", "plain", "no_skip", "inline"])
def test_row_lists_used_as_indices_are_rewritten(how):
    case = _case(how, ("rewritten",))
    outcome = run_case(case)
    assert outcome.declared() == ("rewritten",), (outcome.declared(), outcome.fallbacks, outcome.left_alone)
    check_rewritten(case, outcome)


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [
    ("len", "read other than as an index of a subscript"),
    ("loop", "read other than as an index of a subscript"),
    ("plus_zero", "read other than as an index of a subscript"),
    ("repeated", "read other than as an index of a subscript"),
    ("function", "read other than as an index of a subscript"),
    ("kept", "read other than as an index of a subscript"),
    ("mutated", "changed in place"),
    ("int32", "torch.int32"),
    ("reversed", "no rewrite took its body"),
    ("other_slot", "no rewrite took its body"),
    ("graph_break", "breaks its graph"),
])
def test_look_alikes_are_not_taken_and_equal_to_eager(how, said):
    case = _case(how, ("fell_back",))
    with report.collecting(report.Report()) as seen:
        outcome = run_case(case)
    assert outcome.fallbacks and outcome.kind != "crash", (outcome.declared(), outcome.rewrites, outcome.left_alone)
    check_unchanged(case, outcome)
    for got, ref in outcome.steps:
        assert got.grads.keys() == ref.grads.keys()
        for name in ref.grads:
            assert rel_err(got.grads[name], ref.grads[name]) < 1e-5, name
    assert any(said in f.reason for f in seen.fallbacks), [f.reason for f in seen.fallbacks]


def test_plain_dynamo_keeps_its_graph_break():
    """backend="eager" (plain Dynamo, as backend="inductor" traces): ``tolist`` stays a graph break."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixtral()
    x = torch.randn(3, H)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count >= 1
    assert torch.allclose(torch.compile(model, backend="eager")(x), model(x))


def test_a_wrapper_that_looks_like_ours_but_compiles_elsewhere_falls_back():
    """A function naming "moe_inductor" is taken for a wrapper of ours (capture.py); one that hands the graph to
    another compiler never checks where the lists went: the frame falls back, and runs as eager does."""

    def lookalike(gm, example_inputs):
        gm.meta["wanted"] = "moe_inductor"  # named, never called
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = NoSkip()
    x = torch.randn(3, H)
    assert torch.equal(torch.compile(model, backend=lookalike)(x), model(x))
    assert counters["moe_inductor_fallback"], "the frame must fall back"


def _refusal(fn) -> str | None:
    """``uses_refusal`` at fn's first ``.tolist()`` call, read from its bytecode."""
    instructions = list(dis.get_instructions(fn))
    loads = [i for i, ins in enumerate(instructions) if ins.argval == "tolist"]
    at = next(i for i in range(loads[0], len(instructions)) if instructions[i].opname.startswith("CALL"))
    return uses_refusal(fn.__code__, instructions, at)


def _taken(x, w, t, p):
    rows = t.tolist()
    pos = p.tolist()
    return x[None, rows], x[rows], w[rows, pos, None], x[:, rows], w[rows, 0:1], x[..., rows], w[None, rows, pos]


def _inline(x, t):
    return x[t.tolist()]


def _len(x, t):
    rows = t.tolist()
    return x[rows], len(rows)


def _returned(x, t):
    rows = t.tolist()
    return rows


def _aliased(x, t):
    rows = t.tolist()
    other = rows
    return x[other]


def _subscripted(x, t):
    rows = t.tolist()
    return x[rows[0]]


def _picked(x, t):
    rows = t.tolist()
    return x[(rows, 0)[0]]


def _nested(x, t):
    rows = t.tolist()
    return x[(rows, 0), 1]


def _closure(x, t):
    rows = t.tolist()
    return lambda: x[rows]


def _sliced(x, t):
    rows = t.tolist()
    return x[rows:]


@pytest.mark.parametrize("fn, why", [
    (_taken, None), (_inline, None),
    (_len, "read other than as an index"), (_returned, "RETURN"), (_aliased, "STORE_FAST"),
    (_subscripted, "subscripted itself"), (_picked, "subscripted itself"), (_nested, "tuple inside a tuple"),
    (_closure, "STORE_DEREF"),
    (_sliced, "bound of a slice"),
], ids=lambda v: v.__name__.lstrip("_") if callable(v) else "taken" if v is None else "refused")
def test_the_bytecode_proof_takes_only_index_reads(fn, why):
    got = _refusal(fn)
    assert (got is None) if why is None else (got is not None and why in got), got
