#!/usr/bin/env bash
# Session 3, fifth device call: the paper suites' backward and fwd+bwd at 512 and 1k for the
# final kernel (f2363d5), which the fourth call's time limit cut (all three providers per run).
source "$(dirname "$0")/device_lib.sh"
stage "bwd, fwd_bwd at 512 and 1k"
timeout 75 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 --seqlens 512,1024 --modes bwd,fwd_bwd \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_short_bwd > $R/paper_short_bwd.log 2>&1; echo "rc=$?"; pack
timeout 75 python3 runner.py --suite paper --dtype fp16 --hdims 64,128,256 --seqlens 512,1024 --modes bwd,fwd_bwd \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_fp16_short_bwd > $R/paper_fp16_short_bwd.log 2>&1; echo "rc=$?"; pack
stage done
