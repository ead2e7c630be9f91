#!/usr/bin/env bash
# Session 8: the whole GPU suite at the final kernel and launch code (cached launches, host-side
# cdiv and strides), in one call.
source "$(dirname "$0")/device_lib.sh"
stage "gpu tests: the whole suite"
timeout 570 python3 -m pytest -q -m gpu tests/ > $R/gpu_tests_session8.log 2>&1
rc=$?; echo "rc=$rc"; tail -3 $R/gpu_tests_session8.log; grep -E "^(FAILED|ERROR)" $R/gpu_tests_session8.log | head -20
pack
stage done
