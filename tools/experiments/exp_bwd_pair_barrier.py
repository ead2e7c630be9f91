"""The fused dQ's exchange of dS^T between the Gluon dK/dV kernels' two consumer warpgroups
(kernels/flash_attn_hopper.py, BWD_PAIR_BARRIER): a per-step-parity mbarrier against named
barriers (FA3's and FA4's NamedBarrier), in one process on the H200, FA4 beside where installed.

    python tools/experiments/exp_bwd_pair_barrier.py --out DIR      # DIR/bwd_pair_barrier.csv

The floor is the step's five matmuls; each step both consumers wait for each other's dS^T
before dQ's matmul, which needs all 128 keys. With the mbarrier, a consumer stores its dS^T,
syncs its warpgroup (bar.sync) so that one thread may arrive, and later spins on the mbarrier's
phase, with one more warpgroup bar.sync that Triton's barrier analysis puts before the wait
(tools/compile_check_sm90.py --dump-ptx shows them). With named barriers every thread arrives
(bar.arrive) where it stored, and waits (bar.sync) at the other consumer's barrier: one warpgroup
bar.sync, one mbarrier arrive and the spin fewer per step. Prediction: a percent or two where
steps are short against the exchange's latency, more with GQA and windows (dQ first, so the
exchange sits between the dV and dK matmuls' issue), none where the two consumers drift apart.
Per variant: checked against float64 (exp_bwd_schedule's FEATURE_CHECKS: the dense backward both
causal modes, GQA and a window; and exp_varlen_bwd_loads' packed check), then the features
suite's backward cases with the window at 32k added, rounds interleaved
(exp_bwd_stages.compare_variants).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_bwd_stages import default_cases, run_experiment

TOOL = "tools/experiments/exp_bwd_pair_barrier.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"dS^T exchanged by an mbarrier": False, "dS^T exchanged by named barriers": True}


def select(value: bool) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_PAIR_BARRIER = value
    backward._PLANS.clear()  # plans hold the constexprs they were made with


def check(device) -> tuple[bool, str]:
    """exp_bwd_schedule's dense, GQA and window check, then exp_varlen_bwd_loads' packed one."""
    from exp_bwd_schedule import FEATURE_CHECKS
    from exp_bwd_schedule import check as dense_check
    from exp_varlen_bwd_loads import check as packed_check

    ok, notes = dense_check(device, FEATURE_CHECKS)
    packed_ok, packed_notes = packed_check(device)
    return ok and packed_ok, "; ".join(n for n in (notes, packed_notes) if n)


def cases():
    """exp_bwd_stages' cases (the features suite's dense, GQA, window and packed backwards) and
    the window at 32k, where the features suite's bar was furthest from FA4."""
    from harness.features import WINDOW, Case

    return [*default_cases(), Case("window", "window", 1, 32768, 16, 16, window=WINDOW)]


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_pair_barrier.csv", TOOL, VARIANTS, select, hopper.BWD_PAIR_BARRIER, cases=cases(),
                   checker=check)


if __name__ == "__main__":
    main()
