"""Where the Gluon dK/dV kernel's warps wait: Nsight Compute's PC-sampling stall reasons for the
whole backward's dK/dV launch, causal and not (the profile behind the kernel's schedule,
docs/performance.md, "The Gluon backward's schedule").

    python tools/experiments/exp_bwd_stalls.py --out DIR              # on a GPU with ncu
    python tools/experiments/exp_bwd_stalls.py --out DIR --from-raw   # rows again from DIR's raw CSVs
    python tools/experiments/exp_bwd_stalls.py --out DIR --packed     # the dense and the varlen kernel

With --packed the modes are the dense kernel and the varlen kernel on the same work, twelve
sequences of 2048 tokens, non-causal (as flash_attn_func and as flash_attn_varlen_func on their
packed views); the rows go to DIR/bwd_stalls_packed.csv and DIR/long_scoreboard_by_opcode_packed.csv,
with two more: DIR/samples_by_opcode_packed.csv (every sample by the sampled instruction's opcode,
as shares of the dense kernel's samples, the opcodes whose count differs most) and
DIR/kernel_summary_packed.csv (each kernel's duration, PC-sampling interval and sample count,
tensor-pipe activity and instructions).

Each mode runs in its own process under `ncu` with the SECTIONS below (SourceCounters is the
PC sampling): kernels.flash_attn_func forward and backward twice at batch 2 x 8k, 16 heads, head
dim 128, bf16; the second `_flash_bwd_dkdv_hopper` launch is profiled. Kept in DIR (neither is
committed; the rows below are): the raw page of each report (raw_<mode>.csv) and its source page
(source_<mode>.csv, per SASS instruction). Rows in the decisions format:
- DIR/bwd_stalls.csv: each stall reason's share of all PC samples (every warp of the program:
  the consumers, the loader warp, and the three warps that pad the loader's warpgroup and wait
  at a barrier for the whole kernel, so 'barrier' counts them too);
- DIR/long_scoreboard_by_opcode.csv: the long-scoreboard samples by the stalled instruction's
  opcode, as shares of all samples (the TOP_OPCODES largest), from the source pages.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_bwd_stalls.py, ncu --clock-control none, PC sampling, 2 x 8k, 16 heads, head dim 128"
TOOL_PACKED = ("tools/experiments/exp_bwd_stalls.py --packed, ncu --clock-control none, PC sampling, 12 x 2k "
               "non-causal, 16 heads, head dim 128")
MODES = ("causal", "full")
PACKED_MODES = ("dense", "varlen")
SECTIONS = ("SpeedOfLight", "WarpStateStats", "ComputeWorkloadAnalysis", "SchedulerStats", "InstructionStats",
            "SourceCounters", "MemoryWorkloadAnalysis", "Occupancy")
TOP_OPCODES = 8
SAMPLES = "smsp__pcsamp_sample_count"
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def child(mode: str) -> None:
    import torch

    import kernels

    torch.manual_seed(0)
    if mode in PACKED_MODES:  # the same work through each kernel: 12 sequences of 2048, non-causal
        q, k, v = (torch.randn(12, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        if mode == "varlen":
            q, k, v, dout = (t.reshape(12 * 2048, 16, 128) for t in (q, k, v, dout))
            cu = torch.arange(0, 13 * 2048, 2048, device="cuda", dtype=torch.int32)
        for t in (q, k, v):
            t.requires_grad_()
        for _ in range(2):
            if mode == "varlen":
                kernels.flash_attn_varlen_func(q, k, v, cu, cu, 2048, 2048).backward(dout)
            else:
                kernels.flash_attn_func(q, k, v).backward(dout)
        torch.cuda.synchronize()
        return
    q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    for _ in range(2):
        kernels.flash_attn_func(q, k, v, causal=mode == "causal").backward(dout)
    torch.cuda.synchronize()


def stall_shares(raw_csv: str) -> dict[str, float]:
    """{stall reason: share of all PC samples} from an `ncu --page raw --csv` of one kernel."""
    from harness.ncu import metric_value, parse_ncu_csv

    frame = parse_ncu_csv(raw_csv)
    kernel, problems = frame.iloc[0], frame.attrs.get("problems", {})
    total, _ = metric_value(kernel[SAMPLES])
    shares = {}
    for name, value in kernel.items():
        if str(name).startswith(STALL_PREFIX) and not str(name).endswith("_not_issued"):
            if name in problems:  # a count that cannot be read is an error, not a reason left out
                raise ValueError(f"{name}: {problems[name]}")
            shares[str(name).removeprefix(STALL_PREFIX)] = 100.0 * metric_value(value)[0] / total
    return shares


def long_scoreboard_by_opcode(source_csv: str) -> dict[str, float]:
    """{opcode: long-scoreboard samples as a share of all samples} from `ncu --page source --csv
    --print-source sass` (its first line names the kernel), the TOP_OPCODES largest."""
    import io

    import pandas as pd

    page = pd.read_csv(io.StringIO(source_csv.split("\n", 1)[1]))
    samples = pd.to_numeric(page["Warp Stall Sampling (All Samples)"], errors="coerce").fillna(0)
    long_sb = pd.to_numeric(page["stall_long_sb"], errors="coerce").fillna(0)
    # the opcode, without a predicate ('@!P0 BRA ...' -> 'BRA')
    opcode = page["Source"].astype(str).str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True).str.split().str[0]
    shares = (100.0 * long_sb.groupby(opcode).sum() / samples.sum()).sort_values(ascending=False)
    return shares.head(TOP_OPCODES).to_dict()


SUMMARY = (("duration (us)", "gpu__time_duration.sum", 1e-3),
           ("PC sampling interval (cycles)", "smsp__pcsamp_interval_cycles", 1.0),
           ("PC samples (thousands)", SAMPLES, 1e-3),
           ("tensor pipe active (% of peak)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
            1.0),
           ("instructions issued (millions)", "smsp__inst_executed.sum", 1e-6))


def samples_by_opcode(source_csv: str):
    """Every PC sample of the source page (its first line names the kernel) by the sampled
    instruction's opcode, as a pandas Series of counts."""
    import io

    import pandas as pd

    page = pd.read_csv(io.StringIO(source_csv.split("\n", 1)[1]))
    samples = pd.to_numeric(page["Warp Stall Sampling (All Samples)"], errors="coerce").fillna(0)
    opcode = page["Source"].astype(str).str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True).str.split().str[0]
    return samples.groupby(opcode).sum()


def write_packed_summary(out: Path, modes, tool: str, commit: str | None, shape: str) -> None:
    """DIR/kernel_summary_packed.csv from the kept raw pages (the module docstring says what it holds)."""
    from harness.ncu import metric_value, parse_ncu_csv
    from reports.decisions import DecisionWriter

    with DecisionWriter(out / "kernel_summary_packed.csv", tool, commit=commit) as rows:
        for mode in modes:
            kernel = parse_ncu_csv((out / f"raw_{mode}.csv").read_text()).iloc[0]
            for label, metric, scale in SUMMARY:
                rows.write(label, f"{mode} {shape}", "metric", metric_value(kernel[metric])[0] * scale)


def write_packed_opcodes(out: Path, modes, tool: str, commit: str | None, shape: str) -> None:
    """DIR/samples_by_opcode_packed.csv from the kept source pages (the module docstring says what
    it holds)."""
    import pandas as pd

    from reports.decisions import DecisionWriter

    counts = pd.DataFrame({mode: samples_by_opcode((out / f"source_{mode}.csv").read_text()) for mode in modes})
    counts = counts.fillna(0)
    base = counts[modes[0]].sum()
    differing = (counts[modes[1]] - counts[modes[0]]).abs().sort_values(ascending=False).index[:2 * TOP_OPCODES]
    with DecisionWriter(out / "samples_by_opcode_packed.csv", tool, commit=commit) as rows:
        for opcode in differing:
            for mode in modes:
                rows.write(opcode, f"{mode} {shape}", f"% of {modes[0]}'s samples",
                           100.0 * counts.at[opcode, mode] / base)
        for mode in modes:
            rows.write("every opcode", f"{mode} {shape}", f"% of {modes[0]}'s samples",
                       100.0 * counts[mode].sum() / base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from-raw", action="store_true",
                        help="rebuild the rows (DIR/bwd_stalls.csv, with --packed its files) from DIR's raw and "
                             "source pages")
    parser.add_argument("--commit", help="with --from-raw: the commit the raw CSVs were measured at")
    parser.add_argument("--packed", action="store_true",
                        help="the dense and the varlen dK/dV kernel on the same work (12 x 2k, non-causal)")
    parser.add_argument("--child", choices=MODES + PACKED_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    modes, tool, suffix, shape = MODES, TOOL, "", "2x8k"
    if args.packed:
        modes, tool, suffix, shape = PACKED_MODES, TOOL_PACKED, "_packed", "12x2k full"
    if args.out is None:
        parser.error("--out DIR is required")
    from harness.ncu import NCU, ncu_status
    from reports.decisions import DecisionWriter

    if not args.from_raw and (unusable := ncu_status()):
        raise SystemExit(f"exp_bwd_stalls needs Nsight Compute: {unusable}")
    if args.from_raw and not args.commit:
        parser.error("--from-raw needs --commit (the raw CSVs do not name it)")
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / f"bwd_stalls{suffix}.csv", tool, commit=args.commit) as reasons:
        for mode in modes:
            raw, source = args.out / f"raw_{mode}.csv", args.out / f"source_{mode}.csv"
            if not args.from_raw:
                report = args.out / f"bwd_{mode}"
                sections = [arg for name in SECTIONS for arg in ("--section", name)]
                subprocess.run([NCU, "--clock-control", "none", "--kernel-name", "regex:_flash_bwd_dkdv_hopper",
                                "--launch-skip", "1", "--launch-count", "1", *sections, "--import-source", "no",
                                "-f", "-o", str(report), sys.executable, str(Path(__file__).resolve()),
                                "--child", mode], cwd=ROOT, check=True, capture_output=True)
                for path, page in ((raw, ["--page", "raw", "--csv"]),
                                   (source, ["--page", "source", "--csv", "--print-source", "sass"])):
                    done = subprocess.run([NCU, "-i", f"{report}.ncu-rep", *page], check=True, capture_output=True,
                                          text=True)
                    path.write_text(done.stdout)
            for reason, share in sorted(stall_shares(raw.read_text()).items(), key=lambda kv: -kv[1]):
                reasons.write(reason, f"{mode} {shape}", "% of samples", share)
                print(f"{mode:7s} {reason:24s} {share:5.1f}%", flush=True)
    if args.packed:  # the summary needs only the raw pages
        write_packed_summary(args.out, modes, tool, args.commit, shape)
    sources = {mode: args.out / f"source_{mode}.csv" for mode in modes}
    if not all(path.exists() for path in sources.values()):  # --from-raw without them: the rows stay
        print(f"source pages not kept here: long_scoreboard_by_opcode{suffix}.csv left as it is")
        return None
    with DecisionWriter(args.out / f"long_scoreboard_by_opcode{suffix}.csv", tool, commit=args.commit) as opcodes:
        for mode, path in sources.items():
            for opcode, share in long_scoreboard_by_opcode(path.read_text()).items():
                opcodes.write(opcode, f"{mode} {shape}", "% of samples", share)
                print(f"{mode:7s} long scoreboard at {opcode:20s} {share:5.1f}%", flush=True)
    if args.packed:
        write_packed_opcodes(args.out, modes, tool, args.commit, shape)
    return None


if __name__ == "__main__":
    main()
