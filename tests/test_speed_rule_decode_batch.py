"""The speed rule keys decode by batch: a static step of 8 to 16 tokens ("decode_batch", bench_hf.py's B=16) is
judged by the entry's value measured there where it has one, else by "decode" (the worst over every batch); a
step of fewer tokens by "decode". rule_file.py files a B=16 row under both, a B=1 row under "decode" only."""
import json
from unittest import mock

import torch

from moe_inductor import speed_rule
from moe_inductor.speed_rule import DECODE_BATCH, DECODE_BATCH_MIN_TOKENS, DECODE_MAX_TOKENS, LayerKind

CUDA = torch.device("cuda")
QWEN3 = (2048, 768, 128, 8)
#: Qwen3's experts as a GPU might measure them: level at batch 1 (host-bound), well ahead at batch 16
ENTRY = {"name": "Qwen3-30B-A3B", "route": "hf", "activation": "silu_glu", "gate_up": "concat", "bias": False,
         "shape": list(QWEN3), "prefill": 1.14, "decode": 0.97, DECODE_BATCH: 1.55}


def _verdict(entry, tokens, tables=None, gpu="TEST_GPU"):
    kind = LayerKind("silu_glu", "concat", False, QWEN3)
    with mock.patch.object(speed_rule, "_tables", return_value=tables or {gpu: [entry]}), \
            mock.patch.object(speed_rule, "_gpu_tag", return_value=gpu):
        return speed_rule.verdict(kind, CUDA, speed_rule.mode_from(False, tokens), "inductor")


def test_mode_from_keys_decode_by_its_batch():
    assert (DECODE_BATCH_MIN_TOKENS, DECODE_MAX_TOKENS) == (8, 16)
    assert speed_rule.mode_from(False, 1) == "decode"
    assert speed_rule.mode_from(False, 7) == "decode"
    assert speed_rule.mode_from(False, 8) == DECODE_BATCH
    assert speed_rule.mode_from(False, 16) == DECODE_BATCH
    assert speed_rule.mode_from(False, 17) == "inference"
    assert speed_rule.mode_from(True, 16) == "train"  # training is keyed by its own sizes


def test_a_batched_decode_is_judged_by_its_own_value_and_batch_one_by_decode():
    said = _verdict(ENTRY, 16)
    assert said.startswith("speed rule:") and "1.55x" in said and "decode at a batch of 8-16 tokens" in said, said
    said = _verdict(ENTRY, 1)
    assert said.startswith(speed_rule.KEPT) and "0.97x" in said and "in decode on" in said, said


def test_an_entry_without_the_batched_value_judges_it_by_decode():
    """Files measured before decode was keyed by batch hold "decode" alone: it judges B=16 too, and explain()
    names the value it read."""
    entry = {k: v for k, v in ENTRY.items() if k != DECODE_BATCH}
    said = _verdict(entry, 16)
    assert said.startswith(speed_rule.KEPT) and "0.97x" in said and "in decode on" in said, said


def test_another_gpus_batched_value_asks_the_margin():
    """A GPU without its own decode values is judged by another's, with the margin: 1.55x passes it, 1.06 (the
    H200's Qwen3 "decode" today, with no batched value) does not."""
    own = {**ENTRY, "prefill": 1.2}
    own.pop("decode"), own.pop(DECODE_BATCH)
    other = dict(ENTRY)
    said = _verdict(None, 16, tables={"TEST_GPU": [own], "OTHER_GPU": [other]})
    assert said.startswith("speed rule:") and "OTHER_GPU" not in said, said  # this GPU's own values decide then
    other.pop(DECODE_BATCH)
    other["decode"] = 1.06
    said = _verdict(None, 16, tables={"TEST_GPU": [own], "OTHER_GPU": [other]})
    assert said.startswith(speed_rule.KEPT) and "1.06x" in said and "OTHER_GPU" in said, said


def test_filed_modes_file_a_batched_row_under_both():
    assert speed_rule.filed_modes("decode", 16, False) == ("decode", DECODE_BATCH)
    assert speed_rule.filed_modes("decode", 1, False) == ("decode",)
    assert speed_rule.filed_modes("prefill", 4096, False) == ("prefill",)


def test_rule_file_files_decode_by_batch(tmp_path):
    """rule_file.py on a run of decode B=1 and B=16 (tokens per second: higher is faster): "decode" is the worse of
    the two, "decode_batch" B=16's own."""
    from benchmarks import rule_file

    rows = [dict(family="qwen3_moe", layers=2, mode="decode", size=size, column=column, value=value,
                 unit="new tok/s")
            for size, kept, rewritten in ((1, 760.0, 740.0), (16, 4300.0, 6900.0))
            for column, value in (("moe_inductor_experts_kept", kept), ("moe_inductor_rule_off", rewritten))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"device": "TEST GPU"}, "rows": rows}))
    path = rule_file.main([str(run), "--out-dir", str(tmp_path), "--write"])
    (entry,) = json.loads(path.read_text())["layers"]
    assert (entry["decode"], entry[DECODE_BATCH]) == (0.97, 1.6), entry
