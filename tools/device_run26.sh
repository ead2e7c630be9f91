#!/usr/bin/env bash
# Session 6, after the code review: the fused-dQ GPU tests again (they now check which kernels
# ran and that Hopper takes the TMA form), then the Gluon forward at head dim 64 against the
# Triton forward (`fa2-triton`) at 2k, 4k and 8k in both dtypes, same process: 8k was between the
# measured points of the 4k adoption, 2k below it.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6g_*
stage "gpu tests: fused dQ, deterministic"
timeout 120 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "fused_dq or deterministic" \
  > $R/v6g_gpu_tests.log 2>&1
rc=$?; echo "rc=$rc"; tail -1 $R/v6g_gpu_tests.log; pack
for dtype in bf16 fp16; do
  stage "Gluon forward, head dim 64, $dtype"
  mkdir -p $R/v6g_gluon_d64
  OUT=$R/v6g_gluon_d64 timeout 150 python3 tools/experiments/exp_fwd_gluon.py --time $dtype --hdims 64 \
    --seqlens 2048 4096 8192 > $R/v6g_gluon_d64_$dtype.log 2>&1
  echo "rc=$?"; grep "^$dtype" $R/v6g_gluon_d64_$dtype.log | sed 's/  \/cudnn.*//'; pack
done
stage done
