#!/usr/bin/env bash
# Session 6, last call: the GPU tests of everything changed since the whole suite ran at 9f8300e
# (the descriptor-layout cache of the Gluon forward, the review's test changes), at the final code.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6h_*
stage "gpu tests: Gluon forward, strided views, fused dQ, deterministic, backward d64/d128"
timeout 280 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "gluon or strided_views or fused_dq or deterministic or (backward_matches and d128)" > $R/v6h_gpu_tests.log 2>&1
echo "rc=$?"; tail -2 $R/v6h_gpu_tests.log; pack
stage done
