#!/usr/bin/env bash
# Session 7, after device_run30 (whose whole-suite run hit its time limit before the fused-dQ and
# TMA-allocator tests, and whose paper rows at causal 512-1k were host-bound and spread): the Gluon
# dK/dV kernel now from 2k keys. The GPU tests not reached there plus the head-dim-128 backward
# tests; host against GPU time with the Gluon dK/dV kernel from 1k, 2k (production) or never; the
# paper sweep's backward modes at head dim 128 again; a regression comparison if time is left.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7d_* $R/gpu_tests_v7d*
stage "gpu tests: fused dQ, TMA allocator, deterministic, head-dim-128 backward, Gluon dK/dV"
timeout 170 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "fused_dq or tma_launch or deterministic or gluon_dkdv or (backward_matches and d128)" > $R/gpu_tests_v7d.log 2>&1
rc=$?; echo "rc=$rc"; tail -2 $R/gpu_tests_v7d.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: no timing"; exit 0; fi
stage "host time: Gluon dK/dV from 1k, 2k (production) or never"
mkdir -p $R/v7d_host
OUT=$R/v7d_host timeout 150 python3 tools/experiments/exp_host_overhead.py --hdims 128 --seqlens 1024 2048 \
  --modes bwd fwd_bwd --providers fa2 sdpa-flash --bwd-gluon-min-keys 0 1024 > $R/v7d_host.log 2>&1
echo "rc=$?"; grep "^s" $R/v7d_host.log; pack
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --hdims 128 --modes bwd,fwd_bwd"
for dtype in bf16 fp16; do
  stage "paper $dtype bwd,fwd_bwd, head dim 128"
  timeout 110 python3 runner.py $P --dtype $dtype --out $R/v7d_${dtype}_d128_bwd > $R/v7d_${dtype}_d128_bwd.log 2>&1
  echo "rc=$?"; pack
done
if [ $SECONDS -lt 470 ]; then
  stage "regression comparison against reports/baselines/nvidia-h200.json"
  timeout $((585 - SECONDS)) python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v7d_compare \
    --compare reports/baselines/nvidia-h200.json > $R/v7d_compare.log 2>&1
  echo "rc=$?"; grep -i "regression\|improve\|verdict\|within\|PASS\|FAIL" $R/v7d_compare.log | tail -8; pack
fi
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v7d_*_d128_bwd/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
