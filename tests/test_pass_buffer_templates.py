"""The per-expert loop's zeros buffer used as a template too: ``link = out.new_zeros(())`` (a hand-written DDP
keep-alive that links idle experts' parameters into the graph when training) or ``torch.zeros_like(out)`` reads only
the buffer's shape, dtype and device, so the loop is still rewritten (``fx_utils.reads_metadata_only``), forward and
backward equal to eager. Look-alikes that read the buffer's values, or a template of the sum half-way through the
loop, are left alone, equal to eager; a training-mode module whose no-tokens side does more than skip falls back."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from tests.helpers import assert_close, assert_rewritten_like_eager, compile_moe

H, I, E, K = 16, 8, 5, 2


class TemplateLoopMoE(nn.Module):
    """MiniLLM's loop (``routed = routed.index_add(0, tok, c)`` behind ``if tok.numel() > 0:``, an ``elif
    self.training:`` keep-alive), with the buffer read in the ways ``style`` names."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)) for _ in range(E))

    def forward(self, x):
        if self.style.startswith("in_place"):
            return self._in_place(x)
        s = self.style
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        routed = torch.zeros_like(x)
        if s == "zeros_like":
            link = torch.zeros_like(routed)
        elif s == "value_read":  # reads the buffer's values (zeros here, but the proof does not know that)
            link = routed.new_zeros(()) + routed.sum()
        else:
            link = routed.new_zeros(())
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(ids == e)
            if tok.numel() > 0:
                c = expert(x.index_select(0, tok)) * weights[tok, pos].unsqueeze(-1)
                routed = routed.index_add(0, tok, c)
                if s == "half_way_template" and e == 0:  # a template of a link, not of the zeros
                    link = routed.new_ones(())
            elif self.training:
                link = link + sum((p.sum() * 0.0 for p in expert.parameters()), start=routed.new_zeros(()))
        return routed + link

    def _in_place(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        out = torch.zeros_like(x)
        link = out.new_zeros((1, H))
        if self.style == "in_place_value_read":
            link = link + out
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, pos, None])
        return out + link


@pytest.mark.parametrize("style", ["new_zeros", "zeros_like", "in_place"])
def test_a_template_of_the_buffer_is_rewritten(style):
    torch.manual_seed(0)
    model = TemplateLoopMoE(style).eval()
    for T in (5, 11):
        assert_rewritten_like_eager(model, torch.randn(T, H), "unrolled_loop", f"{style} T={T}")


@pytest.mark.parametrize("style", ["value_read", "half_way_template", "in_place_value_read"])
def test_a_read_of_the_buffers_values_is_left_alone(style):
    torch.manual_seed(0)
    model = TemplateLoopMoE(style).eval()
    x = torch.randn(9, H)
    out = compile_moe(model, x)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    assert_close(out, model(x), torch.float32, style)


def test_training_mode_keep_alive_falls_back_like_eager():
    """Training, an idle expert's side adds its parameters at zero: not a skip, so the frame falls back (equal to
    eager, forward and every parameter's gradient, the idle experts' zeros included)."""
    torch.manual_seed(0)
    model = TemplateLoopMoE("new_zeros").train()
    x = torch.randn(3, H)  # few tokens: some expert gets none
    xc = x.clone().requires_grad_(True)
    out = compile_moe(model, xc)
    assert not counters["moe_inductor"], dict(counters["moe_inductor"])
    out.sum().backward()
    got = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ref = model(x.clone().requires_grad_(True))
    ref.sum().backward()
    assert_close(out, ref, torch.float32, "forward")
    for g, p in zip(got, model.parameters()):
        assert (g is None) == (p.grad is None)
        if g is not None:
            assert_close(g, p.grad, torch.float32, "gradient")


def test_reads_metadata_only_takes_the_template_argument_only():
    """``out.new_full(shape, fill)`` reads ``out``'s metadata; ``x.new_full(shape, out)``-like uses of the buffer as
    a value argument, or ``torch.add``, do not count."""
    from moe_inductor.passes.fx_utils import reads_metadata_only

    graph = torch.fx.Graph()
    out, other = graph.placeholder("out"), graph.placeholder("other")
    template = graph.call_method("new_full", (out, (2,), 0.0))
    as_value = graph.call_method("new_zeros", (other, out))
    both = graph.call_function(torch.zeros_like, (out,), {"dtype": out})
    add = graph.call_function(torch.add, (out, other))
    assert reads_metadata_only(template, out)
    assert not reads_metadata_only(as_value, out)
    assert not reads_metadata_only(both, out)
    assert not reads_metadata_only(add, out)
