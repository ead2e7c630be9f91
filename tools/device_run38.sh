#!/usr/bin/env bash
# Session 8: host time per forward+backward call, cached launches against JIT launches taking
# turns in one process; then the paper sweep at 512 and 1k again (three repeats, bf16 and fp16),
# a second run of the same code as device_run36's (host-bound points are run-dependent).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v8d_*
mkdir -p $R/v8d_breakdown
stage "host breakdown: cached and JIT launches taking turns"
OUT=$R/v8d_breakdown timeout 120 python3 tools/experiments/exp_host_breakdown.py --hdims 256 128 64 \
  --seqlens 512 --causal both --dtype bf16 > $R/v8d_breakdown/exp_host_breakdown_bf16.log 2>&1
echo "rc=$?"; grep "^seqlen" $R/v8d_breakdown/exp_host_breakdown_bf16.log; pack
for dtype in bf16 fp16; do
  if [ $SECONDS -gt 420 ]; then echo "no time left for $dtype"; break; fi
  stage "paper $dtype, 512 and 1k, 3 repeats"
  timeout $((560 - SECONDS)) python3 runner.py --suite paper --providers fa2,sdpa-flash,sdpa-cudnn --seqlens 512,1024 \
    --repeats 3 --dtype $dtype --out $R/v8d_${dtype}_short_x3 > $R/v8d_${dtype}_short_x3.log 2>&1
  echo "rc=$?"; pack
done
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v8d_*_short_x3/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    t = d.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider", values="ms", aggfunc="median")
    t["vs_flash"] = t["sdpa-flash"] / t["fa2"]
    print(f.split("/")[-2]); print(t["vs_flash"].unstack("seqlen").round(3).to_string())
PY
