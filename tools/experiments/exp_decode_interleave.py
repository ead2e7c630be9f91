"""The split-KV kernel's splits sharing a sequence's key blocks round robin (`INTERLEAVE_SPLITS` of
kernels/decode_kernels.py) against one run of consecutive blocks per split, paged and
contiguous, on the decode suite's inputs: the measurement behind `kernels.decode.interleave_splits`.

    python tools/experiments/exp_decode_interleave.py --out DIR      # DIR/decode_interleave.csv

Round robin, a split's first key block depends on the split alone, so a paged cache's first
block-table read is issued with the read of cache_seqlens instead of after it; and a sliding
window's blocks are shared by all splits instead of falling to the one or two whose run holds
them. One process, bf16, one query token, 32 q heads, head dim 128, 16-token pages in a shuffled
pool (harness.decode.Inputs), `num_splits=0` (the heuristic); per shape each variant's output
checked against float64 first (harness.decode's relative-error bound), then rounds interleaved,
each cell the median latency in microseconds by CUDA-graph replay (each captured call reading
another copy of the cache). Rows in the decisions format, written as they are measured; a
variant that fails its check is a row with its reason and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_decode_interleave.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
# (batch, cache length, kv heads, window left or -1): the suite's short caches where paged trails
# contiguous most, long ones, one shape whose programs fill the GPU without a split (a control:
# one split reads the same blocks either way) and a 4096-key window at the end of a 64k cache
SHAPES = ((1, 1024, 32, -1), (1, 1024, 8, -1), (1, 4096, 32, -1), (8, 1024, 8, -1), (1, 65536, 32, -1),
          (1, 65536, 8, -1), (8, 8192, 8, -1), (32, 4096, 8, -1), (1, 65536, 8, 4096))
SCHEMES = (("one run per split", False), ("round robin", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    parser.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a smoke run, not timing)")
    args = parser.parse_args()
    import torch

    from baselines.reference import attention_reference
    from harness.decode import _measure, kv_bytes, measure_each
    from kernels import decode
    from reports.decisions import DecisionWriter

    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)

    def call_for(paged: bool, window: int):
        def call(inputs, i):
            k_cache, v_cache = inputs.paged[i] if paged else inputs.contiguous[i]
            table = inputs.block_tables[i] if paged else None
            return decode.flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                                  block_table=table, window_size=(window, -1), num_splits=0)
        return call

    variants = {f"{layout}, {scheme}": (paged, interleaved) for layout, paged in (("contiguous", False),
                ("paged", True)) for scheme, interleaved in SCHEMES}

    def select(value):
        decode.INTERLEAVED_SPLITS = value[1]

    with DecisionWriter(args.out / "decode_interleave.csv", TOOL) as writer:
        for batch, cache_len, kv_heads, window in SHAPES:

            def measure(batch, cache_len, kv_heads, inputs, window=window):
                if window >= 0:  # the one query token sees its own key and the `window` before it
                    k, v = inputs.contiguous[0]
                    reference = attention_reference(inputs.q[:1], k[:1, -window - 1:], v[:1, -window - 1:])[0][0, 0]
                else:
                    reference = inputs.reference()
                nbytes = kv_bytes(batch, min(cache_len, window + 1) if window >= 0 else cache_len, kv_heads)
                column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv" + (f", window {window}" if window >= 0 else "")

                def time_one(case, value):
                    return _measure(call_for(value[0], window), case, reference, device, nbytes)

                writer.time_interleaved(variants, {column: inputs}, select, time_one, args.repeats, unit="us")
                decode.INTERLEAVED_SPLITS = None  # the rule again

            measure_each([(batch, cache_len, kv_heads)], device, measure)


if __name__ == "__main__":
    main()
