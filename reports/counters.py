"""Nsight Compute counters that test the FlashAttention-2 paper's three claims (issue 5).

The paper (Dao, 2023, arXiv 2307.08691) credits its speed-up over FlashAttention to three
techniques and never shows a counter for any of them. Each rung of the ablation ladder adds
one technique; this module profiles one representative launch per rung (and per reference
kernel) with Nsight Compute and turns the counters into tables and sentences:

1. Sec. 3.1, fewer non-matmul FLOPs (rung 1 vs rung 0): fewer FFMA/FADD/FMUL thread
   instructions and MUFU (XU pipe: exp2) instructions per tensor-core instruction;
2. Sec. 3.2, parallelism over the sequence (rung 2 vs rung 1): a larger grid, more waves and
   a busier SM, most of all at batch 1 (setting B), where a grid over batch x heads alone
   leaves SMs idle;
3. Sec. 3.3, split-Q warp partitioning (rung 3 vs rung 2): fewer shared-memory wavefronts and
   less time stalled at barriers, because warps no longer exchange partial results.

Profiling runs `python -m reports.ncu_target ...` under `ncu` in a subprocess per job, with
`--profile-from-start off` so that compilation, autotuning and warm-up (outside the
cudaProfilerStart/Stop range in ncu_target) are never profiled, `--clock-control none` and
an explicit metric list. Every failure becomes a row with a status and a one-line reason and
the remaining jobs still run.

Metric names: hardware counters are checked against `ncu --query-metrics --chip gh100`
(tests/fixtures/ncu/gh100_metric_names.txt); `launch__*` names are launch statistics, which
that query does not list: all but `launch__waves_per_multiprocessor` were seen working on
the H200 (../shared/GPU.md), and that one is part of ncu's LaunchStats section.
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
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from reports.regression import markdown_table

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

METRIC_GROUPS: dict[str, list[str]] = {
    "non-matmul work": [FFMA, FADD, FMUL, MUFU, HMMA, GMMA],
    "parallelism": [GRID, WAVES, WARPS_ACTIVE, SM_THROUGHPUT, OCCUPANCY_LIMIT_REGISTERS,
                    OCCUPANCY_LIMIT_SHARED],
    "communication": [SHARED_LD, SHARED_ST, SHARED_WAVEFRONTS, BANK_CONFLICTS, BARRIER_STALL],
    "context": [DURATION, DRAM_READ, DRAM_WRITE, REGISTERS, SHARED_PER_BLOCK, TENSOR_PIPE],
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
    """Arguments of `python -m reports.ncu_target` for one provider and Spec."""
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
            sys.executable, "-m", "reports.ncu_target", *target_args]


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
                                   cwd=REPO_ROOT, start_new_session=True)
    except OSError as err:
        return {"status": "error", "reason": f"could not start ncu: {_one_line(str(err))}"}
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended just now
            os.killpg(process.pid, signal.SIGKILL)  # ncu and the target it started share this session
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
    row.update({metric: kernel.get(metric, math.nan) for metric in metrics})
    without_value = [metric for metric in metrics if pd.isna(row[metric])]
    row["reason"] = f"ncu gave no value (n/a) for {', '.join(without_value)}" if without_value else ""
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
COUNTED_UNITS = ("byte", "inst", "cycle", "warp", "block", "thread")
TIME_IN_NS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}


def _base_unit(unit: str) -> tuple[str, float]:
    """(base unit, factor) for a unit ncu may print scaled ('Mbyte', 'Kbyte/block', 'usecond')."""
    if unit in TIME_IN_NS:
        return "nsecond", TIME_IN_NS[unit]
    counted, per, rest = unit.partition("/")
    if counted[:1] in SI_PREFIX and counted[1:] in COUNTED_UNITS:
        return counted[1:] + per + rest, SI_PREFIX[counted[:1]]
    return unit, 1.0


def _number(text: str) -> float:
    """A metric value as a float; ValueError for a value that is text ('No-CC', a GPU name)."""
    cleaned = text.strip().replace(",", "")
    if cleaned in ("", "n/a"):
        return math.nan
    return float(cleaned)


def _numeric_column(values: pd.Series, factor: float) -> pd.Series | None:
    """The column as floats in base units, or None when it holds text (ncu's raw page also
    lists device attributes such as 'device__attribute_confidential_computing_mode' = 'No-CC')."""
    try:
        return values.map(_number) * factor
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """One row per profiled kernel from `ncu --csv --page raw` output: the identifying
    columns ('ID', 'Kernel Name', 'Block Size', 'Grid Size', ...) as text and every metric
    column (a name with '__') as a float in base units (nanoseconds, bytes). '==PROF==' and
    other '==' lines and anything the target printed before the table are skipped; thousands
    separators are removed; 'n/a' becomes NaN. `frame.attrs['units']` maps metric -> unit.
    No table (no kernel profiled) gives an empty frame."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return pd.DataFrame()
    header, *records = csv.reader(lines[start:])
    records = [record for record in records if len(record) == len(header)]
    units = {}
    if records and records[0][0] == "":  # the units row has no kernel ID
        units = dict(zip(header, records.pop(0)))
    frame = pd.DataFrame(records, columns=header)
    base_units = {}
    for column in header:
        if "__" not in column:
            continue
        unit, factor = _base_unit(units.get(column, ""))
        numeric = _numeric_column(frame[column], factor)
        if numeric is None:
            continue  # a text attribute stays text
        frame[column] = numeric
        base_units[column] = unit
    frame.attrs["units"] = base_units
    return frame


# --------------------------------------------------------------------------------------
# Tables and the sentences under them
# --------------------------------------------------------------------------------------
def derive(counters: pd.DataFrame) -> pd.DataFrame:
    """Per-kernel quantities the claims are about, from raw metric columns."""
    c = counters.reindex(columns=METRICS).astype(float)
    tensor = c[HMMA].fillna(0) + c[GMMA].fillna(0)
    return pd.DataFrame({
        "duration_us": c[DURATION] / 1e3,
        # non-matmul warp instructions per tensor-core instruction (FA2 Sec. 3.1)
        "nonmatmul_per_mma": ((c[FFMA] + c[FADD] + c[FMUL]) / WARP_SIZE + c[MUFU]) / tensor.where(tensor > 0),
        "mma_kind": ["gmma" if g > 0 else "hmma" if h > 0 else "" for h, g in zip(c[HMMA], c[GMMA])],
        "grid": c[GRID],
        "waves": c[WAVES],
        "warps_active_pct": c[WARPS_ACTIVE],
        "sm_throughput_pct": c[SM_THROUGHPUT],
        "shared_instructions": c[SHARED_LD] + c[SHARED_ST],
        "shared_wavefronts": c[SHARED_WAVEFRONTS],
        "bank_conflicts": c[BANK_CONFLICTS],
        "barrier_stall_pct": c[BARRIER_STALL],
        "tensor_pipe_pct": c[TENSOR_PIPE],
        "registers": c[REGISTERS],
        "shared_kib": c[SHARED_PER_BLOCK] / 1024,
        "dram_mb": (c[DRAM_READ] + c[DRAM_WRITE]) / 1e6,
    }, index=counters.index)


# Derived columns compared with the previous rung, with the words the sentences use.
COMPARED = {
    "duration_us": "kernel time (us)",
    "nonmatmul_per_mma": "non-matmul instructions per tensor instruction",
    "grid": "grid (blocks)",
    "waves": "waves per SM",
    "warps_active_pct": "warps active (% of peak)",
    "sm_throughput_pct": "SM throughput (% of peak)",
    "shared_wavefronts": "shared-memory wavefronts",
    "barrier_stall_pct": "barrier-stall share (% of active warps)",
}


@dataclass(frozen=True)
class TechniqueCheck:
    rung: int  # the rung that adds the technique; it is compared with rung - 1
    technique: str
    expectations: tuple[tuple[str, str], ...]  # (derived column, 'lower' | 'higher')


TECHNIQUE_CHECKS = (
    TechniqueCheck(1, "Fewer non-matmul FLOPs (FA2 Sec. 3.1)", (("nonmatmul_per_mma", "lower"),)),
    TechniqueCheck(2, "Parallelism over the sequence (FA2 Sec. 3.2)",
                   (("grid", "higher"), ("sm_throughput_pct", "higher"))),
    TechniqueCheck(3, "Split-Q work partitioning between warps (FA2 Sec. 3.3)",
                   (("shared_wavefronts", "lower"), ("barrier_stall_pct", "lower"))),
)

RUNG_NAME = re.compile(r"^rung(\d+)-")


def rung_index(provider: str) -> int | None:
    """3 for 'rung3-split-q'; None for a reference provider."""
    match = RUNG_NAME.match(provider)
    return int(match.group(1)) if match else None


def _fmt(value) -> str:
    """3 significant digits with k/M/G above a million; whole numbers below it in full."""
    if value is None or pd.isna(value):
        return "-"
    for factor, suffix in ((1e9, " G"), (1e6, " M")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    if float(value).is_integer() or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _normal(counters: pd.DataFrame) -> pd.DataFrame:
    frame = counters.copy()
    for column in ("setting", "reason"):  # read back from CSV, an all-empty column is float NaN
        frame[column] = frame[column].astype(object).fillna("").astype(str)
    frame["causal"] = frame["causal"].map(lambda v: str(v).strip().lower() in ("true", "1"))
    return frame


def _with_previous(group: pd.DataFrame) -> pd.DataFrame:
    """Adds `<column>_vs_prev` = value / value of the rung before (same setting)."""
    by_rung = {rung_index(p): i for i, p in zip(group.index, group["provider"]) if rung_index(p) is not None}
    for column in COMPARED:
        ratios = []
        for index, provider in zip(group.index, group["provider"]):
            rung = rung_index(provider)
            previous = by_rung.get(rung - 1) if rung is not None else None
            value = group.at[index, column]
            ratios.append(math.nan if previous is None else value / group.at[previous, column])
        group[f"{column}_vs_prev"] = ratios
    return group


MIN_CHANGE = 0.10  # the smallest relative change of a counter that a verdict counts


def _sentence(check: TechniqueCheck, group: pd.DataFrame) -> str | None:
    """What the counters show about one technique in one setting, or None when the two
    rungs it compares were not both profiled."""
    by_rung = {rung_index(row["provider"]): row for _, row in group.iterrows()
               if rung_index(row["provider"]) is not None}
    if check.rung not in by_rung or check.rung - 1 not in by_rung:
        return None
    before, after = by_rung[check.rung - 1], by_rung[check.rung]
    head = f"**{check.technique}**, {after['provider']} vs {before['provider']}"
    for row in (before, after):
        if row["status"] != "ok":
            return (f"{head}: cannot be checked: {row['provider']} has no counters "
                    f"({row['status']}: {row['reason']}).")
    findings, confirmed = [], True
    for column, direction in check.expectations:
        old, new = before[column], after[column]
        if pd.isna(old) or pd.isna(new):
            return f"{head}: cannot be checked: no value of {COMPARED[column]} for both rungs."
        if old == 0:
            return f"{head}: cannot be checked: {COMPARED[column]} is 0 for {before['provider']}."
        # one launch per rung: a change smaller than MIN_CHANGE is not evidence either way
        if abs(new / old - 1.0) < MIN_CHANGE:
            holds, verdict = False, f"within {MIN_CHANGE:.0%}: no clear change"
        else:
            holds = new < old if direction == "lower" else new > old
            verdict = f"{direction} as expected" if holds else f"expected {direction}"
        confirmed &= holds
        findings.append(f"{COMPARED[column]} {_fmt(old)} -> {_fmt(new)} ({new / old:.2f}x, {verdict})")
    sentence = f"{head}: {'confirmed' if confirmed else 'not confirmed'}: {'; '.join(findings)}."
    if "nonmatmul_per_mma" in dict(check.expectations) and before["mma_kind"] != after["mma_kind"]:
        sentence += (f" Caution: {before['provider']} issues {before['mma_kind'].upper()} and "
                     f"{after['provider']} {after['mma_kind'].upper()} tensor instructions, which do "
                     "different amounts of work each.")
    return sentence


# Derived column -> Markdown header of the tables; ratios to the previous rung follow in brackets.
SHOWN = {
    "duration_us": "time (us)",
    "mma_kind": "mma",
    "nonmatmul_per_mma": "non-matmul / tensor instr",
    "grid": "grid",
    "waves": "waves",
    "warps_active_pct": "warps active %",
    "sm_throughput_pct": "SM throughput %",
    "shared_wavefronts": "shared wavefronts",
    "bank_conflicts": "bank conflicts",
    "barrier_stall_pct": "barrier stall %",
    "tensor_pipe_pct": "tensor pipe %",
    "registers": "regs/thread",
    "shared_kib": "smem/block KiB",
    "dram_mb": "DRAM MB",
}


def _heading(key: dict) -> str:
    shape = (f"{key['mode']}, {'causal' if key['causal'] else 'non-causal'}, hdim {key['hdim']}, "
             f"seqlen {key['seqlen']}, batch {key['batch']}, {key['heads']} heads, {key['dtype']}")
    return f"Setting {key['setting']}: {shape}" if key["setting"] else shape


def counter_table(counters: pd.DataFrame, order: list[str]) -> tuple[str, pd.DataFrame]:
    """Tables of profile_providers' rows, one per setting (and spec): one row per provider
    in `order` (others after, by name), the derived quantities, each rung's ratio to the rung
    before (`<column>_vs_prev`), and under each table one sentence per technique whose two
    rungs are both there, saying 'confirmed' or 'not confirmed' with the numbers.
    Returns (Markdown, table)."""
    frame = _normal(counters)
    frame = pd.concat([frame, derive(frame)], axis=1)
    rank = {name: position for position, name in enumerate(order)}
    frame["_rank"] = [rank.get(provider, len(order)) for provider in frame["provider"]]
    sections, tables = [], []
    for key, group in frame.groupby(GROUP_COLUMNS, sort=True):
        group = _with_previous(group.sort_values(["_rank", "provider"]).copy())
        tables.append(group)
        shown = pd.DataFrame({"provider": group["provider"]})
        for column, header in SHOWN.items():
            cells = [v if isinstance(v, str) else _fmt(v) for v in group[column]]
            if column in COMPARED:
                cells = [f"{cell} ({ratio:.2f}x)" if not pd.isna(ratio) else cell
                         for cell, ratio in zip(cells, group[f"{column}_vs_prev"])]
            shown[header] = cells
        ok = group["status"] == "ok"
        lines = [f"### {_heading(dict(zip(GROUP_COLUMNS, key)))}", ""]
        lines += [markdown_table(shown[ok.to_numpy()]), ""] if ok.any() else []
        failed = [f"- {row.provider}: not profiled ({row.status}: {row.reason})"
                  for row in group[~ok].itertuples()]
        sentences = [f"- {s}" for s in (_sentence(check, group) for check in TECHNIQUE_CHECKS) if s]
        for block in (failed, sentences):
            lines += [*block, ""] if block else []
        sections.append("\n".join(lines))
    intro = ("Counters from Nsight Compute, one launch per kernel; in brackets each rung's ratio to the rung "
             "before. Non-matmul / tensor instr = ((FFMA + FADD + FMUL thread instructions) / 32 + MUFU "
             "instructions) / (HMMA + GMMA instructions); one GMMA (wgmma) does more work than one HMMA "
             "(mma.sync), so compare it only between kernels with the same `mma`.\n")
    table = pd.concat(tables).drop(columns="_rank") if tables else frame.drop(columns="_rank")
    return "\n".join(["## Performance counters", "", intro, *sections]), table.reset_index(drop=True)


def write_counter_report(counters: pd.DataFrame, order: list[str], out_dir) -> Path:
    """counters.md (the tables and sentences) and counters_table.csv (with the derived
    quantities and ratios) in `out_dir`; returns the path of counters.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown, table = counter_table(counters, order)
    table.to_csv(out_dir / "counters_table.csv", index=False)
    report = out_dir / "counters.md"
    report.write_text(markdown)
    return report
