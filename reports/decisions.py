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


# The lines a backward experiment prints as it measures (tools/experiments/exp_bwd_stages.py's
# compare_variants), and their parser: the rows of a run whose CSV did not come back with it are
# read back from its printed log.
NAME_WIDTH, COLUMN_WIDTH = 40, 28


def check_line(name: str, ok: bool, notes: str) -> str:
    return f"{name:{NAME_WIDTH}s} {'ok' if ok else 'WRONG'}  {notes}"


def timing_line(column: str, name: str, row: dict) -> str:
    """One timed cell: its column, variant, ms (NaN where not timed), TFLOPs/s, status and reason."""
    return (f"{column:{COLUMN_WIDTH}s} {name:{NAME_WIDTH}s} {row.get('ms', float('nan')):.3f} ms "
            f"{row.get('tflops', float('nan')):6.1f} TF/s {row.get('status')} {' '.join(str(row.get('reason', '')).split())}")


def rows_from_log(log: Path, out: Path, tool: str, commit: str) -> int:
    """Decision rows (`out`, a new CSV) from a log of check_line and timing_line lines, as the
    experiment's own writer would have written them (a cell not timed: NaN, its status and
    reason in the tool column); returns the number of rows."""
    rows = 0
    with DecisionWriter(out, tool, commit=commit) as writer:
        for line in Path(log).read_text().splitlines():
            name, rest = line[:NAME_WIDTH].strip(), line[NAME_WIDTH + 1:]
            if rest.startswith(("ok  ", "WRONG  ")):
                ok = rest.startswith("ok")
                notes = rest.split("  ", 1)[1]
                writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                             tool=tool if ok else status_tool(tool, "wrong", notes))
                rows += 1
                continue
            column, name = line[:COLUMN_WIDTH].strip(), line[COLUMN_WIDTH + 1:COLUMN_WIDTH + 1 + NAME_WIDTH].strip()
            fields = line[COLUMN_WIDTH + 2 + NAME_WIDTH:].split(" ", 2)
            if len(fields) < 2 or fields[1] != "ms":
                continue  # not a measurement (a warning, a traceback)
            value = float(fields[0])
            tail = fields[2] if len(fields) > 2 else ""
            if "TF/s" in tail:  # timing_line's form; older lines carry no TFLOPs/s
                tail = tail.split("TF/s", 1)[1].strip()
            status, _, reason = tail.partition(" ")
            writer.write(name, column, "ms", value, tool=tool if status == "ok" else status_tool(tool, status, reason))
            rows += 1
    return rows


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
