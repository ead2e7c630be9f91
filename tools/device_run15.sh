#!/usr/bin/env bash
# Session 4, last device call: after the host-time trims (device capability asked once per
# device; no zero gradient materialised for lse), the backward GPU tests, the host/GPU time
# split per call at 512 and 1k (exp_host_overhead.py), and the paper suites' fwd+bwd at 512
# and 1k for head dims 128 and 256, three repeats each (the points that do_bench reads as host
# time), all three providers per run.
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests: backward"
timeout 100 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "backward or deterministic" \
  > $R/gpu_tests_backward.log 2>&1; echo "rc=$?"; tail -2 $R/gpu_tests_backward.log; pack
stage "host against GPU time"
OUT=$R timeout 80 python3 tools/experiments/exp_host_overhead.py --hdims 256 128 --seqlens 512 1024 \
  > $R/exp_host_overhead.log 2>&1; echo "rc=$?"; pack
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn --modes fwd_bwd --hdims 128,256 --seqlens 512,1024 --repeats 3"
for dt in bf16 fp16; do
  stage "paper $dt: fwd_bwd at 512, 1k, three repeats"
  timeout 110 python3 runner.py $P --dtype $dt --out $R/v4_${dt}_fwdbwd_short_x3 > $R/v4_${dt}_fwdbwd_short_x3.log 2>&1
  echo "rc=$?"; pack
done
stage done
grep -v "^ *$" $R/exp_host_overhead.log | cut -c1-150
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v4_*_x3/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider", values="tflops", aggfunc="median")
    t["vs_flash"] = t["fa2"] / t["sdpa-flash"]; t["vs_cudnn"] = t["fa2"] / t["sdpa-cudnn"]
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
