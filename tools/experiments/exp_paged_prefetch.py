"""A paged KV cache's block table read one key block ahead (`PREFETCH_PAGES` of
kernels/decode_kernels.py) against read at each block, next to the contiguous cache, on the
decode suite's inputs: the measurement behind `kernels.decode.PAGED_PREFETCH`.

    python tools/experiments/exp_paged_prefetch.py --out DIR      # DIR/paged_prefetch.csv

One process, bf16, one query token, 32 q heads, head dim 128, 16-token pages in a shuffled pool
(harness.decode.Inputs); each cell the median latency in microseconds by CUDA-graph replay
(harness.decode's timing, each captured call reading another copy of the cache), for
`num_splits=0` (the heuristic) and `num_splits=1`. Rows in the decisions format (row, column,
unit, value, tool, git_commit), written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_paged_prefetch.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
SHAPES = ((1, 1024, 8), (1, 16384, 8), (1, 65536, 8), (8, 8192, 8), (32, 8192, 8), (1, 65536, 32), (8, 8192, 32))
VARIANTS = (("contiguous", False, False), ("paged, block table read per block", True, False),
            ("paged, block table read ahead", True, True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from harness.decode import _ours, _time_call, measure_each
    from kernels import decode
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "paged_prefetch.csv", TOOL) as writer:

        def measure(batch, cache_len, kv_heads, inputs):
            for num_splits in (0, 1):
                column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv, splits {num_splits or 'auto'}"
                for label, paged, prefetch in VARIANTS:
                    decode.PAGED_PREFETCH = prefetch
                    timing, how = _time_call(_ours(num_splits, paged), inputs, device)
                    writer.write(label, column, "us", timing.ms * 1e3)
                    print(f"{column:34s} {label:36s} {timing.ms * 1e3:9.1f} us  ({how})", flush=True)
            decode.PAGED_PREFETCH = True

        measure_each(SHAPES, device, measure)

if __name__ == "__main__":
    main()
