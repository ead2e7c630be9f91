"""Markdown tables for the generated reports."""

from __future__ import annotations

import pandas as pd


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub Markdown table of `frame`'s cells as they print (format numbers first)."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in frame.columns) + " |",
             "|" + "|".join("---" for _ in frame.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def ratio_text(ratio: float) -> str:
    """A speed ratio with the digits that matter: 1.23x, 0.48x, 0.0031x."""
    if ratio is None or pd.isna(ratio):
        return "-"
    if ratio >= 0.1:
        return f"{ratio:.2f}x"
    return f"{ratio:.2g}x"


def ratio_cell(numerator: float, denominator: float) -> str:
    """numerator / denominator as a table cell: 1.23x, or n/a where either is missing or zero."""
    if pd.isna(numerator) or pd.isna(denominator) or denominator == 0:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def summary_table(df, max_rows: int = 60) -> str:
    """Median TFLOPs/s of the ok rows by configuration x provider, when it is short enough."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return "no ok measurement"
    table = ok.pivot_table(index=["setting", "mode", "hdim", "causal", "seqlen"], columns="provider",
                           values="tflops", aggfunc="median")
    if len(table) > max_rows:
        return f"{len(table)} configurations: see report.md"
    return table.to_string(float_format=lambda v: f"{v:.4g}")




def run_environment(env) -> str:
    """Where a run's rows were measured, as the reports name it: GPU, torch, Triton and commit of
    a row (a dict or a pandas row; missing fields empty)."""
    return (f"{env.get('gpu', '')}, torch {env.get('torch', '')}, triton {env.get('triton', '')}, "
            f"commit {env.get('git_commit', '')}")
