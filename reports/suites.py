"""The report of each suite of harness.suite, made from the rows it measured into a results folder."""

from __future__ import annotations

from pathlib import Path

from reports import coverage, decode, features, host_overhead, train_report

REPORTS = {"features": features.write_features_report, "coverage": coverage.write_coverage_report,
           "decode": decode.write_decode_report,
           "host-overhead": host_overhead.write_host_overhead_report, "train": train_report.write_report}


def write_suite_report(name: str, out_dir: Path) -> Path:
    """Suite `name`'s report from the rows in out_dir; returns its path."""
    return REPORTS[name](Path(out_dir))
