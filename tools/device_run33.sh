#!/usr/bin/env bash
# Session 7: dQ fused into the Gluon dK/dV kernel the FA3 way (both consumers' dS^T in shared
# memory, each consumer half of dQ's columns over all 128 keys, one TMA reduce-add per consumer
# and step), head dim 128: checked (a hang is cut by timeout), then timed against the two-kernel
# backward and cuDNN in bf16 and fp16. Four Gluon dK/dV GPU tests first (its source changed).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v7f_*
mkdir -p $R/v7f_bwd_gluon
stage "gpu tests: Gluon dK/dV at 1k"
timeout 100 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "gluon_dkdv and b2_sq1024" > $R/v7f_gpu_tests.log 2>&1
rc=$?; echo "rc=$rc"; tail -1 $R/v7f_gpu_tests.log; pack
stage "check"
OUT=$R/v7f_bwd_gluon timeout 150 python3 tools/experiments/exp_bwd_gluon.py --check --hdims 128 --stages 2 \
  --seqlens 1024 4096 > $R/v7f_check.log 2>&1
rc=$?; echo "rc=$rc"; grep -c " ok$" $R/v7f_check.log; grep -v " ok$" $R/v7f_check.log | tail -12; pack
if [ $rc -eq 0 ] && ! grep -q WRONG $R/v7f_check.log; then
  for dtype in bf16 fp16; do
    stage "time $dtype"
    OUT=$R/v7f_bwd_gluon timeout $((560 - SECONDS)) python3 tools/experiments/exp_bwd_gluon.py --time --dtype $dtype \
      --hdims 128 --stages 2 > $R/v7f_time_$dtype.log 2>&1
    echo "rc=$?"; grep "^$dtype" $R/v7f_time_$dtype.log | grep -v "sdpa-flash\|kernel alone"; pack
  done
fi
stage done
