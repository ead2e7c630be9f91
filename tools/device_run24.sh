#!/usr/bin/env bash
# Session 6: the regression baseline again, with --repeats 3 (README: "a truer band"). The
# --repeats 2 baseline of device_run22.sh read its first configuration (Gluon forward, 1k,
# non-causal) at 364-440 TFLOPs/s with a wide spread inside each repeat, while the comparison
# run of device_run23.sh read 545-548 there; with that band a regression there would have to
# fall below 346 to be flagged. Then a comparison against the new baseline.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6e_*
stage "regression baseline, 3 repeats"
timeout 200 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3 \
  --out $R/v6e_baseline --save-baseline $R/v6e_baseline/nvidia-h200.json > $R/v6e_baseline.log 2>&1
echo "rc=$?"; tail -12 $R/v6e_baseline.log; pack
stage "comparison against it"
timeout 150 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v6e_compare \
  --compare $R/v6e_baseline/nvidia-h200.json > $R/v6e_compare.log 2>&1
echo "rc=$?"; grep "PASS\|FAIL" $R/v6e_compare.log; pack
stage done
