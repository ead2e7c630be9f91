"""Result rows: the schema, the append-writer, and loading/merging a results folder.

Long format, one measurement per row (docs/architecture.md, "Data flow"). `results.csv` is appended to and
flushed row by row, so an interrupted sweep keeps what it measured; several runs (e.g. one
per provider, with --resume) may write into one folder and are merged on loading, a later
row for the same key replacing an earlier one (a failed measurement retried). `results.json`
holds the merged rows plus the metadata of every run that wrote into the folder
(command line, environment before and after, throttle warnings).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import warnings
from pathlib import Path

import pandas as pd

from harness.environment import ENV_COLUMNS, PEER_VERSION_COLUMNS
from harness.io import atomic_write_text

RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
STATUSES = ("ok", "unavailable", "unsupported", "oom", "wrong", "error", "timeout")
# What identifies one measurement: --resume skips a key already measured with status 'ok' (and,
# unless --retry-timeouts, every repeat of a configuration that timed out).
KEY_COLUMNS = ("provider", "setting", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "repeat")
MEASURE_COLUMNS = ("ms", "ms_p20", "ms_p80", "tflops", "tflops_p20", "tflops_p80", "peak_mem_mb", "rel_err")
COLUMNS_BEFORE_CLOCK = (
    "provider", "label", "setting", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "repeat",
    "status", "reason", *MEASURE_COLUMNS, "check_shape", "config", "interpreter", *ENV_COLUMNS,
    *PEER_VERSION_COLUMNS,  # the optional peers' package versions in the run's environment ('' if absent)
)
# and last the mean SM clock while the row was timed (harness.environment.ClockSampler; empty
# where NVML read none: on a CPU, or a row that did not measure)
COLUMNS = (*COLUMNS_BEFORE_CLOCK, "sm_clock_mhz")
# the column sets of earlier results.csv files: before the rows carried the SM clock, before they
# carried the peers' versions, and before the accuracy check recorded the shape it checked; read
# with those columns empty
PREVIOUS_COLUMNS = tuple(column for column in COLUMNS_BEFORE_CLOCK if column not in PEER_VERSION_COLUMNS)
OLDER_HEADERS = (COLUMNS_BEFORE_CLOCK, PREVIOUS_COLUMNS,
                 tuple(column for column in PREVIOUS_COLUMNS if column != "check_shape"))
_FLOAT_COLUMNS = (*MEASURE_COLUMNS, "sm_clock_mhz")
_INT_COLUMNS = ("hdim", "seqlen", "batch", "heads", "repeat")
_BOOL_COLUMNS = ("causal", "interpreter")


RECOVER = ("fix or delete that line (a row is one line; the sweep measures a deleted row again with "
           "--resume), or move results.csv away and start a new --out folder")


class RowFileError(ValueError):
    """A results CSV that cannot be read or written; the message names the file, the line (and
    the column) and how to recover."""


def row_key(row) -> tuple[str, ...]:
    """The key of a row (a dict or a DataFrame row), as strings so that rows read back from
    the CSV and rows about to be measured compare equal."""
    return tuple(str(row[column]) for column in KEY_COLUMNS)


def config_key(row) -> tuple[str, ...]:
    """row_key without the repeat: one (provider, configuration)."""
    return tuple(str(row[column]) for column in KEY_COLUMNS if column != "repeat")


def _clean(value):
    """A CSV cell: NaN as '', text on one line (a row is one physical line, so a row cut by a
    killed process can only ever be the last line)."""
    if isinstance(value, float) and math.isnan(value):
        return ""
    if isinstance(value, str):
        return " ".join(value.splitlines())
    return value


_warned: set[tuple] = set()


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class ResultWriter:
    """Appends rows to a results CSV, writing the header to a new file; each row is one write(2)
    of one whole line (UTF-8), so it is on disk as soon as `write` returns and a failed write
    (a full disk) leaves at most an incomplete last line. An existing file must have this
    version's header or an earlier one (OLDER_HEADERS: the file is then rewritten with this
    version's columns, the new ones empty in its rows); a last line without its newline (a
    process killed mid-row) is cut off before appending, with a warning. An OSError (disk
    full, read-only file) is raised with the file's name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new_file = True
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                first = f.readline()
            if not first.endswith(b"\n"):  # only a header, cut by a killed process: start the file anew
                self.path.write_bytes(b"")
            else:
                header = tuple(next(csv.reader([_decode_line(self.path, 1, first, ())]), []))
                if header in OLDER_HEADERS:
                    self._drop_incomplete_last_line()
                    self._upgrade(header)
                    new_file = False
                elif header != COLUMNS:
                    raise RowFileError(f"{self.path}, line 1: columns {list(header)}, expected {list(COLUMNS)}: it "
                                       "was written by another version of the runner; use a new --out folder")
                else:
                    self._drop_incomplete_last_line()
                    new_file = False
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (opening it to append rows)", str(self.path)) from None
        if new_file:
            header = io.StringIO(newline="")
            csv.DictWriter(header, fieldnames=COLUMNS).writeheader()
            self._append(header.getvalue())

    def _append(self, line: str) -> None:
        data = line.encode()
        try:
            while data:  # write(2) may take part of it
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (appending a row)", str(self.path)) from None

    def _upgrade(self, header: tuple[str, ...]) -> None:
        """Rewrite the file with this version's columns (those it lacks left empty), in the line
        endings of the rows appended after (csv's default). Broken lines, which load_results
        skips, are dropped from the file (and said so)."""
        _, records, _, broken = _parse_lines(self.path)
        lines = io.StringIO(newline="")
        writer = csv.DictWriter(lines, fieldnames=COLUMNS)
        writer.writeheader()
        for fields in records:
            writer.writerow(dict(zip(header, fields, strict=True)))
        atomic_write_text(self.path, lines.getvalue())  # a killed process leaves the old file or the new one
        _warn_once(("upgraded", str(self.path)),
                   f"{self.path}: rewritten with this version's columns ({', '.join(sorted(set(COLUMNS) - set(header)))} "
                   f"empty in its {len(records)} earlier rows{f'; {broken} broken rows dropped' if broken else ''})")

    def _drop_incomplete_last_line(self) -> None:
        data = self.path.read_bytes()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1  # the header always ends with a newline
        with self.path.open("rb+") as f:
            f.truncate(keep)
        _warn_once(("cut", str(self.path), len(data)),
                   f"{self.path}: removed an incomplete last row ({len(data) - keep} bytes, cut by a killed "
                   "process); it is measured again")

    def write(self, row: dict) -> None:
        missing = set(COLUMNS) - set(row)
        extra = set(row) - set(COLUMNS)
        if missing or extra:
            raise ValueError(f"result row has missing columns {sorted(missing)} / unknown columns {sorted(extra)}")
        if row["status"] not in STATUSES:
            raise ValueError(f"row status must be one of {STATUSES}, got {row['status']!r}")
        line = io.StringIO(newline="")
        csv.DictWriter(line, fieldnames=COLUMNS).writerow({k: _clean(v) for k, v in row.items()})
        self._append(line.getvalue())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _csv_path(path: Path) -> Path:
    path = Path(path)
    return path / RESULTS_CSV if path.is_dir() else path


def _decode_line(csv_path: Path, number: int, data: bytes, header: tuple) -> str:
    """Line `number` of the file as text; RowFileError naming the line (and its column of
    `header`) when it is not UTF-8."""
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        fields = next(csv.reader([data.decode(errors="replace")]), [])
        column = next((index for index, field in enumerate(fields) if "\ufffd" in field), len(header))
        where = f", column {header[column]!r}" if column < len(header) else ""
        raise RowFileError(f"{csv_path}, line {number}{where}: not UTF-8 text (byte 0x{data[err.start]:02x}, the line's "
                           f"byte {err.start + 1}); {RECOVER}") from None


def _parse_lines(csv_path: Path) -> tuple[tuple, list[list[str]], list[int], int]:
    """(header, complete records, their line numbers, number of broken lines). Each physical
    line is parsed on its own, so a line cut inside a quoted field cannot swallow the lines
    after it. A whole line that is not UTF-8 is an error (RowFileError); the last line, when a
    killed process cut it (no newline), may end inside a character and is only broken."""
    raw = csv_path.read_bytes().split(b"\n")
    complete = len(raw) - 1  # the lines that end with a newline
    header = tuple(next(csv.reader([_decode_line(csv_path, 1, raw[0], ())]), ()))
    lines = [_decode_line(csv_path, number, line, header) if number <= complete else line.decode(errors="replace")
             for number, line in enumerate(raw, start=1)]
    width = len(header)
    status = header.index("status") if "status" in header else -1
    records, numbers, broken = [], [], 0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            fields = next(csv.reader([line.removesuffix("\r")], strict=True))
        except (csv.Error, StopIteration):
            fields = []
        if len(fields) == width and status >= 0 and fields[status] in STATUSES:
            records.append(fields)
            numbers.append(number)
        else:
            broken += 1
    return header, records, numbers, broken


def _typed(csv_path: Path, df: pd.DataFrame, numbers: list[int]) -> pd.DataFrame:
    """df with its int, float and bool columns typed; RowFileError naming the file, the line and
    the column of the first cell that is not of its column's type."""

    def refuse(column: str, bad: pd.Series, expected: str):
        index = int(bad.to_numpy().nonzero()[0][0])
        raise RowFileError(f"{csv_path}, line {numbers[index]}, column {column!r}: {df[column].iloc[index]!r} is not "
                           f"{expected}; {RECOVER}")

    for column in _INT_COLUMNS:
        bad = ~df[column].str.fullmatch(r"-?\d+")
        if bad.any():
            refuse(column, bad, "an integer")
        df[column] = df[column].astype(int)
    for column in _FLOAT_COLUMNS:
        values = pd.to_numeric(df[column].replace("", "nan"), errors="coerce")
        bad = values.isna() & ~df[column].str.lower().isin(("", "nan"))
        if bad.any():
            refuse(column, bad, "a number (or empty)")
        df[column] = values.astype(float)
    for column in _BOOL_COLUMNS:
        bad = ~df[column].isin(("True", "False"))
        if bad.any():
            refuse(column, bad, "True or False")
        df[column] = df[column] == "True"
    return df


def load_results(path: Path) -> pd.DataFrame:
    """Rows of a results CSV (or of the results.csv in a folder), typed, merged: for a key
    written more than once the last row wins. An absent file gives an empty frame; a broken
    line (a row cut by a killed process) is skipped with one warning per file state. Files
    of an earlier column set (OLDER_HEADERS) are read with the columns they lack empty. A line
    that is not UTF-8, or a cell not of its column's type, is a RowFileError naming the file,
    the line and the column."""
    csv_path = _csv_path(path)
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return pd.DataFrame(columns=list(COLUMNS))
    header, records, numbers, broken = _parse_lines(csv_path)
    if header != COLUMNS and header not in OLDER_HEADERS:
        raise RowFileError(f"{csv_path}, line 1: columns {list(header)}, expected {list(COLUMNS)}")
    if broken:
        stat = csv_path.stat()
        _warn_once(("broken", str(csv_path), stat.st_size, stat.st_mtime_ns),
                   f"{csv_path}: skipped {broken} incomplete row(s) (cut by a killed process)")
    df = pd.DataFrame(records, columns=list(header), dtype=str).reindex(columns=list(COLUMNS), fill_value="")
    df = _typed(csv_path, df, numbers)
    return df.drop_duplicates(subset=list(KEY_COLUMNS), keep="last").reset_index(drop=True)


def completed_keys(df: pd.DataFrame) -> set[tuple[str, ...]]:
    """Keys measured with status 'ok' (what --resume skips)."""
    return {row_key(row) for _, row in df[df["status"] == "ok"].iterrows()}


def timed_out_configs(df: pd.DataFrame) -> set[tuple[str, ...]]:
    """config_key of every (provider, configuration) whose last row of some repeat is a
    'timeout' (what --resume skips unless --retry-timeouts: it would hang again)."""
    return {config_key(row) for _, row in df[df["status"] == "timeout"].iterrows()}


def recorded_outcomes(df: pd.DataFrame) -> dict[tuple[str, ...], tuple[str, str]]:
    """Key -> (status, reason) of the last row of every key (a --resume that finds the same
    failure again does not append it again)."""
    return {row_key(row): (row["status"], row["reason"]) for _, row in df.iterrows()}


def _json_safe(value):
    """JSON has no NaN or infinity: they become null (the CSV keeps 'inf')."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def load_runs(out_dir: Path) -> list[dict]:
    """Metadata of the runs recorded in out_dir/results.json (empty if there is none). An
    unreadable file (cut short, not JSON) gives a warning and no runs: the rows themselves
    live in results.csv."""
    path = Path(out_dir) / RESULTS_JSON
    if not path.exists():
        return []
    try:
        document = json.loads(path.read_text())
        runs = document["runs"]
        if not isinstance(runs, list):
            raise TypeError("'runs' is not a list")
    except (ValueError, KeyError, TypeError) as err:
        _warn_once(("json", str(path), path.stat().st_size),
                   f"{path} is unreadable ({type(err).__name__}: {err}): the earlier runs' metadata is lost; "
                   "the rows are in results.csv and results.json is written anew")
        return []
    return runs


def record_run(out_dir: Path, run: dict) -> Path:
    """Write out_dir/results.json atomically: the merged rows of results.csv and the runs'
    metadata, with `run` added or replacing the run of the same 'run_id' (call at the start
    and the end of a run, so an interrupted run still leaves its command and starting
    environment)."""
    out_dir = Path(out_dir)
    runs = [r for r in load_runs(out_dir) if r.get("run_id") != run["run_id"]] + [run]
    rows = [{k: _json_safe(v) for k, v in row.items()} for row in load_results(out_dir).to_dict("records")]
    runs = json.loads(json.dumps(runs, default=str), parse_constant=lambda _: None)
    text = json.dumps({"runs": runs, "rows": rows}, indent=1, allow_nan=False, default=str)
    return atomic_write_text(out_dir / RESULTS_JSON, text)
