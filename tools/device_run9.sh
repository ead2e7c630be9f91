#!/usr/bin/env bash
# Historical: written for commit adfcb88; its --fwd-configs' 7th field was then `host_descriptors`
# (now tma_host_min_keys), and device_run8.sh's exp_bwd.py variants and FA_HOST_TMA are gone. Check
# out adfcb88 to re-run it.
# Session 3, second device call: the forward with host-made 2D TMA descriptors (batch * seqlen,
# heads * head dim) against in-kernel descriptors and pointer tiles, 512-16k, head dim 64/128/256,
# bf16 (fp16 at head dim 128); the head-dim-256 query-major backward and dQ alternatives.
source "$(dirname "$0")/device_lib.sh"
stage "fwd bf16 d128/d64"
timeout 230 python3 tools/tune_fa2.py --passes fwd --seqlens 512 1024 2048 4096 16384 --hdims 128 64 --dtype bf16 \
  --fwd-configs 128,128,8,3,0 128,128,8,3,1,0 128,128,8,3,1,0,1 128,64,4,3,0 128,64,4,3,1,0,1 128,64,8,3,0 128,64,8,3,1,0,1 \
  > $R/tune_fwd_bf16.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_bf16.csv; pack
stage "fwd d256 bf16, d128 fp16"
timeout 70 python3 tools/tune_fa2.py --passes fwd --seqlens 1024 2048 4096 16384 --hdims 256 --dtype bf16 \
  --fwd-configs 128,64,8,2,0 128,64,8,2,1,0 128,64,8,2,1,0,1 > $R/tune_fwd_d256.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_d256.csv; pack
timeout 60 python3 tools/tune_fa2.py --passes fwd --seqlens 2048 4096 16384 --hdims 128 --dtype fp16 \
  --fwd-configs 128,128,8,3,0 128,128,8,3,1,0 128,128,8,3,1,0,1 > $R/tune_fwd_fp16.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_fp16.csv; pack
stage "bwd d256"
timeout 120 python3 tools/tune_fa2.py --passes bwd --seqlens 1024 4096 16384 --hdims 256 --dtype bf16 \
  --bwd-configs 64,64,64,64,4,2 128,64,64,64,8,1,4,2,1 128,64,64,64,8,1,4,1,1 128,64,128,64,8,1,8,1,1 128,64,64,32,8,1,4,3,1 \
  > $R/tune_bwd_d256.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_bwd_d256.csv; pack
stage done
python3 - <<'PY'
import pandas as pd
pd.set_option("display.width", 250)
for f in ("tune_fwd_bf16", "tune_fwd_d256", "tune_fwd_fp16", "tune_bwd_d256"):
    d = pd.read_csv(f"/tmp/h200/{f}.csv"); d = d[d.status == "ok"]
    d["config"] = d.config.str.replace("FwdConfig", "").str.replace("BwdConfig", "").str.replace("block_|num_|tma_min_keys=|host_descriptors=|dq_num_|query_major=", "", regex=True).str.slice(0, 60)
    print(d.pivot_table(index="config", columns=["hdim", "causal", "seqlen"], values="tflops").round(0).to_string())
PY
