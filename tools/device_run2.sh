#!/usr/bin/env bash
# Second device call: the Nsight Compute counters of the ablation settings (the first call's
# ncu step crashed on a text attribute, fixed since) and the paper suite at head dim 256.
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
R=/tmp/h200; mkdir -p $R
pack() { tar czf $OUT/h200.tgz -C $R . ; }
trap pack EXIT
echo "== $(date +%T) counters"
timeout ${NCU_S:-200} python3 runner.py --ablation all --settings-only --ncu-only --out $R/counters > $R/counters.log 2>&1; echo "rc=$?"; pack
echo "== $(date +%T) paper suite, head dim 256"
timeout ${PAPER_S:-150} python3 runner.py --suite paper --dtype bf16 --hdims 256 --rep-ms 25 --warmup-ms 5 \
  --providers fa2,sdpa-flash,sdpa-cudnn,sdpa-efficient,pytorch --out $R/paper256 > $R/paper256.log 2>&1; echo "rc=$?"
echo "== $(date +%T) done"; tail -n 30 $R/counters.log
