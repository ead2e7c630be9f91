"""The varlen Gluon dK/dV kernel's key blocks (kernels/flash_attn_hopper.py, VARLEN_BWD_GRID):
every sequence given the longest one's, against every sequence's blocks on one axis from its
padded block (cu_seqlens_k[b] + 128 b) // 128, in one process on the H200, FA4 beside.

    python tools/experiments/exp_varlen_bwd_grid.py --out DIR      # DIR/varlen_bwd_grid.csv

The floor is the step's five matmuls, with every SM busy on them. With the longest sequence's key
blocks for each, the programs past a shorter sequence's end start, load their sequence's bounds
and exit: about a third of the grid at the features suite's lengths, nine in ten where one long
sequence sits among short ones. Each holds an SM (one program an SM at the kernel's shared
memory) for its launch and one load. The packed axis leaves at most one such program a
sequence; a program finds its sequence by one vector load of both cu_seqlens and a count
(_varlen_packed_program), where the longest grid reads its place off the grid. Prediction: a
percent or two off the suite's causal case, more on the skewed batch; the spill stores ptxas
reports rose (tools/compile_check_sm90.py --hopper-gluon), which may cost some back. The dense
8 x 2k backward, whose code is unchanged, is the clocks' control. Per grid: checked against
float64 (exp_varlen_bwd_loads' check: ragged lengths with an empty sequence, GQA, both causal
modes), then timed with rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment
from exp_varlen_bwd_loads import cases as packed_cases
from exp_varlen_bwd_loads import check

TOOL = "tools/experiments/exp_varlen_bwd_grid.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"the longest sequence's key blocks for each": "longest", "every sequence's key blocks on one axis": "packed"}
# one 8k sequence among 31 of 256-1023 tokens (a fixed draw): the longest grid's programs mostly idle
SKEWED = (8192, 779, 300, 512, 1000, 256, 640, 871, 333, 999, 402, 288, 760, 512, 615, 901, 257, 450, 1023, 380,
          700, 555, 666, 320, 811, 490, 260, 940, 720, 350, 600, 430)


def select(grid: str) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.VARLEN_BWD_GRID = grid
    backward._PLANS.clear()


def cases():
    """The features suite's packed case causal and not, causal with 32 q heads over 8 kv heads,
    the skewed batch causal, and the dense 8 x 2k backward (unchanged code: the control)."""
    from harness.features import Case

    causal, full = packed_cases()
    skewed = dataclasses.replace(causal, batch=len(SKEWED), seqlen=max(SKEWED), lengths=SKEWED)
    return [causal, full, dataclasses.replace(causal, heads=32, kv_heads=8), skewed,
            Case("score", "dense", 8, 2048, 16, 16)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "varlen_bwd_grid.csv", TOOL, VARIANTS, select, hopper.VARLEN_BWD_GRID,
                   cases=cases(), checker=check)


if __name__ == "__main__":
    main()
