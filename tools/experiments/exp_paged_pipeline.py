"""A paged cache's key-block loop on the split-KV kernel: block-table entries read one key block
ahead (`PREFETCH_PAGES=1`, the code) against two ahead, and against other tiles, next to the
contiguous cache, at the decode suite's short caches where paged trails contiguous most.

    python tools/experiments/exp_paged_pipeline.py --out DIR      # DIR/paged_pipeline.csv

The floor: a paged call reads the same K and V bytes as a contiguous one. Its K addresses come
from the block table, so K loads of later blocks can be issued only once their page numbers have
arrived; two blocks ahead leaves the software pipeline's third stage its pages in time. One
process, bf16, one query token, 32 q heads, head dim 128, 16-token pages in a shuffled pool
(harness.decode.Inputs); per shape each variant's output checked against float64 (harness.decode's
relative-error bound) in every round, rounds interleaved, each cell the median latency in
microseconds by CUDA-graph replay. Rows in the decisions format, written as they are measured; a
variant that fails its check is a row with its reason and no time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_paged_pipeline.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
# (batch, cache length, kv heads, num_splits): the suite's short caches at the heuristic's splits,
# two longer ones, and one program per (batch, kv head) walking every block
SHAPES = ((1, 1024, 8, 0), (1, 4096, 8, 0), (1, 8192, 8, 0), (1, 1024, 32, 0), (1, 4096, 32, 0), (8, 1024, 8, 0),
          (1, 65536, 8, 0), (8, 8192, 8, 0), (1, 16384, 8, 1))
# label -> (paged, block-table read distance, tile override (block_n, num_warps, num_stages) or None)
VARIANTS = {"contiguous": (False, 1, None),
            "paged, pages one block ahead": (True, 1, None),
            "paged, pages two blocks ahead": (True, 2, None),
            "paged, 128-key tiles, 8 warps": (True, 1, (128, 8, 3)),
            "paged, 2 stages": (True, 1, (64, 4, 2))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    parser.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a smoke run, not timing)")
    args = parser.parse_args()
    import torch

    from harness.decode import Inputs, _measure, _ours, kv_bytes, timing_copies
    from kernels import decode
    from reports.decisions import DecisionWriter

    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "paged_pipeline.csv", TOOL) as writer:
        for batch, cache_len, kv_heads, num_splits in SHAPES:
            column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv, splits {num_splits or 'auto'}"
            inputs = Inputs(batch, cache_len, kv_heads, device, timing_copies(batch, cache_len, kv_heads, device))
            reference, nbytes = inputs.reference(), kv_bytes(batch, cache_len, kv_heads)
            for _ in range(args.repeats):
                for name, (paged, ahead, tile) in VARIANTS.items():
                    decode.PAGED_PREFETCH, decode.TILE_OVERRIDE = ahead, tile
                    row = _measure(_ours(num_splits, paged), inputs, reference, device, nbytes)
                    ok = row.get("status") == "ok"
                    writer.write(name, column, "us", row["ms"] * 1e3 if ok else float("nan"),
                                 tool=None if ok else f"{TOOL}; {row.get('status')}: {row.get('reason', '')}"[:600])
                    print(f"{column:30s} {name:32s} {row.get('ms', float('nan')) * 1e3:9.1f} us "
                          f"{row.get('status')} {row.get('reason', '')}", flush=True)
            decode.PAGED_PREFETCH, decode.TILE_OVERRIDE = 1, None  # the code's again
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
