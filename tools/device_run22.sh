#!/usr/bin/env bash
# Session 6, third call: v6 as committed (Gluon forward at head dim 64 from 4k keys, compile-time
# causal flag; fused-dQ backward available but off in every table).
# 1. GPU tests: the Gluon forward (now with head-dim-64 shapes), strided views, the fused-dQ
#    backward (TMA reduce-adds) against float64, the deterministic backward.
# 2. Only if they pass: the paper suite's head-dim-64 rows (forward, forward+backward) in both
#    dtypes, all three providers in each run, to replace the committed ones.
# 3. The regression baseline re-saved (copy v6_baseline/nvidia-h200.json to reports/baselines/).
# 4. If time is left: Nsight Compute counters of the backward, dQ kernel against fused dQ.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6c_* $R/gpu_tests_v6c*  # this run's files only
stage "gpu tests"
timeout 140 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "gluon or fused_dq or deterministic or strided_views" > $R/gpu_tests_v6c.log 2>&1
rc=$?; echo "rc=$rc"; tail -3 $R/gpu_tests_v6c.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: no timing"; exit 0; fi
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --hdims 64"
for spec in "fwd bf16" "fwd fp16" "fwd_bwd bf16" "fwd_bwd fp16"; do
  set -- $spec
  stage "paper $2 $1, head dim 64"
  timeout 85 python3 runner.py $P --modes $1 --dtype $2 --out $R/v6c_${2}_d64_$1 > $R/v6c_${2}_d64_$1.log 2>&1
  echo "rc=$?"; pack
done
stage "regression baseline"
timeout 100 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 2 \
  --out $R/v6c_baseline --save-baseline $R/v6c_baseline/nvidia-h200.json > $R/v6c_baseline.log 2>&1
echo "rc=$?"; tail -2 $R/v6c_baseline.log; pack
if [ $SECONDS -lt 470 ]; then
  stage "ncu: backward, dQ kernel vs fused dQ"
  mkdir -p $R/v6c_bwd_counters
  OUT=$R/v6c_bwd_counters timeout $((580 - SECONDS)) python3 tools/experiments/exp_bwd_dq_counters.py \
    > $R/v6c_bwd_counters.log 2>&1
  echo "rc=$?"; tail -22 $R/v6c_bwd_counters.log; pack
fi
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v6c_*d64*/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
