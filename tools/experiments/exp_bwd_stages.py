"""The Gluon dK/dV kernels' Q/dO ring (kernels/flash_attn_hopper.py, BWD_STAGES): two query steps
in flight against three, in one process on the H200, FA4 beside where it is installed.

    python tools/experiments/exp_bwd_stages.py --out DIR      # DIR/bwd_stages.csv

The floor: the kernel's five matmuls per query step. With two stages the loader can bring step
i + 2's Q_i and dO_i only once both consumers have released step i's; a consumer that runs ahead
of the other, or a load that lands late, leaves the tensor pipe waiting. A third stage fits in
sm_90's 227 KiB beside the fused dQ's buffers (tools/compile_check_sm90.py --hopper-gluon reads
the shared memory). Per ring depth: the whole backward through kernels.flash_attn_func (the
plans rebuilt for it), first checked against the float64 reference (exp_bwd_schedule's check:
dQ, dK, dV within 2x the Triton deterministic backward's error, both causal modes, GQA and a
window beside the dense backward), then timed by
harness.features (`do_bench` of `out.backward`, bf16, head dim 128) on the features suite's
dense, GQA, window and packed variable-length cases, rounds interleaved. Rows in the decisions
format, written as they are measured; a depth that fails its check is a row 'wrong' and is not
timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_bwd_stages.py, bf16, head dim 128, do_bench of the whole backward"
DEPTHS = (2, 3)


def set_stages(stages: int) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_STAGES = stages
    backward._PLANS.clear()  # plans hold the depth they were made with


def depth_name(stages: int) -> str:
    return f"Q/dO ring of {stages}"


def default_cases():
    """The features suite's dense, GQA, window and packed variable-length backward cases."""
    from harness.features import WINDOW, Case
    from harness.features import cases as feature_cases

    return [Case("score", "dense", 2, 8192, 16, 16), Case("score", "dense", 8, 2048, 16, 16),
            Case("gqa", "gqa", 2, 8192, 32, 8), Case("gqa", "gqa", 1, 16384, 32, 8),
            Case("window", "window", 1, 16384, 16, 16, window=WINDOW),
            Case("window", "full-causal", 1, 16384, 16, 16),
            next(c for c in feature_cases(quick=False) if c.variant == "varlen")]


def compare_variants(path: Path, tool: str, variants: dict, select, cases, repeats: int, checks=None,
                     checker=None) -> None:
    """Each variant (name -> value; `select(value)` puts it in place) checked against float64
    (exp_bwd_schedule's check on `checks`, by default FEATURE_CHECKS: dense, GQA and window
    backwards), then the whole backward of each case timed, rounds interleaved, FA4 beside; rows
    to `path` as they are measured. `checker(device)` -> (ok, notes) replaces that check."""
    import torch
    from exp_bwd_schedule import FEATURE_CHECKS, _tool, check

    checks = FEATURE_CHECKS if checks is None else checks

    from harness.features import measure
    from reports.decisions import DecisionWriter, check_line, status_tool, timing_line

    device = torch.device("cuda")
    with DecisionWriter(path, tool) as writer:
        good = []
        for name, value in variants.items():
            select(value)
            ok, notes = checker(device) if checker else check(device, checks)
            writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                         tool=tool if ok else status_tool(tool, "wrong", notes))
            print(check_line(name, ok, notes), flush=True)
            if ok:
                good.append(name)
        for _ in range(repeats):
            for case in cases:
                column = (f"{case.variant} {case.batch}x{case.seqlen // 1024}k {case.heads}/{case.kv_heads}h"
                          + ("" if case.causal else " non-causal"))
                for name in good:
                    select(variants[name])
                    row = measure(case, "ours", "bwd", device, torch.bfloat16)
                    writer.write(name, column, "ms", row.get("ms", float("nan")), tool=_tool(row, tool))
                    print(timing_line(column, name, row), flush=True)
                row = measure(case, "fa4", "bwd", device, torch.bfloat16)
                writer.write("fa4", column, "ms", row.get("ms", float("nan")), tool=_tool(row, tool))
                print(timing_line(column, "fa4", row), flush=True)


def run_experiment(description: str, csv_name: str, tool: str, variants: dict, select, production, cases=None,
                   checks=None, checker=None) -> None:
    """A backward experiment's command line (--out DIR, --repeats) and run: compare_variants over
    `cases` (default_cases()) into DIR/csv_name, then `select(production)` (the code's setting again)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        compare_variants(args.out / csv_name, tool, variants, select, cases or default_cases(), args.repeats, checks,
                         checker)
    finally:
        select(production)


def main() -> None:
    from kernels import flash_attn_hopper as hopper

    run_experiment(__doc__, "bwd_stages.csv", TOOL, {depth_name(stages): stages for stages in DEPTHS}, set_stages,
                   hopper.BWD_STAGES)

if __name__ == "__main__":
    main()
