# Sourced by the device scripts (tools/device_run4.sh and later): strict mode, unbuffered
# Python, a results folder $R packed into $OUT/h200.tgz at every stage and at exit (the device
# returns at most 8 files), and a timestamped stage banner. Set TQDM_MININTERVAL before
# sourcing to change how often progress bars print (default 30 s).
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-30}
R=/tmp/h200; mkdir -p $R
pack() { tar czf $OUT/h200.tgz -C $R . ; }
trap pack EXIT
stage() { echo "== $(date +%T) $*"; }
