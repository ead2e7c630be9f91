"""comparison.md: the regression check's verdicts (harness.regression) as a Markdown report."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.regression import KEY_COLUMNS, VERDICTS, Comparison
from reports.environment import ENV_COLUMNS
from reports.tables import markdown_table


def _band(median: float, lo: float, hi: float) -> str:
    if pd.isna(median):
        return "-"
    return f"{median:.1f} ({lo:.1f}-{hi:.1f})"


def _environment_line(environment: dict) -> str:
    return ", ".join(f"{key} {environment[key]}" for key in ENV_COLUMNS if environment.get(key))


def summary_line(comparison: Comparison) -> str:
    counts = comparison.counts()
    outcome = "FAIL" if comparison.regressed else "PASS"
    parts = ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS)
    return (f"**{outcome}**: {parts} (tolerance {comparison.tolerance:.0%} beyond the measured spread, "
            f"{len(comparison.table)} configurations)")


def format_comparison(comparison: Comparison) -> str:
    """Markdown report: environments, rule, summary line, warnings, one table per verdict."""
    tol = comparison.tolerance
    lines = [
        "## Performance against the baseline",
        "",
        f"- Baseline `{comparison.baseline_path}`: {_environment_line(comparison.baseline_environment)}",
        f"- This run: {_environment_line(comparison.environment)}",
        (f"- Rule: regression when current_hi < baseline_lo x {1 - tol:.2f}, improvement when "
         f"current_lo > baseline_hi x {1 + tol:.2f} (TFLOPs/s; lo-hi is the band of the repeats' "
         "medians and 20th/80th percentiles)."),
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
        for side in ("baseline", "current"):
            bands = rows[[f"{side}_tflops", f"{side}_lo", f"{side}_hi"]].to_numpy()
            shown[f"{side} TFLOPs/s (lo-hi)"] = [_band(*band) for band in bands]
        shown["ratio"] = rows["ratio"].map(lambda r: "-" if pd.isna(r) else f"{r:.3f}x")
        if (rows["note"] != "").any():
            shown["note"] = rows["note"]
        lines += ["", f"### {verdict} ({len(rows)})", "", markdown_table(shown)]
    return "\n".join(lines) + "\n"


def write_comparison(comparison: Comparison, out_dir) -> Path:
    """Write comparison.md (the report) and comparison.csv (the full table) to `out_dir`;
    returns the path of comparison.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    comparison.table.to_csv(out_dir / "comparison.csv", index=False)
    report = out_dir / "comparison.md"
    report.write_text(format_comparison(comparison))
    return report
