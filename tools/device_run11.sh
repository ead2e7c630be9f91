#!/usr/bin/env bash
# Session 3, fourth device call: host descriptors now from 1024 keys (512-key launches were
# host-bound in the third call's paper sweep). The GPU tests the third call's time limit cut
# (backward, determinism, allocator, the new whole-block shapes); the paper suites' 512 and 1k
# points again (all three providers, so ratios stay within one run); the ablation (CUDA-graph
# timing); the regression baseline and the perf tests.
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests"
timeout 140 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "backward or deterministic or thread or allocator or sq1024_sk2048 or sq512_sk1024" > $R/gpu_tests_flash_attn.log 2>&1
echo "rc=$?"; tail -3 $R/gpu_tests_flash_attn.log; pack
stage "paper suites at 512 and 1k"
timeout 60 python3 runner.py --suite paper --dtype bf16 --hdims 64,128,256 --seqlens 512,1024 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_short > $R/paper_short.log 2>&1; echo "rc=$?"; pack
timeout 60 python3 runner.py --suite paper --dtype fp16 --hdims 64,128,256 --seqlens 512,1024 \
  --providers fa2,sdpa-flash,sdpa-cudnn --out $R/paper_fp16_short > $R/paper_fp16_short.log 2>&1; echo "rc=$?"; pack
stage "ablation, CUDA-graph timing"
timeout 190 python3 runner.py --ablation all --repeats 2 --hdims 128 --seqlens 1024,4096,16384 --cuda-graph --no-ncu \
  --out $R/ablation > $R/ablation.log 2>&1; echo "rc=$?"; tail -2 $R/ablation.log; pack
stage "regression baseline"
timeout 50 python3 runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 2 \
  --save-baseline $R/baseline/nvidia-h200.json --out $R/quick_baseline > $R/quick_baseline.log 2>&1; echo "rc=$?"; pack
stage "perf tests"
timeout 45 python3 -m pytest -q -m perf tests/test_perf.py --benchmark-json=$R/perf_benchmark.json \
  > $R/perf_tests.log 2>&1; echo "rc=$?"; tail -1 $R/perf_tests.log
stage done
