"""report.md for the paper suite, generated from result rows (nothing typed by hand).

Sections: the environment (from the rows' environment columns and the runs' metadata in
results.json), one TFLOPs/s table per figure panel (rows: sequence length, columns:
provider), speedups against the official FA2 kernel (sdpa-flash) and PyTorch eager, and the
failed measurements with their reasons.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.environment import ENV_COLUMNS
from harness.io import atomic_write_text
from reports.plots import MODE_TITLES, cell_summary, suite_rows, value_label
from reports.tables import markdown_table, ratio_text

SPEEDUP_REFERENCES = ("sdpa-flash", "pytorch")  # official FA2 CUDA kernel, PyTorch eager
REPORT_NAME = "report.md"
STATE_FIELDS = ("sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w",
                "power_limit_w", "clock_event_reasons")


def _environment_section(rows: pd.DataFrame, runs: list[dict]) -> list[str]:
    """The rows' environment, or where no row names a field (a run that only profiled, or measured
    nothing) the runs' recorded one; then each run's command and GPU state."""
    lines = ["## Environment", ""]
    for column in ENV_COLUMNS:
        values = sorted(set(rows[column].astype(str)) - {""})
        if not values:
            values = sorted({str((run.get("environment_before") or {}).get(column) or "") for run in runs} - {""})
        lines.append(f"- {column}: {', '.join(values) if values else '-'}")
    for run in runs:
        status = "finished" if run.get("finished") else "interrupted or running"
        lines += ["", f"Run {run.get('run_id', '?')}: `{run.get('command', '')}` ({status})"]
        for when in ("before", "after"):
            state = (run.get(f"environment_{when}") or {}).get("state") or {}
            shown = ", ".join(f"{key} {state[key]}" for key in STATE_FIELDS if state.get(key) not in (None, []))
            if shown:
                lines.append(f"- GPU {when}: {shown}")
        lines += [f"- WARNING: {warning}" for warning in run.get("throttle_warnings", [])]
    return lines


def _cell_text(tflops: float, failed: str) -> str:
    return failed if failed else value_label(tflops)


def _panel_table(panel: pd.DataFrame, providers: list[str], labels: dict[str, str]) -> pd.DataFrame:
    """Rows: (seqlen, batch, heads); columns: provider labels; cells: TFLOPs/s or 'OOM'/'n/a'."""
    table = panel.pivot_table(index=["seqlen", "batch", "heads"], columns="provider",
                              values="text", aggfunc="first").reindex(columns=providers).fillna("-")
    table.columns = [labels[p] for p in providers]
    return table.reset_index()


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _speedup_table(cells: pd.DataFrame, reference: str, providers: list[str], labels: dict[str, str]) -> pd.DataFrame:
    """Rows: panels (mode, dtype, head dim, causal); columns: providers; cells: geometric mean
    over sequence lengths of tflops / reference tflops (where both measured) and its range."""
    table = []
    for (mode, dtype, hdim, causal), panel in cells.groupby(["mode", "dtype", "hdim", "causal"], sort=True):
        ref = panel[panel["provider"] == reference].set_index(["seqlen", "batch", "heads"])["tflops"]
        line = {"panel": f"{mode} {dtype} d{hdim} {'causal' if causal else 'non-causal'}"}
        for provider in providers:
            mine = panel[panel["provider"] == provider].set_index(["seqlen", "batch", "heads"])["tflops"]
            ratios = (mine / ref).dropna().tolist()
            line[labels[provider]] = (f"{ratio_text(_geomean(ratios))} ({ratio_text(min(ratios))}-"
                                      f"{ratio_text(max(ratios))})" if ratios else "-")
        table.append(line)
    return pd.DataFrame(table)


def _failures_section(rows: pd.DataFrame) -> list[str]:
    failed = rows[rows["status"] != "ok"]
    if failed.empty:
        return ["## Failed measurements", "", "None."]
    groups = []
    for (provider, status, reason), group in failed.groupby(["provider", "status", "reason"], sort=True):
        example = group.iloc[0]
        groups.append({"provider": provider, "status": status, "count": len(group),
                       "example": (f"{example['mode']} d{example['hdim']} "
                                   f"{'causal' if example['causal'] else 'non-causal'} n{example['seqlen']}"),
                       "reason": reason or "-"})
    intro = ("Each line is one (provider, status, reason) with the number of configurations it applies to "
             "and one of them.")
    return ["## Failed measurements", "", intro, "", markdown_table(pd.DataFrame(groups))]


def build_report(df: pd.DataFrame, runs: list[dict] | None = None, figures: list[Path] | None = None,
                 figure_dir: Path | None = None) -> str:
    """The Markdown text of the report of the suite rows in `df`. `figures` (PNG paths) are
    linked relative to `figure_dir` (the report's folder)."""
    rows = suite_rows(df)
    lines = ["# FlashAttention-2 benchmark: the paper's figures", ""]
    interpreted = bool(rows["interpreter"].any())
    if interpreted:
        lines += ["> **Triton interpreter (no GPU): these numbers are NOT performance.** They show that the",
                  "> pipeline works; measure on a GPU for real numbers. No speedup is computed from them.", "",
                  "TFLOPs/s as the FA2 paper counts them (baselines/flops.py), from the median of a few",
                  "`time.perf_counter` measurements on the CPU; accuracy checked against the float64",
                  "reference first.", ""]
    else:
        lines += ["TFLOPs/s as the FA2 paper counts them (baselines/flops.py): median of `triton.testing.do_bench`",
                  "(CUDA events, L2 flushed before each call; 20th/80th percentiles in results.csv), accuracy",
                  "checked against the float64 reference first (the shape checked is in results.csv's",
                  "`check_shape`).", ""]
    lines += _environment_section(rows, runs or [])
    cells = cell_summary(rows)
    if cells.empty:
        return "\n".join([*lines, "", "No suite measurements."]) + "\n"
    cells["text"] = [_cell_text(t, f) for t, f in zip(cells["tflops"], cells["failed"], strict=True)]
    labels = dict(zip(cells["provider"], cells["label"], strict=False))
    measured = [p for p in dict.fromkeys(rows["provider"]) if cells.loc[cells["provider"] == p, "tflops"].notna().any()]
    pngs = {p.stem: p for p in figures or [] if p.suffix == ".png"}
    for (mode, dtype), figure in cells.groupby(["mode", "dtype"], sort=True):
        lines += ["", f"## {MODE_TITLES[mode].capitalize()}, {dtype} (TFLOPs/s)", ""]
        png = pngs.get(f"{mode}_{dtype}")
        if png is not None:
            link = png.relative_to(figure_dir) if figure_dir is not None else png
            lines += [f"![{mode} {dtype}]({link.as_posix()})", ""]
        for (hdim, causal), panel in figure.groupby(["hdim", "causal"], sort=True):
            lines += [f"### head dim {hdim}, {'causal' if causal else 'non-causal'}", "",
                      markdown_table(_panel_table(panel, measured, labels)), ""]
    for reference in () if interpreted else SPEEDUP_REFERENCES:
        if reference not in measured:
            lines += ["", f"## Speedup vs {reference}", "", f"No `ok` measurement of {reference} in these rows."]
            continue
        others = [p for p in measured if p != reference]
        lines += ["", f"## Speedup vs {labels[reference]}", "",
                  "Geometric mean over sequence lengths of TFLOPs/s divided by the reference's, (min-max).", "",
                  markdown_table(_speedup_table(cells, reference, others, labels))]
    lines += ["", *_failures_section(rows)]
    return "\n".join(lines) + "\n"


def write_report(df: pd.DataFrame, out_dir: Path, runs: list[dict] | None = None,
                 figures: list[Path] | None = None) -> Path:
    """Write out_dir/report.md; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out_dir / REPORT_NAME, build_report(df, runs, figures, figure_dir=out_dir))
