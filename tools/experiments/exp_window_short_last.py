"""A sliding window's launch order in the Gluon forward and dK/dV kernels
(kernels/flash_attn_hopper.py, WINDOW_SHORT_LAST): the grid's order against the programs near
one end of the sequence launched after every other, in one process on the H200, FA4 beside.

    python tools/experiments/exp_window_short_last.py --out DIR      # DIR/window_short_last.csv

The floor: every SM busy to the end. Under a window of `left` keys the programs are all about
as long (the forward's query blocks reach left / 128 + 1 key blocks, the backward's key blocks
see left / 64 + 2 query steps) but for those within `left` keys of one end of the sequence (the
forward's first query blocks, the backward's last key blocks), which the grid's order runs among
each head's (section's) programs; the last wave then holds full-length programs on some SMs and
none on others. A list-scheduling model of these grids (132 SMs, each program its blocks or
steps) puts that tail at about 2% of the window's time at 16k keys and 1% at 32k, and at nothing
once the short programs run last. Prediction: about that on the window's forward and backward
at 16k and 32k, less at 8k (a larger share of short programs), nothing on the full causal calls
(no window: the kernels they run are unchanged, the clocks' control). Per order: the window's
forward and backward checked against float64 (tests/test_features.check_dense: windows whose
left side is a whole number of blocks, is not, is unbounded, and reaches past the sequence,
GQA), then each case's forward and backward timed by harness.features (`do_bench`, bf16, head
dim 128), rounds interleaved. Rows in the decisions format, written as they are measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_window_short_last.py, bf16, head dim 128, do_bench of the forward and of the backward"
VARIANTS = {"grid order": False, "short programs last": True}
CHECKS = (((512, 0), True), ((300, 0), True), ((-1, 200), False), ((5000, 0), True))


def select(value: bool) -> None:
    from kernels import backward, forward
    from kernels import flash_attn_hopper as hopper

    hopper.WINDOW_SHORT_LAST = value
    forward._PLANS.clear()  # plans hold the constexprs they were made with
    backward._PLANS.clear()


def check(device) -> tuple[bool, str]:
    import torch

    from tests.test_features import check_dense

    notes = []
    for window, causal in CHECKS:
        label = f"window {window} causal={causal}"
        try:
            check_dense(2, 1024, 1024, 8, 2, 128, torch.bfloat16, device=device.type, causal=causal, window=window)
        except AssertionError as exc:
            notes.append(f"{label}: {' '.join(str(exc).split())}"[:200])
        else:
            notes.append(f"{label}: ok")
    return all(note.endswith(": ok") for note in notes), "; ".join(notes)


def cases():
    """The features suite's window cases (4096, 0) at 8k, 16k and 32k, 16 heads, and the full
    causal calls at 16k and 32k."""
    from harness.features import WINDOW, Case

    return [*(Case("window", "window", 1, n, 16, 16, window=WINDOW) for n in (8192, 16384, 32768)),
            *(Case("window", "full-causal", 1, n, 16, 16) for n in (16384, 32768))]


def main() -> None:
    import torch
    from exp_bwd_schedule import _tool

    from harness.features import measure
    from kernels import flash_attn_hopper as hopper
    from reports.decisions import DecisionWriter, check_line, status_tool, timing_line

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    production = hopper.WINDOW_SHORT_LAST
    device = torch.device("cuda")
    try:
        with DecisionWriter(args.out / "window_short_last.csv", TOOL) as writer:
            good = []
            for name, value in VARIANTS.items():
                select(value)
                ok, notes = check(device)
                writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                             tool=TOOL if ok else status_tool(TOOL, "wrong", notes))
                print(check_line(name, ok, notes), flush=True)
                if ok:
                    good.append(name)
            for _ in range(args.repeats):
                for case in cases():
                    for mode in ("fwd", "bwd"):
                        column = f"{mode} {case.variant} {case.batch}x{case.seqlen // 1024}k {case.heads}/{case.kv_heads}h"
                        for name in good:
                            select(VARIANTS[name])
                            row = measure(case, "ours", mode, device, torch.bfloat16)
                            writer.write(name, column, "ms", row.get("ms", float("nan")), tool=_tool(row, TOOL))
                            print(timing_line(column, name, row), flush=True)
                        row = measure(case, "fa4", mode, device, torch.bfloat16)
                        writer.write("fa4", column, "ms", row.get("ms", float("nan")), tool=_tool(row, TOOL))
                        print(timing_line(column, "fa4", row), flush=True)
    finally:
        select(production)


if __name__ == "__main__":
    main()
