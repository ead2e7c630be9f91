"""The Gluon dK/dV kernels' launch order (kernels/flash_attn_hopper.py, BWD_HEAD_SECTION and
bwd_grid): each (batch, kv head) pair's key blocks in turn, against sections of pairs whose key
blocks go block-major, in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_launch_order.py --out DIR      # DIR/bwd_launch_order.csv

The floor: the kernel's time when its programs end together. A causal key block's program runs
over the queries from its diagonal to the end, so block 0's is the longest. Programs start in
grid order as SMs free up (one program an SM at 198 KiB of shared memory); with each pair's key
blocks in turn, the last pairs' longest programs start in the last wave and run on alone (FA4's
backward has the same order). Sections of pairs taken block-major start a section's longest
programs first; a section sized to the L2 cache keeps its pairs' Q, dO and float32 dQ
accumulator there (FlashAttention-4's deterministic backward scheduler sizes its sections so),
every pair together does not. Prediction, from a list-scheduling model of these cases (each
program its query steps plus three for its prologue and epilogue, 132 SMs): the tail costs
1-7% of the dense, window and packed backwards and 1-28% of the GQA ones (most at 2k-4k keys,
where a pair's longest program is a quarter of the per-SM work); L2-sized sections recover
the dense, window and packed cases' share, every pair together all of it, if the misses it
adds cost less. Per order: checked against float64 (exp_bwd_schedule's check: dense both
causal modes, GQA and a window; one compiled kernel serves every order, the grid differs),
then the features suite's backward cases timed with rounds interleaved
(exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import default_cases, run_experiment

TOOL = "tools/experiments/exp_bwd_launch_order.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {
    "each pair's key blocks in turn": 1,
    "sections sized to L2, block-major": "l2",
    "sections of 8 pairs, block-major": 8,
    "every pair together, block-major": 1 << 20,
}


def select(value) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_HEAD_SECTION = value
    backward._PLANS.clear()  # plans hold the grid they were made with


def cases():
    """exp_bwd_stages' cases and the features suite's other GQA and window lengths."""
    from harness.features import WINDOW, Case

    return [*default_cases(), Case("gqa", "gqa", 4, 2048, 32, 8), Case("gqa", "gqa", 2, 4096, 32, 8),
            Case("window", "window", 1, 8192, 16, 16, window=WINDOW),
            Case("window", "window", 1, 32768, 16, 16, window=WINDOW)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_launch_order.csv", TOOL, VARIANTS, select, hopper.BWD_HEAD_SECTION, cases=cases())


if __name__ == "__main__":
    main()
