#!/usr/bin/env bash
# Historical: written for commit 523169d; its --fwd-configs' 7th field was then `host_descriptors`
# (now tma_host_min_keys), and device_run8.sh's exp_bwd.py variants and FA_HOST_TMA are gone. Check
# out 523169d to re-run it.
# Session 3, first device call: the forward with host-made TMA descriptors against the in-kernel
# ones and pointer tiles (head dim 64/128/256, seqlen 1k-16k, bf16; fp16 at head dim 128);
# head-dim-256 backward variants kernel by kernel (tools/experiments/exp_bwd.py); the GPU tests
# not yet run on a GPU.
source "$(dirname "$0")/device_lib.sh"
stage "fwd: pointer vs in-kernel TMA vs host TMA, bf16"
timeout 200 python3 tools/tune_fa2.py --passes fwd --seqlens 1024 2048 4096 16384 --hdims 128 64 --dtype bf16 \
  --fwd-configs 128,128,8,3,0 128,128,8,3,1,0 128,128,8,3,1,0,1 128,64,4,3,1,0,1 128,64,8,3,1,0,1 128,64,4,3,0 128,64,8,3,0 \
  > $R/tune_fwd_bf16.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_bf16.csv; pack
stage "fwd d256 and fp16 d128"
timeout 60 python3 tools/tune_fa2.py --passes fwd --seqlens 2048 4096 16384 --hdims 256 --dtype bf16 \
  --fwd-configs 128,64,8,2,0 128,64,8,2,1,0 128,64,8,2,1,0,1 > $R/tune_fwd_d256.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_d256.csv; pack
timeout 60 python3 tools/tune_fa2.py --passes fwd --seqlens 2048 4096 16384 --hdims 128 --dtype fp16 \
  --fwd-configs 128,128,8,3,1,0 128,128,8,3,1,0,1 > $R/tune_fwd_fp16.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_fp16.csv; pack
stage "bwd variants"
timeout 170 python3 tools/experiments/exp_bwd.py --hdims 256 --seqlens 4096 --variants \
  kmajor:64,64,4,2:64,64,4,2 kmajor:64,64,8,2:64,64,4,2 qmajor:64,64,8,2:64,64,4,2 qmajor:128,64,8,1:64,64,4,2 \
  qmajor:128,64,8,2:64,64,4,2 qmajor:32,64,8,2:64,64,4,2 qmajor:64,64,4,2:64,64,4,2 \
  kmajor:64,64,4,2:128,64,8,2 kmajor:64,64,4,2:128,32,8,2 kmajor:64,64,4,2:64,32,4,2 \
  > $R/exp_bwd_d256.log 2>&1; echo "rc=$?"; mv $OUT/exp_bwd.csv $R/exp_bwd_d256.csv; pack
timeout 50 python3 tools/experiments/exp_bwd.py --hdims 128 --seqlens 4096 --variants \
  kmajor:64,128,8,3:128,32,8,3 qmajor:128,64,8,2:128,32,8,3 qmajor:128,128,8,2:128,32,8,3 \
  > $R/exp_bwd_d128.log 2>&1; echo "rc=$?"; mv $OUT/exp_bwd.csv $R/exp_bwd_d128.csv; pack
stage "gpu tests not yet run on a GPU"
timeout 90 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "sq1100 or thread or allocator" \
  > $R/gpu_tests_new.log 2>&1; echo "rc=$?"; tail -3 $R/gpu_tests_new.log; pack
timeout 60 env FA_HOST_TMA=1 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "forward" > $R/gpu_tests_fwd_host_tma.log 2>&1; echo "rc=$?"; tail -2 $R/gpu_tests_fwd_host_tma.log; pack
stage done
python3 - <<'PY'
import pandas as pd
for f in ("tune_fwd_bf16", "tune_fwd_d256", "tune_fwd_fp16"):
    d = pd.read_csv(f"/tmp/h200/{f}.csv"); d = d[d.status == "ok"]
    print(d.pivot_table(index="config", columns=["hdim", "causal", "seqlen"], values="tflops").round(0).to_string())
for f in ("exp_bwd_d256", "exp_bwd_d128"):
    d = pd.read_csv(f"/tmp/h200/{f}.csv"); d = d[d.status == "ok"]; d["part"] = d.get("part", "all")
    print(d.fillna({"part": "all"}).pivot_table(index=["config", "part"], columns=["causal"], values="ms").round(3).to_string())
PY
