#!/usr/bin/env bash
# Session 2, second device call (issue 7): the head-dim-128 forward after the causal
# longest-first launch order (same-process peers), then the bf16 paper suite with the
# TMA forward (the issue's peers first, the other providers resumed into the same folder).
TQDM_MININTERVAL=20; source "$(dirname "$0")/device_lib.sh"
T="--rep-ms ${REP_MS:-20} --warmup-ms ${WARMUP_MS:-5}"
stage tune forward d128 after the launch-order change
timeout 60 python3 tools/tune_fa2.py --seqlens 4096 16384 --hdims 128 --passes fwd --fwd-configs 128,128,8,3,1 \
  > $R/tune_fwd_d128_lpt.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_d128_lpt.csv; tail -7 $R/tune_fwd_d128_lpt.log; pack
stage paper suite bf16, the issue\'s peers
timeout 300 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 $T \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper > $R/paper.log 2>&1; echo "rc=$?"; tail -4 $R/paper.log; pack
stage paper suite bf16, the other providers
timeout 170 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 $T --resume \
  --providers fa2,sdpa-flash,sdpa-cudnn,sdpa-efficient,pytorch,xformers-cutlass,flash-attn,flash-attn-3 \
  --out $R/paper > $R/paper_rest.log 2>&1; echo "rc=$?"; tail -4 $R/paper_rest.log
stage done
