#!/usr/bin/env bash
# Session 4, second and third device calls (DTYPES=bf16, then DTYPES=fp16 GPU_TESTS=0
# SHORT_REPEATS=bf16): the GPU tests, then the paper-suite groups the v4 changes touch, each
# with the official kernel and cuDNN in the same run: head dim 256 backward and fwd+bwd at
# every length (descriptor loads in the backward); head dim 128 causal forward and fwd+bwd at
# 8k (in-kernel descriptors from 4096 visited keys); head dim 128 fwd+bwd at 512 and 1k
# (removed from v3's rows). SHORT_REPEATS: dtypes whose head-dim-256 fwd+bwd at 512 and 1k is
# measured again, three times (the second call's bf16 causal 512 read a p20-p80 spread of 0.76-1.08 ms).
source "$(dirname "$0")/device_lib.sh"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  stage "gpu tests"
  timeout 250 python3 -m pytest -q -m gpu tests/test_flash_attn.py > $R/gpu_tests_flash_attn.log 2>&1
  echo "rc=$?"; tail -3 $R/gpu_tests_flash_attn.log; pack
fi
P="--suite paper --providers fa2,sdpa-flash,sdpa-cudnn"
for dt in ${DTYPES:-bf16}; do
  stage "paper $dt: d256 bwd, fwd_bwd"
  timeout 170 python3 runner.py $P --dtype $dt --hdims 256 --modes bwd,fwd_bwd --out $R/v4_${dt}_d256_bwd \
    > $R/v4_${dt}_d256_bwd.log 2>&1; echo "rc=$?"; pack
  stage "paper $dt: d128 causal 8k fwd, fwd_bwd"
  timeout 40 python3 runner.py $P --dtype $dt --hdims 128 --modes fwd,fwd_bwd --causal true --seqlens 8192 \
    --out $R/v4_${dt}_d128_causal8k > $R/v4_${dt}_d128_causal8k.log 2>&1; echo "rc=$?"; pack
  stage "paper $dt: d128 fwd_bwd at 512, 1k"
  timeout 60 python3 runner.py $P --dtype $dt --hdims 128 --modes fwd_bwd --seqlens 512,1024 \
    --out $R/v4_${dt}_d128_fwdbwd_short > $R/v4_${dt}_d128_fwdbwd_short.log 2>&1; echo "rc=$?"; pack
done
for dt in ${SHORT_REPEATS:-}; do
  stage "paper $dt: d256 fwd_bwd at 512, 1k, three repeats"
  timeout 60 python3 runner.py $P --dtype $dt --hdims 256 --modes fwd_bwd --seqlens 512,1024 --repeats 3 \
    --out $R/v4_${dt}_d256_fwdbwd_short_x3 > $R/v4_${dt}_d256_fwdbwd_short_x3.log 2>&1; echo "rc=$?"; pack
done
if [ "${PERF_TESTS:-0}" = 1 ]; then
  stage "perf tests"
  timeout 45 python3 -m pytest -q -m perf tests/test_perf.py --benchmark-json=$R/perf_benchmark.json \
    > $R/perf_tests.log 2>&1; echo "rc=$?"; tail -1 $R/perf_tests.log
fi
stage done
python3 - <<'PY'
import glob
import pandas as pd
pd.set_option("display.width", 250)
for f in sorted(glob.glob("/tmp/h200/v4_*/results.csv")):
    d = pd.read_csv(f); d = d[d.status == "ok"] if "status" in d else d
    t = d.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider", values="tflops")
    if "fa2" in t:
        t["vs_flash"] = t["fa2"] / t.get("sdpa-flash"); t["vs_cudnn"] = t["fa2"] / t.get("sdpa-cudnn")
    print(f.split("/")[-2]); print(t.round(3).to_string())
PY
