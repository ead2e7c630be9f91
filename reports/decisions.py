"""Design decisions' rows (reports/h200/decisions/*.csv): one measurement per row, `row` and
`column` naming the cell of the table docs/performance.md shows (reports/embed.py's
`decision_table`), with its unit, the tool and settings that measured it, and the commit."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

from harness.environment import git_commit

COLUMNS = ("row", "column", "unit", "value", "tool", "git_commit")


def status_tool(tool: str, status, reason, limit: int = 400) -> str:
    """The tool column of a cell that was not measured: the tool, then the row's status and its
    reason (whitespace collapsed), cut to `limit` characters."""
    return f"{tool}; {status}: {' '.join(str(reason or '').split())}"[:limit]


class DecisionWriter:
    """Writes decision rows to `path` as they are measured (each row flushed, so a killed run
    keeps what it measured); `append` keeps an existing file's rows. `commit` defaults to
    harness.environment.git_commit()."""

    def __init__(self, path: Path, tool: str, commit: str | None = None, append: bool = False):
        path = Path(path)
        new = not (append and path.exists() and path.stat().st_size > 0)
        self.tool, self.commit = tool, git_commit() if commit is None else commit
        self._file = path.open("w" if new else "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(COLUMNS)
            self._file.flush()

    def write(self, row: str, column: str, unit: str, value: float, tool: str | None = None) -> None:
        self._writer.writerow((row, column, unit, value, self.tool if tool is None else tool, self.commit))
        self._file.flush()

    def write_checks(self, checks: dict[str, tuple[bool, str]], width: int = 32) -> list[str]:
        """One 'check against float64' row per variant (its notes in the tool column) and a line
        printed for each; returns the names that passed, the ones an experiment goes on to time."""
        for name, (ok, notes) in checks.items():
            self.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                       tool=f"{self.tool}; {notes}"[:600] if notes else self.tool)
            print(f"{name:{width}s} {'ok' if ok else 'WRONG'}: {notes}", flush=True)
        return [name for name, (ok, _) in checks.items() if ok]

    def time_interleaved(self, variants: dict, cases: dict, select: Callable, time_one: Callable, repeats: int,
                         width: int = 32, unit: str = "ms") -> None:
        """`repeats` rounds; in each, per case (column -> case) each variant (row -> value) in turn:
        `select(value)`, then `time_one(case, value)`'s row (harness.features.measure's or
        harness.decode's dict: `ms` where it is timed and its status is ok) written in `unit`
        (ms or us) and printed with its status; a row without a time, or not ok, is NaN, its status
        and reason in the tool column."""
        scale = {"ms": 1.0, "us": 1e3}[unit]
        for _ in range(repeats):
            for column, case in cases.items():
                for name, value in variants.items():
                    select(value)
                    row = time_one(case, value)
                    timed = "ms" in row and row.get("status", "ok") == "ok"
                    value_out = row["ms"] * scale if timed else float("nan")
                    missing = status_tool(self.tool, row.get("status"), row.get("reason", ""), limit=600)
                    self.write(name, column, unit, value_out, tool=None if timed else missing)
                    print(f"{column:28s} {name:{width}s} {value_out:.3f} {unit} {row.get('status')} "
                          f"{row.get('reason', '')}", flush=True)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> DecisionWriter:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
