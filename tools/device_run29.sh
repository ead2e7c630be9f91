#!/usr/bin/env bash
# Session 7, second call: the Gluon dK/dV kernel with dQ fused (atomics) as well, both (kernels/flash_attn_hopper.py) checked against float64 and the
# production backward (a hang is cut by timeout), then timed against the Triton dK/dV kernel and
# the SDPA peers, 2 and 3 Q/dO stages, head dims 64 and 128, 1k-16k, bf16.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7b_*
mkdir -p $R/v7b_bwd_gluon
stage "check"
OUT=$R/v7b_bwd_gluon timeout 200 python3 tools/experiments/exp_bwd_gluon.py --check --stages 2 3 \
  --seqlens 1024 4096 > $R/v7b_check.log 2>&1
rc=$?; echo "rc=$rc"; grep -c " ok$" $R/v7b_check.log; grep -v " ok$" $R/v7b_check.log | tail -25; pack
if [ $rc -eq 0 ] && ! grep -q WRONG $R/v7b_check.log; then
  stage "time bf16"
  OUT=$R/v7b_bwd_gluon timeout 330 python3 tools/experiments/exp_bwd_gluon.py --time --dtype bf16 --stages 2 3 \
    > $R/v7b_time_bf16.log 2>&1
  echo "rc=$?"; grep "^bf16" $R/v7b_time_bf16.log; pack
fi
stage done
