#!/usr/bin/env bash
# Session 2, fourth device call: GPU tests of the changed backward launch order (causal) and
# determinism; the ablation (head dim 128 sweep and settings A/B) timed with CUDA-graph
# replay, its Nsight Compute counters; the regression baseline re-saved for the new forward;
# the pytest-benchmark perf tests.
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests: causal backward, determinism"
timeout 90 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "(backward and causal) or deterministic" \
  > $R/gpu_tests_causal_bwd.log 2>&1; echo "rc=$?"; tail -2 $R/gpu_tests_causal_bwd.log; pack
stage "ablation, CUDA-graph timing"
timeout 190 python3 runner.py --ablation all --repeats 2 --hdims 128 --seqlens 1024,4096,16384 --cuda-graph --no-ncu \
  --out $R/ablation > $R/ablation.log 2>&1; echo "rc=$?"; tail -4 $R/ablation.log; pack
stage "ablation counters"
timeout 110 python3 runner.py --ablation all --settings-only --ncu-only --resume --out $R/ablation \
  > $R/ablation_ncu.log 2>&1; echo "rc=$?"; tail -3 $R/ablation_ncu.log; pack
stage "regression baseline"
timeout 60 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 2 \
  --save-baseline $R/baseline/nvidia-h200.json --out $R/quick_baseline > $R/quick_baseline.log 2>&1; echo "rc=$?"; pack
stage "perf tests"
timeout 50 python3 -m pytest -q -m perf tests/test_perf.py --benchmark-json=$R/perf_benchmark.json \
  > $R/perf_tests.log 2>&1; echo "rc=$?"; tail -3 $R/perf_tests.log
stage done
grep -A12 "^provider" $R/ablation.log | head -14
