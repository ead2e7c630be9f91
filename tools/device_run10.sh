#!/usr/bin/env bash
# Session 3, third device call (issue 7, v3 kernel: host-made TMA descriptors for the forward's
# short and medium key loops, query-major head-dim-256 backward): the GPU tests, then the paper
# suites in bf16 and fp16 against the issue's peers (do_bench defaults).
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests"
timeout 150 python3 -m pytest -q -m gpu tests/test_flash_attn.py > $R/gpu_tests_flash_attn.log 2>&1; echo "rc=$?"
tail -3 $R/gpu_tests_flash_attn.log; pack
stage "paper suite bf16, the issue's peers"
timeout 200 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper > $R/paper.log 2>&1; echo "rc=$?"; tail -2 $R/paper.log; pack
stage "paper suite fp16, the issue's peers"
timeout 190 python3 runner.py --suite paper --dtype fp16 --hdims 64,128,256 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_fp16 > $R/paper_fp16.log 2>&1; echo "rc=$?"; tail -2 $R/paper_fp16.log; pack
stage done
