"""The split heuristic's floor of key blocks per split (`kernels.decode.MIN_BLOCKS_PER_SPLIT`) at
the decode suite's short caches, paged and contiguous.

    python tools/experiments/exp_decode_split_floor.py --out DIR      # DIR/decode_split_floor.csv

At batch 1 with a short cache the floor, not the SM count, sets the split count (1 x 4k with 8
kv heads: 64 key blocks, 16 splits at a floor of 4, 128 programs on 132 SMs), and each program
walks only a few blocks, where a paged cache's per-block cost shows most. Prediction: a lower
floor (more, shorter splits, up to the heuristic's two programs per SM) shortens each program's
walk and so the paged cache's gap, at the price of a larger combine. One process, bf16, one
query token, 32 q heads, head dim 128, 16-token pages in a shuffled pool (harness.decode.Inputs),
`num_splits=0`; each output checked against float64 (harness.decode's relative-error bound) in
every round, rounds interleaved, each cell the median latency in microseconds by CUDA-graph
replay. Rows in the decisions format, written as they are measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_decode_split_floor.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
# (batch, cache length, kv heads): short caches where the floor sets the split count, and two
# where the SM count does (controls: the same splits at every floor)
SHAPES = ((1, 1024, 8), (1, 4096, 8), (1, 8192, 8), (1, 1024, 32), (1, 4096, 32), (8, 1024, 8), (1, 16384, 8),
          (1, 65536, 8), (8, 8192, 8))
FLOORS = (4, 2, 1)  # the code's first


def main() -> None:
    from harness.decode import ExperimentCase, _ours, layout_variants, run_experiment
    from kernels import decode

    code_floor = decode.MIN_BLOCKS_PER_SPLIT
    variants = layout_variants([(floor, floor) for floor in FLOORS], "{layout}, at least {setting} blocks per split")
    cases = [ExperimentCase(batch, cache_len, kv_heads, f"{batch} x {cache_len // 1024}k, {kv_heads} kv",
                            lambda paged: _ours(0, paged)) for batch, cache_len, kv_heads in SHAPES]

    def select(value):
        decode.MIN_BLOCKS_PER_SPLIT = value[1]

    def restore():
        decode.MIN_BLOCKS_PER_SPLIT = code_floor

    run_experiment(__doc__, "decode_split_floor.csv", TOOL, variants, select, restore, cases, width=40)


if __name__ == "__main__":
    main()
