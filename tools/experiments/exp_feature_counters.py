"""Nsight Compute counters of the Gluon forward with ALiBi and with a sliding window, next to the
dense causal calls they are measured against (the features suite's ALiBi and window bars):
where the extra time goes.

    python tools/experiments/exp_feature_counters.py --out DIR      # DIR/feature_counters.csv

Each variant runs in its own process under `ncu --profile-from-start off` (harness.ncu's
parsing): two calls to compile and warm up, then one call between cudaProfilerStart and
cudaProfilerStop, of which the `_flash_fwd_hopper_kernel` launch is profiled. bf16, causal,
head dim 128, 16 heads. Rows (variant, shape, metric, value, tool, git_commit) are written as
each variant is measured; a variant that fails is a row with its reason.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_feature_counters.py, ncu --clock-control none, bf16, causal, head dim 128, 16 heads"
# variant: (batch, seqlen, the call's extra arguments)
VARIANTS = {"dense 2 x 8k": (2, 8192, "dense"), "alibi 2 x 8k": (2, 8192, "alibi"),
            "full causal 1 x 32k": (1, 32768, "dense"), "window 4096 1 x 32k": (1, 32768, "window")}
METRICS = ("gpu__time_duration.sum",
           "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
           "sm__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_alu.sum", "sm__inst_executed_pipe_xu.sum",
           "smsp__warp_issue_stalled_barrier_per_warp_active.pct", "launch__registers_per_thread")
COLUMNS = ("variant", "metric", "value", "status", "reason", "tool", "git_commit")


def child(variant: str) -> None:
    """Run one variant: warm-up calls, then the profiled one."""
    import torch

    from kernels import flash_attn_func

    batch, seqlen, kind = VARIANTS[variant]
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    kwargs = {}
    if kind == "alibi":  # ALiBi's geometric slopes (Press et al., 2022), as the features suite
        kwargs["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, 17, device="cuda") / 16)
    elif kind == "window":
        kwargs["window_size"] = (4096, 0)
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    flash_attn_func(q, k, v, causal=True, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from-logs", action="store_true",
                        help="rewrite DIR/feature_counters.csv from the ncu outputs a run kept in DIR")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.out is None:
        parser.error("--out DIR is required")
    from harness.ncu import NCU, metric_value, ncu_status, parse_ncu_csv
    from reports.environment import git_commit

    unusable = None if args.from_logs else ncu_status()
    if unusable:
        raise SystemExit(f"exp_feature_counters needs Nsight Compute: {unusable}")

    args.out.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    if args.from_logs:  # the commit of the run that wrote the logs: the rows' own column
        import pandas as pd

        commit = str(pd.read_csv(args.out / "feature_counters.csv", keep_default_na=False)["git_commit"].iloc[0])
    with (args.out / "feature_counters.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for variant in VARIANTS:
            command = [NCU, "--clock-control", "none", "--profile-from-start", "off",
                       "--kernel-name", "regex:_flash_fwd_hopper_kernel", "--launch-count", "1",
                       "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base",
                       sys.executable, str(Path(__file__).resolve()), "--child", variant]
            log = args.out / f"ncu {variant}.txt".replace(" ", "_")
            if args.from_logs:
                done = subprocess.CompletedProcess(command, 0, log.read_text(), "")
            else:
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
                log.write_text(" ".join(command) + "\n" + done.stdout)
            kernels = parse_ncu_csv(done.stdout)
            if done.returncode != 0 or kernels.empty:
                reason = " ".join((done.stderr or done.stdout).split())[-300:]
                writer.writerow({"variant": variant, "metric": "", "value": "", "status": "error",
                                 "reason": reason, "tool": TOOL, "git_commit": commit})
                f.flush()
                print(f"{variant}: error: {reason}", flush=True)
                continue
            problems = kernels.attrs.get("problems", {})
            for metric in METRICS:
                value, problem = metric_value(kernels.iloc[0].get(metric, float("nan")))
                problem = problem or problems.get(metric)
                writer.writerow({"variant": variant, "metric": metric, "value": value,
                                 "status": "ok" if not problem else "problem", "reason": problem or "",
                                 "tool": TOOL, "git_commit": commit})
                print(f"{variant:22s} {metric:90s} {value:,.2f}", flush=True)
            f.flush()


if __name__ == "__main__":
    main()
