"""Split counts around the heuristic's at the decode shapes where ours trailed a peer: the
measurement behind `kernels.decode.choose_num_splits` rounding the programs down to one wave.

    python tools/experiments/exp_decode_splits.py --out DIR      # DIR/decode_splits.csv

One process, bf16, one query token, 32 q heads, head dim 128, contiguous caches (and a paged one
where named), harness.decode's inputs and timing (CUDA-graph replay, each captured call reading
another copy of the cache); each cell GB/s of K and V read, for our kernel at fixed split counts
(the heuristic's rounding up, its rounding down, neighbours) and SDPA flash and cuDNN beside
them. Rows in the decisions format (row, column, unit, value, tool, git_commit), written as they
are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_decode_splits.py, bf16, 32 q heads, head dim 128, CUDA-graph replay"
# (batch, cache length, kv heads): the decode targets' shortfalls, and the bar's anchors
SHAPES = ((1, 65536, 32), (1, 16384, 32), (8, 8192, 8), (8, 16384, 8), (8, 4096, 8), (1, 65536, 8),
          (1, 1024, 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch
    import triton

    from baselines.flops import gigabytes_per_second
    from baselines.providers.decode import DECODE_PROVIDERS
    from harness.decode import _ours, _registry, _time_call, kv_bytes, measure_each
    from kernels import decode
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_n = decode.GPU_CONFIG[0]
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "decode_splits.csv", TOOL) as writer:

        def record(row, column, nbytes, timing):
            gbps = gigabytes_per_second(nbytes, timing.ms)
            writer.write(row, column, "GB/s", gbps)
            print(f"{column:28s} {row:40s} {gbps:8.0f} GB/s", flush=True)

        def measure(batch, cache_len, kv_heads, inputs):
            nbytes = kv_bytes(batch, cache_len, kv_heads)
            column = f"{batch} x {cache_len // 1024}k, {kv_heads} kv"
            programs = batch * kv_heads
            most = max(1, triton.cdiv(cache_len, block_n) // decode.MIN_BLOCKS_PER_SPLIT)
            # the rule before: the programs rounded up past PROGRAMS_PER_SM x SMs (a partial wave)
            up = min(triton.cdiv(decode.PROGRAMS_PER_SM * sms, programs), most, decode.MAX_SPLITS)
            down = decode.choose_num_splits(batch, kv_heads, 1, cache_len, block_n, sms)
            counts = sorted({max(1, c) for c in (down // 2, down - 1, down, up, up + 1, 2 * up) if c <= most})
            for count in counts:
                tag = " (heuristic)" if count == down else " (rounded up)" if count == up else ""
                for paged in (False, True) if cache_len <= 1024 else (False,):
                    layout = "paged" if paged else "contiguous"
                    timing, _ = _time_call(_ours(count, paged), inputs, device)
                    record(f"ours {layout}, {count} splits{tag}", column, nbytes, timing)
            for name in ("sdpa-flash", "sdpa-cudnn"):
                timing, _ = _time_call(_registry(DECODE_PROVIDERS[name]), inputs, device)
                record(name, column, nbytes, timing)

        measure_each(SHAPES, device, measure)


if __name__ == "__main__":
    main()
