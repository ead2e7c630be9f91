"""The varlen Gluon dK/dV kernel's fused dQ accumulator (kernels/flash_attn_hopper.py,
VARLEN_BWD_DQ_ORDER): rows of the packed (total_q, heads x head dim) view against each
consumer's 64 x 64 tile in its registers' order, each sequence's tiles from a padded row of their
own (FA3's padded offsets), in one process on the H200, FA4 beside.

    python tools/experiments/exp_varlen_bwd_dq_tiles.py --out DIR      # DIR/varlen_bwd_dq_tiles.csv

The floor is the step's five matmuls. The dense kernel's tiles in register order (stored without
bank conflicts, one contiguous [16, 256] reduce-add box, cast back by a Triton kernel) were faster
on most of its cases (docs/performance.md); the packed kernel kept rows because its query steps
start at any packed row. With each sequence's rows from (start + 64 b) // 64 * 64 in a padded
accumulator (64 rows a sequence more), no tile holds two sequences, the preprocess zeroes the
padding with the rest, and the cast reads each sequence's tiles. Prediction: the dense kernel's
gain on its short causal case (a few percent) on the packed backward, less with GQA (dQ's share
of the step is the same, but the store waits less); the dense 8 x 2k backward, whose code is
unchanged, is the clocks' control. Per order: checked against float64 (exp_varlen_bwd_loads'
check: ragged lengths with an empty sequence, GQA, both causal modes), then timed with rounds
interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment
from exp_varlen_bwd_loads import cases as packed_cases
from exp_varlen_bwd_loads import check

TOOL = "tools/experiments/exp_varlen_bwd_dq_tiles.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dQ tiles as rows": "rows", "dQ tiles in register order": "registers"}


def select(order: str) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.VARLEN_BWD_DQ_ORDER = order
    backward._PLANS.clear()


def cases():
    """The features suite's packed case causal and not, causal with 32 q heads over 8 kv heads,
    and the dense 8 x 2k backward (unchanged code: the control)."""
    from harness.features import Case

    causal, full = packed_cases()
    return [causal, full, dataclasses.replace(causal, heads=32, kv_heads=8), Case("score", "dense", 8, 2048, 16, 16)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "varlen_bwd_dq_tiles.csv", TOOL, VARIANTS, select, hopper.VARLEN_BWD_DQ_ORDER,
                   cases=cases(), checker=check)


if __name__ == "__main__":
    main()
