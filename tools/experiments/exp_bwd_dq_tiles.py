"""The fused dQ's float32 accumulator in the Gluon dK/dV kernel (kernels/flash_attn_hopper.py,
BWD_DQ_ORDER): rows of the (batch x seqlen, heads x head dim) view against each consumer's 64 x 64
tile in its registers' order (FA4's dQaccum order), in one process on the H200, FA4 beside.

    python tools/experiments/exp_bwd_dq_tiles.py --out DIR      # DIR/bwd_dq_tiles.csv

The floor is the step's five matmuls. Nsight Compute read far more shared-memory bank conflicts
in our kernel than in FA4's (reports/h200/bwd_counters/), and Triton's count puts them on the dQ
tile's store from the wgmma registers into its 128-byte-swizzled rows
(tools/compile_check_sm90.py --bank-conflicts); a 32-byte swizzle removed them but took four
narrower reduce-add boxes per tile and was slower. In register order each thread stores its
registers four at a time side by side (no conflicts, half the store instructions), the tile is
one contiguous [16, 256] box, and a cast kernel puts the tiles back in rows (instead of the
accumulator's cast); ptxas's spill stores fell on every kernel. Prediction: a few percent where
dQ's epilogue is on the step's path (dense MHA, dQ after dK), less with dQ first (GQA, windows),
none on the packed batch (its kernel reads VARLEN_BWD_DQ_ORDER, not this setting: a control). Per order: checked against float64
(exp_bwd_schedule's FEATURE_CHECKS: dense both causal modes, GQA and a window), then the features
suite's backward cases and the window at 32k, rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_dq_order import check
from exp_bwd_stages import default_cases, run_experiment

TOOL = "tools/experiments/exp_bwd_dq_tiles.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dQ tiles as rows": "rows", "dQ tiles in register order": "registers"}


def select(order: str) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_DQ_ORDER = order
    backward._PLANS.clear()  # plans hold the order they were made with


def cases():
    """exp_bwd_stages' cases (the features suite's dense, GQA, window and packed backwards) and
    the window at 32k."""
    from harness.features import WINDOW, Case

    return [*default_cases(), Case("window", "window", 1, 32768, 16, 16, window=WINDOW)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_dq_tiles.csv", TOOL, VARIANTS, select, hopper.BWD_DQ_ORDER, cases=cases(),
                   checker=check)


if __name__ == "__main__":
    main()
