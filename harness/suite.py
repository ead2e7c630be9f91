"""The suites `runner.py --suite NAME` runs besides the paper sweep: each is a case list measured
by the registry's providers of its kind into long-format rows (one measurement per row, the
environment beside it) in one CSV of the results folder, through SuiteRows. Its report and its
bar are made from those rows alone, by the reports module of the same name (reports.suites)."""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.environment import capture_environment, throttle_warnings

NOTES_TXT = "notes.txt"


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    module: str  # the harness module holding its case list and measure_rows(args, out_dir)
    rows_csv: str  # the file its rows go to, in the results folder

    def measure_rows(self) -> Callable[[argparse.Namespace, Path], None]:
        return importlib.import_module(self.module).measure_rows


SUITES = {
    "features": Suite("features", "GQA, sliding windows, packed variable lengths, ALiBi and softcap against the "
                      "peers that have them (harness/features.py)", "harness.features", "features.csv"),
    "coverage": Suite("coverage", "the shapes a model meets (the paper sweep's head dims, off-grid lengths, queries "
                      "against more keys, GQA, varlen), forward and backward, against FA4, cuDNN and SDPA flash, "
                      "with the kernel that served each of ours (--kernel-times: ours' and FA4's time by kernel) "
                      "(harness/coverage.py)", "harness.coverage",
                      "coverage.csv"),
    "decode": Suite("decode", "one query token against a KV cache: split-KV over batch x cache length against the "
                    "decode peers (harness/decode.py)", "harness.decode", "decode.csv"),
    "host-overhead": Suite("host-overhead", "host against GPU time per call, ours and SDPA's backends, eager and "
                           "compiled (harness/host_overhead.py; --providers and --modes narrow it)",
                           "harness.host_overhead", "host_overhead.csv"),
    "train": Suite("train", "GPT-3 training with each attention provider: the paper's Table 1, the longest context "
                   "in a memory budget, loss curves (harness/train.py; --models, --contexts, --train-parts)",
                   "harness.train", "train.csv"),
}


def measure(name: str, args: argparse.Namespace, out_dir: Path) -> Path:
    """Suite `name`'s rows into out_dir (args.quick, args.repeats narrow it); returns their CSV."""
    suite = SUITES[name]
    suite.measure_rows()(args, Path(out_dir))
    return Path(out_dir) / suite.rows_csv


class SuiteRows:
    """One measuring run of a suite: its rows written to out_dir/csv_name (a new file, `columns`)
    as they are measured, each flushed, so that a killed run keeps them; the environment captured
    before (`env`, for the rows) and after; and out_dir/notes.txt at the end: the throttling seen
    between the two, and what the time budget (`budget_s` from the start) left unmeasured (a tool
    whose CSV shares its folder names its notes file `notes_name`)."""

    def __init__(self, out_dir: Path, csv_name: str, columns, budget_s: float = math.inf, notes_name: str = NOTES_TXT):
        self.path, self.notes_path = Path(out_dir) / csv_name, Path(out_dir) / notes_name
        self.columns, self.budget_s, self.skipped = tuple(columns), budget_s, []

    def __enter__(self) -> SuiteRows:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.env = capture_environment()
        self.start = time.monotonic()
        self._file = self.path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
        self._writer.writeheader()
        return self

    def write(self, row: dict) -> None:
        self._writer.writerow(row)
        self._file.flush()

    def out_of_time(self) -> bool:
        return time.monotonic() - self.start > self.budget_s

    def skip(self, what: str) -> None:
        """`what` (a case, a provider's call) was not measured: the budget ran out before it."""
        self.skipped.append(what)

    def __exit__(self, *exc) -> None:
        self._file.close()
        notes = throttle_warnings(self.env, capture_environment())
        if self.skipped:
            notes.append(f"not measured (the suite's {self.budget_s:.0f}-s budget ran out): " + ", ".join(self.skipped))
        self.notes_path.write_text("\n".join(notes) + ("\n" if notes else ""))
