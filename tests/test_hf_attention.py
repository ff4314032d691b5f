"""GPT-OSS's attention with sinks as one SDPA call under moe_inductor compiles (moe_inductor/hf_attention.py).

The compiled model must give eager's logits and every parameter's gradient (the sinks' included), with the
causal, sliding-window and padding masks transformers builds, in prefill and in a cached decode step; calls the
identity does not cover (dropout in effect, a boolean mask, other backends) must keep the eager function.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_inductor
from moe_inductor import hf_attention
from moe_inductor.backend import moe_inductor_backend
from moe_inductor.passes.fx_utils import reach
from tests.hf_models import tiny

pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


@pytest.fixture(autouse=True)
def on_the_cpu_too(monkeypatch):
    """The SDPA form is on by default on the GPU only (where it was measured); these tests check it on the CPU."""
    monkeypatch.setattr(moe_inductor.config, "sink_attention_devices", ("cuda", "cpu"))


def test_the_cpu_keeps_the_eager_function_by_default(monkeypatch):
    monkeypatch.setattr(moe_inductor.config, "sink_attention_devices", ("cuda",))
    model = _model().eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(10))
    compiled, targets = _compiled(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)
    assert targets and _sdpa_calls(targets) == 0


def _model(dtype=torch.float32, window=None, dropout=0.0):
    model = tiny("gpt_oss").to(dtype)
    with torch.no_grad():  # HF starts the sinks at zeros, where a sink that is ignored would not show
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout
        if window is not None and layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = window
    if window is not None:
        model.config.sliding_window = window
    return model


def _compiled(model, ours=True):
    """The model compiled under moe_inductor (light inner compiler), or under a plain backend; and the call
    targets of every graph it was handed that an output depends on (the graph itself is left as it is: dead-code
    removal would drop in-place writes, such as a cache's, that no output reads)."""
    targets = []

    def record(gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        live = reach(output.all_input_nodes, lambda n: n.all_input_nodes)
        targets.extend(str(n.target) for n in live if n.op == "call_function")

    def wrapped(gm, example_inputs):
        record(gm)
        return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})

    def plain(gm, example_inputs):
        record(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=wrapped if ours else plain), targets


def _sdpa_calls(targets):
    return sum("scaled_dot_product_attention" in t for t in targets)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("window", [None, 5], ids=["window_wider_than_T", "window_5"])
def test_training_step_equals_eager_with_one_sdpa_call_per_layer(window):
    torch.manual_seed(0)
    model = _model(window=window).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    compiled, targets = _compiled(model)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert _sdpa_calls(targets) == len(model.model.layers)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    got = _grads(model)
    assert set(got) == set(expected)
    sinks = [n for n in expected if n.endswith("sinks")]
    assert sinks and all(expected[n].abs().max() > 0 for n in sinks)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_materialised_softmax_is_gone_from_the_graph():
    """Besides the SDPA calls, the compiled graph keeps no softmax over the (T, S + 1) scores: the routers' softmax
    over the experts is all that is left (one per layer), where the plain graph has one more per layer."""
    model = _model().eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        compiled, ours = _compiled(model)
        compiled(input_ids=ids)
        compiled, plain_targets = _compiled(model, ours=False)
        compiled(input_ids=ids)
    softmaxes = lambda targets: sum("softmax" in t for t in targets)  # noqa: E731
    layers = len(model.model.layers)
    assert softmaxes(plain_targets) - softmaxes(ours) == layers
    assert _sdpa_calls(ours) == layers and _sdpa_calls(plain_targets) == 0


def test_padding_mask_and_a_cached_decode_step_equal_eager():
    model = _model().eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, :4] = 0  # left padding: the padded row's first queries see only masked keys and the sink
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=pad, use_cache=True)
        nxt = ref.logits[:, -1:].argmax(-1)
        ref_step = model(input_ids=nxt, attention_mask=torch.cat([pad, torch.ones(2, 1, dtype=torch.long)], 1),
                         past_key_values=ref.past_key_values, use_cache=True)
        compiled, targets = _compiled(model)
        out = compiled(input_ids=ids, attention_mask=pad, use_cache=True)
        step = compiled(input_ids=nxt, attention_mask=torch.cat([pad, torch.ones(2, 1, dtype=torch.long)], 1),
                        past_key_values=out.past_key_values, use_cache=True)
    # the prefill's graph takes the SDPA form; the one-query step keeps the eager function (not measured there)
    assert _sdpa_calls(targets) == len(model.model.layers)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step.logits, ref_step.logits, rtol=1e-4, atol=1e-5)


def test_recorded_attentions_are_eagers():
    """With ``output_attentions=True`` the attention weights leave the graph: they are eager's formula, so the
    recorded attentions equal eager's as well as the logits."""
    model = _model().eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True)
        compiled, targets = _compiled(model)
        out = compiled(input_ids=ids, output_attentions=True)
    assert _sdpa_calls(targets) == len(model.model.layers)
    assert len(out.attentions) == len(ref.attentions) == len(model.model.layers)
    for got, expected in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)


def test_token_counts_share_one_dynamic_graph():
    """The SDPA form adds no guard beyond T >= 2: prefills of 5, 9 and 17 tokens after the first compile reuse one
    dynamic graph, and each equals eager."""
    from torch._dynamo.utils import counters

    model = _model().eval()
    compiled, targets = _compiled(model)
    counters.clear()
    with torch.no_grad():
        for T in (4, 5, 9, 17):
            ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(T))
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4,
                                       atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 2
    assert _sdpa_calls(targets) == len(model.model.layers) * counters["stats"]["unique_graphs"]


def test_bf16_logits_agree_with_eager():
    model = _model(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        compiled, targets = _compiled(model)
        got = compiled(input_ids=ids).logits.float()
    assert _sdpa_calls(targets) == len(model.model.layers)
    assert (got - ref).norm() / ref.norm() < 2e-2


def test_dropout_in_effect_keeps_the_eager_function():
    """With attention dropout in a training step the eager function drops probabilities, which the SDPA form (no
    dropout) would not: the call keeps its own code. In eval the same model takes the SDPA form."""
    model = _model(dropout=0.1).train()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    compiled, targets = _compiled(model)
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert _sdpa_calls(targets) == 0
    model.eval()
    compiled, targets = _compiled(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)
    assert _sdpa_calls(targets) == len(model.model.layers)


def test_a_tensor_scaling_keeps_the_eager_function(monkeypatch):
    """SDPA takes its scale as a Python number: a module whose ``scaling`` is a tensor keeps its own code."""
    model = _model().eval()
    for layer in model.model.layers:
        layer.self_attn.scaling = torch.tensor(layer.self_attn.scaling)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(11))
    from torch._dynamo.utils import counters

    compiled, targets = _compiled(model)
    counters.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)
    assert targets and _sdpa_calls(targets) == 0
    assert not counters["moe_inductor_fallback"], "the SDPA form was tried and failed, rather than refused"


def test_other_backends_keep_the_eager_function():
    model = _model().eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(6))
    compiled, targets = _compiled(model, ours=False)
    with torch.no_grad():
        compiled(input_ids=ids)
    assert targets and _sdpa_calls(targets) == 0


class _Attn(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.num_key_value_groups = heads // kv_heads


@pytest.mark.parametrize("case", ["bool_mask", "mask_narrower_than_keys", "sinks_per_kv_head", "value_dim_differs",
                                  "mixed_dtypes", "groups_mismatch", "mask_of_other_dtype",
                                  "one_query"])
def test_calls_the_identity_does_not_cover_are_refused(case):
    module = _Attn()
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.zeros(2, 1, 6, 6)
    assert hf_attention.applies(module, q, k, v, mask, 8 ** -0.5, 0.0)
    if case == "bool_mask":
        mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    elif case == "mask_narrower_than_keys":
        mask = torch.zeros(2, 1, 6, 5)
    elif case == "sinks_per_kv_head":
        module.sinks = torch.nn.Parameter(torch.randn(2))
    elif case == "value_dim_differs":
        v = torch.randn(2, 2, 6, 16)
    elif case == "mixed_dtypes":
        k = k.double()
    elif case == "groups_mismatch":
        module.num_key_value_groups = 3
    elif case == "mask_of_other_dtype":
        mask = mask.double()
    elif case == "one_query":
        q, mask = q[:, :, :1], mask[:, :, :1]
    assert not hf_attention.applies(module, q, k, v, mask, 8 ** -0.5, 0.0)


@pytest.mark.parametrize("T,S", [(1, 1), (1, 7), (5, 5), (3, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_sinks_sdpa_equals_the_eager_formula(T, S, masked):
    """The identity itself, forward and backward in float64, against transformers' formula written out, including
    a fully masked row (only the sink left to attend to)."""
    torch.manual_seed(T * 10 + S)
    module = _Attn().double()
    q = torch.randn(2, 4, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, 8, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.zeros(2, 1, T, S, dtype=torch.float64)
        mask[..., : S // 2] = torch.finfo(torch.float64).min
        mask[1, :, 0] = torch.finfo(torch.float64).min
    scaling = 8 ** -0.5
    probs = hf_attention._eager_weights(module, q, k, mask, scaling, torch.float64)
    ref = torch.matmul(probs, hf_attention._repeat_heads(v, 2)).transpose(1, 2)
    got = hf_attention.sinks_sdpa(module, q, k, v, mask, scaling)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v, module.sinks), g)
    actual = torch.autograd.grad(got, (q, k, v, module.sinks), g)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), kv_heads=st.integers(1, 3), groups=st.integers(1, 3), T=st.integers(1, 9),
       extra_keys=st.integers(0, 6), D=st.integers(1, 20), mask=st.sampled_from(["none", "full", "broadcast_T"]),
       masked_frac=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_sinks_sdpa_equals_the_eager_formula_at_random(B, kv_heads, groups, T, extra_keys, D, mask, masked_frac,
                                                       seed):
    """The identity at random shapes (head dims that are not multiples of 8, grouped heads, more keys than queries)
    and random masks, rows with every key masked included; float64, forward and backward."""
    gen = torch.Generator().manual_seed(seed)
    H, S = kv_heads * groups, T + extra_keys
    module = _Attn(H, kv_heads).double()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(H, generator=gen, dtype=torch.float64) * 3)
    q, k, v = (torch.randn(B, h, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, n in ((H, T), (kv_heads, S), (kv_heads, S)))
    attention_mask = None
    if mask != "none":
        rows = T if mask == "full" else 1
        hidden = torch.rand(B, 1, rows, S, generator=gen) < masked_frac
        attention_mask = torch.zeros(B, 1, rows, S, dtype=torch.float64).masked_fill(
            hidden, torch.finfo(torch.float64).min)
    scaling = D ** -0.5
    probs = hf_attention._eager_weights(module, q, k, attention_mask, scaling, torch.float64)
    ref = torch.matmul(probs, hf_attention._repeat_heads(v, groups)).transpose(1, 2)
    got = hf_attention.sinks_sdpa(module, q, k, v, attention_mask, scaling)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(ref, (q, k, v, module.sinks), g)
    actual = torch.autograd.grad(got, (q, k, v, module.sinks), g)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-10)


def test_explain_states_the_attention_rewrite():
    model = _model().eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    report = moe_inductor.explain(model, ids)
    assert hf_attention.NOTE in report.notes


def _rel(a, b):
    return ((a.float() - b.float()).norm() / (b.float().norm() + 1e-12)).item()


@pytest.mark.gpu
def test_gpu_bf16_prefill_and_training_step_no_further_from_eager_than_inductor():
    """In bf16 the fused attention rounds differently from eager's materialised softmax, as Inductor's fusion of
    it does: the logits and every gradient must be no further from eager's than Inductor's are (twice its error,
    or 2% of the norm where Inductor's is smaller). Gradients that nearly cancel (the key biases') are where the
    rounding shows most."""
    model = _model(torch.bfloat16).cuda()
    ids = torch.randint(0, 64, (2, 48), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    with torch.no_grad():
        ref = model.eval()(input_ids=ids).logits
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    expected = _grads(model)
    errors = {}
    for backend in ("inductor", "moe_inductor"):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            model.eval()
            errors[backend, "logits"] = _rel(compiled(input_ids=ids).logits, ref)
        model.train()
        compiled(input_ids=ids, labels=ids).loss.backward()
        for name, e in expected.items():
            errors[backend, name] = _rel(model.get_parameter(name).grad, e)
    worse = {name: (errors["moe_inductor", name], errors["inductor", name]) for (b, name) in errors
             if b == "inductor" and errors["moe_inductor", name] > max(2 * errors["inductor", name], 2e-2)}
    assert not worse, worse
