#!/usr/bin/env bash
# Session 2, first device call (issue 7): TMA forward candidates per head dim next to SDPA
# flash and cuDNN at seqlen 4k and 16k; the GPU tests of the forward/backward at real sizes
# (TMA path, determinism); the ablation settings timed with CUDA-graph replay.
TQDM_MININTERVAL=15; source "$(dirname "$0")/device_lib.sh"
stage gpu tests
timeout 200 python3 -m pytest -q -m gpu tests/test_flash_attn.py -x > $R/gpu_tests_flash_attn.log 2>&1; echo "rc=$?"; tail -3 $R/gpu_tests_flash_attn.log
tune() {  # hdim, then candidate forward configs
  local h=$1; shift
  timeout 150 python3 tools/tune_fa2.py --seqlens 4096 16384 --hdims $h --passes fwd --fwd-configs "$@" > $R/tune_fwd_d$h.log 2>&1
  echo "d$h rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fwd_d$h.csv; tail -9 $R/tune_fwd_d$h.log; pack
}
stage tune forward
tune 128 128,128,8,3,0 128,128,8,3,1 128,128,8,2,1 128,64,8,3,1 128,64,8,4,1
tune 64 128,64,4,3,0 128,64,8,3,0 128,64,4,3,1 128,64,8,3,1 128,128,8,3,1
tune 256 128,64,8,2,0 128,64,8,2,1 64,64,4,2,1 128,32,8,3,1
stage ablation settings, CUDA-graph timing
timeout 150 python3 runner.py --ablation all --settings-only --no-ncu --cuda-graph --repeats 2 \
  --out $R/ablation_graph > $R/ablation_graph.log 2>&1; echo "rc=$?"; tail -25 $R/ablation_graph.log
stage done
