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
    from baselines.reference import attention_reference
    from harness.decode import ExperimentCase, kv_bytes, layout_variants, run_experiment
    from kernels import decode

    def call_for(window: int):
        def for_layout(paged: bool):
            def call(inputs, i):
                k_cache, v_cache = inputs.paged[i] if paged else inputs.contiguous[i]
                table = inputs.block_tables[i] if paged else None
                return decode.flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                                      block_table=table, window_size=(window, -1), num_splits=0)
            return call
        return for_layout

    def window_reference(window: int):
        def reference(inputs):  # the one query token sees its own key and the `window` before it
            k, v = inputs.contiguous[0]
            return attention_reference(inputs.q[:1], k[:1, -window - 1:], v[:1, -window - 1:])[0][0, 0]
        return reference

    cases = [ExperimentCase(batch, cache_len, kv_heads,
                            f"{batch} x {cache_len // 1024}k, {kv_heads} kv" + (f", window {window}" if window >= 0 else ""),
                            call_for(window),
                            kv_bytes(batch, min(cache_len, window + 1) if window >= 0 else cache_len, kv_heads),
                            window_reference(window) if window >= 0 else None)
             for batch, cache_len, kv_heads, window in SHAPES]

    def select(value):
        decode.INTERLEAVED_SPLITS = value[1]

    def restore():
        decode.INTERLEAVED_SPLITS = None  # the rule again

    run_experiment(__doc__, "decode_interleave.csv", TOOL, layout_variants(SCHEMES), select, restore, cases)


if __name__ == "__main__":
    main()
