#!/usr/bin/env bash
# Ran at 3ec9ed6; FwdConfig.warp_specialize, which it times, was removed after it (wrong rows,
# illegal addresses and hangs on the H200: reports/h200/perf_notes.md, v4 -> v5).
# Session 5, second device call: Triton 3.6's sm_90 warp specialisation of the forward's key
# loop (FwdConfig.warp_specialize: a producer warpgroup issuing TMA loads, two consumer
# warpgroups; 4 warps per partition). First the GPU reference tests of the warp-specialised
# path at every GPU test shape, then forward timings of candidates against the current table,
# SDPA flash and cuDNN in one process per (head dim, dtype) (tools/tune_fa2.py checks each
# candidate against the float64 reference first).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/ws_*  # this run's rows only
stage "gpu tests: warp-specialised forward"
timeout 150 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k warp_specialized \
  > $R/ws_gpu_tests.log 2>&1; echo "rc=$?"; tail -3 $R/ws_gpu_tests.log; pack
K="2048,1024,8192"
D128="128,128,8,3,1,$K 128,128,8,3,1,2048,1024,4096 128,128,4,2,1,$K,1 128,64,4,3,1,$K,1 128,64,4,4,1,$K,1"
D64="128,64,4,3,0 128,64,8,3,0 128,128,4,2,1,$K,1 128,128,4,3,1,$K,1 128,64,4,3,1,$K,1"
D256="128,64,8,2,1,$K 128,64,4,2,1,$K,1 128,32,4,3,1,$K,1"
for dt in bf16 fp16; do
  for spec in "128|512 1024 2048 4096 8192 16384|$D128" "64|2048 4096 16384|$D64" "256|2048 4096 16384|$D256"; do
    IFS="|" read -r hd seqlens configs <<< "$spec"
    stage "tune fwd d$hd $dt"
    mkdir -p $R/ws_d${hd}_$dt
    OUT=$R/ws_d${hd}_$dt timeout 150 python3 tools/tune_fa2.py --passes fwd --hdims $hd --seqlens $seqlens \
      --dtype $dt --fwd-configs $configs > $R/ws_d${hd}_$dt.log 2>&1; echo "rc=$?"; pack
  done
done
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/ws_d*/tune_fa2.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"]
    d["config"] = (d.config.str.replace("FwdConfig(block_m=", "", regex=False).str.replace(" block_n=", "")
                   .str.replace(" num_warps=", "w").str.replace(" num_stages=", "s").str.replace(", tma_min_keys=2048, tma_host_min_keys=1024", "")
                   .str.replace(" tma_host_below_keys=", "hb").str.replace(" warp_specialize=True", "WS").str.replace(")", ""))
    t = d.pivot_table(index="config", columns=["seqlen", "causal"], values="tflops").round(0)
    print(f.split("/")[-2]); print(t.to_string())
PY
