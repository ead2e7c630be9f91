"""The Gluon varlen dK/dV kernel's mask (kernels/flash_attn_hopper.py, VARLEN_BWD_MASK_AT_RUN_TIME):
in its one loop every query step masks P^T, against each step telling at run time whether it
needs the mask, in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_varlen_bwd_mask.py --out DIR      # DIR/varlen_bwd_mask.csv

The floor is the dense kernel's step (the same five matmuls). The packed kernel's one loop masks
P^T at every step (keys past the sequence's end, and causal, keys past each row's diagonal): a
comparison, an and and a select per element where only a sequence's last key block and, causal,
the steps that cross a block's diagonal need it; the dense kernel's one loop told at run time
(before its diagonal steps ran apart), and the masked steps in a loop of their own measured
level causal and slower non-causal for this kernel (docs/performance.md). Prediction: a few
percent on the packed backward, more non-causal (no diagonal); ptxas's spill stores rose causal
and fell non-causal (`tools/compile_check_sm90.py --hopper-gluon`), which may cost back. Per
variant: checked against float64 (exp_varlen_bwd_loads' check: ragged lengths with an empty
sequence, GQA, both causal modes), then the features suite's packed case, causal and not, and
with GQA, timed with rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment
from exp_varlen_bwd_loads import cases as packed_cases
from exp_varlen_bwd_loads import check

TOOL = "tools/experiments/exp_varlen_bwd_mask.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"every step masked": False, "masked where a step needs it": True}


def select(value: bool) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.VARLEN_BWD_MASK_AT_RUN_TIME = value
    backward._PLANS.clear()


def cases():
    """The features suite's packed case causal and not, and causal with 32 q heads over 8 kv heads."""
    causal, full = packed_cases()
    return [causal, full, dataclasses.replace(causal, heads=32, kv_heads=8)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "varlen_bwd_mask.csv", TOOL, VARIANTS, select, hopper.VARLEN_BWD_MASK_AT_RUN_TIME,
                   cases=cases(), checker=check)


if __name__ == "__main__":
    main()
