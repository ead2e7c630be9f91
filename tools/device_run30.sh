#!/usr/bin/env bash
# Session 7: the production backward now takes the Gluon dK/dV kernel at head dim 128 from 1k keys
# (BwdConfig.hopper_gluon_min_keys). The whole GPU suite (it includes the new Gluon dK/dV tests),
# then the paper sweep at head dim 128 for the backward modes (bwd, fwd_bwd) in bf16 and fp16.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7c_* $R/gpu_tests_v7c*
stage "gpu tests (all)"
timeout 330 python3 -m pytest -q -m gpu tests/ > $R/gpu_tests_v7c.log 2>&1
rc=$?; echo "rc=$rc"; tail -4 $R/gpu_tests_v7c.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: no timing"; exit 0; fi
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --hdims 128 --modes bwd,fwd_bwd"
for dtype in bf16 fp16; do
  stage "paper $dtype bwd,fwd_bwd, head dim 128"
  timeout $((585 - SECONDS > 120 ? 120 : 585 - SECONDS)) python3 runner.py $P --dtype $dtype \
    --out $R/v7c_${dtype}_d128_bwd > $R/v7c_${dtype}_d128_bwd.log 2>&1
  echo "rc=$?"; pack
done
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v7c_*_d128_bwd/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
