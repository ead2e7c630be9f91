"""Design decisions' rows (reports/h200/decisions/*.csv): one measurement per row, `row` and
`column` naming the cell of the table docs/performance.md shows (reports/embed.py's
`decision_table`), with its unit, the tool and settings that measured it, and the commit."""

from __future__ import annotations

import csv
from pathlib import Path

from reports.environment import git_commit

COLUMNS = ("row", "column", "unit", "value", "tool", "git_commit")


class DecisionWriter:
    """Writes decision rows to `path` as they are measured (each row flushed, so a killed run
    keeps what it measured); `append` keeps an existing file's rows. `commit` defaults to
    reports.environment.git_commit()."""

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

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> DecisionWriter:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
