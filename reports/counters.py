"""Tables and sentences from Nsight Compute counters: what the counters say about the
FlashAttention-2 paper's three claims (Dao, 2023, arXiv 2307.08691).

The counters come from harness.ncu (one profiled launch per rung and reference kernel);
`counter_table` turns its rows into one table per setting, with each rung's ratio to the
rung before and one sentence per technique saying whether its counters moved the way the
paper says they should; `write_counter_report` writes counters.md and counters_table.csv.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.ncu import (
    BANK_CONFLICTS,
    BARRIER_STALL,
    DRAM_READ,
    DRAM_WRITE,
    DURATION,
    FADD,
    FFMA,
    FMUL,
    GMMA,
    GRID,
    GROUP_COLUMNS,
    HMMA,
    INSTRUCTIONS,
    ISSUE_ACTIVE,
    L2_HIT,
    METRICS,
    MUFU,
    REGISTERS,
    SHARED_LD,
    SHARED_PER_BLOCK,
    SHARED_ST,
    SHARED_WAVEFRONTS,
    SM_CYCLES,
    SM_THROUGHPUT,
    STALL_BARRIER_PER_ISSUE,
    STALL_MEMORY_PER_ISSUE,
    STALL_WAIT_PER_ISSUE,
    TENSOR_PIPE,
    WARP_SIZE,
    WARPS_ACTIVE,
    WAVES,
)
from reports.tables import markdown_table


# --------------------------------------------------------------------------------------
# Tables and the sentences under them
# --------------------------------------------------------------------------------------
def derive(counters: pd.DataFrame) -> pd.DataFrame:
    """Per-kernel quantities the claims are about, from raw metric columns."""
    c = counters.reindex(columns=METRICS).apply(pd.to_numeric, errors="coerce")  # text -> NaN
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
        "sm_cycles": c[SM_CYCLES],
        "instructions": c[INSTRUCTIONS],
        "issue_active_pct": c[ISSUE_ACTIVE],
        "gmma": c[GMMA],
        "barrier_stalls_per_issue": c[STALL_BARRIER_PER_ISSUE],
        "wait_stalls_per_issue": c[STALL_WAIT_PER_ISSUE],
        "memory_stalls_per_issue": c[STALL_MEMORY_PER_ISSUE],
        "l2_hit_pct": c[L2_HIT],
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


# The columns that set one kernel beside a faster peer's on the same call: where the cycles go.
SHOWN_BESIDE_PEER = {
    "duration_us": "time (us)",
    "sm_cycles": "SM cycles active",
    "tensor_pipe_pct": "tensor pipe %",
    "gmma": "wgmma instr",
    "nonmatmul_per_mma": "non-matmul / tensor instr",
    "instructions": "instructions",
    "issue_active_pct": "issue slots busy %",
    "barrier_stalls_per_issue": "CTA-barrier stalls / issue",
    "wait_stalls_per_issue": "fixed-latency-wait stalls / issue",
    "memory_stalls_per_issue": "memory stalls / issue",
    "l2_hit_pct": "L2 hit %",
    "dram_mb": "DRAM MB",
    "registers": "regs/thread",
    "grid": "grid",
}


def _heading(key: dict) -> str:
    shape = (f"{key['mode']}, {'causal' if key['causal'] else 'non-causal'}, hdim {key['hdim']}, "
             f"seqlen {key['seqlen']}, batch {key['batch']}, {key['heads']} heads, {key['dtype']}")
    return f"Setting {key['setting']}: {shape}" if key["setting"] else shape


def counter_table(counters: pd.DataFrame, order: list[str], columns: dict | None = None) -> tuple[str, pd.DataFrame]:
    """Tables of profile_providers' rows, one per setting (and spec): one row per provider
    in `order` (others after, by name), the derived quantities (`columns`: derived column ->
    header; SHOWN unless given, SHOWN_BESIDE_PEER for a kernel beside a peer's), each rung's
    ratio to the rung before (`<column>_vs_prev`), and under each table one sentence per
    technique whose two rungs are both there, saying 'confirmed' or 'not confirmed' with the
    numbers. Returns (Markdown, table)."""
    frame = _normal(counters)
    frame = pd.concat([frame, derive(frame)], axis=1)
    rank = {name: position for position, name in enumerate(order)}
    frame["_rank"] = [rank.get(provider, len(order)) for provider in frame["provider"]]
    sections, tables = [], []
    for key, group in frame.groupby(GROUP_COLUMNS, sort=True):
        group = _with_previous(group.sort_values(["_rank", "provider"]).copy())
        tables.append(group)
        shown = pd.DataFrame({"provider": group["provider"]})
        for column, header in (columns or SHOWN).items():
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
