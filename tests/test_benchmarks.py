"""Smoke runs of the benchmark scripts on the CPU, so that a broken script is found here and not on the GPU, where
every minute is budgeted. They check that each script runs end to end and prints its rows; they measure nothing."""
import pytest


def test_bench_hf_runs_on_a_tiny_model(capsys, tmp_path):
    import json

    from benchmarks import bench_hf

    out = tmp_path / "hf.json"
    bench_hf.main(["--tiny", "--device", "cpu", "--skip-decode", "--tokens", "8", "--variants", "eager",
                   "moe_inductor", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "prefill T=8" in printed and "moe_inductor vs eager" in printed and "(back to back)" in printed
    result = json.loads(out.read_text())
    assert set(result["prefill_ms"]["8"]) == set(result["prefill_back_to_back_ms"]["8"]) == {"eager", "moe_inductor"}
    assert all(ms > 0 for ms in result["prefill_back_to_back_ms"]["8"].values())


def test_host_python_runs(capsys, monkeypatch):
    import moe_inductor
    from benchmarks import host_python

    monkeypatch.setattr(moe_inductor.config, "triton_on_cpu", moe_inductor.config.triton_on_cpu)  # restored after
    with monkeypatch.context() as m:
        from moe_inductor.kernels import launch
        from moe_inductor.ops import grouped, routing

        for module, name in ((launch, "grouped_gemm_kernel"), (routing, "route_count_kernel"),
                             (routing, "route_place_kernel"), (grouped, "combine_kernel")):
            m.setattr(module, name, getattr(module, name))  # the script stubs them: put them back afterwards
        host_python.main(reps=20)
    assert capsys.readouterr().out.count("us per call") == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mem_backward_runs(capsys, dtype):
    from benchmarks import mem_backward

    mem_backward.main(["--dtype", dtype, "--shape", "64", "32", "64", "4", "2"])
    assert capsys.readouterr().out.strip()


def test_device_run_script_names_only_existing_diagnostics():
    """device_run.sh calls debug_gpu.py by function name; a typo there would cost a GPU call to find."""
    import re
    import subprocess
    from pathlib import Path

    from benchmarks import debug_gpu

    script = Path(__file__).parents[1] / "benchmarks" / "device_run.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    called = {name for line in re.findall(r"debug_gpu\.py((?: [a-z_]+)+)", script.read_text()) for name in line.split()}
    assert called and all(callable(getattr(debug_gpu, name, None)) for name in called), called


def test_fwd_bwd_cpu_runs(capsys):
    from benchmarks import fwd_bwd_cpu

    fwd_bwd_cpu.main(["--shape", "8", "16", "8", "3", "2", "--reps", "2"])
    assert "fwd+bwd median" in capsys.readouterr().out


def test_bench_hf_opaque_variant_compiles_under_its_config(monkeypatch):
    """The opaque variant runs (and compiles) with config.visible_kernels off, the others under the default, and the
    setting is put back."""
    import moe_inductor
    from benchmarks import bench_hf

    monkeypatch.setattr(moe_inductor.config, "visible_kernels", True)
    with bench_hf.variant_config("moe_inductor_opaque"):
        assert not moe_inductor.config.visible_kernels
    with bench_hf.variant_config("moe_inductor"):
        assert moe_inductor.config.visible_kernels
    assert moe_inductor.config.visible_kernels


def test_every_script_device_run_calls_exists_and_parses_its_arguments():
    """The GPU-only scripts (they time with CUDA events) cannot run here; each must at least import and parse its
    command line, so that a typo does not cost a GPU call."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    scripts = set(re.findall(r"benchmarks/([a-z_]+)\.py", (root / "benchmarks" / "device_run.sh").read_text()))
    scripts.discard("debug_gpu")  # takes diagnostic names, checked above
    assert {"bench_backward_engine", "tune_weight_grad", "profile_experts", "bench_hf"} <= scripts
    for name in sorted(scripts):
        out = subprocess.run([sys.executable, str(root / "benchmarks" / f"{name}.py"), "--help"], capture_output=True,
                             text=True, cwd=root, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stderr[-2000:])
