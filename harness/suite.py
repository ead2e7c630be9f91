"""The suites `runner.py --suite NAME` runs besides the paper sweep: each is a case list measured
into long-format rows (one measurement per row, the environment beside it) in one CSV of the
results folder. Its report and its bar are made from those rows alone, by the reports module
of the same name (reports.suites)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


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
    "decode": Suite("decode", "one query token against a KV cache: split-KV over batch x cache length against the "
                    "decode peers (harness/decode.py)", "harness.decode", "decode.csv"),
    "host-overhead": Suite("host-overhead", "host against GPU time per call, ours and SDPA's backends, eager and "
                           "compiled (harness/host_overhead.py; --providers and --modes narrow it)",
                           "harness.host_overhead", "host_overhead.csv"),
}


def measure(name: str, args: argparse.Namespace, out_dir: Path) -> Path:
    """Suite `name`'s rows into out_dir (args.quick, args.repeats narrow it); returns their CSV."""
    suite = SUITES[name]
    suite.measure_rows()(args, Path(out_dir))
    return Path(out_dir) / suite.rows_csv
