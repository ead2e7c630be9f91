#!/usr/bin/env bash
# Session 8: the paper sweep at 512 and 1k again (three repeats, bf16 and fp16) with the final code
# (cached launches, host-side trims, the fused Gluon backward from 1k at head dim 128); host time
# per forward+backward call, cached launches against JIT launches taking turns in one process; the
# regression baseline re-saved (its 1k points changed).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v8d_*
for dtype in bf16 fp16; do
  stage "paper $dtype, 512 and 1k, 3 repeats"
  timeout 200 python3 runner.py --suite paper --providers fa2,sdpa-flash,sdpa-cudnn --seqlens 512,1024 \
    --repeats 3 --dtype $dtype --out $R/v8d_${dtype}_short_x3 > $R/v8d_${dtype}_short_x3.log 2>&1
  echo "rc=$?"; pack
done
if [ $SECONDS -lt 420 ]; then
  mkdir -p $R/v8d_breakdown
  stage "host breakdown: cached and JIT launches taking turns"
  OUT=$R/v8d_breakdown timeout 90 python3 tools/experiments/exp_host_breakdown.py --hdims 256 128 \
    --seqlens 512 --causal both --dtype bf16 > $R/v8d_breakdown/exp_host_breakdown_bf16.log 2>&1
  echo "rc=$?"; grep "^seqlen" $R/v8d_breakdown/exp_host_breakdown_bf16.log; pack
fi
if [ $SECONDS -lt 500 ]; then
  stage "regression baseline, 3 repeats"
  timeout $((590 - SECONDS)) python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3 \
    --out $R/v8d_baseline --save-baseline $R/v8d_baseline/nvidia-h200.json > $R/v8d_baseline.log 2>&1
  echo "rc=$?"; pack
fi
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
