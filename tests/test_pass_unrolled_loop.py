"""The unrolled per-expert loop: matched in several styles, equal to eager (fwd and bwd), look-alikes left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_gpu_bf16_rewrite, assert_rewritten_like_eager, compile_moe

H, I = 16, 8


class LoopMoE(nn.Module):
    def __init__(self, style="where_matmul", E=3, k=2):
        super().__init__()
        self.style, self.E, self.k = style, E, k
        self.router = nn.Linear(H, E, bias=False)
        kn = style in ("nonzero_kn", "torch_nonzero_kn")
        self.w1 = nn.Parameter(torch.randn((E, H, I) if kn else (E, I, H)) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn((E, H, I) if kn else (E, I, H)) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn((E, I, H) if kn else (E, H, I)) * I ** -0.5)

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        if self.style == "setitem_repeated_ids":  # ids that repeat within a token: out[tok] += keeps one write
            ids = ids.clone()
            ids[:, -1] = ids[:, 0]
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)  # HF v4's (E, k, T) mask
        dev = ids.device
        arange = {"arange_from_one": lambda: torch.arange(1, self.E + 1, device=dev), "arange_step": lambda: torch.arange(
            0, 2 * self.E, 2, device=dev), "arange_flipped": lambda: torch.arange(self.E, device=dev).flip(0)}.get(
            self.style, lambda: torch.arange(self.E, device=dev))()
        # litgpt's (E, T, k) mask: a broadcast compare against arange(E), permuted (the look-alikes compare
        # against other aranges: expert e then reads the rows of another id)
        token_masks = (ids[..., None] if self.style == "litgpt_ellipsis" else ids.unsqueeze(-1)) == arange
        token_masks = (F.one_hot(ids, self.E) if self.style == "one_hot_token_first" else token_masks).permute(2, 0, 1)
        experts = range(self.E - 1) if self.style == "partial" else range(self.E)
        if self.style == "litgpt_iter":  # litgpt iterates over the mask tensor's rows: for mask, expert in zip(...)
            for e, mask in enumerate(token_masks):
                tok, pos = torch.where(mask)
                out[tok] += weights[tok, pos, None] * (F.silu(x[tok] @ self.w1[e].T) * (x[tok] @ self.w3[e].T)
                                                       ) @ self.w2[e].T
            return out
        for e in experts:
            if self.style in ("where_matmul", "partial", "extra_write"):
                tok, pos = torch.where(ids == e)
                xe = x[tok]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, pos, None])
            elif self.style == "linear_plain":  # F.linear, a plain activation, weight factor first
                tok, pos = torch.where(ids == e)
                h = F.gelu(F.linear(x[tok], self.w1[e]))
                out.index_add_(0, tok, weights[tok, pos, None] * F.linear(h, self.w2[e]))
            elif self.style in ("nonzero_kn", "torch_nonzero_kn"):  # nonzero(as_tuple=True), weights (E, in, out)
                if self.style == "torch_nonzero_kn":
                    tok, pos = torch.nonzero(ids == e, as_tuple=True)
                else:
                    tok, pos = (ids == e).nonzero(as_tuple=True)
                xe = x[tok]
                h = (xe @ self.w3[e]) * F.relu(xe @ self.w1[e])
                out.index_add_(0, tok, (h @ self.w2[e]) * weights[tok, pos, None])
            elif self.style == "hf_v4_mask":  # (choice, token) from the one-hot mask, x[None, tok].reshape
                idx, top_x = torch.where(expert_mask[e])
                xe = x[None, top_x].reshape(-1, H)
                h = F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e])
                out.index_add_(0, top_x, F.linear(h, self.w2[e]) * weights[top_x, idx, None])
            elif self.style in ("setitem_add", "setitem_repeated_ids"):  # out[tok] += ..., a plain activation
                tok, pos = torch.where(ids == e)
                out[tok] += (F.relu(x[tok] @ self.w1[e].T) @ self.w2[e].T) * weights[tok, pos, None]
            elif self.style == "up_shifted":  # only the up projection reads the next expert's weights
                tok, pos = torch.where(ids == e)
                h = F.silu(x[tok] @ self.w1[e].T) * (x[tok] @ self.w3[(e + 1) % self.E].T)
                out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, pos, None])
            elif self.style == "weight_on_input":  # the routing weight scales the expert's input (Llama4 style)
                tok, pos = torch.where(ids == e)
                xe = x[tok] * weights[tok, pos, None]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, h @ self.w2[e].T)
            elif self.style == "weight_between":  # ... or the hidden state before the down projection
                tok, pos = torch.where(ids == e)
                xe = x[tok]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, (weights[tok, pos, None] * h) @ self.w2[e].T)
            elif self.style == "rows_gathered_twice":  # x[tok] written out for each projection
                tok, pos = torch.where(ids == e)
                h = F.silu(F.linear(x[tok], self.w1[e])) * F.linear(x[tok], self.w3[e])
                out.index_add_(0, tok, F.linear(h, self.w2[e]) * weights[tok, pos, None])
            elif self.style == "up_reads_other_rows":  # the up projection reads x[pos] instead: not an MoE
                tok, pos = torch.where(ids == e)
                h = F.silu(F.linear(x[tok], self.w1[e])) * F.linear(x[pos], self.w3[e])
                out.index_add_(0, tok, F.linear(h, self.w2[e]) * weights[tok, pos, None])
            elif self.style == "weight_twice":  # input and output both scaled: w^2, not an MoE the op computes
                tok, pos = torch.where(ids == e)
                xe = x[tok] * weights[tok, pos, None]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, (h @ self.w2[e].T) * weights[tok, pos, None])
            elif self.style == "weight_on_up_only":  # scales only the up half: equal to "between", but not proven
                tok, pos = torch.where(ids == e)
                xe = x[tok]
                h = F.silu(xe @ self.w1[e].T) * ((xe @ self.w3[e].T) * weights[tok, pos, None])
                out.index_add_(0, tok, h @ self.w2[e].T)
            elif self.style == "unweighted":  # no routing weight anywhere
                tok, pos = torch.where(ids == e)
                xe = x[tok]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, h @ self.w2[e].T)
            elif self.style == "input_weight_of_first_choice":  # every row scaled by choice 0's weight, not its own
                tok, pos = torch.where(ids == e)
                xe = x[tok] * weights[tok, torch.zeros_like(pos), None]
                h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
                out.index_add_(0, tok, h @ self.w2[e].T)
            elif self.style in ("litgpt_masks", "litgpt_ellipsis", "one_hot_token_first", "arange_from_one",
                                "arange_step", "arange_flipped"):  # the (E, T, k) mask read at e
                tok, pos = torch.where(token_masks[e])
                h = F.silu(x[tok] @ self.w1[e].T) * (x[tok] @ self.w3[e].T)
                out[tok] += weights[tok, pos, None] * (h @ self.w2[e].T)
            elif self.style == "shifted_expert":  # expert e reads the weights of expert e+1: not an MoE we know
                tok, pos = torch.where(ids == e)
                nxt = (e + 1) % self.E
                h = F.silu(x[tok] @ self.w1[nxt].T) * (x[tok] @ self.w3[nxt].T)
                out.index_add_(0, tok, (h @ self.w2[nxt].T) * weights[tok, pos, None])
        if self.style == "extra_write":  # the accumulator is changed by something else too
            out.add_(1.0)
        return out


@pytest.mark.parametrize(
    "style", ["where_matmul", "linear_plain", "nonzero_kn", "torch_nonzero_kn", "hf_v4_mask", "setitem_add",
              "weight_on_input", "weight_between", "rows_gathered_twice", "litgpt_masks", "litgpt_ellipsis",
              "litgpt_iter", "one_hot_token_first"])
@pytest.mark.parametrize("E,k", [(3, 2), *(pytest.param(*Ek, marks=pytest.mark.slow) for Ek in ((5, 1), (4, 4)))],
                         ids=["E3-k2", "E5-k1", "k-eq-E"])  # the quick suite keeps E3-k2 for every style
def test_styles_are_rewritten_and_equal(style, E, k):
    torch.manual_seed(0)
    model = LoopMoE(style, E, k)
    for T in (3, 11):
        x = torch.randn(T, H)
        out, ref = compile_moe(model, x), model(x)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        assert counters["moe_inductor"]["unrolled_loop"] == 1
        assert sum(counters["graph_break"].values()) == 0


def test_no_nonzero_left_in_the_graph():
    captured = []

    def backend(gm, example_inputs):
        from moe_inductor.passes import unrolled_loop
        from moe_inductor.passes.fx_utils import canonicalize_operators

        canonicalize_operators(gm.graph)  # as the backend does first (torch 2.11 spells ids == e as __eq__)
        unrolled_loop.rewrite(gm)
        captured.append([n.target for n in gm.graph.nodes])
        return gm.forward

    from moe_inductor import capture

    setattr(backend, capture.BACKEND_MARKER, True)  # scoped capture on, as for the real backend
    torch._dynamo.reset()
    torch.compile(LoopMoE(), backend=backend)(torch.randn(6, H))
    (targets,) = captured
    assert torch.ops.moe_inductor.experts_forward.default in targets
    assert torch.where not in targets and "index_add_" not in targets
    assert not any("assert" in str(t) for t in targets)


@pytest.mark.parametrize("style", ["where_matmul", "setitem_add", "weight_on_input", "weight_between"])
def test_torch_2_11_dunder_spelling_is_rewritten(style):
    """Dynamo in torch 2.11 records ``ids == e`` as ``call_method __eq__`` (seen on the H200), 2.13 as
    ``operator.eq``; both must be rewritten. The graph is respelled the 2.11 way before the backend sees it."""
    import operator

    from moe_inductor import capture
    from moe_inductor.backend import moe_inductor_backend

    respelled = []

    def as_torch_2_11(gm, example_inputs):
        for node in list(gm.graph.nodes):  # on torch 2.11 most are spelled so already
            spelled = {operator.eq: "__eq__", operator.mul: "__mul__", operator.setitem: "__setitem__"}
            if node.op == "call_function" and node.target in spelled:
                node.op, node.target = "call_method", spelled[node.target]
        gm.recompile()
        respelled.extend(n.target for n in gm.graph.nodes if n.op == "call_method")
        return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})

    setattr(as_torch_2_11, capture.BACKEND_MARKER, True)
    torch.manual_seed(0)
    model, x = LoopMoE(style, 4, 2), torch.randn(9, H)
    torch._dynamo.reset()
    counters.clear()
    out, ref = torch.compile(model, backend=as_torch_2_11)(x), model(x)
    assert "__eq__" in respelled
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("style", ["where_matmul", "hf_v4_mask", "weight_on_input", "weight_between", "litgpt_iter"])
def test_gradients_match_eager(style):
    torch.manual_seed(0)
    model = LoopMoE(style, 4, 2)
    x = torch.randn(9, H, requires_grad=True)
    params = [x, model.router.weight, model.w1, model.w2, model.w3]
    out = compile_moe(model, x, inner="aot_eager")
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    grads = torch.autograd.grad(out.square().sum(), params)
    ref_grads = torch.autograd.grad(model(x).square().sum(), params)
    for g, r in zip(grads, ref_grads):
        assert ((g - r).norm() / r.norm()).item() < 1e-5


@pytest.mark.parametrize("style", ["partial", "shifted_expert", "up_shifted", "extra_write", "setitem_repeated_ids",
                                   "weight_twice", "weight_on_up_only", "unweighted", "input_weight_of_first_choice",
                                   "up_reads_other_rows"])
def test_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = LoopMoE(style, 4, 2)
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    assert counters["moe_inductor_left_alone"] == {"unrolled_loop": 1}  # and explain() says why (below)


@pytest.mark.parametrize("style,reason", [
    ("partial", "not each of range(E) once"),
    ("shifted_expert", "output is not a matmul or F.linear on w[0]"),
    ("up_shifted", "hidden state is not a known activation"),
    ("extra_write", "also changed by something other than the loop's writes"),
    ("setitem_repeated_ids", "ids not from topk"),
    ("weight_twice", "input is not x[tok]"),
    ("weight_on_up_only", "hidden state is not a known activation"),
    ("unweighted", "no routing weight"),
    ("input_weight_of_first_choice", "no routing weight"),
    ("up_reads_other_rows", "read different rows"),
])
def test_explain_says_why_a_loop_was_left_alone(style, reason):
    torch.manual_seed(0)
    report = moe_inductor.explain(LoopMoE(style, 4, 2), torch.randn(7, H))
    assert not report.rewrites
    (left,) = report.left_alone
    assert left.form == "unrolled_loop" and reason in left.reason, left
    assert "test_pass_unrolled_loop.py" in left.where  # the user's line, from Dynamo's stack trace
    assert "left alone: unrolled_loop" in report.summary() and reason in report.summary()


@pytest.mark.parametrize("style", ["arange_from_one", "arange_step", "arange_flipped"])
def test_masks_against_another_arange_are_left_alone(style):
    """litgpt's mask compared against an arange that is not 0..E-1 (from 1, in steps of 2, flipped): expert e's rows
    are another id's, so the loop is not the MoE of its weights. No body is read as an expert's, so the loop is
    reported as a region no form proves."""
    torch.manual_seed(0)
    model = LoopMoE(style, 4, 2)
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    report = moe_inductor.explain(model, x)
    assert not report.rewrites and [m.form for m in report.left_alone] == ["moe_region"]


def test_a_rewritten_loop_reports_nothing_left_alone():
    torch.manual_seed(0)
    report = moe_inductor.explain(LoopMoE("where_matmul", 4, 2), torch.randn(7, H))
    assert len(report.rewrites) == 1 and not report.left_alone and "left alone" not in str(report)


class HeadLoop(nn.Module):
    """Not an MoE, though it is a loop of where + index_add_ over stacked weights: each of 3 heads adds its MLP to the
    rows where its score is positive, so a token takes any number of heads (no top-k). "ids_not_topk" selects with
    ids == h for ids from a threshold: that one is an MoE after all (see the test)."""

    def __init__(self, style="threshold"):
        super().__init__()
        self.style = style
        self.q = nn.Parameter(torch.randn(H, 3))
        self.w1 = nn.Parameter(torch.randn(3, I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(3, H, I) * I ** -0.5)

    def forward(self, x):
        scores = x @ self.q
        out = torch.zeros_like(x)
        ids = (scores > 0).long() + (scores > 1).long()  # (T, 3) values in {0, 1, 2}, shaped like top-k ids
        for h in range(3):
            if self.style == "threshold":
                tok = torch.where(scores[:, h] > 0)[0]
                out.index_add_(0, tok, F.silu(x[tok] @ self.w1[h].T) @ self.w2[h].T)
            else:
                tok, pos = torch.where(ids == h)
                out.index_add_(0, tok, (F.silu(x[tok] @ self.w1[h].T) @ self.w2[h].T) * scores[tok, pos, None])
        return out


def test_a_loop_over_heads_is_left_alone():
    torch.manual_seed(0)
    model = HeadLoop("threshold")
    x = torch.randn(9, H)
    torch.testing.assert_close(compile_moe(model, x), model(x))
    assert not counters["moe_inductor"]


def test_index_add_loop_over_any_ids_is_an_moe():
    """With ``index_add_`` the ids need not come from a top-k, nor be distinct in a row: the loop still computes
    sum over (t, j) of score[t, j] * mlp_{ids[t, j]}(x_t), which is what the op computes. So it is rewritten."""
    torch.manual_seed(0)
    model = HeadLoop("ids_not_topk")
    x = torch.randn(9, H)
    ids = (x @ model.q > 0).long() + (x @ model.q > 1).long()
    assert any(len(set(row)) < 3 for row in ids.tolist())  # repeated ids within a row are exercised
    torch.testing.assert_close(compile_moe(model, x), model(x))
    assert counters["moe_inductor"]["unrolled_loop"] == 1


class Expert(nn.Module):
    def __init__(self, act=F.silu):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class RawExpert(nn.Module):
    """An expert written with raw (in, out) parameters: ``x @ w``."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(H, I) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(H, I) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(I, H) * I ** -0.5)

    def forward(self, x):
        return (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class ModuleListMoE(nn.Module):
    """Mixtral's reference code (HF v4): experts as a ModuleList of nn.Linear MLPs."""

    def __init__(self, style="hf_v4", E=4, k=2):
        super().__init__()
        self.style, self.E, self.k = style, E, k
        self.gate = nn.Linear(H, E, bias=False)
        if style in ("raw_in_out", "raw_in_out_input"):
            self.experts = nn.ModuleList(RawExpert() for _ in range(E))
        elif style == "mixed_layouts":  # half nn.Linear (out, in), half raw (in, out): not one stack
            self.experts = nn.ModuleList(Expert() if e % 2 else RawExpert() for e in range(E))
        else:
            self.experts = nn.ModuleList(Expert() for _ in range(E))
        if style == "shared_weight":  # two experts share one projection: not the per-expert form
            self.experts[1].w2 = self.experts[0].w2

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1, dtype=torch.float), self.k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)
        for e in range(self.E):
            idx, top_x = torch.where(mask[e])
            cur = x[None, top_x].reshape(-1, H)
            if self.style in ("weight_on_input", "raw_in_out_input"):  # the routing weight scales the expert's input
                y = self.experts[e](cur * weights[top_x, idx, None])
            else:
                y = self.experts[e](cur) * weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(x.dtype))
        return out


@pytest.mark.parametrize("style", ["hf_v4", "weight_on_input", "raw_in_out", "raw_in_out_input"])
@pytest.mark.parametrize("E,k", [(4, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_module_list_experts_are_rewritten_and_equal(E, k, style):
    torch.manual_seed(0)
    model = ModuleListMoE(style, E, k)
    for T in (4, 13):
        x = torch.randn(T, H)
        out, ref = compile_moe(model, x), model(x)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        assert counters["moe_inductor"]["unrolled_loop"] == 1


@pytest.mark.parametrize("style", ["hf_v4", "weight_on_input", "raw_in_out"])
def test_module_list_gradients_match_eager(style):
    torch.manual_seed(0)
    model = ModuleListMoE(style, 4, 2)
    x = torch.randn(10, H, requires_grad=True)
    params = [x] + list(model.parameters())
    out = compile_moe(model, x, inner="aot_eager")
    assert counters["moe_inductor"]["unrolled_loop"] == 1
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, params, dy), torch.autograd.grad(model(x), params, dy)):
        assert ((g - r).norm() / r.norm().clamp_min(1e-12)).item() < 1e-5


@pytest.mark.parametrize("style", ["shared_weight", "mixed_layouts"])
def test_module_lists_that_are_not_one_stack_are_left_alone(style):
    """A projection shared by two experts, or experts of two weight layouts: no one (E, ., .) stack to take."""
    torch.manual_seed(0)
    model = ModuleListMoE(style, 4, 2)
    x = torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]


class SwitchLoopMoE(nn.Module):
    """Switch-style loops: each expert's output written (not added) at its rows, the routing weight applied to the
    combined result; per-expert nn.Linear experts with biases."""

    def __init__(self, style="switch", E=4):
        super().__init__()
        self.style, self.E = style, E
        self.router = nn.Linear(H, E)
        self.fc1 = nn.ModuleList([nn.Linear(H, I) for _ in range(E)])
        self.fc2 = nn.ModuleList([nn.Linear(I, H) for _ in range(E)])

    def expert(self, e, xe):
        return self.fc2[e](F.relu(self.fc1[e](xe)))

    def forward(self, x):
        s = self.style
        probs = F.softmax(self.router(x), dim=-1)
        out = x.new_ones(x.shape) if s == "ones_buffer" else x.new_zeros(x.shape)
        if s in ("switch", "scaled_by_result", "read_unscaled", "unweighted", "hashed_ids", "torch_mul_scaled",
                 "ones_buffer", "skipped_expert", "written_after"):  # (T,) top-1 ids, out[tok, :] = ...
            p, ids = torch.max(probs, dim=-1)
            if s == "hashed_ids":  # ids of no router: -1 and E come up, rows no expert writes stay zero
                ids = (x.detach().sum(-1) * 3).floor().long() % (self.E + 2) - 1
            for e in range(1 if s == "skipped_expert" else 0, self.E):  # expert 0's rows left zero, or not
                tok = torch.eq(ids, e).nonzero(as_tuple=True)[0]
                out[tok, :] = self.expert(e, x[tok, :])
            if s == "written_after":  # a row of the result changed after the loop
                out[0] = 0.0
            if s == "scaled_by_result":  # the factor reads the result itself: the op's result, scaled by the user
                return out * out.norm(dim=-1, keepdim=True)
            if s == "read_unscaled":  # the unscaled result is read too: both reads get the op's result
                return out * p.view(-1, 1) + out
            if s in ("unweighted", "hashed_ids", "ones_buffer", "skipped_expert"):
                return out
            if s == "torch_mul_scaled":  # LLaMA-MoE's SwitchDropTokenCalculator: the user's product stays
                return torch.mul(out, p.reshape(-1, 1) * 1.0)
            return out * p.view(-1, 1)
        k = 1 if self.style == "keepdim_top1" else 2
        p, ids = torch.topk(probs, k, dim=-1)
        for e in range(self.E):
            tok, pos = torch.where(ids == e)
            if self.style == "top2_assigned":  # k = 2 written, not added: a token's second expert overwrites
                out[tok] = self.expert(e, x[tok]) * p[tok, pos, None]
            else:  # "keepdim_top1" (one choice: scaled after), "top2_scaled_after" (two choices, one factor)
                out.index_add_(0, tok, self.expert(e, x[tok]))
        return out * p[:, :1]


@pytest.mark.parametrize("style", ["switch", "keepdim_top1", "unweighted", "hashed_ids", "torch_mul_scaled",
                                   "scaled_by_result", "read_unscaled"])
def test_switch_style_loops_are_rewritten_and_equal(style):
    """One choice per token: rows written once each, so acc[tok] = ... is the accumulation, and a (T, 1) factor on
    the result is the routing weight; the biases are the experts' own. Without a factor the op scales by 1 and every
    reader of the result (a factor of any spelling, the result itself) reads the op's result: each row its one
    expert's output, or zero for an id outside range(E), which the op skips as the loop does."""
    torch.manual_seed(0)
    assert_rewritten_like_eager(SwitchLoopMoE(style), torch.randn(9, H), "unrolled_loop", style)
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("style,reason", [
    ("top2_assigned", "keeps only the last write"),
    ("top2_scaled_after", "no routing weight"),  # two choices per token: a factor after the loop is no weight of 1
    ("skipped_expert", "not one distinct weight per expert"),  # expert 0's rows stay zero: no op over 1..E-1 says it
    ("written_after", "a write to the accumulator is neither"),
])
def test_switch_style_look_alikes_are_left_alone(style, reason):
    torch.manual_seed(0)
    model, x = SwitchLoopMoE(style), torch.randn(9, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    (left,) = moe_inductor.explain(model, x).left_alone
    assert left.form == "unrolled_loop" and reason in left.reason, left


def test_switch_style_loop_into_ones_is_left_alone():
    """A top-1 loop writing into ones: a row of no expert keeps its 1, which the op does not give; the loop's proof
    needs zeros, so nothing is rewritten, and the output is eager's."""
    torch.manual_seed(0)
    model = SwitchLoopMoE("ones_buffer")
    x = torch.randn(9, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])


class FlatBlocksMoE(nn.Module):
    """DBRX's experts (each projection one flat (E*I, H) weight, expert e its rows [e*I, (e+1)*I), up used as
    (out, in), down as (in, out)), and the tokens that chose e at all (``(ids == e).any(-1)``), each row's weight
    ``(weights * (ids == e)).sum(-1)``."""

    def __init__(self, style, E=3, k=2):
        super().__init__()
        self.style, self.E, self.k = style, E, k
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E * I, H) * I ** -0.5)

    def forward(self, x):
        scores = F.softmax(self.router(x), dim=-1)
        weights, ids = torch.topk(scores, self.k, dim=-1)
        if self.style == "any_ids_not_topk":  # may choose an expert twice: its weights would be summed on one row
            ids = torch.argsort(scores, dim=-1)[:, -self.k:]
        out = torch.zeros_like(x)
        for e in range(self.E):
            if self.style == "blocks":
                tok, pos = torch.where(ids == e)
                w = weights[tok, pos, None]
            else:  # "any...": one row per token that chose e
                hit = ids == e
                tok = hit.any(dim=-1).nonzero().squeeze(-1)
                other = ids == (e + 1) % self.E if self.style == "any_weight_of_other_expert" else hit
                w = (weights * other).sum(dim=-1)[tok, None]
            rows = slice(e * I, (e + 1) * I)
            down = slice(((e + 1) % self.E) * I, ((e + 1) % self.E + 1) * I) if self.style == "shifted_block" else rows
            xe = x[tok] * w if self.style != "blocks" else x[tok]  # the weight on the input, or on the output
            h = F.silu(F.linear(xe, self.w1[rows])) * F.linear(xe, self.w3[rows])
            y = h @ self.w2[down]
            out.index_add_(0, tok, y * w if self.style == "blocks" else y)
        return out


@pytest.mark.parametrize("style", ["blocks", "any"])
def test_flat_blocks_and_any_selection_are_rewritten_and_equal(style):
    torch.manual_seed(0)
    assert_rewritten_like_eager(FlatBlocksMoE(style), torch.randn(7, H), "unrolled_loop", style)


@pytest.mark.parametrize("style,reason", [
    ("shifted_block", "does not read rows [e*n, (e+1)*n)"),  # expert e's down projection is expert e+1's
    ("any_weight_of_other_expert", "no routing weight"),  # rows of e, weights of e+1's choices
    ("any_ids_not_topk", "ids not from topk"),
])
def test_flat_block_and_any_look_alikes_are_left_alone(style, reason):
    torch.manual_seed(0)
    model, x = FlatBlocksMoE(style), torch.randn(7, H)
    assert torch.allclose(compile_moe(model, x), model(x), rtol=1e-6, atol=1e-6)
    assert not counters["moe_inductor"]
    (left,) = moe_inductor.explain(model, x).left_alone
    assert left.form == "unrolled_loop" and reason in left.reason, left


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: LoopMoE("where_matmul", 4, 2), lambda: LoopMoE("weight_on_input", 4, 2),
                                  lambda: LoopMoE("weight_between", 4, 2),
                                  lambda: ModuleListMoE("raw_in_out_input", 4, 2)],
                         ids=["where_matmul", "weight_on_input", "weight_between", "module_list_in_out_weight_on_input"])
def test_gpu_kernels_run_the_rewritten_loop_bf16(make):
    torch.manual_seed(0)
    assert_gpu_bf16_rewrite(make(), "unrolled_loop")


class ChunkedStackMoE(nn.Module):
    """DBRX's per-expert weights: flat (E*I, H) parameters viewed (E, I, H), ``chunk(E)``-ed and squeezed, each used
    as ``x.matmul(w.t())`` (a tensor method, not ``torch.matmul``)."""

    def __init__(self, shift=0, E=4, H=16, I=8, k=2, mixed=False):
        super().__init__()
        self.E, self.I, self.H, self.k, self.shift, self.mixed = E, I, H, k, shift, mixed
        self.router = nn.Linear(H, E, bias=False)
        self.w1, self.v1, self.w2 = (nn.Parameter(torch.randn(E * I, H) * H ** -0.5) for _ in range(3))

    def forward(self, x):
        E = self.E
        weights, ids = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        shape = (E, self.I, self.H)
        w1, v1 = ([w.squeeze(0) for w in p.view(shape).chunk(E, dim=0)] for p in (self.w1, self.v1))
        w2 = [w.squeeze(0) for w in self.w2.view((E, self.I, self.H) if self.mixed else (E, self.H, self.I)).chunk(
            E, dim=0)]  # mixed: DBRX's own down projection, h.matmul(w2[e]) in the (in, out) layout
        out = torch.zeros_like(x)
        for e in range(E):
            pos, tok = torch.where(mask[e])
            d = (e + self.shift) % E  # shift=1: expert e runs on expert e + 1's down weight
            h = F.silu(x[tok].matmul(w1[e].t())) * x[tok].matmul(v1[e].t())
            y = h.matmul(w2[d]) if self.mixed else h.matmul(w2[d].t())
            out.index_add_(0, tok, y * weights[tok, pos, None])
        return out


@pytest.mark.parametrize("mixed", [False, True], ids=["one-layout", "mixed-layouts"])
def test_chunked_views_of_a_stacked_weight_are_the_experts(mixed):
    """DBRX's chunked views, in one layout or with the down projection in the other one (the op gets (E, out, in)
    views of each)."""
    torch.manual_seed(0)
    assert_rewritten_like_eager(ChunkedStackMoE(mixed=mixed), torch.randn(11, 16), "unrolled_loop")


def test_a_chunk_of_another_expert_is_left_alone():
    torch.manual_seed(0)
    model = ChunkedStackMoE(shift=1)
    x = torch.randn(9, 16)
    assert torch.allclose(compile_moe(model, x), model(x), atol=1e-6)
    assert not counters["moe_inductor"]


def test_a_scatter_add_of_unrelated_data_dependent_sizes_is_not_an_accumulation_and_does_not_raise():
    """``acc.scatter_add_(0, tok[:, None].expand(-1, H), c)`` where the index's and the contribution's rows are two
    unrelated nonzero counts (Megatron's dispatcher traces such sizes): the sizes cannot be proven equal, so this is no
    accumulation of c's rows at tok, and reading it must not guard on the unbacked sizes (that raised before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moe_inductor.passes import unrolled_loop

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        u0, u1 = env.create_unbacked_symint(), env.create_unbacked_symint()
        vals = {"acc": torch.empty(6, H), "tok": torch.empty(u0, dtype=torch.long), "c": torch.empty(u1, H)}
        vals["col"] = vals["tok"][:, None]
        vals["index"] = vals["col"].expand(-1, H)
    g = torch.fx.Graph()
    acc, tok, c = (g.placeholder(name) for name in ("acc", "tok", "c"))
    col = g.call_method("unsqueeze", (tok, -1))
    index = g.call_method("expand", (col, -1, H))
    add = g.call_method("scatter_add_", (acc, 0, index, c))
    for node, name in ((acc, "acc"), (tok, "tok"), (c, "c"), (col, "col"), (index, "index")):
        node.meta["val"] = vals[name]
    assert unrolled_loop._accumulation(add, acc) is None
    vals_same = dict(vals)
    with FakeTensorMode(shape_env=env):
        vals_same["c"] = torch.empty(u0, H)  # the same count: c's rows are added at tok
    c.meta["val"] = vals_same["c"]
    assert unrolled_loop._accumulation(add, acc) == (tok, c, None)
