"""Problem builders and dtype-aware comparisons shared by the tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_inductor.ops import expert_weight_views, is_gated

# relative L2 error bounds that fit the dtype (never loosened to pass a test)
REL_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    assert not torch.isnan(a).any(), "NaN in result (an unwritten row?)"
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.2e} > {REL_TOL[dtype]:.0e}"


def assert_bf16_logits_match(out: torch.Tensor, ref_bf16: torch.Tensor, ref_fp32: torch.Tensor, what: str = "") -> None:
    """bf16 logits of a compiled model against eager's: within 2e-2 of eager's bf16 logits, or, when eager's own bf16
    run is already far from the same model in fp32 (a router near-tie that flips an expert choice in one of them), no
    further from the fp32 logits than twice eager's bf16 distance plus 2e-3. The second rule is torch._dynamo's
    accuracy check against a higher-precision reference; a wrong rewrite misses both by far."""
    err = rel_err(out, ref_bf16)
    if err <= REL_TOL[torch.bfloat16]:
        return
    ours, eagers = rel_err(out, ref_fp32), rel_err(ref_bf16, ref_fp32)
    assert ours <= 2 * eagers + 2e-3, (
        f"{what}: bf16 rel err {err:.3g} against eager bf16; against fp32: ours {ours:.3g}, eager bf16 {eagers:.3g}")


@dataclass
class Problem:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    b1: Optional[torch.Tensor]
    b2: Optional[torch.Tensor]
    activation: str
    layout: str
    gate_up: str

    def views(self):
        return expert_weight_views(self.w1, self.w2, self.b1, activation=self.activation, layout=self.layout,
                                   gate_up=self.gate_up)

    def leaves(self):
        return [t for t in (self.x, self.topk_weights, self.w1, self.w2, self.b1, self.b2) if t is not None]


def make_problem(
    T: int, H: int, I: int, E: int, k: int, *, dtype=torch.float32, device="cpu", activation="silu_glu",
    layout="nk", gate_up="concat", bias=False, routing="random", seed=0, requires_grad=True,
) -> Problem:
    """Random data (never zeros). routing: "random", "one_expert" (all tokens on expert 0), "skip_odd" (odd
    experts stay empty)."""
    gen = torch.Generator().manual_seed(seed)
    n1 = 2 * I if is_gated(activation) else I

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rnd(T, H)
    logits = torch.randn(T, E, generator=gen)
    if routing == "one_expert":
        ids = torch.stack([torch.arange(k) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        ids = ids % E
    elif routing == "skip_odd":
        logits[:, 1::2] = -1e9
        ids = logits.topk(k, dim=-1).indices
    else:
        ids = logits.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype)
    w1_shape = (E, n1, H) if layout == "nk" else (E, H, n1)
    w2_shape = (E, H, I) if layout == "nk" else (E, I, H)
    p = Problem(
        x=x, topk_ids=ids.to(device), topk_weights=weights.to(device),
        w1=rnd(*w1_shape, scale=H ** -0.5), w2=rnd(*w2_shape, scale=I ** -0.5),
        b1=rnd(E, n1, scale=0.1) if bias else None, b2=rnd(E, H, scale=0.1) if bias else None,
        activation=activation, layout=layout, gate_up=gate_up,
    )
    if requires_grad:
        for t in p.leaves():
            t.requires_grad_(True)
    return p


def compile_moe(model, *args, inner: str = "eager"):
    """Fresh Dynamo state and counters, then ``model`` compiled with moe_inductor (light inner compiler) on args."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="moe_inductor", options={"inner": inner})(*args)


def assert_rewritten_like_eager(model: torch.nn.Module, x: torch.Tensor, form: str, what: str = "") -> None:
    """``model`` compiled with moe_inductor (light inner compiler) on ``x``: one rewrite of ``form``, and the output and
    the gradients of ``x`` and of every parameter (for one random upstream gradient) equal to eager's, within the
    tolerance of ``x``'s dtype. The counters stay as this compile left them, for the caller's own checks."""
    from torch._dynamo.utils import counters

    xc = x.clone().requires_grad_(True)
    out = compile_moe(model, xc)
    assert counters["moe_inductor"][form] == 1, dict(counters["moe_inductor"])
    probe = torch.randn(out.shape, dtype=out.dtype, device=out.device)
    (out.float() * probe.float()).sum().backward()
    got = [xc.grad] + [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    xe = x.clone().requires_grad_(True)
    ref = model(xe)
    (ref.float() * probe.float()).sum().backward()
    want = [xe.grad] + [p.grad for p in model.parameters()]
    model.zero_grad()
    assert_close(out, ref, x.dtype, f"{what} forward")
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what}: gradient {i} present in one run only"
        if w is not None:
            assert_close(g, w, x.dtype, f"{what} gradient {i}")


def assert_gpu_bf16_rewrite(model: torch.nn.Module, form: str, width: int = 16) -> None:
    """``model`` in bf16 on the GPU, compiled once with moe_inductor (light inner compiler) and run at two token
    counts: within bf16's tolerance of eager, no graph break, and ``form`` rewritten at least once."""
    from torch._dynamo.utils import counters

    model = model.to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", options={"inner": "eager"})
    for T in (3, 40):
        x = torch.randn(T, width, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out, ref = compiled(x), model(x)
        assert_close(out, ref, torch.bfloat16, f"{form} T={T}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["moe_inductor"][form] >= 1, dict(counters["moe_inductor"])
