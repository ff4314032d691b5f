"""Smoke runs of the benchmark scripts on the CPU, so that a broken script is found here and not on the GPU, where
every minute is budgeted. They check that each script runs end to end and prints its rows; they measure nothing."""
import json
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
def test_bench_hf_runs_on_a_tiny_model(capsys, tmp_path):
    import json

    from benchmarks import bench_hf

    out = tmp_path / "hf.json"
    bench_hf.main(["--tiny", "--device", "cpu", "--cells", "qwen3_moe:prefill:8:eager+moe_inductor", "--json", str(out),
                   "--profile", "--host-profile", "--interleave", "2", "--clocks",
                   "--budget-s", "3600"])  # the rounds start only within the budget: a loaded machine must not skip them
    printed = capsys.readouterr().out
    assert "| Qwen3-30B-A3B (4) | prefill T=8 | ms |" in printed and "== prefill T=8 moe_inductor" in printed
    assert "median of 2 interleaved rounds" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["column"] for r in rows] == ["eager", "moe_inductor"] and all(r["value"] > 0 for r in rows)
    for r in rows:  # the interleaved rounds: each column's value is their median; the first measure is kept
        assert len(r["rounds"]) == 2 and r["value"] == sum(r["rounds"]) / 2 and r["value_alone"] > 0, r
        assert "interleave_recompiled" not in r and "interleave_error" not in r and "sm_mhz" not in r, r  # CPU
    assert rows[1]["err"] < 1e-4, rows  # fp32: the same function as eager on the same tokens
    traces = (tmp_path / "hf.profile.txt").read_text()
    assert traces.startswith("== prefill T=8 moe_inductor") and "== host prefill T=8 moe_inductor" in traces
    assert "compiled graphs (Inductor's generated code)" in traces  # the host split names the compiled call's own code


@pytest.mark.slow
def test_bench_hf_every_family_and_mode_runs_eagerly(tmp_path):
    """Every family's builder, and the decode and training steps, without compiles (they cost minutes here)."""
    import json

    from benchmarks import bench_hf

    out = tmp_path / "hf.json"
    bench_hf.main(["--tiny", "--device", "cpu", "--child", "--columns", "eager", "--json", str(out), "--cells",
                   "gpt_oss:train:8", "gpt_oss:decode:2"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["unit"]) for r in rows] == [("train", "ms"), ("decode", "new tok/s")], rows
    assert all(r["value"] > 0 and r["err"] == 0 for r in rows), rows
    for family in bench_hf.FAMILIES:  # random biases too: HF starts some at zeros, and zeros time faster
        model, cfg = bench_hf.build(family, 1, True, "cpu", torch.float32)
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        assert all(p.abs().sum() > 0 for p in biases), family
        ids = bench_hf.tokens(cfg, (1, 8), "cpu")
        assert model(input_ids=ids, logits_to_keep=1).logits.shape == (1, 1, cfg.vocab_size), family


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_bench_hf_gpt_oss_v4_family_is_v5_gpt_oss_spelled_as_v4_and_rewritten(train):
    """``gpt_oss_v4`` (transformers v4.55's MoE block code in the v5 model, hf_v4_code.py) computes what v5's GPT-OSS
    computes with the same weights, and moe_inductor rewrites its blocks by the FX passes: the dense expert-major
    form in eval, the hit-experts loop in training. Its values never file under the "hf" route (rule_file.py)."""
    from torch._dynamo.utils import counters

    from benchmarks import bench_hf, rule_file

    v5, cfg = bench_hf.build("gpt_oss", 1, True, "cpu", torch.float32)
    v4, _ = bench_hf.build("gpt_oss_v4", 1, True, "cpu", torch.float32)
    ids = bench_hf.tokens(cfg, (2, 8), "cpu")
    v5.train(train), v4.train(train)
    with torch.set_grad_enabled(train):
        want = v5(input_ids=ids, labels=ids).loss if train else v5(input_ids=ids).logits
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(v4, backend="moe_inductor", options={"inner": "eager"})
        got = compiled(input_ids=ids, labels=ids).loss if train else compiled(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert dict(counters["moe_inductor"]) == ({"unrolled_loop": 1} if train else {"dense_experts": 1})
    if train:
        got.backward()
        assert v4.model.layers[0].mlp.experts.down_proj.grad is not None
    assert "gpt_oss_v4" in rule_file.NOT_HF_ROUTE


def test_bench_hf_cells_and_table():
    from benchmarks import bench_hf, hf_processes, hf_profile, hf_tables

    cells = [("mixtral", "prefill", 8, ("eager", "inductor")), ("mixtral", "decode", 1, ("inductor", "moe_inductor")),
             ("mixtral", "train", 8, ("eager",)), ("olmoe", "train", 8, ("eager",))]
    assert hf_processes.process_groups(cells, alone=True) == [  # each decode column alone, the rest by family
        [cells[0]], [("mixtral", "decode", 1, ("inductor",))], [("mixtral", "decode", 1, ("moe_inductor",))],
        [cells[2]], [cells[3]]]
    assert hf_processes.process_groups(cells, alone=False) == [cells[:3], [cells[3]]]
    one = lambda c: [("mixtral", "decode", 1, (c,))]  # noqa: E731
    assert hf_processes.process_groups(cells[1:2], alone=True, repeats=3) == [  # the order reversed every other round
        one("inductor"), one("moe_inductor"), one("moe_inductor"), one("inductor"), one("inductor"), one("moe_inductor")]
    ran = [dict(family="mixtral", mode="decode", size=1, column=c, value=v, err=e) for c, v, e in
           [("inductor", 100.0, 0.1), ("moe_inductor", 90.0, 0.2), ("moe_inductor", 130.0, 0.3),
            ("inductor", 110.0, 0.4), ("inductor", 120.0, 0.5), ("moe_inductor", 120.0, 0.6)]]
    merged = hf_processes.merge_repeats(ran + [dict(family="olmoe", mode="train", size=8, column="eager", value=5.0)])
    assert [(r["column"], r["value"], r.get("values"), r.get("err")) for r in merged] == [  # the first's other fields
        ("inductor", 110.0, [100.0, 110.0, 120.0], 0.1), ("moe_inductor", 120.0, [90.0, 130.0, 120.0], 0.2),
        ("eager", 5.0, None, None)]
    assert "| decode B=1 | new tok/s | – | 110 (100-120) | – | 120 (90-130) | 1.09 |" in hf_tables.markdown(
        [dict(r, layers=2, unit="new tok/s") for r in merged[:2]])
    groups = hf_processes.process_groups(cells + [("gpt_oss", "train", 8, ("eager",))], alone=True)
    # one GPU per family, round-robin; a family's groups (its decode columns too) stay on its GPU, in order
    assert hf_processes.lanes_of(groups, 2) == [[0, 1, 2, 3, 5], [4]]
    assert hf_processes.lanes_of(groups, 8) == [[0, 1, 2, 3], [4], [5]]
    assert hf_processes.lanes_of(groups, 1) == [list(range(6))]
    assert hf_processes.cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11} and hf_processes.cpu_list("5") == {5}
    assert hf_profile.host_bucket("~", "<built-in method torch.mm>") == "C: torch.mm"
    assert hf_profile.host_bucket("/tmp/torchinductor_u/ab/cab.py", "call").startswith("compiled graphs")
    assert hf_profile.host_bucket("/v/site-packages/transformers/generation/utils.py", "_sample") == "transformers generate"
    assert hf_profile.host_bucket("/v/site-packages/torch/_inductor/cudagraph_trees.py", "run") == "cudagraph trees"

    assert bench_hf.parse_cell("gpt_oss:train:4096", ["eager"]) == ("gpt_oss", "train", 4096, ("eager",))
    cell = bench_hf.parse_cell("mixtral:prefill:512:inductor+moe_inductor", [])
    assert bench_hf.parse_cell(bench_hf.cell_text(cell), []) == cell
    with pytest.raises(Exception):
        bench_hf.parse_cell("mixtral:prefil:512", [])
    common = dict(family="mixtral", layers=2, mode="prefill", size=512, unit="ms")
    decode = dict(common, mode="decode", size=1, unit="new tok/s")
    table = hf_tables.markdown([dict(common, column="eager", value=3.0), dict(common, column="inductor", value=2.0),
                               dict(common, column="moe_inductor", value=1.0, first_call_s=9.0, err=1e-3),
                               dict(decode, column="inductor", value=100.0),
                               dict(decode, column="moe_inductor", value=150.0)])
    assert "| Mixtral-8x7B (2) | prefill T=512 | ms | 3.00 | 2.00 | – | 1.00 | 2.00 | 3.00 | – / 9 |" in table
    assert "| decode B=1 | new tok/s | – | 100 | – | 150 | 1.50 |" in table  # a rate: higher is faster


def test_bench_hf_driver_skips_what_its_deadline_leaves_no_time_for(capsys):
    from benchmarks import bench_hf

    bench_hf.main(["--tiny", "--device", "cpu", "--deadline-s", "0", "--cells", "olmoe:prefill:8", "gpt_oss:train:8"])
    assert capsys.readouterr().out.count(" skipped ") == 6  # two families' cells, three columns each


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mem_backward_runs(capsys, dtype):
    from benchmarks import mem_backward

    mem_backward.main(["--dtype", dtype, "--shape", "64", "32", "64", "4", "2"])
    assert capsys.readouterr().out.strip()


def test_fwd_bwd_cpu_runs(capsys):
    from benchmarks import fwd_bwd_cpu

    fwd_bwd_cpu.main(["--shape", "8", "16", "8", "3", "2", "--reps", "2"])
    assert "fwd+bwd median" in capsys.readouterr().out


@pytest.mark.slow
def test_every_script_device_run_calls_exists_and_parses_its_arguments():
    """The GPU-only scripts (they time with CUDA events) cannot run here; each must at least import and parse its
    command line, so that a typo does not cost a GPU call."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    script = root / "benchmarks" / "device_run.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    scripts = set(re.findall(r"benchmarks/([a-z_]+)\.py", script.read_text()))
    assert {"bench_backward_engine", "tune_weight_grad", "profile_experts", "bench_hf"} <= scripts
    # one process runs every script's `--help` as its __main__ (torch imported once, not once a script): each must
    # exit 0 having printed its usage, and a script that fails is named with its traceback
    check = """
import contextlib, io, runpy, sys, traceback
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failed.append((path, "returned without exiting"))
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            failed.append((path, f"exit {e.code}: {out.getvalue()[-500:]}"))
    except BaseException:
        failed.append((path, traceback.format_exc()[-2000:]))
print(repr(failed))
"""
    paths = [str(root / "benchmarks" / f"{name}.py") for name in sorted(scripts)]
    out = subprocess.run([sys.executable, "-c", check, *paths], capture_output=True, text=True, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-4000:]


@pytest.mark.slow  # a fresh process compiles a model
def test_bench_compile_time_measures_one_family(capsys):
    """The compile-time comparison runs end to end on this checkout (one family, one repeat)."""
    from benchmarks import bench_compile_time

    bench_compile_time.main(["--families", "qwen3_moe", "--repeats", "1"])
    assert "| qwen3_moe |" in capsys.readouterr().out


@pytest.mark.slow  # the Triton interpreter runs Liger's 64-row tiles: about half a minute
def test_bench_experts_liger_column_agrees_with_the_op(monkeypatch):
    """bench_experts.py's Liger column computes the same experts function as ours (Liger's kernels under the
    interpreter, our CPU path), on HF's weight layout, so that its GPU timings compare like with like."""
    pytest.importorskip("liger_kernel")  # a benchmark-only extra (pip install -e '.[bench]')
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")  # one config: the interpreter would time every candidate
    import moe_inductor
    from benchmarks import bench_experts

    liger = bench_experts.liger_experts()
    assert liger is not None and bench_experts.liger_version() != "not installed"
    gen = torch.Generator().manual_seed(0)
    T, H, I, E, k = 5, 32, 16, 4, 2
    x = torch.randn(T, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5, torch.randn(E, H, I, generator=gen) * I ** -0.5
    ids, weights = bench_experts.make_routing(T, E, k, False, gen, "cpu")
    # Liger's kernels run where Triton does: the interpreter on a CPU machine, the GPU where there is one (whose
    # fp32 dots may round through tf32)
    dev, tol = ("cuda", 5e-3) if torch.cuda.is_available() else ("cpu", 1e-5)
    x, gate_up, down, ids, weights = (t.to(dev) for t in (x, gate_up, down, ids, weights))
    y_liger = liger(x, ids.to(torch.int32), weights, gate_up, down)
    y_ours = moe_inductor.fused_experts(x, ids, weights, gate_up, down)
    assert ((y_liger - y_ours).norm() / y_ours.norm()).item() < tol


def test_bench_experts_table_has_the_liger_column():
    from benchmarks import bench_experts

    row = dict(shape="qwen3", T=4096, routing="balanced", ours=1.0, engine="triton", sort_gmm=2.0, floor=0.5,
               mem_ours_mib=10.0, mem_sort_gmm_mib=20.0)
    table = bench_experts.markdown([dict(row, liger=1.25, fwdbwd_ours=3.0, fwdbwd_liger=4.0)])
    assert "| Liger |" in table.splitlines()[0] and "| 1.250 | – | 0.500 | 0.50 | 0.80 | 3.000 |" in table
    absent = bench_experts.markdown([row], "not installed")
    assert "| – | not installed | – | 0.500 | 0.50 | not installed |" in absent


@pytest.mark.slow  # two compiles of the quickstart model
def test_bench_cpu_quickstart_mode_runs(capsys):
    from benchmarks import bench_cpu

    bench_cpu.main(["--model", "quickstart", "--tokens", "8", "--rounds", "1", "--calls", "1", "--backends",
                    "inductor", "moe_inductor"])
    assert "| 8 |" in capsys.readouterr().out


@pytest.mark.slow  # an eager step and a moe_inductor compile of the quickstart model's training step
def test_bench_cpu_train_mode_compares_loss_and_gradients(capsys):
    """The training mode's rows hold the error of the loss and the gradient norms against eager's (it raises over
    1e-4), here on the tiny GPT-OSS (biases, interleaved gate/up)."""
    from benchmarks import bench_cpu

    rows = bench_cpu.model_table([8], rounds=1, calls=1, backends=["eager", "moe_inductor"], train=True,
                                 model_name="gptoss")
    assert "gptoss model" in capsys.readouterr().out
    assert rows[0]["err"]["eager"] == 0.0 and rows[0]["err"]["moe_inductor"] < 1e-4


@pytest.mark.slow  # an eager run and a moe_inductor compile of the quickstart model
def test_bench_cpu_model_mode_in_bf16(capsys):
    """--dtype bfloat16 builds the model in bf16 (the header says so) and holds the error against eager in the
    bf16 bound."""
    from benchmarks import bench_cpu

    rows = bench_cpu.model_table([8], rounds=1, calls=1, backends=["eager", "moe_inductor"],
                                 dtype=torch.bfloat16)
    assert "bfloat16" in capsys.readouterr().out
    assert rows[0]["err"]["moe_inductor"] < bench_cpu.ERROR_BOUND[torch.bfloat16]


def test_bench_cpu_model_mode_refuses_a_dtype_it_has_no_bound_for():
    from benchmarks import bench_cpu

    with pytest.raises(ValueError, match="dtype must be one of"):
        bench_cpu.model_table([8], rounds=1, calls=1, dtype=torch.float64)


def test_bench_hf_rule_values_divide_the_two_moe_inductor_columns():
    """The speed rule's value of a cell: rule-on time over rule-off time (ms), or rule-off over rule-on (tok/s)."""
    from benchmarks import bench_hf, hf_tables

    def row(mode, column, value, unit):
        return dict(family="gpt_oss", layers=2, mode=mode, size=1 if mode == "decode" else 4096, column=column,
                    value=value, unit=unit)

    kept, off = bench_hf.EXPERTS_KEPT, bench_hf.RULE_OFF
    rows = [row("prefill", kept, 8.57, "ms"), row("prefill", off, 10.19, "ms"),
            row("decode", kept, 401.0, "new tok/s"), row("decode", off, 464.0, "new tok/s"),
            row("train", "moe_inductor", 50.0, "ms"), row("train", off, 54.0, "ms")]  # no experts-kept column
    values = {v["mode"]: round(v["value"], 2) for v in hf_tables.rule_values(rows)}
    assert values == {"prefill": 0.84, "decode": 1.16}
    table = hf_tables.rule_markdown(rows)
    assert "| GPT-OSS-20B (2) | prefill 4096 | ms | 8.57 | 10.19 | 0.84 |" in table
    assert hf_tables.rule_markdown(rows[4:]) == ""


def test_bench_hf_variant_columns_against_the_default_one():
    """A column with a setting changed (tail split off, TMA "auto") beside the default moe_inductor column: the
    variants table gives the default's time over the column's (ms) or the column's over the default's (tok/s)."""
    from benchmarks import bench_hf, hf_tables

    def row(mode, column, value, unit, **kw):
        return dict(family="qwen3_moe", layers=2, mode=mode, size=1 if mode == "decode" else 4096, column=column,
                    value=value, unit=unit, **kw)

    rows = [row("prefill", "moe_inductor", 3.22, "ms", peak_mib=3130.0),
            row("prefill", bench_hf.TMA_AUTO, 3.67, "ms", peak_mib=3223.0),
            row("decode", "moe_inductor", 500.0, "new tok/s"), row("decode", bench_hf.TAIL_OFF, 550.0, "new tok/s")]
    table = hf_tables.variants_markdown(rows)
    assert ("| Qwen3-30B-A3B (2) | prefill 4096 | moe_inductor_tma_auto | ms | 3.22 | 3.67 | 0.88 | 3130 / 3223 |"
            in table)
    assert "| decode 1 | moe_inductor_tail_off | new tok/s | 500 | 550 | 1.10 | – / – |" in table
    assert hf_tables.variants_markdown(rows[:1]) == ""


def test_bench_hf_setting_columns_hold_their_setting_and_a_backend_of_their_own():
    """Each column that differs from moe_inductor by a setting holds it while it compiles and runs (and gives it back
    after), with the compile caches off, and compiles with a backend object of its own (Dynamo keeps one compiled
    entry per backend)."""
    from benchmarks import bench_hf, hf_columns
    from moe_inductor import config

    wanted = {bench_hf.TAIL_OFF: ("gemm_tail_split", False), bench_hf.TMA_AUTO: ("gemm_tma_weights", "auto"),
              bench_hf.TMA_OFF: ("gemm_tma_weights", "off"), bench_hf.FUSED: ("gemm_engine", "triton"),
              bench_hf.RULE_OFF: ("speed_rule", False), bench_hf.ENGINE: ("gemm_engine", "grouped_mm"),
              bench_hf.BW_FUSED: ("gemm_engine_backward", "triton")}
    for column, (name, value) in wanted.items():
        before = getattr(config, name)
        assert before != value
        with hf_columns.column_options(column):
            assert getattr(config, name) == value, column
            if column != bench_hf.RULE_OFF:
                assert torch._inductor.config.fx_graph_cache is False
            assert config.speed_rule is (column not in (bench_hf.RULE_OFF, bench_hf.BW_FUSED))
        assert getattr(config, name) == before and config.speed_rule
        assert hf_columns.moe_backend(column) != "moe_inductor"
    assert hf_columns.moe_backend("moe_inductor") == "moe_inductor"


@pytest.mark.slow
def test_bench_hf_rule_columns_compile_with_the_rule_off_and_with_no_form(capsys, monkeypatch):
    """moe_inductor_rule_off traces with moe_inductor.config.speed_rule = False (the moe_inductor column with it
    on), moe_inductor_experts_kept rewrites no MoE form, and the run prints the rule's table."""
    from benchmarks import bench_hf
    from moe_inductor import config, speed_rule

    seen, real = [], speed_rule.verdict
    monkeypatch.setattr(speed_rule, "verdict", lambda *a, **k: seen.append(config.speed_rule) or real(*a, **k))
    columns = ("moe_inductor", bench_hf.RULE_OFF, bench_hf.EXPERTS_KEPT)
    bench_hf.main(["--tiny", "--device", "cpu", "--cells", "qwen3_moe:prefill:8:" + "+".join(columns)])
    # the rule is asked once a layer (4), with the rule on, then off; the experts-kept column rewrites no layer
    assert seen == [True] * 4 + [False] * 4
    assert config.speed_rule  # put back after the column
    assert "| Qwen3-30B-A3B (4) | prefill 8 | ms |" in capsys.readouterr().out


def test_tune_gemm_records_each_candidate_launch_without_running_it():
    """tune_gemm.py's first pass stands in for the tuner: every candidate's launch of an untuned key is recorded as a
    compile job (tensors as their dtypes, for ``JITFunction.warmup`` in a worker), nothing runs, and the launch
    function is put back."""
    from benchmarks import tune_gemm
    from moe_inductor.kernels import configs, launch

    real = launch.launch_kernel
    cands = configs.gemm_candidates(torch.bfloat16)[:3]
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    ran = []

    def run(cfg):
        ran.append(cfg)
        launch.launch_kernel(launch.grouped_gemm_kernel, (cfg.BLOCK_M, 1), (a, 3, 1.5), {"BLOCK_M": cfg.BLOCK_M})

    recorder = tune_gemm.Recorder()
    key = "gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m2"
    assert recorder(key, lambda: cands, run) == cands[0]
    assert ran == cands and launch.launch_kernel is real
    jobs = recorder.jobs[key]
    assert [job[2] for job in jobs] == [(c.BLOCK_M, 1) for c in cands]
    assert jobs[0][:2] == ("moe_inductor.kernels.grouped_gemm", "grouped_gemm_kernel")
    assert jobs[0][3] == (torch.bfloat16, 3, 1.5) and jobs[1][4] == {"BLOCK_M": cands[1].BLOCK_M}
    assert recorder("wgrad|E4|N8|K8|torch.bfloat16|a1|g0|m2", lambda: cands, run) == cands[0]
    assert list(recorder.jobs) == [key]  # the weight-gradient kernel is not this script's


def test_tune_gemm_reads_the_default_config_from_a_key(monkeypatch):
    from benchmarks import tune_gemm
    from moe_inductor.kernels import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the GPU's defaults, which differ by bucket and dtype
    assert configs.default_gemm_config(2048, 1024, 2048, torch.bfloat16, True) != \
        configs.default_gemm_config(2, 1024, 2048, torch.bfloat16, True)
    assert tune_gemm.default_of("gemm|E64|N1024|K2048|torch.bfloat16|g1|a1|c0|m2048") == \
        configs.default_gemm_config(2048, 1024, 2048, torch.bfloat16, True)
    assert tune_gemm.default_of("gemm|E60|N2048|K1408|torch.float32|g0|a0|c2|m2|il") == \
        configs.default_gemm_config(2, 2048, 1408, torch.float32, False)


def test_tune_gemm_tma_keys_default_to_pointers_and_only_filters(monkeypatch):
    """A TMA key's default is POINTERS; ``--only`` leaves the other keys to the table or their default, untuned."""
    from benchmarks import tune_gemm
    from moe_inductor.kernels import configs

    key = "gemm|E64|N1024|K2048|torch.bfloat16|g1|a1|c0|m2048"
    assert tune_gemm.default_of(key + "|tma") == configs.POINTERS
    monkeypatch.setattr(tune_gemm, "ONLY", "|tma")
    recorder = tune_gemm.Recorder()
    monkeypatch.setattr(configs.TABLE, "lookup", lambda k: None)
    assert recorder(key, lambda: [configs.POINTERS], lambda c: None) == tune_gemm.default_of(key)
    assert recorder(key + "|tail", lambda: [configs.POINTERS], lambda c: None) == tune_gemm.default_of(key)
    assert recorder(key + "|tma", lambda: [configs.POINTERS], lambda c: None) == configs.POINTERS
    assert list(recorder.jobs) == [key + "|tma"]


def test_tune_gemm_sets_tma_entries_back_where_the_whole_forward_did_not_gain(monkeypatch):
    """A case's TMA entries stay only when its whole forward, timed with them and without them in alternating
    rounds, gains CONFIRM_GAIN; its other keys are untouched."""
    from benchmarks import tune_gemm
    from moe_inductor.kernels import configs

    stored, table = {}, {}

    def store(key, cfg, persist=False):
        table[key] = cfg
        if persist:
            stored[key] = cfg

    monkeypatch.setattr(configs.TABLE, "store", store)
    tma = "gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m256|tma"
    tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "GROUP_M": 8}
    entries = {tma: {**tile, "_best_ms": 1.0}, "gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m256": dict(tile)}
    order = []

    def forward_ms(with_tile_ms, drift=0.0):
        def timed():  # (a card that slows down as it runs: each later timing is ``drift`` ms slower)
            order.append(table[tma] != configs.POINTERS)
            return (with_tile_ms if order[-1] else 1.0) + drift * len(order)
        return timed

    assert tune_gemm.confirm_tma(entries, list(entries), forward_ms(0.95)) == ([], pytest.approx(1.0 / 0.95))
    assert table[tma] == configs.LaunchConfig(**tile) and not stored, "kept: the tile is in force again"
    assert order == [False, True, True, False, False, True, True, False], "both sides each round, ABBA order"
    order.clear()
    # a drift larger than the tile's gain: timed minutes apart, the forward with the tile would read slower
    back, gain = tune_gemm.confirm_tma(entries, list(entries), forward_ms(0.95, drift=0.03))
    assert back == [] and gain == pytest.approx(1.0 / 0.95, rel=0.02)
    back, gain = tune_gemm.confirm_tma(entries, list(entries), forward_ms(0.99))
    assert back == [tma] and gain < tune_gemm.CONFIRM_GAIN
    assert stored == {tma: configs.POINTERS}, "in the user's cache too, where the tuner saved the tile"
    assert tune_gemm._fields(entries[tma]) == configs.POINTERS and entries[tma]["_confirm_gain"] < 1.02
    assert entries["gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m256"]["BLOCK_M"] == 128
    assert tune_gemm.confirm_tma(entries, list(entries), forward_ms(0.5)) == ([], 1.0), "POINTERS already"


def test_tune_gemm_settles_each_tma_key_in_its_whole_forward(monkeypatch):
    """Each TMA key of a case is timed in the case's forward with POINTERS and with its best tile alone; the tile
    stays only when the forward gains the margin with it, whatever its time alone said."""
    from benchmarks import tune_gemm
    from moe_inductor.kernels import configs

    table = {}
    monkeypatch.setattr(configs.TABLE, "store", lambda key, cfg, persist=False: table.update({key: cfg}))
    up, down = "gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m256|tma", "gemm|E4|N8|K8|torch.bfloat16|g0|a0|c2|m256|tma"
    fast, slow = configs.LaunchConfig(128, 128, 64, 8, 3), configs.LaunchConfig(64, 128, 64, 4, 3)
    # alone, both keys' tiles beat POINTERS; in the forward, the up key's tile costs 5%, the down key's saves 5%
    times = {up: {configs.POINTERS: 1.0, fast: 0.8, slow: 0.9}, down: {configs.POINTERS: 1.0, slow: 0.85}}
    entries = {up: dict(vars(fast)), down: dict(vars(slow)), "gemm|E4|N8|K8|torch.bfloat16|g1|a1|c0|m256": {}}

    def forward_ms():
        return 1.0 + (0.05 if table.get(up) == fast else 0.0) - (0.05 if table.get(down) == slow else 0.0)

    chosen = tune_gemm.settle_in_context(entries, times, list(entries), forward_ms)
    assert chosen == {up: configs.POINTERS, down: slow}
    assert table[up] == configs.POINTERS and table[down] == slow
    assert tune_gemm._fields(entries[up]) == configs.POINTERS and entries[up]["_forward_ms_tile"] > 1.0


def test_tune_gemm_gptoss_case_is_the_models_own_layout(monkeypatch):
    """tune_gemm.py's "gptoss" case is GPT-OSS's experts as the model holds them ((E, H, 2I) gate_up, interleaved
    columns, biases, clamped glu), so that its tuned keys are the ones the model meets: its forward equals that
    layer written out expert by expert."""
    from benchmarks import tune_gemm

    monkeypatch.setitem(tune_gemm.SHAPES, "gptoss", (8, 4, 3, 2))
    (T, case), = tune_gemm.shape_cases("gptoss", [5], "cpu", torch.float32)
    x, ids, weights, w1, w2, kw = case
    assert T == 5 and w1.shape == (3, 8, 8) and kw["gate_up"] == "interleaved" and kw["layout"] == "kn"
    want = torch.zeros_like(x)
    for t in range(T):
        for e, w in zip(ids[t].tolist(), weights[t]):
            h = x[t] @ w1[e] + kw["b1"][e]
            gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
            want[t] += w * (((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w2[e] + kw["b2"][e])
    torch.testing.assert_close(tune_gemm.forward(*case), want, rtol=1e-4, atol=1e-5)


def test_decode_host_ab_variants_name_their_backends():
    """decode_host_ab.py's variants: Inductor, a plain compile_fx backend with none of ours, and moe_inductor."""
    from benchmarks import decode_host_ab

    assert decode_host_ab.backend_of("ind") == decode_host_ab.backend_of("ind_imp") == "inductor"
    assert decode_host_ab.backend_of("custom") is decode_host_ab.plain_backend
    assert decode_host_ab.backend_of("moe") == "moe_inductor"
    with pytest.raises(ValueError, match="unknown variant"):
        decode_host_ab.backend_of("moe_inductor")


def test_tuned_entries_merge_into_the_shipped_table(tmp_path, monkeypatch):
    """The tuning scripts' --merge: new keys are added, existing ones replaced, the rest kept, keys sorted."""
    import json

    from moe_inductor.kernels import configs

    monkeypatch.setattr(configs, "_TUNED_DIR", tmp_path)
    monkeypatch.setattr(configs.ConfigTable, "device_tag", staticmethod(lambda: "GPU_X"))
    old, new = configs.LaunchConfig(16, 64, 64, 4, 3), configs.LaunchConfig(128, 128, 64, 8, 3)
    (tmp_path / "GPU_X.json").write_text(json.dumps({"gemm|b": vars(old), "gemm|z": vars(old)}))
    path = configs.TABLE.merge_into_shipped({"gemm|a": new, "gemm|z": new})
    table = json.loads(path.read_text())
    assert path == tmp_path / "GPU_X.json" and list(table) == ["gemm|a", "gemm|b", "gemm|z"]
    assert table["gemm|a"] == table["gemm|z"] == vars(new) and table["gemm|b"] == vars(old)


def test_interleaved_rounds_alternate_the_order_and_take_medians():
    from benchmarks import hf_rounds

    assert hf_rounds.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    calls, entered = [], []
    clock = iter([5.0, 1.0, 1.0, 2.0, 9.0, 3.0])  # a: 5, 2, 9 (calls 1, 4, 5); b: 1, 1, 3 (calls 2, 3, 6)

    def step(name):
        return lambda: calls.append(name)

    def time_ms(fn):
        fn()
        return next(clock)

    import contextlib

    @contextlib.contextmanager
    def context(column):
        entered.append(column)
        yield

    got = hf_rounds.interleaved({"a": step("a"), "b": step("b")}, 3, time_ms, context, "cpu", clocks=True)
    assert calls == ["a", "b", "b", "a", "a", "b"] and entered == calls
    assert got == {"a": {"value": 5.0, "rounds": [5.0, 2.0, 9.0]}, "b": {"value": 1.0, "rounds": [1.0, 1.0, 3.0]}}
    with hf_rounds.GpuSampler("cpu") as sampler:  # no GPU: nothing sampled, nothing fails
        pass
    assert sampler.summary() == {}
    with pytest.raises(ValueError, match="at least 1"):
        hf_rounds.interleaved({"a": step("a")}, 0, time_ms, context, "cpu")


def test_mem_peak_replays_an_allocator_trace():
    """The peak of a trace's live bytes and what is live at its first reaching, by the frame charged: the
    innermost in generated code, moe_inductor or transformers, else the innermost outside torch."""
    from benchmarks import mem_peak

    gen = {"filename": "/tmp/torchinductor_u/ab/cab.py", "line": 12, "name": "call"}
    ours = {"filename": "/x/moe_inductor/ops/grouped_mm_engine.py", "line": 210, "name": "backward"}
    torch_frame = {"filename": "/v/torch/nn/functional.py", "line": 5, "name": "linear"}
    user = {"filename": "/home/me/train.py", "line": 7, "name": "step"}
    assert mem_peak.site([torch_frame, ours, gen, user]) == "grouped_mm_engine.py:210 backward"
    assert mem_peak.site([torch_frame, user]) == "train.py:7 step" and mem_peak.site([]) == "?"
    events = [dict(action="alloc", addr=1, size=100, frames=[gen]),
              dict(action="alloc", addr=2, size=50, frames=[ours, gen]),
              dict(action="free_requested", addr=1, size=100),  # not yet reusable: still counted
              dict(action="alloc", addr=3, size=30, frames=[ours, gen]),
              dict(action="free_completed", addr=1, size=100),
              dict(action="alloc", addr=4, size=60, frames=[user])]
    peak, sites = mem_peak.peak_live(events)
    assert peak == 180 and sites == {"cab.py:12 call": 100, "grouped_mm_engine.py:210 backward": 80}
    peak, _ = mem_peak.peak_live([e for e in events if e["action"] != "free_completed"])  # frees as requested then
    assert peak == 150


def test_rule_file_writes_what_the_speed_rule_reads(tmp_path, monkeypatch):
    """benchmarks/rule_file.py: bench_hf runs with the experts kept and rewritten become a GPU's whole_model file,
    each family's mode at its worst size; the speed rule then keeps Inductor's path on that GPU exactly where a
    value is below 1.0, and keeps the file's entries that the runs did not measure."""
    from benchmarks import bench_hf, rule_file
    from moe_inductor import speed_rule

    def row(family, mode, size, column, value):
        return dict(family=family, layers=2, mode=mode, size=size, column=column, value=value, unit="ms")

    kept, off = bench_hf.EXPERTS_KEPT, bench_hf.RULE_OFF
    run = {"meta": {"device": "NVIDIA H100 80GB HBM3"}, "rows": [
        row("qwen3_moe", "prefill", 4096, kept, 4.8), row("qwen3_moe", "prefill", 4096, off, 3.2),  # 1.50
        row("qwen3_moe", "prefill", 512, kept, 1.0), row("qwen3_moe", "prefill", 512, off, 1.25),  # 0.80: the worst
        row("gpt_oss", "train", 4096, kept, 54.0), row("gpt_oss", "train", 4096, off, 45.0),  # 1.20
        row("qwen3_moe", "train", 1024, kept, 6.0), row("qwen3_moe", "train", 1024, off, 10.0),  # 0.60
        row("qwen3_moe", "train", 4096, kept, 14.4), row("qwen3_moe", "train", 4096, off, 13.5),  # 1.067: long
        row("gpt_oss", "prefill", 4096, "moe_inductor", 8.0)]}  # no experts-kept column: no value
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run.json").write_text(json.dumps(run))
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"layers": [
        {"name": "Mixtral-8x7B", "route": "hf", "activation": "silu_glu", "gate_up": "concat", "bias": False,
         "shape": [4096, 14336, 8, 2], "prefill": 0.9},
        {"name": "GPT-OSS-20B", "route": "hf", "activation": "gptoss_glu", "gate_up": "interleaved", "bias": True,
         "shape": [2880, 2880, 32, 4], "decode": 1.3, "train": 0.5}]}))
    path = rule_file.main([str(tmp_path / "runs" / "run.json"), "--out-dir", str(tmp_path), "--write"])
    layers = {e["name"]: e for e in json.loads(path.read_text())["layers"]}
    assert layers["Qwen3-30B-A3B"]["prefill"] == 0.8 and layers["Qwen3-30B-A3B"]["shape"] == [2048, 768, 128, 8]
    assert (layers["GPT-OSS-20B"]["train"], layers["GPT-OSS-20B"]["decode"]) == (1.2, 1.3)  # decode kept
    # training: "train" the worst over sizes, "train_long" the 4096-token step's, each rounded down
    assert (layers["Qwen3-30B-A3B"]["train"], layers["Qwen3-30B-A3B"][speed_rule.TRAIN_LONG]) == (0.6, 1.06)
    assert layers["GPT-OSS-20B"][speed_rule.TRAIN_LONG] == 1.2
    assert "prefill" not in layers["GPT-OSS-20B"] and layers["Mixtral-8x7B"]["prefill"] == 0.9

    monkeypatch.setattr(speed_rule, "_DATA_DIR", tmp_path)
    monkeypatch.setattr(speed_rule, "_gpu_tag", lambda device: "NVIDIA_H100_80GB_HBM3")
    speed_rule._tables.cache_clear()
    try:
        cuda = torch.device("cuda")
        qwen3 = speed_rule.LayerKind("silu_glu", "concat", False, (2048, 768, 128, 8))
        gptoss = speed_rule.LayerKind("gptoss_glu", "interleaved", True, (2880, 2880, 32, 4))
        assert speed_rule.keeps_inductor(qwen3, cuda, "prefill", "inductor")  # 0.80 at T = 512
        assert speed_rule.keeps_inductor(gptoss, cuda, "train", "inductor") is None  # 1.20
        assert speed_rule.keeps_inductor(gptoss, cuda, "decode", "inductor") is None  # 1.3, kept from the file
        assert "0.60x" in speed_rule.keeps_inductor(qwen3, cuda, "train", "inductor")  # a 1024-token step lost
        assert speed_rule.keeps_inductor(qwen3, cuda, speed_rule.TRAIN_LONG, "inductor") is None
    finally:
        speed_rule._tables.cache_clear()


def test_rule_file_refuses_runs_of_two_gpus():
    from benchmarks import rule_file

    runs = [{"meta": {"device": "NVIDIA H100 80GB HBM3"}, "rows": []}, {"meta": {"device": "NVIDIA H200"}, "rows": []}]
    with pytest.raises(ValueError, match="different GPUs"):
        rule_file.measured(runs)


def test_rule_file_merges_bench_fx_forms_logs(tmp_path):
    """--fx-logs: the RULE lines of bench_fx_forms.py's logs (the H100's, as measured) replace the modes of the
    entries of their route and shape, keep the rest, and add the routes the file lacks; logs of two GPUs are
    refused."""
    from benchmarks import rule_file

    data = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
    logs = sorted(str(p) for p in data.glob("bench_fx_forms_h100_2026-12-05_thirtyfourth_*.log"))
    assert len(logs) == 3
    dsv2 = [2048, 1408, 64, 6]
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"layers": [
        {"name": "old loop", "route": "fx_loop", "activation": "silu_glu", "gate_up": "separate", "bias": False,
         "shape": dsv2, "prefill": 0.5, "decode": 0.5, "train": 0.5},
        {"name": "Qwen3-30B-A3B", "route": "hf", "activation": "silu_glu", "gate_up": "concat", "bias": False,
         "shape": [2048, 768, 128, 8], "prefill": 1.1}]}))
    path = rule_file.main(["--fx-logs", *logs, "--out-dir", str(tmp_path), "--write"])
    layers = json.loads(path.read_text())["layers"]
    by = {(e["route"], tuple(e["shape"])): e for e in layers}
    loop = by[("fx_loop", tuple(dsv2))]
    assert loop["name"] == "old loop" and (loop["prefill"], loop["decode"], loop["train"]) == (10.49, 30.53, 28.79)
    assert by[("hf", (2048, 768, 128, 8))]["prefill"] == 1.1
    added = by[("fx_sorted", (4096, 14336, 8, 2))]
    # the RULE line's 0.69 was rounded; its long step's rows, rounded down, say 0.68, and "train" is never above it
    assert (added["train"], added["train_long"]) == (0.68, 0.68)
    assert len(layers) == 2 + 5  # fx_list and fx_sorted at both widths, fx_loop at Mixtral's
    other = tmp_path / "h200.log"
    other.write_text("torch 2.11.0, NVIDIA H200, H=1\nRULE " + json.dumps(loop) + "\n")
    with pytest.raises(SystemExit, match="different GPUs"):
        rule_file.main(["--fx-logs", logs[0], str(other), "--out-dir", str(tmp_path)])


@pytest.mark.slow  # three compiles of the layer
def test_bench_moe_infer_cpu_runs_end_to_end():
    from benchmarks import bench_moe_infer_cpu

    rows = bench_moe_infer_cpu.main(["--tiny", "--tokens", "3", "--rounds", "1", "--calls", "1"])
    assert [r["T"] for r in rows] == [3] and all(r[c] > 0 for r in rows for c in ("eager", "inductor", "moe_inductor"))


def test_bench_loop_cpu_runs_end_to_end():
    from benchmarks import bench_loop_cpu

    rows = bench_loop_cpu.main(["--tokens", "3", "--rounds", "1", "--calls", "1", "--widths", "16", "8", "4", "2"])
    assert [(r["bias"], r["T"]) for r in rows] == [(False, 3), (True, 3)]
    assert all(r["rewrites"] == {"unrolled_loop": 1} for r in rows), rows


def test_bench_capacity_cpu_runs_end_to_end():
    from benchmarks import bench_capacity_cpu

    rows = bench_capacity_cpu.main(["--tokens", "5", "--rounds", "1", "--calls", "1", "--widths", "16", "8", "4"])
    assert [r["T"] for r in rows] == [5] and rows[0]["rewrites"] == {"padded_capacity": 1}, rows


def test_bench_fx_forms_rewrites_every_form_it_times(monkeypatch):
    """Each form's layer is rewritten by its FX pass (a row that times Inductor's path twice would be worthless on
    the GPU), equal to eager, in a forward and a training step; the speed rule is off while it runs."""
    from benchmarks import bench_fx_forms
    from moe_inductor import config

    monkeypatch.setattr(config, "speed_rule", True)  # restored after; the script turns it off itself
    rows = bench_fx_forms.main(["--device", "cpu", "--inner", "aot_eager", "--columns", "eager", "moe_inductor",
                                "--tokens", "6", "--widths", "16", "8", "4", "2"])
    assert config.speed_rule is False
    ours = [r for r in rows if r["column"] == "moe_inductor"]
    assert sorted({r["form"] for r in ours}) == sorted(bench_fx_forms.FORMS) and len(ours) == 2 * len(bench_fx_forms.FORMS)
    for r in ours:  # max abs error on O(1) outputs; sorted runs in bf16 (torch._grouped_mm), a few ulps of 2**-8
        assert r["rewrites"] >= 1 and r["err"] < (1e-1 if r["form"] == "sorted" else 1e-4), r


def test_bench_fx_forms_rule_entries_take_each_modes_worst_ratio():
    from benchmarks.bench_fx_forms import rule_entries

    def row(form, mode, T, column, ms, rewrites=1):
        return dict(form=form, mode=mode, T=T, column=column, ms=ms, rewrites=rewrites)

    rows = [row("stacked_loop", "forward", 4096, "inductor", 6.0), row("stacked_loop", "forward", 4096,
                                                                          "moe_inductor", 5.0),
            row("stacked_loop", "forward", 8192, "inductor", 9.0), row("stacked_loop", "forward", 8192,
                                                                          "moe_inductor", 10.0),
            row("stacked_loop", "forward", 16, "inductor", 1.0), row("stacked_loop", "forward", 16,
                                                                        "moe_inductor", 0.5),
            row("stacked_loop", "forward", 64, "inductor", 1.0), row("stacked_loop", "forward", 64,
                                                                        "moe_inductor", 0.1),  # no rule mode
            row("stacked_loop", "train", 4096, "inductor", 3.0), row("stacked_loop", "train", 4096,
                                                                        "moe_inductor", 3.0, rewrites=0)]
    (entry,) = rule_entries(rows, [16, 8, 4, 2])
    assert entry["route"] == "fx_loop" and entry["shape"] == [16, 8, 4, 2]
    assert entry["prefill"] == 0.9 and entry["decode"] == 2.0 and "train" not in entry  # not rewritten: no value


def test_graphs_check_flags_a_compiled_column_that_compiled_again(tmp_path):
    """graphs_check.py over bench_hf rows: the recompile storm's row (27 graphs) fails the check, and so do a
    compiled row that ran nothing and a run with no row timed; one graph per compiled column, eager's zero and a
    decode cell's several pass."""
    import json

    from benchmarks import graphs_check

    rows = [dict(family="qwen2_moe", mode="train", size=1024, column="moe_inductor_experts_kept", value=9.2,
                 unit="ms", graphs=1),
            dict(family="qwen2_moe", mode="train", size=1024, column="eager", value=20.0, unit="ms", graphs=0),
            dict(family="qwen2_moe", mode="decode", size=1, column="inductor", value=500.0, unit="new tok/s",
                 graphs=3),
            dict(family="qwen2_moe", mode="decode", size=16, column="inductor", skipped="time budget")]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rows": rows}))
    assert graphs_check.main([str(good)]) == 0
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps({"rows": rows + [dict(family="qwen2_moe", mode="prefill", size=512,
                                                        column="moe_inductor_rule_off", skipped="time budget")]}))
    assert graphs_check.main([str(skipped)]) == 1
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"rows": rows[1:]}))  # eager and decode only: nothing checked
    assert graphs_check.main([str(nothing)]) == 1
    storm = tmp_path / "storm.json"
    storm.write_text(json.dumps({"rows": rows + [dict(family="qwen2_moe", mode="train", size=1024,
                                                      column="moe_inductor_rule_off", value=3143.25, unit="ms",
                                                      graphs=27)]}))
    assert graphs_check.main([str(good), str(storm)]) == 1
    assert graphs_check.offending(json.loads(storm.read_text())["rows"]) == [
        "qwen2_moe train 1024 moe_inductor_rule_off: 27 graphs (3143.25 ms)"]
