#!/usr/bin/env bash
# Everything a GPU session should run, in one device call (sized for the 10-minute per-command limit).
#   bash benchmarks/device_run.sh tests      # GPU suite + memcheck                       (~4 min)
#   bash benchmarks/device_run.sh experts    # bench_experts.py, the RESULTS.md table       (~5 min)
#   bash benchmarks/device_run.sh hf         # bench_hf.py, whole-model prefill and decode  (not yet timed)
# Outputs go to $OUT (the device tool brings them back). The project must be installed for the entry point.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
python -m pip install --no-build-isolation --no-deps -e . -q >/dev/null 2>&1
case "${1:-tests}" in
  tests)
    timeout 330 python -m pytest tests/test_gpu.py tests/test_kernels.py tests/test_routing.py -q -p no:warnings \
      2>&1 | grep -v torch.__trace | tee "$OUT/gpu_tests.log" | tail -15
    timeout 150 compute-sanitizer --tool memcheck python -m pytest tests/test_kernels.py -q -p no:warnings -x \
      2>&1 | tee "$OUT/sanitizer.log" | tail -4 ;;
  experts)
    timeout 560 python benchmarks/bench_experts.py --tokens 16 512 4096 16384 --skew-tokens 4096 \
      --hf-shapes qwen3 mixtral --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    tail -30 "$OUT/bench.md" ;;
  hf)
    timeout 560 python benchmarks/bench_hf.py --json "$OUT/hf.json" 2>&1 | tee "$OUT/hf.log" | tail -20 ;;
esac
