#!/usr/bin/env bash
# Prepared in session 5, not yet run (its device time was spent): the first call of the next
# session, for what v5 left open (reports/h200/perf_notes.md, "v5: a Gluon forward").
# 1. GPU tests the Gluon forward has not had: strided views (packed qkv, padded rows) and the
#    fp16 head-dim-128 backward (its inputs are the Gluon forward's output and logsumexp).
# 2. The regression baseline re-saved for the v5 forward (the committed one predates it).
# 3. The Gluon forward at head dim 64 a second time (one run read 0.97-1.10x the Triton kernel).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6_* $R/gpu_tests_v6*  # this run's files only
stage "gpu tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "strided_views or gluon or (backward_matches and d128 and fp16)" > $R/gpu_tests_v6.log 2>&1
rc=$?; echo "rc=$rc"; tail -3 $R/gpu_tests_v6.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: nothing else"; exit 0; fi
stage "regression baseline"
timeout 200 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 2 \
  --out $R/v6_baseline --save-baseline $R/v6_baseline/nvidia-h200.json > $R/v6_baseline.log 2>&1
echo "rc=$?"; pack  # then copy v6_baseline/nvidia-h200.json to reports/baselines/
stage "Gluon forward at head dim 64, second run"
OUT=$R/v6_gluon_d64 timeout 150 python3 tools/experiments/exp_fwd_gluon.py --time bf16 > $R/v6_gluon_d64.log 2>&1
echo "rc=$?"; grep "d64" $R/v6_gluon_d64.log; pack
stage done
