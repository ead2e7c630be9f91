#!/usr/bin/env bash
# Session 6, last call: the whole GPU test suite on the final v6 code (the backward's kernels
# changed signature for the fused-dQ option, so every backward test runs again), then the perf
# tests and a regression comparison against the baseline re-saved by device_run22.sh.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6d_* $R/gpu_tests_v6d*  # this run's files only
stage "gpu tests (all)"
timeout 400 python3 -m pytest -q -m gpu tests/ > $R/gpu_tests_v6d.log 2>&1
echo "rc=$?"; tail -4 $R/gpu_tests_v6d.log; pack
if [ $SECONDS -lt 470 ]; then
  stage "perf tests"
  timeout 60 python3 -m pytest -q -m perf tests/test_perf.py --benchmark-json=$R/v6d_perf_benchmark.json > $R/v6d_perf_tests.log 2>&1
  echo "rc=$?"; tail -3 $R/v6d_perf_tests.log; pack
fi
if [ $SECONDS -lt 520 ]; then
  stage "regression comparison against reports/baselines/nvidia-h200.json"
  timeout $((585 - SECONDS)) python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v6d_compare \
    --compare reports/baselines/nvidia-h200.json > $R/v6d_compare.log 2>&1
  echo "rc=$?"; grep -i "regression\|improvement\|verdict\|within" $R/v6d_compare.log | tail -6; pack
fi
stage done
