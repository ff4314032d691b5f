"""The speed rule keys training by token count: a static step of at least the long size training is measured at
(4096 tokens) is judged by the entry's value measured there ("train_long"), where it has one; a smaller or
symbolic step by the worst over every size; a smaller static step whose backward Inductor launches
("train_static") by its own value where the entry has one, else by that worst."""
import contextlib
from unittest import mock

import pytest
import torch

from moe_inductor import config, speed_rule
from moe_inductor.speed_rule import TRAIN_LONG, TRAIN_LONG_MIN_TOKENS, TRAIN_STATIC, LayerKind

CUDA = torch.device("cuda")
SHAPE = (2048, 1408, 64, 6)
#: a sort + grouped_mm layer as the H100 measured one: behind Inductor in a 16-token step, ahead at 4096 tokens
SORTED = {"name": "sort + grouped_mm, test-sized", "route": "fx_sorted", "activation": "silu_glu",
          "gate_up": "separate", "bias": False, "shape": list(SHAPE), "train": 0.73, TRAIN_LONG: 1.16,
          "prefill": 1.59, "decode": 1.62}


def _judged(entry, form="sorted_grouped_mm", shape=SHAPE, gpu="TEST_GPU", per_expert=False):
    """``backend._speed_rule`` of a layer, on a GPU whose file holds ``entry`` alone: tokens -> (kept, said)."""
    from moe_inductor.backend import _speed_rule
    from moe_inductor.passes.driver import Layer

    def judge(tokens, train=True):
        with mock.patch.object(speed_rule, "_tables", return_value={gpu: [entry]}), \
                mock.patch.object(speed_rule, "_gpu_tag", return_value=gpu):
            return _speed_rule("inductor", Layer(form, "silu_glu", "separate", False, shape, CUDA, train,
                                                 per_expert, tokens))
    return judge


@pytest.mark.parametrize("visible", [True, False])
def test_mode_from_keys_training_by_a_static_token_count(visible):
    """A shorter static step is "train_static" where its backward is Inductor's to launch, else "train"; a
    symbolic count is always "train" (its backward takes the opaque ops)."""
    short = TRAIN_STATIC if visible else "train"
    assert TRAIN_LONG_MIN_TOKENS == 4096  # the size bench_fx_forms.py and bench_list_train.py train at
    assert speed_rule.TRAIN_STATIC_MIN_TOKENS == 1024  # bench_hf.py's shorter training size
    assert speed_rule.mode_from(True, 4096, visible) == TRAIN_LONG
    assert speed_rule.mode_from(True, 16384, visible) == TRAIN_LONG
    assert speed_rule.mode_from(True, 4095, visible) == short
    assert speed_rule.mode_from(True, 1024, visible) == short
    assert speed_rule.mode_from(True, 1023, visible) == "train"  # never measured with the visible backward
    assert speed_rule.mode_from(True, 16, visible) == "train"
    assert speed_rule.mode_from(True, None, visible) == "train"  # symbolic: never read, the worst over every size


#: (H, I, E, k) of Qwen3-30B-A3B's, OLMoE's and GPT-OSS-20B's experts
QWEN3, OLMOE, GPTOSS = (2048, 768, 128, 8), (2048, 1024, 64, 8), (2880, 2880, 32, 4)


def test_the_visible_backward_is_read_from_the_layers_shapes_as_the_compile_decides(monkeypatch):
    """``backward_visible`` asks the functions the compile asks: a static step of under 128 rows per expert
    (the engine's backward rule in bf16) runs the visible backward, one of more the opaque ops; so does any step
    of experts the engine may take in the forward (Mixtral's), or with biases at 128 rows per expert (GPT-OSS), where
    the engine's backward is not traced (``config.visible_engine_backward``, the end of the test)."""
    monkeypatch.setattr(config, "visible_engine_backward", False)
    assert speed_rule.backward_visible(1024, QWEN3, False)  # 64 rows per expert
    assert not speed_rule.backward_visible(2048, QWEN3, False)  # 128: the engine may take the backward
    assert speed_rule.backward_visible(2048, QWEN3, False, torch.float16)  # the engine is bf16 only
    assert not speed_rule.backward_visible(1024, OLMOE, False)  # 128
    assert speed_rule.backward_visible(1023, OLMOE, False)
    assert not speed_rule.backward_visible(1024, GPTOSS, True)  # 128, biased, 2880 x 2880
    assert speed_rule.backward_visible(1024, GPTOSS, False, torch.bfloat16) is False  # unbiased: 128 rows too
    assert not speed_rule.backward_visible(64, (4096, 14336, 8, 2), False)  # Mixtral: the engine's forward
    assert not speed_rule.backward_visible(None, QWEN3, False)  # symbolic
    assert not speed_rule.backward_visible(1024, (), False)  # no shape said
    monkeypatch.setattr(config, "gemm_engine_backward", "triton")  # no engine in the backward
    assert speed_rule.backward_visible(2048, QWEN3, False) and speed_rule.backward_visible(1024, GPTOSS, True)
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    w = torch.zeros(2, 2, requires_grad=True)
    assert speed_rule.mode_of(torch.zeros(1024, 2048), (w,), QWEN3, False) == "train"  # CPU: no kernel of ours
    monkeypatch.setattr(config, "triton_on_cpu", True)  # our kernels on CPU tensors too (the interpreter's)

    def x(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype)

    assert speed_rule.mode_of(x(1024, 2048), (w,), QWEN3, False) == TRAIN_STATIC
    assert speed_rule.mode_of(x(2, 1024, 2048), (w,), QWEN3, False) == "train"  # 2048 tokens: the engine's
    assert speed_rule.mode_of(x(2, 1024, 2048, dtype=torch.float32), (w,), QWEN3, False) == TRAIN_STATIC
    assert speed_rule.mode_of(x(2, 2048, 2048), (w,), QWEN3, False) == TRAIN_LONG
    assert speed_rule.mode_of(x(2, 512, 2048), (w,), OLMOE, False) == "train"
    assert speed_rule.mode_of(x(1024, 2048), (w,)) == "train"  # no shape: not known to be visible
    with torch.no_grad():
        assert speed_rule.mode_of(x(4096, 2048), (w,), QWEN3, False) == "prefill"
    # the engine's backward traced: its static steps are visible too, but where the engine takes the forward
    monkeypatch.setattr(config, "visible_engine_backward", True)
    assert speed_rule.backward_visible(2048, QWEN3, False) and speed_rule.backward_visible(1024, OLMOE, False)
    assert speed_rule.backward_visible(1024, GPTOSS, True)
    assert not speed_rule.backward_visible(64, (4096, 14336, 8, 2), False)  # Mixtral: the forward is the engine's
    assert speed_rule.mode_of(x(2, 1024, 2048), (w,), QWEN3, False) == TRAIN_STATIC


def test_settings_without_the_visible_backward_keep_a_short_step_train(monkeypatch):
    assert speed_rule.backward_visible(1024, QWEN3, False)
    monkeypatch.setattr(config, "gemm_tma_descriptors", "host")  # only the opaque backward takes those
    assert not speed_rule.backward_visible(1024, QWEN3, False)
    monkeypatch.setattr(config, "gemm_tma_descriptors", "device")
    monkeypatch.setattr(config, "visible_kernels", False)  # no visible forward, no visible backward
    assert not speed_rule.backward_visible(1024, QWEN3, False)
    monkeypatch.setattr(config, "visible_kernels", True)
    monkeypatch.setattr(config, "visible_backward", False)
    assert not speed_rule.backward_visible(1024, QWEN3, False)
    assert speed_rule.backward_traced(1024, QWEN3, False)  # the filers' question: the settings aside


def test_a_long_training_step_is_judged_by_its_own_value():
    """Rewritten at 4096 tokens (1.16x there), kept at 16 and where the count is symbolic (0.73x, the worst)."""
    judge = _judged(SORTED)
    kept, said = judge(4096)
    assert not kept and "1.16x" in said and "training at 4096+ tokens" in said, said
    kept, said = judge(16)
    assert kept and "0.73x" in said and "in train on" in said, said
    kept, said = judge(None)
    assert kept and "0.73x" in said, said
    assert not judge(4096, train=False)[0]  # inference is untouched: prefill 1.59x


def test_an_entry_without_a_long_value_judges_every_training_step_by_its_worst():
    """Files measured before training was keyed by size hold "train" alone: it still judges long steps, and
    explain() names the value it read ("train"), not a long step's."""
    entry = {k: v for k, v in SORTED.items() if k != TRAIN_LONG}
    kept, said = _judged(entry)(4096)
    assert kept and "0.73x" in said and "in train on" in said and "4096+" not in said, said
    entry["train"] = 1.3
    kept, said = _judged(entry)(4096)
    assert not kept and "1.30x" in said and "in train on" in said, said
    entry[TRAIN_LONG] = 0.95  # measured slower at the long sizes too: kept there as well
    kept, said = _judged(entry)(4096)
    assert kept and "0.95x" in said and "training at 4096+ tokens" in said, said


def test_a_static_step_with_the_visible_backward_is_judged_by_its_own_value(monkeypatch):
    """An entry measured faster with the visible backward at 1024 tokens (1.02x) and slower through the opaque ops
    (0.71x): a static 1024-token step (96 rows per expert) is rewritten; a 2048-token one (192 rows per expert,
    which the engine may take in the opaque ops), a shorter one, a symbolic one, and any step with the visible
    backward off take "train" and stay Inductor's; so does the list op, which has no visible backward. With the
    engine's backward traced, the 2048-token step is visible too, and rewritten."""
    monkeypatch.setattr(config, "visible_engine_backward", False)
    entry = {**SORTED, "train": 0.71, TRAIN_STATIC: 1.02}
    judge = _judged(entry)
    kept, said = judge(1024)
    assert not kept and "1.02x" in said and "training at a static 1024-4095 tokens" in said, said
    for tokens in (2048, 4095, 1023, 16, None):
        kept, said = judge(tokens)
        assert kept and "0.71x" in said and "in train on" in said, (tokens, said)
    monkeypatch.setattr(config, "gemm_engine_backward", "triton")  # no engine: 2048 tokens' backward is visible
    assert not judge(2048)[0]
    monkeypatch.setattr(config, "gemm_engine_backward", None)
    monkeypatch.setattr(config, "visible_engine_backward", True)  # the engine's, traced: visible
    assert not judge(2048)[0] and judge(1023)[0]
    monkeypatch.setattr(config, "visible_engine_backward", False)
    monkeypatch.setattr(config, "visible_backward", False)
    assert judge(1024)[0]
    monkeypatch.setattr(config, "visible_backward", True)
    without = {k: v for k, v in entry.items() if k != TRAIN_STATIC}  # a file measured before the visible backward
    kept, said = _judged(without)(1024)
    assert kept and "0.71x" in said and "in train on" in said, said
    kept, said = _judged({**entry, TRAIN_STATIC: 0.91})(1024)  # measured slower with it too: kept
    assert kept and "0.91x" in said, said
    listed = {**entry, "route": "fx_list"}
    kept, said = _judged(listed, form="stacked_loop", per_expert=True)(1024)
    assert kept and "0.71x" in said, said


@pytest.mark.parametrize("visible", [False, True])
def test_filed_modes_never_file_a_visible_runs_training_value_as_train(visible):
    """"train" judges a symbolic count, which takes the opaque ops: a run with the visible backward files its
    training rows as "train_static" (1024 to 4095 tokens) and "train_long" only."""
    filed = {tokens: speed_rule.filed_modes("train", tokens, visible) for tokens in (16, 1023, 1024, 4095, 4096)}
    if visible:
        assert filed == {16: (), 1023: (), 1024: (TRAIN_STATIC,), 4095: (TRAIN_STATIC,), 4096: (TRAIN_LONG,)}
    else:
        assert filed == {16: ("train",), 1023: ("train",), 1024: ("train",), 4095: ("train",),
                         4096: ("train", TRAIN_LONG)}
    for tokens, modes in ((1, ("decode",)), (16, ("decode", speed_rule.DECODE_BATCH)), (17, ()), (512, ("prefill",)),
                          (4096, ("prefill",))):
        assert speed_rule.filed_modes("prefill", tokens, visible) == modes


def _entry(path, kind: dict) -> dict:
    """The layer entry of ``kind`` in the rule file at ``path``."""
    import json

    return next(e for e in json.loads(path.read_text())["layers"] if e["name"] == kind["name"])


def test_rule_file_files_a_visible_runs_training_rows_apart(tmp_path):
    """rule_file.py on two bench_hf runs at 1024 tokens, one per backward: the opaque run's value becomes "train",
    the visible run's (its meta says so) "train_static" where the family's 1024-token backward is the visible one
    (Qwen3-MoE, 64 rows per expert), and "train" where it is not (GPT-OSS: 128 rows per expert, the engine's, in
    the opaque ops, whatever the run's settings); an existing "train_long" stays."""
    import json

    from benchmarks import rule_file

    def run(visible, kept, rewritten, family, name, engine=False):
        rows = [dict(family=family, layers=2, mode="train", size=1024, column=column, value=value, unit="ms")
                for column, value in (("moe_inductor_experts_kept", kept), ("moe_inductor_rule_off", rewritten))]
        meta = {"device": "TEST GPU", **({"visible_backward": True} if visible else {}),
                **({"visible_engine_backward": True} if engine else {})}
        path = tmp_path / f"run_{name}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}))
        return str(path)

    setting = config.visible_engine_backward
    kind = rule_file.layer_kind("qwen3_moe")
    (tmp_path / "TEST_GPU.json").write_text(json.dumps({"layers": [{**kind, TRAIN_LONG: 1.01}]}))
    path = rule_file.main([run(False, 9.12, 12.77, "qwen3_moe", "a"), run(True, 9.13, 8.91, "qwen3_moe", "b"),
                           "--out-dir", str(tmp_path), "--write"])
    (entry,) = json.loads(path.read_text())["layers"]
    assert (entry["train"], entry[TRAIN_STATIC], entry[TRAIN_LONG]) == (0.71, 1.02, 1.01), entry
    path = rule_file.main([run(True, 9.13, 8.91, "gpt_oss", "c"), "--out-dir", str(tmp_path), "--write"])
    gptoss = _entry(path, rule_file.layer_kind("gpt_oss"))
    assert gptoss["train"] == 1.02 and TRAIN_STATIC not in gptoss, gptoss
    # a run that traced the engine's backward (config.visible_engine_backward, in its meta) files GPT-OSS's
    # 1024-token step apart, whatever this process's setting
    path = rule_file.main([run(True, 9.03, 8.12, "gpt_oss", "d", engine=True), "--out-dir", str(tmp_path),
                           "--write"])
    gptoss = _entry(path, rule_file.layer_kind("gpt_oss"))
    assert gptoss["train"] == 1.02 and gptoss[TRAIN_STATIC] == 1.11, gptoss
    assert config.visible_engine_backward is setting  # the run's setting was read, this process's kept


def test_the_engines_traced_backward_counts_as_visible_under_its_setting(monkeypatch):
    """GPT-OSS's 1024-token step (128 rows per expert: the engine's backward) is "train" with the engine's
    backward opaque and "train_static" where ``config.visible_engine_backward`` traces it."""
    gptoss = (2880, 2880, 32, 4)
    monkeypatch.setattr(config, "visible_engine_backward", False)
    assert not speed_rule.backward_traced(1024, gptoss, True)
    assert not speed_rule.backward_visible(1024, gptoss, True)
    monkeypatch.setattr(config, "visible_engine_backward", True)
    assert speed_rule.backward_traced(1024, gptoss, True)
    assert speed_rule.backward_visible(1024, gptoss, True)
    monkeypatch.setattr(config, "gemm_tma_descriptors", "host")  # a traced launch cannot take those
    assert not speed_rule.backward_traced(1024, gptoss, True)
    monkeypatch.setattr(config, "gemm_tma_descriptors", "device")
    assert speed_rule.mode_from(True, 1024, speed_rule.backward_visible(1024, gptoss, True)) == TRAIN_STATIC


def test_another_gpus_long_value_asks_the_margin():
    """A GPU with no file judges a long step by the other GPUs' long values, with ``UNMEASURED_GPU_MARGIN``: 1.16x
    clears it; 1.05x does on the GPU that measured it, not on another."""
    from moe_inductor.backend import _speed_rule
    from moe_inductor.passes.driver import Layer

    layer = Layer("sorted_grouped_mm", "silu_glu", "separate", False, SHAPE, CUDA, True, False, 4096)
    for value, kept_elsewhere in ((1.16, False), (1.05, True)):
        entry = {**SORTED, TRAIN_LONG: value}
        with mock.patch.object(speed_rule, "_tables", return_value={"TEST_GPU": [entry]}), \
                mock.patch.object(speed_rule, "_gpu_tag", return_value="OTHER_GPU"):
            kept, said = _speed_rule("inductor", layer)
        assert kept == kept_elsewhere and f"{value:.2f}x" in said, said
        if kept:
            assert "no measurements for OTHER_GPU" in said, said
        assert not _judged(entry)(4096)[0]


def test_the_cpu_judges_a_long_training_step_by_its_one_training_value():
    """bench_cpu.py measured the CPU's training step at one size: a bf16 step of any size stays Inductor's."""
    bf16 = LayerKind("silu_glu", "concat", False, (64, 32, 8, 2), torch.bfloat16)
    said = speed_rule.keeps_inductor(bf16, torch.device("cpu"), TRAIN_LONG, "inductor")
    assert said is not None and "bfloat16 train step" in said, said


def test_bench_fx_forms_files_the_long_training_value():
    """The benchmark's RULE entries: "train" the worst over every size, "train_long" over the sizes from 4096."""
    from benchmarks.bench_fx_forms import rule_entries

    def pair(T, ours, theirs):
        return [dict(form="sorted", mode="train", T=T, column="inductor", ms=theirs, rewrites=0),
                dict(form="sorted", mode="train", T=T, column="moe_inductor", ms=ours, rewrites=1)]

    (entry,) = rule_entries(pair(4096, 10.0, 11.6) + pair(16, 1.0, 0.73) + pair(512, 2.0, 1.8), list(SHAPE))
    assert entry["train"] == 0.73 and entry[TRAIN_LONG] == 1.16  # (512 tokens: 0.9x, below the long size)
    (entry,) = rule_entries(pair(4096, 10.0, 9.99), list(SHAPE))
    assert entry[TRAIN_LONG] == 0.99  # rounded down: 0.999x is a loss, not a tie
    (entry,) = rule_entries(pair(16, 1.0, 0.73), list(SHAPE))
    assert entry["train"] == 0.73 and TRAIN_LONG not in entry  # no long step measured: no long value


def test_hf_experts_in_a_long_static_training_step_are_judged_long():
    """The HF route hands the rule the step's size too: 4096 static tokens "train_long"; 1024 "train", since this
    compile's backward is not the visible one (the eager inner compiler, and CPU tensors, swap in no visible op);
    8 and dynamic shapes "train"."""
    from helpers import hf_modes_judged

    assert hf_modes_judged(True, ((4096, False), (1024, False), (8, False), (4096, True))) == [
        {TRAIN_LONG}, {"train"}, {"train"}, {"train"}]


def test_rule_file_takes_the_worst_of_two_runs_and_the_long_value_from_old_rows(tmp_path):
    """rule_file.py --fx-logs over the H100's two runs of sort + grouped_mm at DeepSeek-V2-Lite's widths: each mode
    its worse run (the 16-token step 0.73x then 0.54x), and "train_long" made from the rows of the first log, which
    was written before the mode was filed (1.1599x, rounded down to 1.15; the second's RULE line says 1.15)."""
    import json
    from pathlib import Path

    from benchmarks import rule_file

    data = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
    old, new = (data / f"bench_fx_forms_h100_2026-12-06_{s}_dsv2lite.log" for s in ("thirtysixth", "thirtyseventh"))
    assert TRAIN_LONG not in old.read_text() and TRAIN_LONG in new.read_text()
    (_, first), (_, second) = rule_file.fx_log_entries(old.read_text()), rule_file.fx_log_entries(new.read_text())
    by_route = {e["route"]: e for e in first}
    assert by_route["fx_sorted"]["train"] == 0.73 and by_route["fx_sorted"][TRAIN_LONG] == 1.15
    assert next(e for e in second if e["route"] == "fx_sorted")[TRAIN_LONG] == 1.15
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"layers": []}))
    for logs in ((old, new), (new, old)):  # the order of the logs does not matter
        path = rule_file.main(["--fx-logs", *map(str, logs), "--out-dir", str(tmp_path), "--write"])
        entry = next(e for e in json.loads(path.read_text())["layers"] if e["route"] == "fx_sorted")
        assert (entry["train"], entry[TRAIN_LONG], entry["prefill"], entry["decode"]) == (0.54, 1.15, 1.59, 1.62)


def test_rule_file_rounds_the_hf_routes_values_down():
    """bench_hf.py's values are rounded down as bench_fx_forms.py's are: 0.996x is filed 0.99 (kept), not 1.00 (a
    tie, rewritten)."""
    from benchmarks import rule_file

    doc = rule_file.merged(None, {"qwen3_moe": {"prefill": 0.996, "train": 1.2349}}, ["a run"])
    (entry,) = doc["layers"]
    assert (entry["prefill"], entry["train"]) == (0.99, 1.23) and doc["_source"] == "a run"
    assert rule_file.merged(doc, {}, ["a run"])["_source"] == "a run"  # a source is filed once


@pytest.mark.parametrize("mode,options,visible", [(None, None, True), ("reduce-overhead", None, False),
                                                  (None, {"triton.cudagraphs": True}, False),
                                                  ("max-autotune-no-cudagraphs", None, True),
                                                  (None, {"inner": "aot_eager"}, False)])
def test_a_compile_that_replays_cuda_graphs_keeps_the_opaque_backward_in_the_rule(mode, options, visible,
                                                                                monkeypatch):
    """Under CUDA graphs (or another inner compiler) no op of ours is swapped for its visible twin, so a static
    1024-token step runs the opaque backward: the compile's state says so, from torch.compile's mode and options,
    and ``backward_visible`` answers False inside it."""
    from moe_inductor import capture

    seen = []
    real = capture._compiling

    @contextlib.contextmanager
    def record(state):
        with real(state) as inside:
            if state.ours and not state.plain:
                seen.append((state.visible_ops, speed_rule.backward_visible(1024, QWEN3, False)))
            yield inside

    monkeypatch.setattr(capture, "_compiling", record)
    torch._dynamo.reset()
    kwargs = {"mode": mode} if mode else {}
    if options:
        kwargs["options"] = options
    torch.compile(lambda x: x + 1, backend="moe_inductor", **kwargs)(torch.ones(3))
    torch._dynamo.reset()
    assert seen == [(visible, visible)], seen
    assert speed_rule.backward_visible(1024, QWEN3, False)  # outside a compile: the settings and shapes alone


def test_the_rule_asked_while_dynamo_traces_a_training_call_costs_no_recompile(monkeypatch):
    """The HF polyfills ask ``mode_of`` while Dynamo traces them, on tensors our kernels would run on. Its answer
    reads the compile being traced (``capture``'s thread-local stack), which is empty at run time: were that read
    traced, it would become a guard failing on every call, and each training step would compile the frame again
    (the H100's 1024-token steps took 3 s each so). Three calls of one shape: one graph."""
    import moe_inductor
    from torch._dynamo.utils import counters

    monkeypatch.setattr(config, "triton_on_cpu", True)  # CPU tensors count as ours: the read is reached

    def step(x, w):
        mode = speed_rule.mode_of(x, (w,), QWEN3, False)
        return (x @ w) * (2.0 if mode == "train" else 3.0)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend=moe_inductor.with_options(inner="aot_eager"), dynamic=False)
    x, w = torch.randn(1024, 8), torch.randn(8, 8, requires_grad=True)
    for _ in range(3):
        out = compiled(x, w)
    torch.testing.assert_close(out, (x @ w) * 2.0)  # "train": under aot_eager no visible op is swapped in
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_explain_judges_a_short_static_training_step_as_the_users_compile_does(monkeypatch):
    """explain() compiles with a light inner compiler but judges as Inductor would (``judging_as``): its answer
    on which backward a static 1024-token training step takes must be the user's compile's, or explain() would
    say "kept" of a layer the user's compile rewrites. Our kernels are taken to run on CPU tensors here
    (``config.triton_on_cpu``), so the question is asked as on a GPU."""
    import moe_inductor
    from moe_inductor import capture, hf

    monkeypatch.setattr(config, "triton_on_cpu", True)
    modes = []
    real = speed_rule.verdict

    def recorded(kind, device, mode, inner, form="hf_grouped_mm", route=None):
        modes.append(mode)
        return real(kind, device, mode, inner, form, route=route)

    monkeypatch.setattr(speed_rule, "verdict", recorded)

    def step(x, w1, w2):
        kw = dict(activation="silu_glu", layout="nk", gate_up="concat", w1=w1, w2=w2, b1=None, b2=None)
        if capture.rewriting_enabled("hf_grouped_mm"):  # as the polyfills ask: not in explain()'s rewrites-off pass
            hf._speed_rule_verdict("hf_grouped_mm", kw, x, 2)
        return x * 2

    x = torch.randn(1024, 8)
    w1, w2 = torch.randn(4, 16, 8, requires_grad=True), torch.randn(4, 8, 8, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(step, backend="moe_inductor", dynamic=False)(x, w1, w2)
    compiled = set(modes)
    modes.clear()
    torch._dynamo.reset()
    moe_inductor.explain(step, x, w1, w2)
    torch._dynamo.reset()
    assert compiled == {TRAIN_STATIC}, compiled
    assert set(modes) == {TRAIN_STATIC}, modes


def test_judging_as_in_one_thread_leaves_another_threads_compile_judged_by_its_own_inner():
    """explain() judges as Inductor inside ``judging_as``; a compile running meanwhile in another thread (Dynamo
    compiles in the calling thread) must still be judged by its own inner compiler, or explain() would change
    which layers another thread's compile rewrites."""
    from tests.helpers import read_beside

    inside, beside = read_beside(speed_rule.judging_as("inductor"), lambda: speed_rule.judged_inner("aot_eager"))
    assert (inside, beside) == ("inductor", "aot_eager")
    assert speed_rule.judged_inner("eager") == "eager"


def test_rule_file_refuses_a_run_that_timed_recompiles(tmp_path):
    """A cell whose two columns compiled different numbers of graphs timed recompiles (or graph breaks), not the
    rewrite: the H100's Qwen1.5-MoE row at bd2181e read 3143 ms against 9.20 (27 graphs against 1). The filer
    refuses such a run, whichever column compiled more, and the table says so; the same run with one graph each
    files."""
    import json

    from benchmarks import hf_tables, rule_file

    def run(graphs, rewritten):
        rows = [dict(family="qwen2_moe", layers=2, mode="train", size=1024, column="moe_inductor_experts_kept",
                     value=9.2024, unit="ms", graphs=1),
                dict(family="qwen2_moe", layers=2, mode="train", size=1024, column="moe_inductor_rule_off",
                     value=rewritten, unit="ms", graphs=graphs)]
        path = tmp_path / f"run_{graphs}.json"
        path.write_text(json.dumps({"meta": {"device": "TEST GPU"}, "rows": rows}))
        return str(path), rows

    storm, rows = run(27, 3143.25)
    with pytest.raises(ValueError, match="the kept column compiled 1 graph"):
        rule_file.main([storm, "--out-dir", str(tmp_path), "--write"])
    assert not (tmp_path / "TEST_GPU.json").exists()
    assert "graphs: 1 kept, 27 rewritten" in hf_tables.rule_markdown(rows)
    for row in rows:  # a storm in the kept column would make the rewrite look faster: refused too
        row["graphs"] = 27 if row["column"] == "moe_inductor_experts_kept" else 1
    (tmp_path / "kept_storm.json").write_text(json.dumps({"meta": {"device": "TEST GPU"}, "rows": rows}))
    with pytest.raises(ValueError, match="the kept column compiled 27 graph"):
        rule_file.main([str(tmp_path / "kept_storm.json"), "--out-dir", str(tmp_path), "--write"])
    fine, rows = run(1, 9.49)
    (entry,) = json.loads(rule_file.main([fine, "--out-dir", str(tmp_path), "--write"]).read_text())["layers"]
    assert entry["train"] == 0.96, entry
    assert "more graphs" not in hf_tables.rule_markdown(rows)
