"""The Gluon forward's persistent grid (kernels/flash_attn_hopper.py, FWD_PERSISTENT): one
program per query tile against one program per SM walking the tiles, on the H200, FA4 beside
where it is installed.

    python tools/experiments/exp_fwd_persistent.py --out DIR      # DIR/fwd_persistent.csv

The floor: the forward's two matmuls per key block. With one program per tile, each tile's
prologue (Q_i and the first K/V blocks loaded, the first S matmul waited for) and epilogue (O
normalised, staged and stored) leave the tensor cores idle, and a sliding window's tiles visit
few key blocks each (33 at a window of 4096), so that time weighs more there: our window's
TFLOPs/s stayed below the full causal call's at every length (reports/h200/features/). A
persistent program's loader brings the next tile's first K/V blocks while its consumers finish
a tile (Q_i once they have stored their O from its buffers). Two orders of the tiles: head-major,
the one-per-tile grid's own (the tiles running at once share a head's K and V in L2), and every
head's tile of a query block before the next. Prediction: a few percent on the window, less on
long causal tiles, level or worse on short full-attention calls, whose balance changes (a static
assignment instead of the hardware's); the query-block-major order worse than head-major.

First each variant against the float64 reference on each case's small form (batch 2 x 1k, bf16:
more tiles than SMs, so a persistent program walks several), within 2x the same-dtype PyTorch
error; then per case `harness.features.measure`'s `do_bench` of the forward, rounds interleaved.
Rows in the decisions format, written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_fwd_persistent.py, bf16, do_bench of the forward"
VARIANTS = {"one program per tile": None, "persistent, head-major": "head-major",
            "persistent, query-block-major": "query-block-major"}


def cases():
    from harness.features import WINDOW, Case

    return {"window 1x8k 16h": Case("window", "window", 1, 8192, 16, 16, window=WINDOW),
            "window 1x16k 16h": Case("window", "window", 1, 16384, 16, 16, window=WINDOW),
            "window 1x32k 16h": Case("window", "window", 1, 32768, 16, 16, window=WINDOW),
            "full-causal 1x16k 16h": Case("window", "full-causal", 1, 16384, 16, 16),
            "full-causal 1x32k 16h": Case("window", "full-causal", 1, 32768, 16, 16),
            "dense causal 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16),
            "dense causal 8x2k 16h": Case("score", "dense", 8, 2048, 16, 16),
            "dense full 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16, causal=False),
            "dense causal d64 4x8k 16h": Case("score", "dense", 4, 8192, 16, 16, hdim=64),
            "gqa causal 2x8k 32/8h": Case("gqa", "gqa", 2, 8192, 32, 8),
            "alibi causal 2x8k 16h": Case("score", "alibi", 2, 8192, 16, 16, alibi=True)}


def set_variant(persistent) -> None:
    from kernels import flash_attn_hopper, forward

    flash_attn_hopper.FWD_PERSISTENT = None if persistent == "fa4" else persistent
    forward._PLANS.clear()  # plans hold the grid and constexprs they were made with


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    import torch
    from exp_fwd_v_stages import check

    from harness.features import measure
    from kernels import flash_attn_hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    production = flash_attn_hopper.FWD_PERSISTENT
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with DecisionWriter(args.out / "fwd_persistent.csv", TOOL) as writer:
            passed = writer.write_checks({name: check(value, device, set_variant, cases())
                                          for name, value in VARIANTS.items()})
            timed = {**{name: VARIANTS[name] for name in passed}, "fa4": "fa4"}
            writer.time_interleaved(timed, cases(), set_variant,
                                    lambda case, value: measure(case, "fa4" if value == "fa4" else "ours", "fwd",
                                                                device, torch.bfloat16), args.repeats)
    finally:
        set_variant(production)


if __name__ == "__main__":
    main()
