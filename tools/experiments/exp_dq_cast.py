"""The cast of the register-order dQ accumulator (kernels/flash_attn_hopper.py, DQ_CAST): each
element stored to its (row, column) as the tile's bases give it, against the tile put in rows
first, in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_dq_cast.py --out DIR      # DIR/dq_cast.csv

The Gluon dK/dV kernels add dQ into a float32 accumulator in their registers' order, and a
Triton kernel casts it back into rows of dQ (dq_from_accumulator, dq_from_varlen_accumulator).
Stored element by element from the register order, each thread's writes are 2-byte stores
and the varlen cast's loads, masked in register order, 4-byte ones (the compile check lists them);
with the tile permuted into rows in registers (_register_tile_in_rows: a reshape and a permute,
which Triton does through shared memory), the stores are 16-byte ones; the varlen cast also
returns early past a sequence's tiles and reads the rest whole, unmasked, so its loads are
16-byte ones too (its rows measure both changes). The floor: the cast reads 4 and writes 2 bytes an element, a few percent of a
backward's time at the features suite's sizes. Prediction: the cast at about that floor, and the
backward a little faster, most on the packed batch (whose cast loads were not vectorised).
Per cast: checked against float64 (exp_bwd_schedule's dense, GQA and window checks and
exp_varlen_bwd_loads' packed ones), then the whole backward timed on the features suite's dense,
GQA, window and packed cases, rounds interleaved (exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import run_experiment

TOOL = "tools/experiments/exp_dq_cast.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dQ cast element by element": "scattered", "dQ cast from the tile in rows": "rows"}


def select(cast: str) -> None:
    from kernels import flash_attn_hopper as hopper

    hopper.DQ_CAST = cast  # read at each cast: no plan holds it


def check(device) -> tuple[bool, str]:
    """exp_bwd_schedule's dense, GQA and window checks, then exp_varlen_bwd_loads' packed ones."""
    from exp_bwd_schedule import FEATURE_CHECKS
    from exp_bwd_schedule import check as check_dense
    from exp_varlen_bwd_loads import check as check_varlen

    results = (check_dense(device, FEATURE_CHECKS), check_varlen(device))
    return all(ok for ok, _ in results), "; ".join(notes for _, notes in results)


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "dq_cast.csv", TOOL, VARIANTS, select, hopper.DQ_CAST, checker=check)


if __name__ == "__main__":
    main()
