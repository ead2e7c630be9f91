"""The varlen Gluon dK/dV kernel's loader warp (kernels/flash_attn_hopper.py,
VARLEN_BWD_STATS_AHEAD): each query step's rows of L and D loaded at the step, or one step
ahead, in one process on the H200, FA4 beside.

    python tools/experiments/exp_varlen_bwd_stats_ahead.py --out DIR   # DIR/varlen_bwd_stats_ahead.csv

The floor is the step's five matmuls. On equal lengths the varlen kernel took longer than the
dense kernel over the same work, causal and not; where the dense kernel's L and D arrive by TMA
with Q and dO, the varlen loader (one warp) loads each step's rows by plain loads, waits for
them to store them into the stage and arrives, so each of its steps spends one load latency
before the next step's TMA can be issued, with two stages to cover it. Loading the next step's
rows before storing this one's takes that latency off the loader's cycle. Prediction: a few
percent where the loader falls behind (the packed cases, equal lengths included), nothing on the
dense control, whose code is unchanged; ptxas's spill stores rose non-causal (the loader holds
two steps' rows at 24 registers a thread). Per form: checked against float64 (exp_varlen_bwd_loads'
check), then timed with rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment
from exp_varlen_bwd_loads import cases as packed_cases
from exp_varlen_bwd_loads import check

TOOL = "tools/experiments/exp_varlen_bwd_stats_ahead.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"L, D loaded at their step": False, "L, D loaded one step ahead": True}


def select(ahead: bool) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.VARLEN_BWD_STATS_AHEAD = ahead
    backward._PLANS.clear()


def cases():
    """The features suite's packed case causal and not, causal with 32 q heads over 8 kv heads,
    twelve equal sequences of 2048 tokens causal and not, and the dense 8 x 2k backward (unchanged
    code: the control)."""
    from harness.features import Case

    causal, full = packed_cases()
    equal = dataclasses.replace(causal, batch=12, seqlen=2048, lengths=(2048,) * 12)
    return [causal, full, dataclasses.replace(causal, heads=32, kv_heads=8), equal,
            dataclasses.replace(equal, causal=False), Case("score", "dense", 8, 2048, 16, 16)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "varlen_bwd_stats_ahead.csv", TOOL, VARIANTS, select, hopper.VARLEN_BWD_STATS_AHEAD,
                   cases=cases(), checker=check)


if __name__ == "__main__":
    main()
