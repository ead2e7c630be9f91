"""Where the Gluon dK/dV kernel issues the fused dQ's matmul (kernels/flash_attn_hopper.py,
BWD_DQ_FIRST and `_dq_first`'s rule), timed again on the kernel's current step, in one process on
the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_dq_order.py --out DIR      # DIR/bwd_dq_order.csv

The floor is the step's five matmuls. After dK and dV have finished (dense MHA's order), dQ's
matmul and then its store and reduce-add run with no other matmul of this consumer in flight;
before dK (FA3's order, the rule's for GQA/MQA, windows and ALiBi), they run under the dK
matmul. The rule was read from exp_bwd_schedule's rows, taken before the step's later changes (D
read late, the diagonal steps apart, L in log2 units), which moved registers and spills.
Prediction: the rule still holds where it was clear (GQA, windows); for dense MHA, where the two
orders were within a few percent either way, either may now lead. Per order: checked against
float64 (exp_bwd_schedule's FEATURE_CHECKS: dense both causal modes, GQA and a window), then the
features suite's dense, GQA and window backwards and full causal at 32k, rounds interleaved
(exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment

TOOL = "tools/experiments/exp_bwd_dq_order.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dQ first where the rule says": None, "dQ before dK everywhere": True, "dQ after dK everywhere": False}


def select(value: bool | None) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_DQ_FIRST = value
    backward._PLANS.clear()  # plans hold the constexprs they were made with


def check(device) -> tuple[bool, str]:
    from exp_bwd_schedule import FEATURE_CHECKS
    from exp_bwd_schedule import check as schedule_check

    return schedule_check(device, FEATURE_CHECKS)


def cases():
    """The features suite's dense, GQA and window backward cases, full causal at 16k and 32k
    (the window's yardsticks)."""
    from harness.features import WINDOW, Case

    return [Case("score", "dense", 2, 8192, 16, 16), Case("score", "dense", 8, 2048, 16, 16),
            Case("gqa", "gqa", 2, 8192, 32, 8), Case("gqa", "gqa", 1, 16384, 32, 8),
            Case("window", "window", 1, 16384, 16, 16, window=WINDOW), Case("window", "full-causal", 1, 16384, 16, 16),
            Case("window", "window", 1, 32768, 16, 16, window=WINDOW), Case("window", "full-causal", 1, 32768, 16, 16)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_dq_order.csv", TOOL, VARIANTS, select, hopper.BWD_DQ_FIRST, cases=cases(),
                   checker=check)


if __name__ == "__main__":
    main()
