"""The Gluon backward's per-step conversions (kernels/backward.py, GLUON_STATS_LOG2): L converted
to log2 units and dQ_i scaled by the softmax scale at every query step, against L * log2(e) from
the preprocess kernel and the float32 dQ accumulator scaled once, in the pass that casts it; in one
process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_stats_log2.py --out DIR      # DIR/bwd_stats_log2.csv

The floor: the kernel's five matmuls per query step. Nsight Compute counted about 1.4x FA4's
non-matmul instructions per tensor-core instruction in our dense backward
(reports/h200/bwd_counters/counters.md); per step each consumer thread multiplied its 16 columns
of L by log2(e) and its 32 elements of dQ_i by the scale, against 32 elements of S for the
exponent and dS. Prediction: fewer ALU instructions on the path between a step's dQ matmul and
the next step's score matmuls, a few percent. Per variant: the whole backward through
kernels.flash_attn_func (the plans rebuilt for it), first checked against the float64 reference
(exp_bwd_schedule's check), then timed by harness.features (`do_bench` of `out.backward`, bf16,
head dim 128), rounds interleaved (exp_bwd_stages.compare_variants). Rows in the decisions format,
written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_bwd_stats_log2.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"L converted, dQ scaled at every step": False, "L * log2(e) given, dQ scaled once": True}


def select(log2: bool) -> None:
    from kernels import backward

    backward.GLUON_STATS_LOG2 = log2
    backward._PLANS.clear()  # plans hold the setting they were made with


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    from exp_bwd_stages import compare_variants, default_cases

    from harness.features import Case
    from kernels import backward

    production = backward.GLUON_STATS_LOG2
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [*default_cases()[:5], Case("score", "alibi", 2, 8192, 16, 16, alibi=True)]
    compare_variants(args.out / "bwd_stats_log2.csv", TOOL, VARIANTS, select, cases, args.repeats)
    select(production)


if __name__ == "__main__":
    main()
