"""Key rows' addresses worked out once per launch (`kernels.decode.HOISTED_ADDRESSES`: the split
kernel's PAGE_LAYOUT and SAME_KV_STRIDES) against worked out at every key block, paged and
contiguous, on the decode suite's inputs.

    python tools/experiments/exp_paged_addressing.py --out DIR      # DIR/paged_addressing.csv

The floor: a paged call reads the same K and V bytes as a contiguous one. Compiled for sm_90
(16-token pages, 64-key blocks), the paged kernel's key loop had many more instructions than the
contiguous one's (the SASS of both), most of them each row's page number, offset in its page and
64-bit row address, for K and again for V; with a block holding whole pages the offsets are the same at
every block, and with K and V strided alike V's rows are K's. One process, bf16, one query token,
32 q heads, head dim 128, 16-token pages in a shuffled pool (harness.decode.Inputs); per shape
each variant's output checked against float64 first (harness.decode's relative-error bound),
then rounds interleaved, each cell the median latency in microseconds by CUDA-graph replay (each
captured call reading another copy of the cache). Rows in the decisions format, written as they
are measured; a variant that fails its check is a row with its reason and no time.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_paged_addressing.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
# (batch, cache length, kv heads, num_splits): the suite's short caches where paged trails
# contiguous most, one program walking a long cache alone (num_splits=1: the loop's own cost),
# long caches split by the heuristic, and batches whose programs fill the GPU (more registers
# per program could leave fewer of them resident)
SHAPES = ((1, 1024, 8, 0), (1, 1024, 32, 0), (1, 4096, 8, 0), (1, 4096, 32, 0), (1, 16384, 8, 0),
          (1, 16384, 8, 1), (1, 65536, 8, 0), (1, 65536, 32, 0), (8, 8192, 8, 0), (32, 4096, 8, 0),
          (64, 4096, 32, 0), (32, 16384, 32, 0))
SCHEMES = (("per block", False), ("per launch", True))


def main() -> None:
    from harness.decode import ExperimentCase, _ours, layout_variants, run_experiment
    from kernels import decode

    production = decode.HOISTED_ADDRESSES
    cases = [ExperimentCase(batch, cache_len, kv_heads,
                            f"{batch} x {cache_len // 1024}k, {kv_heads} kv, splits {num_splits or 'auto'}",
                            lambda paged, num_splits=num_splits: _ours(num_splits, paged))
             for batch, cache_len, kv_heads, num_splits in SHAPES]

    def select(value):
        decode.HOISTED_ADDRESSES = value[1]

    def restore():
        decode.HOISTED_ADDRESSES = production  # the rule again

    run_experiment(__doc__, "paged_addressing.csv", TOOL, layout_variants(SCHEMES, "{layout}, addresses {setting}"),
                   select, restore, cases)


if __name__ == "__main__":
    main()
