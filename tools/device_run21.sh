#!/usr/bin/env bash
# Session 6, second call: dQ fused into the dK/dV kernel (TMA reduce-adds into a float32
# accumulator: 5 matmuls instead of 7) against the production backward (dK/dV then dQ kernel),
# SDPA flash and cuDNN, same process (tools/experiments/exp_bwd.py; bf16, paper shapes).
# Fields: M1,N1,M2,N2,WARPS,STAGES,DQ_WARPS,DQ_STAGES,QUERY_MAJOR,TMA,FUSED_DQ_MIN_ROWS.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6b_*
mkdir -p $R/v6b_d128 $R/v6b_d64
stage "head dim 128"
OUT=$R/v6b_d128 timeout 280 python3 tools/experiments/exp_bwd.py --hdims 128 --seqlens 1024 4096 16384 --configs \
  64,128,128,32,8,3,8,3,0,0,0 64,128,128,32,8,3,8,3,0,0,1 64,128,128,32,8,2,8,3,0,0,1 64,128,128,32,8,3,8,3,0,1,1 \
  > $R/v6b_d128.log 2>&1
echo "rc=$?"; grep -v "^ncu" $R/v6b_d128.log | grep "all\|sdpa\|production\|wrong\|error" | tail -40; pack
stage "head dim 64"
OUT=$R/v6b_d64 timeout 200 python3 tools/experiments/exp_bwd.py --hdims 64 --seqlens 1024 4096 16384 --configs \
  32,128,128,32,4,3,4,3,0,0,0 32,128,128,32,4,3,4,3,0,0,1 64,128,128,32,8,3,8,3,0,0,1 64,64,128,32,4,3,4,3,0,0,1 \
  > $R/v6b_d64.log 2>&1
echo "rc=$?"; grep "all\|sdpa\|production\|wrong\|error" $R/v6b_d64.log | tail -40; pack
stage done
