#!/usr/bin/env bash
# Session 4, first device call: the backward with tensor-descriptor loop loads (BwdConfig.tma;
# ptxas: no spills left at head dim 256) timed kernel by kernel against pointer loads, head dims
# 64/128/256 at seqlen 4k and 16k; the forward's host against in-kernel descriptors at head dim
# 128, 4k-16k, twice each in one process (causal 8k visits 4096 keys); rung 4's counters (the
# folder is named counters_v3 after the forward it profiles, which v4 left unchanged at
# settings A and B; merged as reports/h200/ablation/ablation_ncu_v4_rung4.log).
source "$(dirname "$0")/device_lib.sh"
stage "bwd d256"
timeout 170 python3 tools/experiments/exp_bwd.py --hdims 256 --seqlens 4096 16384 --configs \
  128,64,64,32,8,1,4,3,1,0 128,64,64,32,8,1,4,3,1,1 128,64,128,32,8,1,8,2,1,1 128,64,64,64,8,1,4,2,1,1 \
  > $R/exp_bwd_d256.log 2>&1; echo "rc=$?"; mv $OUT/exp_bwd.csv $R/exp_bwd_d256.csv; pack
stage "bwd d128, d64"
timeout 100 python3 tools/experiments/exp_bwd.py --hdims 128 --seqlens 4096 16384 --configs \
  64,128,128,32,8,3,8,3,0,0 64,128,128,32,8,3,8,3,0,1 64,128,128,64,8,3,8,2,0,1 \
  > $R/exp_bwd_d128.log 2>&1; echo "rc=$?"; mv $OUT/exp_bwd.csv $R/exp_bwd_d128.csv; pack
timeout 80 python3 tools/experiments/exp_bwd.py --hdims 64 --seqlens 4096 16384 --configs \
  32,128,128,32,4,3,4,3,0,0 32,128,128,32,4,3,4,3,0,1 64,128,128,64,8,3,8,3,0,1 \
  > $R/exp_bwd_d64.log 2>&1; echo "rc=$?"; mv $OUT/exp_bwd.csv $R/exp_bwd_d64.csv; pack
stage "fwd d128: host against in-kernel descriptors"
for dt in bf16 fp16; do
  timeout 70 python3 tools/tune_fa2.py --passes fwd --seqlens 4096 8192 16384 --hdims 128 --dtype $dt \
    --fwd-configs 128,128,8,3,1,0,0,1000000 128,128,8,3,1,0,0,0 128,128,8,3,1,0,0,1000000 128,128,8,3,1,0,0,0 \
    > $R/tune_fwd_host_vs_kernel_$dt.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_host_vs_kernel_$dt.csv; pack
done
stage "rung 4 counters"
timeout 100 python3 runner.py --ablation hopper --settings-only --ncu-only --out $R/counters_v3 \
  > $R/counters_v3.log 2>&1; echo "rc=$?"; tail -3 $R/counters_v3.log; pack
stage done
python3 - <<'PY'
import pandas as pd
pd.set_option("display.width", 250)
for f in ("exp_bwd_d256", "exp_bwd_d128", "exp_bwd_d64"):
    try:
        d = pd.read_csv(f"/tmp/h200/{f}.csv")
    except FileNotFoundError:
        print(f"{f}: no rows (its stage did not write any)")
        continue
    d["part"] = d["part"].fillna("all") if "part" in d else "all"
    print(d.pivot_table(index=["config", "part"], columns=["hdim", "seqlen", "causal"], values="ms").round(3).to_string())
for dt in ("bf16", "fp16"):
    try:
        d = pd.read_csv(f"/tmp/h200/tune_fwd_host_vs_kernel_{dt}.csv")
    except FileNotFoundError:
        print(f"tune_fwd_host_vs_kernel_{dt}: no rows (its stage did not write any)")
        continue
    d = d[d.status == "ok"]
    d["config"] = d.config.str.replace(r"FwdConfig\(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=1, ", "", regex=True)
    d["n"] = d.groupby(["config", "seqlen", "causal"]).cumcount()
    print(dt); print(d.pivot_table(index=["config", "n"], columns=["seqlen", "causal"], values="tflops").round(1).to_string())
PY
