"""The Gluon dK/dV kernel under a sliding window (kernels/flash_attn_hopper.py, BWD_SPLIT_WINDOW):
one loop whose every query step tells at run time whether its rows see all of the key block,
against three loops (the masked steps on the block's diagonal side, the steps that see every
key with no mask code, the masked steps at the window's far edge), in one process on the H200,
FA4 beside where it is installed.

    python tools/experiments/exp_bwd_window_loop.py --out DIR      # DIR/bwd_window_loop.csv

The floor: the step's five matmuls. A window of 4096 keys gives each 128-key block about 66
query steps of 64 rows, of which 4 need the mask: the one-loop form keeps the mask's code (its
comparisons' registers, a run-time branch) in all of them, as the causal kernel's one loop did
before its diagonal steps ran apart (BWD_SPLIT_DIAGONAL, a few percent there). Prediction: a
percent or two on the window's backward, nothing on the full causal one (another kernel: the
control for the clocks). Per variant: checked against float64 (exp_bwd_schedule's check on
windows both sides, one narrower than a block, non-causal, with GQA), then the features suite's
window cases timed with rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_schedule import DENSE_CHECKS
from exp_bwd_stages import run_experiment

TOOL = "tools/experiments/exp_bwd_window_loop.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"one loop, run-time mask": False, "masked steps apart": True}
# (causal, kv heads of 4 q heads, window): one-sided and two-sided, a window narrower than a key
# block (its masked steps before and after meet), non-causal, and GQA
CHECKS = (*DENSE_CHECKS, (True, 4, (256, 0)), (True, 2, (1000, 0)), (False, 4, (100, 37)), (False, 4, (30, 10)),
          (True, 4, (7, 0)))


def select(value: bool) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_SPLIT_WINDOW = value
    backward._PLANS.clear()  # plans hold the kernel they were made with


def cases():
    """The features suite's window cases at 8k-32k (16 heads, and 32 q heads over 8 kv heads at
    16k) and the full causal calls the bar divides by."""
    from harness.features import WINDOW, Case

    return [*(Case("window", "window", 1, n, 16, 16, window=WINDOW) for n in (8192, 16384, 32768)),
            Case("window", "window", 1, 16384, 32, 8, window=WINDOW),
            *(Case("window", "full-causal", 1, n, 16, 16) for n in (16384, 32768))]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_window_loop.csv", TOOL, VARIANTS, select, hopper.BWD_SPLIT_WINDOW, cases=cases(),
                   checks=CHECKS)


if __name__ == "__main__":
    main()
