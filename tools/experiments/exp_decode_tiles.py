"""The split kernel's tile (key block, warps, pipeline depth) across the decode suite's batch
sizes, for a contiguous and a paged KV cache: the measurement behind `kernels.decode.choose_tile`.

    python tools/experiments/exp_decode_tiles.py --out DIR      # DIR/decode_tiles.csv

One process, bf16, one query token, 32 q heads, head dim 128, 16-token pages in a shuffled pool
(harness.decode.Inputs), `num_splits=0`; each cell the median latency in microseconds by
CUDA-graph replay (harness.decode's timing, each captured call reading another copy of the
cache), with every call of a cell on the same tile (`kernels.decode.TILE_OVERRIDE`). Rows in
the decisions format, written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_decode_tiles.py, bf16, 32 q heads, head dim 128, num_splits=0, CUDA-graph replay"
TILES = ((64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 4))
SHAPES = ((1, 1024, 8), (1, 65536, 8), (8, 1024, 8), (8, 8192, 8), (32, 1024, 8), (32, 4096, 8), (32, 16384, 8),
          (64, 1024, 8), (64, 4096, 8), (64, 16384, 8), (8, 1024, 32), (32, 1024, 32), (32, 4096, 32),
          (64, 1024, 32), (64, 4096, 32))


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
    with DecisionWriter(args.out / "decode_tiles.csv", TOOL) as writer:

        def measure(batch, cache_len, kv_heads, inputs):
            column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv"
            for layout in ("contiguous", "paged"):
                for tile in TILES:
                    decode.TILE_OVERRIDE = tile
                    try:
                        timing, _ = _time_call(_ours(0, layout == "paged"), inputs, device)
                    except Exception as exc:  # noqa: BLE001 -- a tile that does not compile or fit: a row, go on
                        writer.write(f"{layout} {tile}", column, "us", float("nan"),
                                     tool=f"{TOOL}; failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
                        print(f"{column:20s} {layout} {tile}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    finally:
                        decode.TILE_OVERRIDE = None
                    writer.write(f"{layout} {tile}", column, "us", timing.ms * 1e3)
                    print(f"{column:20s} {layout:10s} {tile!s:14s} {timing.ms * 1e3:9.1f} us", flush=True)

        measure_each(SHAPES, device, measure)

if __name__ == "__main__":
    main()
