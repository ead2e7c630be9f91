#!/usr/bin/env bash
# For the next device call (not run in session 8, whose device time was spent): the GPU tests of
# the launch cache after the review's changes to kernels/launch.py at 74ab2e4 (debug and
# instrumentation knobs and keyword values in the key; kernels with pre-run hooks through the
# JIT), then a comparison against the v8 baseline saved at 38c87fc.
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests: repeated calls (cached launches), the Gluon kernels, determinism"
timeout 300 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "repeated_calls or gluon or deterministic" > $R/gpu_tests_v8_review.log 2>&1
rc=$?; echo "rc=$rc"; tail -2 $R/gpu_tests_v8_review.log; pack
stage "comparison against the v8 baseline"
timeout 120 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v8_compare \
  --compare reports/baselines/nvidia-h200.json > $R/v8_compare.log 2>&1
echo "rc=$?"; grep "PASS\|FAIL" $R/v8_compare.log; pack
stage done
