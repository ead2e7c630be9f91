"""The Gluon dK/dV kernel's query step (kernels/flash_attn_hopper.py): where D_i is read, whether
a causal key block's diagonal steps run in a loop of their own, and whether a softcap's backward
runs on the Gluon kernel, in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_step_loop.py --out DIR      # DIR/bwd_step_loop.csv

The floor: the step's five matmuls; the question is what the registers around them cost. Each
consumer warpgroup holds dK_j and dV_j (64 keys x 128 columns of float32 each), S^T and the
in-flight dP^T (64 x 64 each) at 240 registers a thread, so whatever else lives through the
softmax spills (ptxas counts spill stores: `tools/compile_check_sm90.py --hopper-gluon`).
Reading D_i with L_i (the old form) holds its row through the softmax; reading it once P^T is
made does not (BWD_LATE_DELTA). Under a causal mask one loop for all steps keeps the diagonal
mask's code, and its registers, in every step; a loop for the two steps that cross the diagonal
and one without a mask for the rest do not (BWD_SPLIT_DIAGONAL). A softcap holds tanh through
the softmax as well, which spilled most (dispatch.GLUON_SOFTCAP_BACKWARD sends its backward to
the Gluon kernel). Per variant: checked against float64 (exp_bwd_schedule's check: dense both
causal modes, GQA, a window and a softcap), then the features suite's backward cases timed with
rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_schedule import FEATURE_CHECKS
from exp_bwd_stages import default_cases, run_experiment

TOOL = "tools/experiments/exp_bwd_step_loop.py, bf16, head dim 128, do_bench of the whole backward"
# name -> (BWD_LATE_DELTA, BWD_SPLIT_DIAGONAL, GLUON_SOFTCAP_BACKWARD)
VARIANTS = {
    "one loop, D with L, softcap on Triton": (False, False, False),
    "one loop, D late, softcap on Gluon": (True, False, True),
    "diagonal loop, D late, softcap on Gluon": (True, True, True),
}
CHECKS = (*FEATURE_CHECKS, (True, 4, (-1, -1), 30.0))


def select(value) -> None:
    from kernels import backward, dispatch
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_LATE_DELTA, hopper.BWD_SPLIT_DIAGONAL, dispatch.GLUON_SOFTCAP_BACKWARD = value
    backward._PLANS.clear()  # plans hold the kernel they were made with


def cases():
    """exp_bwd_stages' cases and the features suite's softcap and ALiBi ones."""
    from harness.features import SOFTCAP, Case

    return [*default_cases(), Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
            Case("score", "alibi", 2, 8192, 16, 16, alibi=True)]


def main() -> None:
    from kernels import dispatch
    from kernels import flash_attn_hopper as hopper

    production = (hopper.BWD_LATE_DELTA, hopper.BWD_SPLIT_DIAGONAL, dispatch.GLUON_SOFTCAP_BACKWARD)
    run_experiment(__doc__, "bwd_step_loop.csv", TOOL, VARIANTS, select, production, cases=cases(), checks=CHECKS)


if __name__ == "__main__":
    main()
