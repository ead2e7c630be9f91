"""The split kernel's tile (key block, warps, pipeline depth) for a paged KV cache, next to the
contiguous cache at its shipped tile, on the decode suite's inputs: the measurement behind
`kernels.decode.PAGED_CONFIG`.

    python tools/experiments/exp_paged_tiles.py --out DIR      # DIR/paged_tiles.csv

One process, bf16, one query token, 32 q heads, head dim 128, 16-token pages in a shuffled pool
(harness.decode.Inputs), `num_splits=0`; each cell the median latency in microseconds by
CUDA-graph replay (harness.decode's timing, each captured call reading another copy of the
cache). The shapes: the shortest caches, where a paged cache lost most against a contiguous one,
and the bar's anchors. Rows in the decisions format, written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_paged_tiles.py, bf16, 32 q heads, head dim 128, num_splits=0, CUDA-graph replay"
SHAPES = ((1, 1024, 8), (1, 4096, 8), (64, 1024, 8), (64, 4096, 8), (1, 1024, 32), (64, 1024, 32),
          (1, 65536, 8), (8, 8192, 8), (32, 4096, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from harness.decode import TUNE_TILES, Inputs, _ours, _time_call, timing_copies
    from kernels import decode
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    shipped = decode.PAGED_CONFIG
    with DecisionWriter(args.out / "paged_tiles.csv", TOOL) as writer:
        for batch, cache_len, kv_heads in SHAPES:
            inputs = Inputs(batch, cache_len, kv_heads, device, timing_copies(batch, cache_len, kv_heads, device))
            column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv"
            timing, _ = _time_call(_ours(0, False), inputs, device)
            writer.write(f"contiguous {decode.GPU_CONFIG}", column, "us", timing.ms * 1e3)
            contiguous_us = timing.ms * 1e3
            for tile in TUNE_TILES:
                decode.PAGED_CONFIG = tile
                try:
                    timing, _ = _time_call(_ours(0, True), inputs, device)
                except Exception as exc:  # noqa: BLE001 -- a tile that does not compile or fit: say so, go on
                    print(f"{column:20s} paged {tile}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    decode.PAGED_CONFIG = shipped
                writer.write(f"paged {tile}", column, "us", timing.ms * 1e3)
                print(f"{column:20s} paged {tile!s:14s} {timing.ms * 1e3:9.1f} us  "
                      f"contiguous / paged {contiguous_us / (timing.ms * 1e3):.3f}", flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
