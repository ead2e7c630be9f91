"""The Gluon backward's next S^T matmul issued ahead (kernels/flash_attn_hopper.py,
BWD_SCORES_AHEAD), in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_scores_ahead.py --out DIR      # DIR/bwd_scores_ahead.csv

The floor: the kernel's five matmuls per query step. With dQ fused and issued after dK, a
consumer waits for its dQ_i matmul, scales dQ_i, writes it to shared memory and issues its
reduce-add before it issues step i + 1's S^T matmul: nothing of its own is queued on the tensor
cores meanwhile, and Nsight Compute saw the tensor pipe active a smaller share of the time than
FA4's (reports/h200/bwd_counters/counters.md). Issuing S^T_{i+1} right after dQ_i's matmul (dP^T
stays at the top of the step: with both ahead the consumer spills several times more, by
tools/compile_check_sm90.py) lets it run under that epilogue. Prediction: a few percent on the
dense backward. The rule puts dQ before dK with GQA, a window or ALiBi (_dq_first), where the
dQ epilogue already runs under the dK matmul; the third variant runs those with dQ after dK and
S^T ahead. Per variant: the whole backward through kernels.flash_attn_func (the plans rebuilt
for it), first checked against the float64 reference on dense, GQA and window backwards
(exp_bwd_schedule.FEATURE_CHECKS), then timed by harness.features (`do_bench` of `out.backward`,
bf16, head dim 128), rounds interleaved (exp_bwd_stages.compare_variants). Rows in the
decisions format, written as they are measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_bwd_scores_ahead.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"S^T issued at its step": (False, None),
            "next S^T ahead of dQ's epilogue": (True, None),
            "next S^T ahead, dQ after dK everywhere": (True, False)}


def select(setting: tuple[bool, bool | None]) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_SCORES_AHEAD, hopper.BWD_DQ_FIRST = setting
    backward._PLANS.clear()  # plans hold the constexprs they were made with


def main() -> None:
    from exp_bwd_schedule import FEATURE_CHECKS
    from exp_bwd_stages import run_experiment

    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_scores_ahead.csv", TOOL, VARIANTS, select,
                   (hopper.BWD_SCORES_AHEAD, hopper.BWD_DQ_FIRST), FEATURE_CHECKS)


if __name__ == "__main__":
    main()
