#!/usr/bin/env bash
# Session 6's first call (prepared at the end of session 5 and extended before it ran), for what v5
# left open (reports/h200/perf_notes.md, "v5: a Gluon forward"):
# 1. GPU tests the Gluon forward has not had: strided views (packed qkv, padded rows) and the
#    fp16 head-dim-128 backward (its inputs are the Gluon forward's output and logsumexp); the
#    Gluon tests again for v6's compile-time causal flag.
# 2. The v6 kernel (and head dim 64) against float64, then timed with v5's kernel in the same
#    process (results/v5_flash_attn_hopper.py = `git show fd7e67e:kernels/flash_attn_hopper.py`,
#    carried): the compile-time causal flag's A/B, and the head-dim-64 timing a second time.
# 3. Nsight Compute counters of the Gluon forward and cuDNN's at the paper's 4k point.
# The regression baseline is re-saved in the session's last call, after the forward settles.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6_* $R/gpu_tests_v6*  # this run's files only
stage "gpu tests"
timeout 170 python3 -m pytest -q -m gpu tests/test_flash_attn.py \
  -k "strided_views or gluon or (backward_matches and d128 and fp16)" > $R/gpu_tests_v6.log 2>&1
rc=$?; echo "rc=$rc"; tail -3 $R/gpu_tests_v6.log; pack
if [ $rc -ne 0 ]; then stage "tests failed: nothing else"; exit 0; fi
stage "Gluon forward check, d128 and d64"
timeout 90 python3 tools/experiments/exp_fwd_gluon.py --check bf16 --variants ws > $R/v6_gluon_check.log 2>&1
echo "rc=$?"; grep -c "ok$" $R/v6_gluon_check.log; grep WRONG $R/v6_gluon_check.log; pack
stage "Gluon forward timing: v6 vs v5 (gluon-ws-previous), d128 and d64"
mkdir -p $R/v6_gluon_time; OUT=$R/v6_gluon_time timeout 200 python3 tools/experiments/exp_fwd_gluon.py --time bf16 \
  --previous results/v5_flash_attn_hopper.py > $R/v6_gluon_time.log 2>&1
echo "rc=$?"; tail -14 $R/v6_gluon_time.log; pack
stage "ncu: Gluon forward vs cuDNN, paper 4k, d128"
timeout 200 python3 runner.py --suite paper --ncu-only --providers fa2,sdpa-cudnn --modes fwd --hdims 128 \
  --seqlens 4096 --dtype bf16 --out $R/v6_counters > $R/v6_counters.log 2>&1
echo "rc=$?"; tail -4 $R/v6_counters.log; pack
stage done
