#!/usr/bin/env bash
# Session 8: where the host time of a short forward+backward call goes, stage by stage
# (the one target of issue 7 still missed is host-bound: bf16 head dim 256 forward+backward at
# causal 512).
source "$(dirname "$0")/device_lib.sh"
mkdir -p $R/v8_breakdown
stage "host breakdown bf16"
OUT=$R/v8_breakdown timeout 200 python3 tools/experiments/exp_host_breakdown.py --hdims 256 128 \
  --seqlens 512 1024 --causal both --dtype bf16 2>&1 | tee $R/v8_breakdown/exp_host_breakdown_bf16.log
pack
stage done
