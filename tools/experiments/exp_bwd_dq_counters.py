"""Nsight Compute counters of the backward's kernels, dQ kernel against dQ fused into the dK/dV
kernel (BwdConfig.fused_dq_min_rows; TMA reduce-adds into a float32 accumulator): why the fused
backward, with 5 matmuls instead of 7, measured slower (reports/h200/perf_notes.md, "v6").

    python tools/experiments/exp_bwd_dq_counters.py            # runs ncu on itself, prints a table
    python tools/experiments/exp_bwd_dq_counters.py --target   # what ncu profiles (one call of each)

bf16, head dim 128, seqlen 4096, batch 4, 16 heads (the paper's shape), non-causal. Rows go to
$OUT/exp_bwd_dq_counters.csv.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

METRICS = [
    "gpu__time_duration.sum",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_op_red.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "launch__registers_per_thread",
    "smsp__warp_issue_stalled_gmma_per_warp_active.pct",
    "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
    "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
    "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
    "smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct",
    "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct",
    "smsp__warp_issue_stalled_membar_per_warp_active.pct",
    "smsp__warp_issue_stalled_wait_per_warp_active.pct",
]


def target() -> None:
    """One backward with the dQ kernel, then one with dQ fused, inside a profiler range (both
    compiled and run once before it)."""
    import torch

    from kernels import flash_attn as fa

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = fa.flash_attn_forward(q, k, v, 128 ** -0.5, False)
    # the Triton kernels, as measured in v6 (since v7 the table's head-dim-128 backward, from 2k keys
    # and from 1k since v8, is the Gluon kernel, which fuses dQ its own way)
    separate = dataclasses.replace(fa.HOPPER_BWD_CONFIGS[128], hopper_gluon_min_keys=0)
    fused = dataclasses.replace(separate, fused_dq_min_rows=1)
    for config in (separate, fused):
        fa.flash_attn_backward(do, q, k, v, out, lse, 128 ** -0.5, False, config)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for config in (separate, fused):
        fa.flash_attn_backward(do, q, k, v, out, lse, 128 ** -0.5, False, config)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="store_true", help="run the profiled calls (ncu runs this)")
    args = parser.parse_args()
    if args.target:
        target()
        return
    import pandas as pd

    command = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", "regex:_flash_bwd",
               "--metrics", ",".join(METRICS), "--csv", "--page", "raw", sys.executable, __file__, "--target"]
    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT)
    lines = run.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if run.returncode != 0 or start is None:
        sys.exit(f"ncu failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    table = pd.read_csv(io.StringIO("\n".join(lines[start:])), skiprows=[1]).copy()  # row 1: units
    # launch order: the two-kernel backward's dK/dV and dQ kernels, then the fused dK/dV kernel
    dkdv_seen = (table["Kernel Name"] == "_flash_bwd_dkdv_kernel").cumsum()
    table["call"] = ["fused dQ" if seen > 1 else "separate dQ" for seen in dkdv_seen]
    keep = ["call", "Kernel Name", *METRICS]
    table = table[[c for c in keep if c in table.columns]]
    out = Path(os.environ.get("OUT", ".")) / "exp_bwd_dq_counters.csv"
    table.to_csv(out, index=False)
    print(table.T.to_string())


if __name__ == "__main__":
    main()
