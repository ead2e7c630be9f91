#!/usr/bin/env bash
# Session 7: the Hopper table's head-dim-128 backward now fuses dQ into the Gluon dK/dV kernel
# (TMA reduce-adds, FA3's scheme). The GPU tests of the backward paths; the paper sweep's backward
# modes at head dim 128 in bf16 and fp16; the regression baseline re-saved and a comparison; then,
# if time is left, host time with the fused Gluon kernel from 1k keys.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7g_* $R/gpu_tests_v7g*
stage "gpu tests: Gluon dK/dV (fused or not), deterministic, fused dQ, head-dim-128 backward, strided views"
timeout 200 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "gluon_dkdv or deterministic or fused_dq or (backward_matches and d128) or strided" > $R/gpu_tests_v7g.log 2>&1
rc=$?; echo "rc=$rc"; tail -2 $R/gpu_tests_v7g.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: no timing"; exit 0; fi
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --hdims 128 --modes bwd,fwd_bwd"
for dtype in bf16 fp16; do
  stage "paper $dtype bwd,fwd_bwd, head dim 128"
  timeout 90 python3 runner.py $P --dtype $dtype --out $R/v7g_${dtype}_d128_bwd > $R/v7g_${dtype}_d128_bwd.log 2>&1
  echo "rc=$?"; pack
done
stage "regression baseline, 3 repeats, and a comparison against it"
timeout 100 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3 \
  --out $R/v7g_baseline --save-baseline $R/v7g_baseline/nvidia-h200.json > $R/v7g_baseline.log 2>&1
echo "rc=$?"; pack
timeout 60 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --out $R/v7g_compare \
  --compare $R/v7g_baseline/nvidia-h200.json > $R/v7g_compare.log 2>&1
echo "rc=$?"; grep "PASS\|FAIL" $R/v7g_compare.log; pack
if [ $SECONDS -lt 480 ]; then
  stage "host time: the fused Gluon kernel from 1k"
  mkdir -p $R/v7g_host
  OUT=$R/v7g_host timeout $((575 - SECONDS)) python3 tools/experiments/exp_host_overhead.py --hdims 128 --seqlens 1024 \
    --modes bwd fwd_bwd --providers fa2 sdpa-flash --bwd-gluon-min-keys 1024 > $R/v7g_host.log 2>&1
  echo "rc=$?"; grep "^s" $R/v7g_host.log; pack
fi
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v7g_*_d128_bwd/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
