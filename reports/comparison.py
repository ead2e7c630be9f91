"""comparison.md: the regression check's verdicts (harness.regression) as a Markdown report."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.environment import ENV_COLUMNS
from harness.io import atomic_write_text
from harness.regression import KEY_COLUMNS, VERDICTS, Comparison
from reports.tables import markdown_table, ratio_text


def _slowdown(log_threshold: float) -> float:
    """A log-ratio threshold as the slowdown it flags: 1 - exp(-t)."""
    return -math.expm1(-log_threshold)


def _percent(value: float) -> str:
    return "-" if pd.isna(value) else f"{value:+.1%}"


def _environment_line(environment: dict) -> str:
    return ", ".join(f"{key} {environment[key]}" for key in ENV_COLUMNS if environment.get(key))


def summary_line(comparison: Comparison) -> str:
    counts = comparison.counts()
    outcome = "FAIL" if comparison.regressed else ("NOTHING COMPARED" if comparison.compared == 0 else "PASS")
    parts = ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS)
    return f"**{outcome}**: {parts} ({len(comparison.table)} configurations)"


def format_comparison(comparison: Comparison) -> str:
    """Markdown report: environments, the rule with its numbers, summary, warnings, one table
    per verdict."""
    sigmas = comparison.table["sigma"].dropna()
    thresholds = comparison.table["threshold"].dropna()
    spread = (f"{_slowdown(thresholds.min()):.1%}" if thresholds.nunique() <= 1 else
              f"{_slowdown(thresholds.min()):.1%}-{_slowdown(thresholds.max()):.1%}") if len(thresholds) else "-"
    lines = [
        "## Performance against the baseline",
        "",
        f"- Baseline `{comparison.baseline_path}`: {_environment_line(comparison.baseline_environment)}",
        f"- This run: {_environment_line(comparison.environment)}",
        (f"- Rule: each configuration's TFLOPs/s divided by {comparison.reference}'s in the same run; a change "
         f"of that ratio beyond the threshold is a regression (slower) or an improvement (faster). "
         f"Threshold = max(z x sigma, tolerance {comparison.tolerance:.0%}), z for a "
         f"{comparison.false_positive_rate:.1%} false-positive rate per configuration; here {spread}."),
        f"- sigma ({sigmas.min() if len(sigmas) else float('nan'):.4f} as a log-ratio): {comparison.sigma_source}.",
        "",
        summary_line(comparison),
    ]
    if comparison.warnings:
        lines += ["", "Warnings:", *[f"- {warning}" for warning in comparison.warnings]]
    table = comparison.table
    for verdict in VERDICTS:
        rows = table[table["verdict"] == verdict]
        if rows.empty:
            continue
        shown = rows[KEY_COLUMNS].copy()
        shown["baseline TFLOPs/s"] = rows["baseline_tflops"].map(lambda v: "-" if pd.isna(v) else f"{v:.1f}")
        shown["now TFLOPs/s"] = rows["current_tflops"].map(lambda v: "-" if pd.isna(v) else f"{v:.1f}")
        shown[f"baseline vs {comparison.reference}"] = rows["baseline_ratio"].map(ratio_text)
        shown[f"now vs {comparison.reference}"] = rows["current_ratio"].map(ratio_text)
        shown["change"] = rows["change"].map(_percent)
        shown["threshold"] = rows["threshold"].map(lambda t: "-" if pd.isna(t) else f"{_slowdown(t):.1%}")
        if (rows["note"] != "").any():
            shown["note"] = rows["note"]
        lines += ["", f"### {verdict} ({len(rows)})", "", markdown_table(shown)]
    return "\n".join(lines) + "\n"


def write_comparison(comparison: Comparison, out_dir) -> Path:
    """Write comparison.md (the report) and comparison.csv (the full table) to `out_dir`;
    returns the path of comparison.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "comparison.csv", comparison.table.to_csv(index=False))
    return atomic_write_text(out_dir / "comparison.md", format_comparison(comparison))
