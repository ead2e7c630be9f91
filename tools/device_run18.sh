#!/usr/bin/env bash
# Session 5: the Gluon forwards (tools/experiments/exp_fwd_gluon.py): first run at a9646c6 (one-partition
# kernel, checked and timed); second at the next commit, checking the warp-specialised kernel.
# Correctness first (float64 reference, NaN-poisoned output; each dtype in its own time-limited
# process, since a wrong mbarrier phase hangs), then, only if every check passed, forward
# TFLOPs/s next to the production Triton forward, SDPA flash and SDPA cuDNN in one process.
source "$(dirname "$0")/device_lib.sh"
rm -rf $R/gluon_*  # this run's rows only
mkdir -p $R/gluon_rows
ok=1
for dt in bf16 fp16; do
  stage "check $dt"
  timeout 120 python3 tools/experiments/exp_fwd_gluon.py --check $dt --variants ws > $R/gluon_check_$dt.log 2>&1
  rc=$?; echo "rc=$rc"; grep "^check" $R/gluon_check_$dt.log; tail -3 $R/gluon_check_$dt.log | grep -v "^check"
  if [ $rc -ne 0 ] || grep -q WRONG $R/gluon_check_$dt.log; then ok=0; fi
  pack
done
if [ $ok -eq 1 ]; then
  for dt in bf16 fp16; do
    stage "time $dt"
    OUT=$R/gluon_rows timeout 170 python3 tools/experiments/exp_fwd_gluon.py --time $dt > $R/gluon_time_$dt.log 2>&1
    echo "rc=$?"; grep -E "^(bf16|fp16)" $R/gluon_time_$dt.log; pack
  done
fi
stage done
