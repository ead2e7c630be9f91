#!/usr/bin/env bash
# Session 2, third device call (issue 7): TMA vs pointer tiles at short key loops (the
# tma_min_keys rule), then the paper suites in bf16 and fp16 with do_bench's default timing
# (25 ms warm-up, 100 ms of calls: a sustained clock; 20-ms windows read cuDNN ~10% high).
source "$(dirname "$0")/device_lib.sh"
stage "TMA vs pointer tiles by seqlen"
timeout 70 python3 tools/tune_fa2.py --seqlens 512 1024 2048 4096 --hdims 128 --passes fwd \
  --fwd-configs 128,128,8,3,0 128,128,8,3,1,0 > $R/tune_tma_by_seqlen.log 2>&1; echo "rc=$?"
mv $OUT/tune_fa2.csv $R/tune_tma_by_seqlen.csv; pack
stage "paper suite bf16, the issue's peers"
timeout 200 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper > $R/paper.log 2>&1; echo "rc=$?"; tail -3 $R/paper.log; pack
stage "paper suite fp16, the issue's peers"
timeout 180 python3 runner.py --suite paper --dtype fp16 --hdims 64,128,256 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_fp16 > $R/paper_fp16.log 2>&1; echo "rc=$?"; tail -3 $R/paper_fp16.log; pack
stage "paper suite bf16, the other providers"
timeout 110 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 --resume \
  --providers fa2,sdpa-flash,sdpa-cudnn,sdpa-efficient,pytorch,xformers-cutlass,flash-attn,flash-attn-3 \
  --out $R/paper > $R/paper_rest.log 2>&1; echo "rc=$?"; tail -3 $R/paper_rest.log
stage done
grep "^fwd" $R/tune_tma_by_seqlen.log
