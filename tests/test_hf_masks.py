"""transformers' causal-mask skip under moe_inductor compiles (moe_inductor/hf_masks.py), and Dynamo's
``torch.compiler.is_exporting()`` answered as eager reads it (capture.py).

Older transformers refuse the skip whenever they see torch.compile, so the compiled prefill builds a (T, T) mask that
eager never builds and SDPA cannot take its flash kernel. The tests stand in such a transformers (the function
refusing under compile) and check that a moe_inductor compile passes SDPA no mask where eager passes none, keeps the
mask where eager keeps it (a padding mask), and gives eager's logits; and that nothing changes for other backends.
"""
import itertools

import pytest
import torch

import moe_inductor  # noqa: F401  (installs the hooks)
from moe_inductor import capture, hf_masks
from moe_inductor.backend import moe_inductor_backend
from tests.hf_models import tiny

masking_utils = pytest.importorskip("transformers.masking_utils")


def _refusing_under_compile(original):
    """The function as transformers releases before the fix define it: never skip while torch.compile traces."""

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if torch.compiler.is_compiling():
            return False
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    return _ignore_causal_mask_sdpa


@pytest.fixture
def old_transformers(monkeypatch):
    original = masking_utils._ignore_causal_mask_sdpa
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", _refusing_under_compile(original))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sdpa_masks(model, ours: bool, ids, attention_mask=None):
    """The attn_mask argument of every SDPA call in the graphs the backend is handed, and the logits: under
    moe_inductor (light inner compiler) when ``ours``, else under a plain backend that runs the graph as traced."""
    seen = []

    def record(gm):
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
                seen.append(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None))

    def plain(gm, example_inputs):
        record(gm)
        return gm.forward

    def wrapped(gm, example_inputs):
        record(gm)
        return moe_inductor_backend(gm, example_inputs, options={"inner": "eager"})

    compiled = torch.compile(model, backend=wrapped if ours else plain)
    with torch.no_grad():
        logits = compiled(input_ids=ids, attention_mask=attention_mask).logits
    return seen, logits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_compiled_prefill_passes_no_mask_where_eager_passes_none(old_transformers, family):
    model = tiny(family).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    plain, _ = _sdpa_masks(model, False, ids)
    torch._dynamo.reset()
    ours, logits = _sdpa_masks(model, True, ids)
    assert plain and all(m is not None for m in plain), "the stand-in must build the mask under other backends"
    assert ours and all(m is None for m in ours), ours
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_a_padding_mask_is_kept(old_transformers):
    """With a padding mask eager reads its values (a token may be padding): the mask stays, and the logits agree."""
    model = tiny("qwen3_moe").eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :3] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=pad).logits
    ours, logits = _sdpa_masks(model, True, ids, pad)
    assert ours and all(m is not None for m in ours)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_eager_skip_never_skips_where_eager_keeps_the_mask():
    """Every case the polyfill answers True, eager transformers answers True too (the original, run eagerly)."""
    original = masking_utils._ignore_causal_mask_sdpa
    for q, kv, offset, window in itertools.product((1, 3, 8), (1, 3, 8, 11), (0, 2), (None, 4, 16)):
        args = dict(padding_mask=None, q_length=q, kv_length=kv, q_offset=offset, kv_offset=0,
                    local_attention_size=window)
        if hf_masks.eager_skip(args):
            assert original(**args), args
    assert not hf_masks.eager_skip(dict(padding_mask=torch.ones(1, 4, dtype=torch.bool), q_length=4, kv_length=4,
                                        q_offset=0, kv_offset=0))
    assert not hf_masks.eager_skip(dict(padding_mask=None, q_length=1, kv_length=9, q_offset=torch.tensor(8),
                                        kv_offset=0))


def test_is_exporting_reads_false_while_we_trace_and_dynamos_table_is_restored():
    from torch._dynamo.variables.torch import tracing_state_functions

    table = tracing_state_functions()
    before = table.get(torch.compiler.is_exporting)
    with capture._compiling(capture._CompileState(ours=True)):
        inside = table.get(torch.compiler.is_exporting)
    with capture._compiling(capture._CompileState(ours=True, plain=True)):
        plain = table.get(torch.compiler.is_exporting)
    assert table.get(torch.compiler.is_exporting) is before
    assert plain is before
    if before is True:
        assert inside is False

    def f(x):
        return x + 1 if torch.compiler.is_exporting() else x - 1

    torch._dynamo.reset()
    x = torch.ones(3)
    got = torch.compile(f, backend="moe_inductor", options={"inner": "eager"})(x)
    torch.testing.assert_close(got, f(x))
