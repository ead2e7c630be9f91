"""The Gluon varlen dK/dV kernel's query step (kernels/flash_attn_hopper.py): L_i and D_i read from
global memory by the consumers at each step against brought into shared memory by the loader
warp, and the steps that need a mask in one loop with the rest against a loop of their own, in
one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_varlen_bwd_loads.py --out DIR      # DIR/varlen_bwd_loads.csv

The floor is the dense kernel's step (the same five matmuls). The consumer that loads L_i and
D_i itself holds their pointer tiles and rows through the softmax at 240 registers a thread, and
a causal packed batch's single loop keeps the mask's code in every step: ptxas's spill stores
(`tools/compile_check_sm90.py --hopper-gluon`) and the loop's local loads are what the variants
change. By TMA, as the dense kernel brings L and D, the kernel hit an illegal instruction on the
H200 (docs/performance.md); here the loader warp loads each row with plain loads (before it
waits for the stage), stores it to the stage's shared memory and arrives on an mbarrier of its
own (VARLEN_BWD_STATS_IN_SHARED); with it the consumers also read D_i once P^T is made (the
dense kernel's BWD_LATE_DELTA), where the global form reads both rows before the softmax (from a
scalar base, the pointer tiles made at each load, in every variant here). Per variant: checked against float64 (tests/test_features.py's
check_varlen: ragged lengths with an empty sequence, GQA, both causal modes), then the features
suite's packed case timed causal and not, rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment

TOOL = "tools/experiments/exp_varlen_bwd_loads.py, bf16, head dim 128, do_bench of the whole backward"
# name -> (VARLEN_BWD_STATS_IN_SHARED, VARLEN_BWD_SPLIT_MASKED)
VARIANTS = {
    "L, D from global, one loop": (False, False),
    "L, D from global, masked steps apart": (False, True),
    "L, D by the loader, one loop": (True, False),
    "L, D by the loader, masked steps apart": (True, True),
}
# (lengths_q, lengths_k, heads, kv_heads): sequences shorter and longer than a block, an empty one,
# query lengths above and below the key lengths
CHECKS = (([1500, 0, 700, 2000, 129, 1024], [1100, 300, 700, 2048, 0, 1024], 8, 2),
          ([300, 1024, 77, 513], [300, 1024, 77, 513], 4, 4))


def select(value) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    # a variant's one loop masks every step, as when its rows were taken (VARLEN_BWD_MASK_AT_RUN_TIME
    # off); the code's own setting comes back with the production value's third entry
    hopper.VARLEN_BWD_STATS_IN_SHARED, hopper.VARLEN_BWD_SPLIT_MASKED, hopper.VARLEN_BWD_MASK_AT_RUN_TIME = (
        *value, False)[:3]
    backward._PLANS.clear()


def check(device) -> tuple[bool, str]:
    """check_varlen (out, dq, dk, dv and lse against float64 within flash-attn's criterion) on
    CHECKS, causal and not, in bf16."""
    import torch

    from tests.test_features import check_varlen

    notes = []
    for lengths_q, lengths_k, heads, kv_heads in CHECKS:
        for causal in (False, True):
            label = f"{len(lengths_q)} sequences {heads}/{kv_heads}h causal={causal}"
            try:
                check_varlen(lengths_q, lengths_k, heads, kv_heads, 128, torch.bfloat16, device=device.type,
                             causal=causal)
            except AssertionError as exc:
                notes.append(f"{label}: {' '.join(str(exc).split())}"[:200])
            else:
                notes.append(f"{label}: ok")
    return all(note.endswith(": ok") for note in notes), "; ".join(notes)


def cases():
    """The features suite's packed variable-length case, causal and not."""
    from harness.features import cases as feature_cases

    varlen = next(c for c in feature_cases(quick=False) if c.variant == "varlen")
    return [varlen, dataclasses.replace(varlen, causal=False)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "varlen_bwd_loads.csv", TOOL, VARIANTS, select,
                   (hopper.VARLEN_BWD_STATS_IN_SHARED, hopper.VARLEN_BWD_SPLIT_MASKED, hopper.VARLEN_BWD_MASK_AT_RUN_TIME),
                   cases=cases(), checker=check)


if __name__ == "__main__":
    main()
