"""The fused dQ tile's shared-memory swizzle in the Gluon backward (kernels/flash_attn_hopper.py,
BWD_DQ_SWIZZLE): the 128-byte default against a 32-byte swizzle, in one process on the H200, FA4
beside where it is installed.

    python tools/experiments/exp_bwd_dq_swizzle.py --out DIR      # DIR/bwd_dq_swizzle.csv

The floor: the kernel's five matmuls per query step. Nsight Compute counted far more
shared-memory bank conflicts in our dense backward than in FA4's
(reports/h200/bwd_counters/counters.md); Triton's own count (tools/compile_check_sm90.py
--bank-conflicts) puts them on the store of each step's float32 dQ tile from the wgmma
accumulator into its 128-byte-swizzled layout, and finds none under a 32-byte swizzle, which the
TMA reduce-add takes too (in more, narrower boxes). Prediction: the store, which sits between a
step's dQ matmul and its reduce-add, takes half the wavefronts; a few percent where that store
delays the next step. Per variant: the whole backward through kernels.flash_attn_func (the plans
rebuilt for it), first checked against the float64 reference (exp_bwd_schedule's check), then
timed by harness.features (`do_bench` of `out.backward`, bf16, head dim 128), rounds interleaved
(exp_bwd_stages.compare_variants). Rows in the decisions format, written as they are measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_bwd_dq_swizzle.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dQ tile, 128-byte swizzle": None, "dQ tile, 32-byte swizzle": 32}


def select(swizzle: int | None) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_DQ_SWIZZLE = swizzle
    backward._PLANS.clear()  # plans hold the descriptor templates they were made with


def main() -> None:
    from exp_bwd_stages import run_experiment

    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_dq_swizzle.csv", TOOL, VARIANTS, select, hopper.BWD_DQ_SWIZZLE)

if __name__ == "__main__":
    main()
