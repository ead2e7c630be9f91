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
