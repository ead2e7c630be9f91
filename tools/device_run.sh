#!/usr/bin/env bash
# The H200 measurements committed under reports/h200/, in one device call (the device lends
# 10 minutes a command): the paper suite, the ablation with Nsight Compute counters, and the
# regression baseline with two comparisons against it (unchanged kernel; slowed fa2 forward).
# Everything lands in $OUT/h200.tgz (the device returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
R=/tmp/h200; mkdir -p $R
T="--rep-ms ${REP_MS:-25} --warmup-ms ${WARMUP_MS:-5}"
stage() { echo "== $(date +%T) $*"; }
pack() { tar czf $OUT/h200.tgz -C $R . ; }
trap pack EXIT

stage paper suite
timeout ${PAPER_S:-230} python3 runner.py --suite paper --dtype bf16 --hdims 64,128 $T \
  --providers fa2,sdpa-flash,sdpa-cudnn,sdpa-efficient,pytorch,xformers-cutlass,flash-attn,flash-attn-3 \
  --out $R/paper > $R/paper.log 2>&1; echo "rc=$?"; pack

stage ablation
timeout ${ABLATION_S:-220} python3 runner.py --ablation all --repeats 2 --hdims 64,128 --seqlens 1024,4096,16384 \
  $T --ncu --out $R/ablation > $R/ablation.log 2>&1; echo "rc=$?"; pack

stage regression baseline and comparisons
Q="--quick --providers fa2,sdpa-flash --dtype bf16 $T"
timeout 60 python3 runner.py $Q --repeats 2 --save-baseline $R/baseline/nvidia-h200.json --out $R/quick_baseline > $R/quick_baseline.log 2>&1; echo "rc=$?"
timeout 50 python3 runner.py $Q --compare $R/baseline/nvidia-h200.json --out $R/quick_compare > $R/quick_compare.log 2>&1; echo "compare rc=$?"
timeout 50 python3 runner.py $Q --fa2-fwd-config 16,16,4,1 --compare $R/baseline/nvidia-h200.json --out $R/quick_slowed > $R/quick_slowed.log 2>&1; echo "slowed compare rc=$? (1 = regression flagged)"
stage done
tail -n 25 $R/ablation.log; tail -n 12 $R/quick_slowed.log
