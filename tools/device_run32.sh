#!/usr/bin/env bash
# Session 7: the regression baseline re-saved with the Gluon dK/dV kernel in the backward (3
# repeats, as v6's), then a comparison against it.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7e_*
stage "regression baseline, 3 repeats"
timeout 260 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3 \
  --out $R/v7e_baseline --save-baseline $R/v7e_baseline/nvidia-h200.json > $R/v7e_baseline.log 2>&1
echo "rc=$?"; tail -3 $R/v7e_baseline.log; pack
stage "comparison against it"
timeout $((585 - SECONDS)) python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v7e_compare \
  --compare $R/v7e_baseline/nvidia-h200.json > $R/v7e_compare.log 2>&1
echo "rc=$?"; grep "PASS\|FAIL" $R/v7e_compare.log | tail -3; pack
stage done
