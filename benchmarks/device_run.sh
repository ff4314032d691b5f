#!/usr/bin/env bash
# Everything a GPU session should run, in one device call (sized for the 10-minute per-command limit).
#   bash benchmarks/device_run.sh tests      # the GPU suite, part 1 (tests/test_gpu.py)     (~6 min)
#   bash benchmarks/device_run.sh kernels    # the GPU suite, part 2 (kernels, routing, engine) (~3 min)
#   bash benchmarks/device_run.sh examples   # memcheck of the kernel tests + every example  (~4 min)
#   bash benchmarks/device_run.sh experts    # bench_experts.py, the RESULTS.md table       (~5 min)
#   bash benchmarks/device_run.sh hf         # bench_hf.py, whole-model prefill and decode, with the opaque-op
#                                            # column                                          (~5 min warm)
#   bash benchmarks/device_run.sh perf       # T=512 prefill: visible kernels and CUDA graphs against inductor,
#                                            # then host vs wall                                (~9 min)
#   bash benchmarks/device_run.sh open       # the visible-kernel GPU tests with recompile logs  (~2 min)
#   bash benchmarks/device_run.sh decode     # why the visible op decoded slowly under CUDA graphs (debug_gpu.py
#                                            # decode_visible)                                   (~5 min)
#   bash benchmarks/device_run.sh bwd        # forward + backward kernel breakdown, ours against sort + _grouped_mm
#                                            # (profile_experts.py, Qwen3, GPT-OSS, DeepSeek-V3 at T=4096) (~3 min)
#   bash benchmarks/device_run.sh tunewg     # tune the weight-gradient kernel (tune_weight_grad.py: fwd+bwd before,
#                                            # after, sort+_grouped_mm), merge into the table, rerun the backward
#                                            # GPU tests with it                                 (~8 min)
#   bash benchmarks/device_run.sh bwdengine  # fwd+bwd with each pairing of GEMM engines vs sort+_grouped_mm
#                                            # (bench_backward_engine.py), then the engine's GPU tests (~5 min)
#   bash benchmarks/device_run.sh pending6   # what the sixth session could not run: the backward's auto rule as
#                                            # shipped (bench_backward_engine.py), the engine's GPU tests, the
#                                            # weight-position FX forms on the GPU                 (~5 min)
#   bash benchmarks/device_run.sh close4     # hf, then the GPU tests of the fifth session's changes   (~8 min)
#   bash benchmarks/device_run.sh verify     # bench_hf (with the opaque-op column), then the GPU suite's compile-
#                                            # heavy files in 4 parallel shards                 (~9 min)
# A cold machine start costs held time too: batch what you need into few calls and give the machine back after.
# Outputs go to $OUT (the device tool brings them back). The project must be installed for the entry point.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
python -m pip install --no-build-isolation --no-deps -e . -q >/dev/null 2>&1
# the device has no internet: test-only wheels (expecttest, hypothesis) come along in .wheels/ (carry=[".wheels"])
if [ -d .wheels ]; then python -m pip install --no-deps -q .wheels/*.whl >/dev/null 2>&1; fi
case "${1:-tests}" in
  tests)  # the GPU suite, part 1: the op on the GPU, HF models, FX forms, CUDA graphs, compile counts
    timeout -s INT 560 python -m pytest tests/test_gpu.py -q -p no:warnings \
      --durations=10 2>&1 | grep -v torch.__trace | tee "$OUT/gpu_tests.log" | tail -30 ;;
  kernels)  # the GPU suite, part 2: kernels, routing, rewritten graphs, the grouped_mm engine, visible kernels
    timeout -s INT 560 python -m pytest tests/test_kernels.py tests/test_routing.py tests/test_rewritten_graphs.py \
      tests/test_grouped_mm_engine.py tests/test_visible_kernels.py -q -p no:warnings \
      --durations=10 2>&1 | grep -v torch.__trace | tee "$OUT/gpu_kernel_tests.log" | tail -30 ;;
  examples)
    timeout 260 compute-sanitizer --tool memcheck python -m pytest tests/test_kernels.py tests/test_grouped_mm_engine.py \
      -q -p no:warnings -x -k "not inductor_graph" \
      2>&1 | tee "$OUT/sanitizer.log" | tail -4
    for ex in quickstart generate train_step inspect_hf gshard_capacity your_own_loop; do
      echo "== examples/$ex.py"; timeout 120 python "examples/$ex.py" 2>&1 | tee "$OUT/example_$ex.log" | tail -12
    done ;;
  experts)  # the engine's own GPU tests first: a table of a broken engine would be worthless
    timeout -s INT 150 python -m pytest tests/test_grouped_mm_engine.py -q -p no:warnings 2>&1 | tail -3
    timeout 420 python benchmarks/bench_experts.py --tokens 16 512 4096 16384 --skew-tokens 4096 \
      --hf-shapes qwen3 mixtral --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    tail -30 "$OUT/bench.md" ;;
  hf)
    timeout 560 python benchmarks/bench_hf.py --variants eager inductor moe_inductor moe_inductor_opaque \
      --json "$OUT/hf.json" 2>&1 | grep -v "torch.__trace\|^DEBUG" | tee "$OUT/hf.log" | tail -24 ;;
  perf)  # the host-bound T = 512 prefill: visible kernels and CUDA graphs against inductor (one process each), then
         # where the host time goes (prefill_host: host vs wall, fast launch A/B)
    timeout 220 python benchmarks/bench_hf.py --variants inductor moe_inductor moe_inductor_opaque \
      --skip-decode --tokens 512 4096 --json "$OUT/hf_visible.json" 2>&1 | grep "prefill T" | sed "s/^/visible /"
    timeout 190 python benchmarks/bench_hf.py --variants inductor moe_inductor --skip-decode --tokens 512 4096 \
      --prefill-mode reduce-overhead --json "$OUT/hf_cudagraphs.json" 2>&1 | grep "prefill T" | sed "s/^/cudagraphs /"
    timeout 150 python benchmarks/debug_gpu.py prefill_host 2>&1 | grep -v "torch.__trace\|^DEBUG" > "$OUT/prefill_host.log"
    grep PREFILL512 "$OUT/prefill_host.log"; grep -A30 "PREFILL HOST" "$OUT/prefill_host.log" | cut -c1-200 | head -40 ;;
  verify)  # the benchmark first, alone on the machine; then tests, sharded: compiles are CPU-bound and it has 16 cores
    timeout 270 python benchmarks/bench_hf.py --variants eager inductor moe_inductor moe_inductor_opaque \
      --json "$OUT/hf.json" 2>&1 | grep -v "torch.__trace\|^DEBUG" | tee "$OUT/hf.log" | grep -E "prefill|decode|torch"
    python -m pytest --collect-only -q -o addopts="" tests/test_gpu.py tests/test_visible_kernels.py \
      tests/test_grouped_mm_engine.py \
      2>/dev/null | grep "::" > /tmp/test_ids.txt
    # (ids and shards outside $OUT: the device tool brings back only a few files)
    for i in 0 1 2 3; do
      awk -v i=$i 'NR % 4 == i' /tmp/test_ids.txt > /tmp/shard_$i.txt
      timeout -s INT 290 python -m pytest $(cat /tmp/shard_$i.txt) -o addopts="--strict-markers" -q -p no:warnings \
        -p no:cacheprovider > "$OUT/shard_$i.log" 2>&1 &
    done
    wait
    for i in 0 1 2 3; do grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/shard_$i.log" | tail -8; done ;;
  close4)  # issue 4's benchmark first (alone on the machine), then the GPU tests that cover this session's changes
    timeout 380 python benchmarks/bench_hf.py --variants eager inductor moe_inductor moe_inductor_opaque \
      --json "$OUT/hf.json" 2>&1 | grep -v "torch.__trace\|^DEBUG" | tee "$OUT/hf.log" | grep -E "prefill|decode"
    timeout -s INT 180 python -m pytest tests/test_gpu.py tests/test_grouped_mm_engine.py tests/test_visible_kernels.py \
      -o addopts="--strict-markers" -q -p no:warnings --tb=short \
      -k "visible or inductor_graph or (hf_models_rewritten_on_gpu_bf16 and qwen3) or static_cache_decode or layouts" 2>&1 \
      | grep -v "torch.__trace" | tee "$OUT/close4_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" ;;
  bwd)
    for shape in qwen3 gptoss deepseekv3; do
      timeout 150 python benchmarks/profile_experts.py --shape $shape --tokens 4096 --backward --reference 2>&1 \
        | grep -v "torch.__trace" | tee -a "$OUT/bwd_profile.log" | grep -E "^==|Self CUDA time total" | cut -c1-160
    done ;;
  tunewg)
    timeout 400 python benchmarks/tune_weight_grad.py --shapes qwen3 gptoss deepseekv3 --tokens 4096 16384 \
      --json "$OUT/tuned_wgrad.json" --merge 2>&1 | grep -v "torch.__trace" | tee "$OUT/tune_wgrad.log" \
      | grep -v "autotuning "
    cp moe_inductor/kernels/tuned/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
    timeout -s INT 120 python -m pytest tests/test_kernels.py tests/test_gpu.py -o addopts="--strict-markers" -q \
      -p no:warnings --tb=short -k "backward or weight_grad or wgrad or fp64" 2>&1 | grep -v "torch.__trace" \
      | tee "$OUT/tunewg_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" ;;
  bwdengine)
    timeout 330 python benchmarks/bench_backward_engine.py 2>&1 | grep -v "torch.__trace" | tee "$OUT/bwd_engine.log"
    timeout -s INT 100 python -m pytest tests/test_grouped_mm_engine.py -o addopts="--strict-markers" -q \
      -p no:warnings --tb=short 2>&1 | tee "$OUT/engine_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" ;;
  autobwd)  # the backward's "auto" rule, measured as shipped (auto column), and its GPU tests
    timeout 100 python benchmarks/bench_backward_engine.py --shapes qwen3 gptoss --tokens 4096 2>&1 \
      | grep -v "torch.__trace" | tee "$OUT/bwd_auto.log"
    timeout -s INT 60 python -m pytest tests/test_grouped_mm_engine.py -o addopts="--strict-markers" -q \
      -p no:warnings --tb=short -k "auto or differ" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed|Error" ;;
  pending6)
    timeout 240 python benchmarks/bench_backward_engine.py --shapes qwen3 gptoss deepseekv3 --tokens 4096 16384 2>&1 \
      | grep -v "torch.__trace" | tee "$OUT/bwd_engine_default.log"
    timeout -s INT 200 python -m pytest tests/test_grouped_mm_engine.py tests/test_gpu.py -o addopts="--strict-markers" \
      -q -p no:warnings --tb=short -k "engine or fx_forms or holds" 2>&1 | grep -v "torch.__trace" \
      | tee "$OUT/pending6_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    timeout 120 python examples/your_own_loop.py 2>&1 | tail -6 ;;
  decode)
    timeout 500 python benchmarks/debug_gpu.py decode_visible 2>&1 | grep -v "torch.__trace\|^DEBUG" \
      | tee "$OUT/decode_visible.log" | grep -E "DECODE16|FAILED" ;;
  open)  # the visible-kernel GPU tests with recompile logs (which guard failed, if one does)
    TORCH_LOGS="recompiles" timeout -s INT 200 python -m pytest tests/test_gpu.py -q -p no:warnings --tb=short -rxX \
      -k "visible" 2>&1 | grep -v "torch.__trace\|^DEBUG" > "$OUT/open_tests.log"
    grep -E "triggered by|guard failure|^ *- |passed|failed|xfail|XPASS" "$OUT/open_tests.log" | cut -c1-400 | head -40 ;;
esac
