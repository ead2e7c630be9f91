#!/usr/bin/env bash
# Session 6: host time of the Gluon forward at 1k keys, where the quick sweep's fa2 forward read
# wide bands (device_run22/24: p20-p80 of one repeat up to 0.28-0.33 ms at causal 1k, GPU work
# ~0.18 ms), after caching the descriptors' shared-memory layout (_tile_layout). A Gluon
# reference test first (the launch path changed), then GPU time against host time per call and
# the profiles of fa2's forward (tools/experiments/exp_host_overhead.py).
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/v6f_*
stage "gluon tests (1k, head dim 128)"
timeout 90 python3 -m pytest -q -m gpu tests/test_flash_attn.py -k "gluon_forward_matches and b2_sq1024" \
  > $R/v6f_gpu_tests.log 2>&1
rc=$?; echo "rc=$rc"; tail -1 $R/v6f_gpu_tests.log; pack
if [ $rc -ne 0 ]; then stage "tests failed"; exit 0; fi
stage "host time, forward, 1k and 4k"
mkdir -p $R/v6f_host
OUT=$R/v6f_host timeout 200 python3 tools/experiments/exp_host_overhead.py --hdims 128 --seqlens 1024 4096 \
  --modes fwd --providers fa2 sdpa-flash --profile > $R/v6f_host.log 2>&1
echo "rc=$?"; grep "^s" $R/v6f_host.log; pack
stage done
