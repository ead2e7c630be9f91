"""Merge the rows of several runner output folders into one, for a report from runs that each
measured part of a sweep (e.g. a GPU job cut short by its time limit).

Sources are read in order and a later row replaces an earlier one with the same key
(provider, setting, mode, causal, hdim, seqlen, batch, heads, dtype, repeat); `--where` keeps
only the rows of the source before it that match a pandas query, and `--drop` removes matching
rows from the merged set. Every source's runs (commands, environments) go into the merged
results.json, and each row keeps its own git_commit and timestamp. Rebuild the report after:
`python runner.py --suite paper --report-only --out OUT`.

    python tools/merge_paper_runs.py --out merged --source run_a --source run_b --where "mode == 'fwd'"
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.results import (
    COLUMNS,
    KEY_COLUMNS,
    RESULTS_CSV,
    RESULTS_JSON,
    load_results,
    load_runs,
    record_run,
)


def merge(sources: list[tuple[Path, str | None]], drop: list[str]) -> tuple[pd.DataFrame, list[dict]]:
    """Rows of `sources` (folder, optional query), later ones replacing earlier ones by key,
    minus rows matching any `drop` query; and the runs of every source."""
    frames, runs = [], []
    for folder, where in sources:
        rows = load_results(folder)
        if rows.empty:
            raise ValueError(f"{folder}: no results.csv rows")
        frames.append(rows.query(where) if where else rows)
        runs += [run for run in load_runs(folder) if run["run_id"] not in {r["run_id"] for r in runs}]
    merged = pd.concat(frames, ignore_index=True)
    key = merged[list(KEY_COLUMNS)].astype(str)
    merged = merged[~key.duplicated(keep="last")]
    for query in drop:
        merged = merged.drop(merged.query(query).index)
    return merged.reset_index(drop=True), runs


class _Source(argparse.Action):
    """--source DIR: a new source, with no filter yet."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.sources.append([Path(value), None])


class _Where(argparse.Action):
    """--where QUERY: the filter of the --source just before it (one per source)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if not namespace.sources:
            parser.error("--where must follow a --source")
        if namespace.sources[-1][1] is not None:
            parser.error(f"{namespace.sources[-1][0]}: one --where per --source")
        namespace.sources[-1][1] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for the merged results.csv and results.json")
    parser.add_argument("--source", action=_Source, dest="sources", default=[], metavar="DIR",
                        help="a runner output folder (repeat; later sources win)")
    parser.add_argument("--where", action=_Where, dest="sources", metavar="QUERY",
                        help="keep only the rows of the preceding --source that match (pandas query)")
    parser.add_argument("--drop", action="append", default=[], metavar="QUERY",
                        help="remove merged rows that match (pandas query)")
    args = parser.parse_args()
    if not args.sources:
        parser.error("give at least one --source")
    merged, runs = merge([tuple(source) for source in args.sources], args.drop)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs.append({"run_id": f"{now} merge", "command": shlex.join(["python", *sys.argv]), "finished": now})
    args.out.mkdir(parents=True, exist_ok=True)
    merged.to_csv(args.out / RESULTS_CSV, index=False, columns=list(COLUMNS))
    (args.out / RESULTS_JSON).unlink(missing_ok=True)  # the merged runs replace any recorded there
    for run in runs:
        record_run(args.out, run)  # the runner's own writer: strict JSON, rows from results.csv
    print(f"{len(merged)} rows from {len(args.sources)} sources, {len(runs)} runs -> {args.out}")


if __name__ == "__main__":
    main()
