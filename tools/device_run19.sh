#!/usr/bin/env bash
# Session 5, adopting the Gluon forward (kernels/flash_attn_hopper.py) for head dim 128 from 1k
# keys: the GPU tests that run it (its own reference tests, the forward reference tests, the
# head-dim-128 backward tests, whose inputs come from its output and logsumexp), then, only if
# they pass, the paper suite's head-dim-128 rows (forward first, then forward+backward) in both
# dtypes, all three providers in each run.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v5_* $R/gpu_tests_v5*  # this run's files only
stage "gpu tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "gluon or forward_matches or (backward_matches and d128 and bf16)" > $R/gpu_tests_v5.log 2>&1
rc=$?; echo "rc=$rc"; tail -3 $R/gpu_tests_v5.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: no timing"; exit 0; fi
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --hdims 128"
for spec in "fwd bf16" "fwd fp16" "fwd_bwd bf16" "fwd_bwd fp16"; do
  set -- $spec
  stage "paper $2 $1, head dim 128"
  timeout 110 python3 runner.py $P --modes $1 --dtype $2 --out $R/v5_${2}_d128_$1 > $R/v5_${2}_d128_$1.log 2>&1
  echo "rc=$?"; pack
done
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v5_*/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
