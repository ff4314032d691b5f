"""Bucketed inference: padded to a few static lengths, the logits of a causal LM stay those of eager, and the
compiles are bounded by the number of buckets."""
import pytest
import torch
from torch._dynamo.utils import counters

import moe_inductor
from tests.hf_models import tiny


@pytest.mark.slow
def test_bucketed_compiled_causal_lm_matches_eager_with_one_compile_per_bucket():
    model = tiny("qwen3_moe")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="moe_inductor", dynamic=False, options={"inner": "eager"})
    runner = moe_inductor.bucketed(compiled, buckets=(8, 16, 32))
    lengths = (3, 5, 8, 9, 13, 16, 17, 30)
    for T in lengths:
        ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            got, ref = runner(ids).logits, model(ids).logits
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3  # one static graph per bucket, whatever the lengths
    assert counters["moe_inductor"]["hf_grouped_mm"] == 2 * 3
    assert runner.bucket_for(33) == 33  # past the largest bucket: unpadded


def test_bucketed_keeps_a_user_attention_mask():
    model = tiny("mixtral")
    runner = moe_inductor.bucketed(model, buckets=(16,))
    ids = torch.randint(0, 64, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of the caller's own
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=1e-4, atol=1e-5)


def test_bucketed_refuses_models_where_padding_changes_results():
    with pytest.raises(ValueError, match="causal"):
        moe_inductor.bucketed(tiny("switch"))  # an encoder-decoder with capacity routing
    with pytest.raises(ValueError, match="buckets"):
        moe_inductor.bucketed(tiny("qwen3_moe"), buckets=(0,))
    runner = moe_inductor.bucketed(tiny("qwen3_moe"), buckets=(16,))
    with pytest.raises(ValueError, match="prefill"):
        runner(torch.zeros(1, 4, dtype=torch.long), past_key_values=object())
