"""Nsight Compute profiling: one representative launch per provider, its counters as rows.

Each job runs `python -m harness.ncu_target ...` under `ncu` in a subprocess, with
`--profile-from-start off` so that compilation, autotuning and warm-up (outside the
cudaProfilerStart/Stop range in ncu_target) are never profiled, `--clock-control none` and
an explicit metric list (METRIC_GROUPS: the counters that test the FlashAttention-2 paper's
three claims, read by reports/counters.py). Every failure becomes a row with a status and a
one-line reason and the remaining jobs still run.

Metric names: hardware counters are checked against `ncu --query-metrics --chip gh100`
(tests/fixtures/ncu/gh100_metric_names.txt); `launch__*` names are launch statistics, which
that query does not list (they are part of ncu's LaunchStats section).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pandas as pd

REPO_ROOT = Path(__file__).resolve().parents[1]
NCU = "ncu"
DEFAULT_TIMEOUT_S = 600
WARP_SIZE = 32

# --------------------------------------------------------------------------------------
# Metrics, grouped by the claim they test
# --------------------------------------------------------------------------------------
FFMA = "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum"
FADD = "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum"
FMUL = "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum"
MUFU = "smsp__inst_executed_pipe_xu.sum"  # warp instructions on the XU pipe (exp2, rcp, ...)
HMMA = "sm__inst_executed_pipe_tensor_op_hmma.sum"  # mma.sync
GMMA = "sm__inst_executed_pipe_tensor_op_gmma.sum"  # wgmma (Hopper warpgroup MMA)
GRID = "launch__grid_size"
WAVES = "launch__waves_per_multiprocessor"
WARPS_ACTIVE = "sm__warps_active.avg.pct_of_peak_sustained_active"  # achieved occupancy
SM_THROUGHPUT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY_LIMIT_REGISTERS = "launch__occupancy_limit_registers"
OCCUPANCY_LIMIT_SHARED = "launch__occupancy_limit_shared_mem"
SHARED_LD = "smsp__inst_executed_op_shared_ld.sum"
SHARED_ST = "smsp__inst_executed_op_shared_st.sum"
SHARED_WAVEFRONTS = "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
BANK_CONFLICTS = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
BARRIER_STALL = "smsp__warp_issue_stalled_barrier_per_warp_active.pct"
DURATION = "gpu__time_duration.sum"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
REGISTERS = "launch__registers_per_thread"
SHARED_PER_BLOCK = "launch__shared_mem_per_block_dynamic"
TENSOR_PIPE = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"  # HMMA and HGMMA
# Where a kernel's cycles go (set against a peer's: a faster kernel's counters beside ours)
SM_CYCLES = "sm__cycles_active.avg"
INSTRUCTIONS = "smsp__inst_executed.sum"
ISSUE_ACTIVE = "smsp__issue_active.avg.pct_of_peak_sustained_active"
STALL_BARRIER_PER_ISSUE = "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"  # warps at a CTA barrier
STALL_WAIT_PER_ISSUE = "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"  # a fixed-latency wait
STALL_MEMORY_PER_ISSUE = "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"  # global/local memory
L2_HIT = "lts__t_sector_hit_rate.pct"

METRIC_GROUPS: dict[str, list[str]] = {
    "non-matmul work": [FFMA, FADD, FMUL, MUFU, HMMA, GMMA],
    "parallelism": [GRID, WAVES, WARPS_ACTIVE, SM_THROUGHPUT, OCCUPANCY_LIMIT_REGISTERS,
                    OCCUPANCY_LIMIT_SHARED],
    "communication": [SHARED_LD, SHARED_ST, SHARED_WAVEFRONTS, BANK_CONFLICTS, BARRIER_STALL],
    "context": [DURATION, DRAM_READ, DRAM_WRITE, REGISTERS, SHARED_PER_BLOCK, TENSOR_PIPE],
    "issue": [SM_CYCLES, INSTRUCTIONS, ISSUE_ACTIVE, STALL_BARRIER_PER_ISSUE, STALL_WAIT_PER_ISSUE,
              STALL_MEMORY_PER_ISSUE, L2_HIT],
}
METRICS: list[str] = [metric for group in METRIC_GROUPS.values() for metric in group]

# ncu output lines that name a failure, and what they mean
PERMISSION_ERROR = "ERR_NVGPUCTRPERM"
UNKNOWN_METRIC = re.compile(
    r"^==ERROR==.*(failed to find metric|metric.*not (found|valid|supported)|invalid metric)", re.IGNORECASE)
NO_KERNEL = re.compile(r"no kernels were profiled", re.IGNORECASE)
STATUSES = ("ok", "unavailable", "permission", "unknown-metric", "no-kernel", "timeout", "error")  # of a row

SPEC_FIELDS = ["mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]
GROUP_COLUMNS = ["setting", *SPEC_FIELDS]
ROW_COLUMNS = ["provider", *GROUP_COLUMNS, "kernel_regex", "status", "reason", "kernel_name", "block_size",
               "grid_dims"]


class NcuJob(NamedTuple):
    """One profile: `provider` (a name in baselines.providers.PROVIDERS, rungs included),
    `spec` (a baselines.providers.Spec: mode, causal, hdim, seqlen, batch, heads, dtype),
    `kernel_regex` (the kernel to profile) and the ablation `setting` ('A', 'B' or '')."""

    provider: str
    spec: object
    kernel_regex: str
    setting: str = ""


# --------------------------------------------------------------------------------------
# Running ncu
# --------------------------------------------------------------------------------------
def ncu_status() -> str | None:
    """None when `ncu` is on PATH and runs; otherwise the reason it cannot be used."""
    path = shutil.which(NCU)
    if path is None:
        return "ncu not on PATH (install Nsight Compute, or put its folder on PATH)"
    try:
        probe = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`ncu --version` failed: {_one_line(str(err))}"
    if probe.returncode != 0:
        return f"`ncu --version` exited with {probe.returncode}: {_last_line(probe.stdout + probe.stderr)}"
    return None


def target_args(provider: str, spec) -> list[str]:
    """Arguments of `python -m harness.ncu_target` for one provider and Spec."""
    return ["--provider", provider, "--mode", spec.mode, "--causal", str(int(bool(spec.causal))),
            "--hdim", str(spec.hdim), "--seqlen", str(spec.seqlen), "--batch", str(spec.batch),
            "--heads", str(spec.heads), "--dtype", spec.dtype]


def build_ncu_command(target_args: list[str], kernel_regex: str, metrics=METRICS) -> list[str]:
    """The ncu command line profiling one launch of `kernel_regex` inside ncu_target's
    cudaProfilerStart/Stop range, printing `metrics` as raw CSV in base units."""
    if not kernel_regex:
        raise ValueError("kernel_regex must be a non-empty regular expression naming the kernel to profile")
    if not metrics:
        raise ValueError("metrics must list at least one Nsight Compute metric name")
    return [NCU, "--clock-control", "none", "--profile-from-start", "off",
            "--kernel-name", f"regex:{kernel_regex}", "--launch-count", "1",
            "--metrics", ",".join(metrics), "--csv", "--page", "raw", "--print-units", "base",
            sys.executable, "-m", "harness.ncu_target", *target_args]


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==PROF==")]
    return _one_line(lines[-1]) if lines else "(no output)"


def _diagnose(returncode: int, stdout: str, stderr: str, kernel_regex: str,
              kernels: pd.DataFrame) -> tuple[str, str]:
    """(status, one-line reason) of a finished ncu run whose parsed table is `kernels`;
    ('ok', '') when it produced a row."""
    output = stdout + "\n" + stderr
    if PERMISSION_ERROR in output:
        return "permission", (f"no permission to read GPU performance counters ({PERMISSION_ERROR}): run as "
                              "root or load the nvidia module with NVreg_RestrictProfilingToAdminUsers=0")
    for line in output.splitlines():
        if UNKNOWN_METRIC.search(line):
            return "unknown-metric", f"ncu refused a metric: {_one_line(line)}"
    target_lines = [line for line in output.splitlines() if line.startswith("ncu_target:")]
    if returncode != 0 or target_lines:
        detail = _one_line(target_lines[-1]) if target_lines else _last_line(stderr or stdout)
        return "error", f"ncu exited with {returncode}: {detail}"
    if NO_KERNEL.search(output) or kernels.empty:
        return "no-kernel", f"no kernel matched regex:{kernel_regex} inside the profiled range"
    return "ok", ""


def _log_name(index: int, job: NcuJob) -> str:
    spec = job.spec
    name = (f"{index:02d}_{job.provider}_{job.setting or 'suite'}_{spec.mode}_c{int(bool(spec.causal))}"
            f"_d{spec.hdim}_s{spec.seqlen}_b{spec.batch}_h{spec.heads}_{spec.dtype}")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name) + ".log"


def _profile_one(job: NcuJob, metrics: list[str], timeout_s: float, log_path: Path) -> dict:
    command = build_ncu_command(target_args(job.provider, job.spec), job.kernel_regex, metrics)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=REPO_ROOT, start_new_session=True)  # its own process group
    except OSError as err:
        return {"status": "error", "reason": f"could not start ncu: {_one_line(str(err))}"}
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended just now
            os.killpg(process.pid, signal.SIGKILL)  # ncu and the target it started share the group
        stdout, stderr = process.communicate()
        log_path.write_text(" ".join(command) + "\n" + stdout + stderr)
        return {"status": "timeout", "reason": f"ncu did not finish within {timeout_s:g} s (killed)"}
    log_path.write_text(" ".join(command) + "\n" + stdout + stderr)
    kernels = parse_ncu_csv(stdout)
    status, reason = _diagnose(process.returncode, stdout, stderr, job.kernel_regex, kernels)
    if status != "ok":
        return {"status": status, "reason": reason}
    kernel = kernels.iloc[0]  # --launch-count 1: one row
    row = {"status": "ok", "kernel_name": kernel.get("Kernel Name", ""),
           "block_size": kernel.get("Block Size", ""), "grid_dims": kernel.get("Grid Size", "")}
    problems = dict(kernels.attrs.get("problems", {}))
    for metric in metrics:
        value, problem = metric_value(kernel.get(metric, math.nan))
        row[metric] = value
        if problem:
            problems.setdefault(metric, problem)
    notes = [f"{metric}: {problems[metric]}" for metric in metrics if metric in problems]
    without_value = [metric for metric in metrics if pd.isna(row[metric]) and metric not in problems]
    if without_value:
        notes.append(f"ncu gave no value (n/a) for {', '.join(without_value)}")
    row["reason"] = _one_line("; ".join(notes), limit=1000)
    return row


def profile_providers(jobs, out_dir, timeout_s: float = DEFAULT_TIMEOUT_S, metrics=METRICS,
                      progress: Callable[[str], None] | None = print) -> pd.DataFrame:
    """Profile each job (an NcuJob, or a (provider, spec, kernel_regex[, setting]) tuple) with
    ncu in a subprocess. Returns one row per job: ROW_COLUMNS then one column per metric (base
    units: bytes, nanoseconds, percent). A failure (ncu missing, counter permission, unknown
    metric, no kernel matched, timeout, non-zero exit) is a row with its status and a
    one-line reason; the other jobs still run. `out_dir`/counters.csv is rewritten after
    every job, and each job's ncu output is kept in `out_dir`/ncu/."""
    out_dir = Path(out_dir)
    log_dir = out_dir / "ncu"
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics = list(metrics)
    columns = [*ROW_COLUMNS, *metrics]
    unusable = ncu_status()
    rows = []
    frame = pd.DataFrame(columns=columns)
    jobs = [NcuJob(*job) for job in jobs]
    for index, job in enumerate(jobs):
        if unusable:
            outcome = {"status": "unavailable", "reason": unusable}
        else:
            outcome = _profile_one(job, metrics, timeout_s, log_dir / _log_name(index, job))
        rows.append({"provider": job.provider, "setting": job.setting, "kernel_regex": job.kernel_regex,
                     **{name: getattr(job.spec, name) for name in SPEC_FIELDS}, **outcome})
        frame = pd.DataFrame(rows).reindex(columns=columns)
        frame.to_csv(out_dir / "counters.csv", index=False)
        if progress is not None:
            reason = f": {outcome['reason']}" if outcome.get("reason") else ""
            progress(f"ncu [{index + 1}/{len(jobs)}] {job.provider} {job.setting} {job.spec.mode}: "
                     f"{outcome['status']}{reason}")
    return frame


# --------------------------------------------------------------------------------------
# Parsing `ncu --csv --page raw`
# --------------------------------------------------------------------------------------
SI_PREFIX = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
BINARY_PREFIX = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
COUNTED_UNITS = ("byte", "inst", "cycle", "warp", "block", "thread", "request", "sector", "wavefront",
                 "register", "SM", "transaction", "branches")  # 'branches': PC samples of stalled branches
BYTE_SYMBOLS = {"B": "byte"}  # 'KiB' = Ki + B
TIME_IN_NS = {"psecond": 1e-3, "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
              "ps": 1e-3, "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}  # Nsight Compute 2025 prints "ns"
PLAIN_UNITS = ("", "%", "none", "inst", "cycle", "byte", "warp", "block", "thread", "register", "SM", "Hz",
               "nsecond", "request", "sector", "wavefront", "transaction", "branches")
NOT_AVAILABLE = ("", "n/a", "na", "-")
THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?([eE][-+]?\d+)?$")


def _scaled(part: str) -> tuple[str, float] | None:
    """('byte', 1024.0) for 'KiB', ('inst', 1e6) for 'Minst', ('nsecond', 1e3) for 'usecond',
    (part, 1) for a base unit; None for a unit this parser does not know."""
    if part in TIME_IN_NS:
        return "nsecond", TIME_IN_NS[part]
    if part in PLAIN_UNITS:
        return part, 1.0
    if part in BYTE_SYMBOLS:
        return BYTE_SYMBOLS[part], 1.0
    for prefixes in (BINARY_PREFIX, SI_PREFIX):
        for prefix, factor in prefixes.items():
            rest = part[len(prefix):]
            if part.startswith(prefix) and (rest in COUNTED_UNITS or rest in BYTE_SYMBOLS or rest == "Hz"):
                return BYTE_SYMBOLS.get(rest, rest), factor
    return None


def _base_unit(unit: str) -> tuple[str, float] | None:
    """(base unit, factor) for a unit ncu may print scaled ('Mbyte', 'Kbyte/block', 'usecond',
    'KiB', 'Gbyte/second'); None for a unit it does not know (its values are not used)."""
    parts = unit.strip().split("/")
    scaled = [_scaled(part) for part in parts]
    if any(s is None for s in scaled):
        return None
    base, factor = scaled[0]
    for name, divisor in scaled[1:]:
        base, factor = f"{base}/{name}", factor / divisor
    return base, factor


def _number(text: str) -> float:
    """A metric value as a float: '1,234,567' (thousands separators), 'n/a' or 'N/A' -> NaN;
    ValueError for anything else that is not a number ('No-CC', '24,61')."""
    cleaned = text.strip()
    if cleaned.lower() in NOT_AVAILABLE:
        return math.nan
    if "," in cleaned:
        if not THOUSANDS.match(cleaned):
            raise ValueError(f"{text!r} is not a number (a comma that does not separate thousands)")
        cleaned = cleaned.replace(",", "")
    return float(cleaned)


def metric_value(value) -> tuple[float, str]:
    """(value, problem) of one parsed cell: a float as is, text parsed by _number."""
    if isinstance(value, (int, float)):
        return float(value), ""
    try:
        return _number(str(value)), ""
    except ValueError:
        return math.nan, f"ncu printed {str(value)!r}, not a number"


def _unique_header(header: list[str], problems: dict[str, str]) -> list[str]:
    """The header with repeated names made unique ('name#2'); the repeats are dropped later."""
    seen: dict[str, int] = {}
    unique = []
    for name in header:
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            problems[name] = f"ncu printed the column {name!r} {seen[name]} times; the first is used"
            name = f"{name}#{seen[name]}"
        unique.append(name)
    return unique


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """One row per profiled kernel from `ncu --csv --page raw` output: the identifying
    columns ('ID', 'Kernel Name', 'Block Size', 'Grid Size', ...) as text and every metric
    column (a name with '__') as a float in base units (nanoseconds, bytes). '==PROF==' and
    other '==' lines and anything the target printed before the table are skipped; thousands
    separators are removed; 'n/a' (any case) becomes NaN. A metric whose unit is unknown, whose
    units row does not line up with the header, or whose value is not a number is NaN, with
    the reason in `frame.attrs['problems']` (metric -> text); `frame.attrs['units']` maps
    metric -> base unit. A repeated column keeps its first copy. No table gives an empty frame."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return pd.DataFrame()
    header, *records = csv.reader(lines[start:])
    problems: dict[str, str] = {}
    units: dict[str, str] | None = {}
    if records and records[0] and records[0][0] == "":  # the units row has no kernel ID
        units_row = records.pop(0)
        if len(units_row) == len(header):
            units = dict(zip(header, units_row, strict=True))
        else:
            units = None
            problem = f"the units row has {len(units_row)} fields for {len(header)} columns"
    skipped = sum(len(record) != len(header) for record in records)
    records = [record for record in records if len(record) == len(header)]
    columns = _unique_header(header, problems)
    frame = pd.DataFrame(records, columns=columns)
    frame = frame[[column for column in columns if "#" not in column or column in header]]
    base_units = {}
    for column in frame.columns:
        if "__" not in column:
            continue
        if units is None:
            frame[column] = math.nan
            problems[column] = problem
            continue
        unit = units.get(column, "")
        scaled = _base_unit(unit)
        parsed = [metric_value(value) for value in frame[column]]
        values = [value for value, _ in parsed]
        bad = [problem for _, problem in parsed if problem]
        if bad and len(bad) == len(parsed) and not _looks_numeric(frame[column]):
            continue  # a text attribute ('device__attribute_confidential_computing_mode' = 'No-CC') stays text
        if scaled is None:
            frame[column] = math.nan
            problems[column] = f"unknown unit {unit!r}: value not used"
            continue
        frame[column] = pd.Series(values, index=frame.index, dtype=float) * scaled[1]
        base_units[column] = scaled[0]
        if bad:
            problems[column] = bad[0]
    frame.attrs["units"] = base_units
    frame.attrs["problems"] = problems
    frame.attrs["skipped_rows"] = skipped
    return frame


def _looks_numeric(values: pd.Series) -> bool:
    """Whether a column's text is a number gone wrong ('24,61') rather than a word ('No-CC')."""
    return all(re.fullmatch(r"[-+0-9.,eE ]+", str(value).strip() or "x") for value in values)
