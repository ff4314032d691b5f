"""vLLM's Gaudi (HPU) ``static_fused_moe`` (passes/dense_tables.py): every expert on every token, weighted by its
column of a ``scatter_``-made (T, E) table read through views, ``+=`` into a zeros buffer, the activation through
an out-parameter ``copy_``. Rewritten (and two other spellings of the same proof: ``add_`` into a (T, H) buffer,
the table's column as ``padded[:, e, None]``), equal to eager forward and backward at several T (1 token, experts
with no token, E not a power of 2); look-alikes left alone and equal to eager."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import moe_inductor
from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, K = 16, 12, 2


def _silu_and_mul(out, a):
    x, y = torch.split(a, a.shape[-1] // 2, dim=-1)
    out.copy_(F.silu(x) * y)


class GaudiMoE(nn.Module):
    """vLLM's ``static_fused_moe`` and variants of it (``style``): the look-alikes change one thing each."""

    def __init__(self, style="gaudi", E=6):
        super().__init__()
        self.style, self.E = style, E
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def _hidden(self, x, e):
        """Expert e's hidden state on x, and a term the output adds (0, read from the buffer in one look-alike)."""
        s, zero = self.style, x.new_zeros(())
        a = torch.matmul(x, self.w13[e].transpose(0, 1))
        if s == "plain_act":
            g, u = torch.split(a, I, dim=-1)
            return F.silu(g) * u, zero
        if s == "copy_into_view":  # the out-parameter is a view of a larger buffer
            buf = torch.empty(a.shape[0], 2 * I, dtype=a.dtype, device=a.device)
            out = buf[:, :I]
            _silu_and_mul(out, a)
            return out, zero
        out = torch.empty(a.shape[0], I, dtype=a.dtype, device=a.device)
        if s == "copy_read_before":  # read before the copy (its values times 0: eager's result does not depend on them)
            zero = (torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0) * 0).sum()
        _silu_and_mul(out, a)
        return out, zero

    def forward(self, hidden_states):
        s, E = self.style, self.E
        T = hidden_states.shape[0]
        probs = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float32)
        weights, ids = torch.topk(probs, K, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)
        if s == "ids_not_topk":  # the first choice twice: scatter_ keeps one write of two
            ids, weights = torch.cat([ids[:, :1], ids[:, :1]], 1), torch.cat([weights[:, :1], weights[:, :1]], 1)
        make = torch.ones if s == "ones_table" else torch.zeros
        if s == "bound_scatter":
            padded = torch.zeros((T, E), dtype=hidden_states.dtype).scatter_(-1, ids, weights)
        else:
            padded = make((T, E), dtype=hidden_states.dtype, device=hidden_states.device)
            padded.scatter_(-1, ids, weights)
        if s == "table_written_twice":
            padded[:, 0] += 0.5
        if s in ("add_", "column_index"):
            cols = None
        elif s == "bound_scatter":
            cols = padded.transpose(0, 1)
        elif s == "no_permute":
            cols = padded.unsqueeze(-1)  # row e, not column e (T = E in its test)
        elif s == "permute_rows":
            cols = padded.reshape(-1, T, E).permute(1, 0, 2).unsqueeze(-1)
        else:
            cols = padded.reshape(-1, T, E).permute(2, 0, 1).unsqueeze(-1)
        two_d = s in ("add_", "column_index", "bound_scatter")
        final = (torch.ones if s == "ones_buffer" else torch.zeros)(
            (T, H) if two_d else (1, T, H), dtype=hidden_states.dtype, device=hidden_states.device)
        extra = 0
        experts = list(range(E - 1)) if s == "skipped_expert" else list(range(E)) + [1] if s == "twice" else range(E)
        partial = None
        for e in experts:
            x = hidden_states.reshape(-1, H)
            h, zero = self._hidden(x, e)
            extra = extra + zero
            out = torch.matmul(h, self.w2[e].transpose(0, 1))
            if s == "output_scaled_in_place":  # the graph's ``out * cols[e]`` reads the matmul's node, now doubled
                out.mul_(2.0)
            if s == "add_":
                final.add_(out * padded[:, e, None])
            elif s == "column_index":
                final += out * padded[:, e, None]
            elif s == "bound_scatter":
                final += out * cols[e].unsqueeze(-1)
            else:
                final += out * cols[e]
            if s == "read_between" and e == 2:
                partial = final.clone()
            if s == "buffer_written_twice" and e == 3:
                final.mul_(0.5)
        y = final.view(-1, H)
        if partial is not None:
            y = y + 0.5 * partial.view(-1, H)
        return y + extra


@pytest.mark.parametrize("E", [6, 5], ids=["E6", "E5-prime"])
@pytest.mark.parametrize("T", [1, 2, 9, 16], ids=["T1", "T2-experts-without-tokens", "T9", "T16"])
def test_gaudi_loop_is_rewritten_and_equal(T, E):
    torch.manual_seed(0)
    model = GaudiMoE("gaudi", E)
    x = torch.randn(T, H)
    if T == 2:  # 2 tokens choose at most 4 of the E experts: some expert gets no token
        ids = torch.topk(model.gate(x).softmax(-1), K, dim=-1).indices
        assert ids.unique().numel() < E
    assert_rewritten_like_eager(model, x, "dense_experts", f"T={T} E={E}")
    assert not counters["moe_inductor_left_alone"], dict(counters["moe_inductor_left_alone"])


@pytest.mark.parametrize("style", ["add_", "column_index", "bound_scatter", "plain_act"])
def test_other_spellings_are_rewritten_and_equal(style):
    """``final.add_(t)`` into a (T, H) buffer read after the loop; the column as ``padded[:, e, None]``; the table
    bound to ``zeros(...).scatter_(...)``'s result and read through a transpose; a plain activation."""
    torch.manual_seed(0)
    model = GaudiMoE(style)
    for T in (3, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "dense_experts", f"{style} T={T}")
        assert not counters["moe_inductor_left_alone"], dict(counters["moe_inductor_left_alone"])


def test_training_steps_equal_eager():
    """Three SGD steps compiled (one compile, a recompile for another T at most) against eager: the same parameters
    after every step, each step through the op."""
    torch.manual_seed(0)
    model = GaudiMoE("gaudi", 6)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "aot_eager"})
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for T in (8, 8, 13):
        x = torch.randn(T, H)
        for m, o in ((compiled, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), torch.float32, f"T={T} {name}")
    assert counters["moe_inductor"]["dense_experts"] >= 1, dict(counters["moe_inductor"])
    assert not counters["moe_inductor_left_alone"], dict(counters["moe_inductor_left_alone"])


def test_explain_names_the_table_loop():
    torch.manual_seed(0)
    report = moe_inductor.explain(GaudiMoE("gaudi", 6), torch.randn(7, H))
    (rewrite,) = report.rewrites
    assert rewrite.form == "dense_experts" and rewrite.num_experts == 6 and rewrite.top_k == K
    assert "scatter_-made (T, E) table" in rewrite.note and "+= into a zeros buffer" in rewrite.note, rewrite.note
    assert not report.left_alone


LOOK_ALIKES = {
    "ones_table": "not zeros scattered",  # the table scattered into ones: every expert weighs 1 off the top-k
    "table_written_twice": "not zeros scattered",
    "buffer_written_twice": "written other than by +=",
    "ones_buffer": "does not start from zeros",
    "read_between": "read between its +=",
    "ids_not_topk": "not zeros scattered",
    "skipped_expert": "not each of range(6) once",
    "twice": "not each of range(6) once",
    "copy_read_before": "read before its copy_",
    "copy_into_view": "not a known activation",
    "output_scaled_in_place": "changed in place before the region reads it",
}


@pytest.mark.parametrize("style", list(LOOK_ALIKES))
def test_look_alikes_are_left_alone(style):
    torch.manual_seed(0)
    model = GaudiMoE(style)
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    reasons = [r for r in counters["moe_inductor_left_alone"]]
    assert reasons, "left alone without a word"
    assert_close(out, model(x), torch.float32, style)
    report = moe_inductor.explain(model, x)
    assert any(left.form == "dense_experts" and LOOK_ALIKES[style] in left.reason for left in report.left_alone), \
        report.left_alone


@pytest.mark.parametrize("style", ["no_permute", "permute_rows"])
def test_a_row_of_the_table_is_left_alone(style):
    """Without the permute, or with permute(1, 0, 2), ``[e]`` reads row e of the table (token e's weights), not
    expert e's column; T = E so that eager broadcasts it."""
    torch.manual_seed(0)
    model = GaudiMoE(style)
    x = torch.randn(6, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)
    report = moe_inductor.explain(model, x)
    assert any(left.form == "dense_experts" and "expert" in left.reason for left in report.left_alone), \
        report.left_alone
