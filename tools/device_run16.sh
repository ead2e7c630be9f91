#!/usr/bin/env bash
# Session 5, first device call: does a 256-row forward tile at 16 warps (four warpgroups of
# 64 rows each, 128 registers per thread, no spills in ptxas's report for sm_90) beat the
# 128-row, 8-warp table at head dims 128 and 64? Forward only, paper shapes, both dtypes,
# SDPA flash and cuDNN in the same process (tools/tune_fa2.py checks each candidate against
# the float64 reference first).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/d128_* $R/d64_*  # this run's rows only
D128="128,128,8,3,1,2048,1024,8192 128,128,8,3,1,2048,1024,4096 256,64,16,3,1,2048,1024,8192 256,64,16,3,1,2048,1024,4096 256,64,16,2,1,2048,1024,8192 256,64,16,4,1,2048,1024,8192"
D64="128,64,4,3,0 128,64,8,3,0 256,128,16,3,1,2048,1024,8192 256,128,16,2,1,2048,1024,8192 256,64,16,3,1,2048,1024,8192"
for dt in bf16 fp16; do
  stage "tune fwd d128 $dt"
  mkdir -p $R/d128_$dt
  OUT=$R/d128_$dt timeout 140 python3 tools/tune_fa2.py --passes fwd --hdims 128 --seqlens 4096 8192 16384 \
    --dtype $dt --fwd-configs $D128 > $R/d128_$dt.log 2>&1; echo "rc=$?"; pack
  stage "tune fwd d64 $dt"
  mkdir -p $R/d64_$dt
  OUT=$R/d64_$dt timeout 120 python3 tools/tune_fa2.py --passes fwd --hdims 64 --seqlens 2048 4096 16384 \
    --dtype $dt --fwd-configs $D64 > $R/d64_$dt.log 2>&1; echo "rc=$?"; pack
done
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250); pd.set_option("display.max_colwidth", 60)
for f in sorted(glob.glob("/tmp/h200/d*/tune_fa2.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    d["config"] = d.config.str.replace("FwdConfig", "").str.replace("block_|num_|tma_", "", regex=True).str.slice(0, 60)
    t = d.pivot_table(index="config", columns=["seqlen", "causal"], values="tflops").round(0)
    print(f.split("/")[-2]); print(t.to_string())
PY
