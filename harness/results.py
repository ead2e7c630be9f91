"""Result rows: the schema, the append-writer, and loading/merging a results folder.

Long format, one measurement per row (docs/CONTRACTS.md). `results.csv` is appended to and
flushed row by row, so an interrupted sweep keeps what it measured; several runs (e.g. one
per provider, with --resume) may write into one folder and are merged on loading, a later
row for the same key replacing an earlier one (a failed measurement retried). `results.json`
holds the merged rows plus the metadata of every run that wrote into the folder
(command line, environment before and after, throttle warnings).
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from pathlib import Path

import pandas as pd

from reports.environment import ENV_COLUMNS

RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
STATUSES = ("ok", "unavailable", "unsupported", "oom", "wrong", "error")
# What identifies one measurement: --resume skips a key already measured with status 'ok'.
KEY_COLUMNS = ("provider", "setting", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "repeat")
MEASURE_COLUMNS = ("ms", "ms_p20", "ms_p80", "tflops", "tflops_p20", "tflops_p80", "peak_mem_mb", "rel_err")
COLUMNS = (
    "provider", "label", "setting", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "repeat",
    "status", "reason", *MEASURE_COLUMNS, "config", "interpreter", *ENV_COLUMNS,
)
_INT_COLUMNS = ("hdim", "seqlen", "batch", "heads", "repeat")
_BOOL_COLUMNS = ("causal", "interpreter")


def row_key(row) -> tuple[str, ...]:
    """The key of a row (a dict or a DataFrame row), as strings so that rows read back from
    the CSV and rows about to be measured compare equal."""
    return tuple(str(row[column]) for column in KEY_COLUMNS)


class ResultWriter:
    """Appends rows to a results CSV, writing the header to a new file and flushing each row."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != COLUMNS:
                raise ValueError(f"{self.path} has columns {header}, expected {list(COLUMNS)}: it was "
                                 "written by another version of the runner; use a new --out folder")
            with self.path.open("rb+") as f:  # a process killed mid-row left no newline: end that line
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            new_file = False
        else:
            new_file = True
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if new_file:
            self._writer.writeheader()
            self._file.flush()

    def write(self, row: dict) -> None:
        missing = set(COLUMNS) - set(row)
        extra = set(row) - set(COLUMNS)
        if missing or extra:
            raise ValueError(f"result row has missing columns {sorted(missing)} / unknown columns {sorted(extra)}")
        if row["status"] not in STATUSES:
            raise ValueError(f"row status must be one of {STATUSES}, got {row['status']!r}")
        self._writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _csv_path(path: Path) -> Path:
    path = Path(path)
    return path / RESULTS_CSV if path.is_dir() else path


def load_results(path: Path) -> pd.DataFrame:
    """Rows of a results CSV (or of the results.csv in a folder), typed, merged: for a key
    written more than once the last row wins. An absent file gives an empty frame."""
    csv_path = _csv_path(path)
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return pd.DataFrame(columns=list(COLUMNS))
    with csv_path.open(newline="") as f:
        reader = csv.reader(f)
        header = tuple(next(reader, ()))
        records = list(reader)
    if header != COLUMNS:
        raise ValueError(f"{csv_path} has columns {list(header)}, expected {list(COLUMNS)}")
    status = COLUMNS.index("status")
    complete = [r for r in records if len(r) == len(COLUMNS) and r[status] in STATUSES]
    if len(complete) < len(records):  # a line cut short by a killed process
        warnings.warn(f"{csv_path}: skipped {len(records) - len(complete)} incomplete row(s)", stacklevel=2)
    df = pd.DataFrame(complete, columns=list(COLUMNS))
    for column in _INT_COLUMNS:
        df[column] = df[column].astype(int)
    for column in MEASURE_COLUMNS:
        df[column] = df[column].replace("", "nan").astype(float)
    for column in _BOOL_COLUMNS:
        unknown = set(df[column]) - {"True", "False"}
        if unknown:
            raise ValueError(f"{csv_path}: column {column!r} must hold True/False, found {sorted(unknown)}")
        df[column] = df[column] == "True"
    return df.drop_duplicates(subset=list(KEY_COLUMNS), keep="last").reset_index(drop=True)


def completed_keys(df: pd.DataFrame) -> set[tuple[str, ...]]:
    """Keys measured with status 'ok' (what --resume skips)."""
    return {row_key(row) for _, row in df[df["status"] == "ok"].iterrows()}


def _json_safe(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _json_safe(value.item())
    return value


def load_runs(out_dir: Path) -> list[dict]:
    """Metadata of the runs recorded in out_dir/results.json (empty if there is none)."""
    path = Path(out_dir) / RESULTS_JSON
    return json.loads(path.read_text())["runs"] if path.exists() else []


def record_run(out_dir: Path, run: dict) -> Path:
    """Write out_dir/results.json: the merged rows of results.csv and the runs' metadata, with
    `run` added or replacing the run of the same 'run_id' (call at the start and the end of a
    run, so an interrupted run still leaves its command and starting environment)."""
    out_dir = Path(out_dir)
    runs = [r for r in load_runs(out_dir) if r.get("run_id") != run["run_id"]] + [run]
    rows = [{k: _json_safe(v) for k, v in row.items()} for row in load_results(out_dir).to_dict("records")]
    path = out_dir / RESULTS_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"runs": runs, "rows": rows}, indent=1, allow_nan=False, default=str))
    tmp.replace(path)
    return path
