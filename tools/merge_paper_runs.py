"""Merge the rows of several runner output folders into one, for a report from runs that each
measured part of a sweep (e.g. a device call cut short by its time limit).

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
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reports.results import COLUMNS, KEY_COLUMNS, RESULTS_CSV, RESULTS_JSON, load_results, load_runs


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the merged results.csv and results.json")
    parser.add_argument("--source", type=Path, action="append", required=True, help="a runner output folder")
    parser.add_argument("--where", action="append", default=[], metavar="QUERY",
                        help="keep only the rows of the preceding --source that match (pandas query)")
    parser.add_argument("--drop", action="append", default=[], metavar="QUERY", help="remove merged rows that match")
    args = parser.parse_args()
    # pair each --where with the --source before it on the command line
    sources, argv = [], sys.argv[1:]
    for i, token in enumerate(argv):
        if token == "--source":
            sources.append([Path(argv[i + 1]), None])
        elif token == "--where":
            if not sources:
                parser.error("--where must follow a --source")
            sources[-1][1] = argv[i + 1]
    merged, runs = merge([tuple(s) for s in sources], args.drop)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs.append({"run_id": f"{now} merge", "command": shlex.join(["python", *sys.argv]), "finished": now})
    args.out.mkdir(parents=True, exist_ok=True)
    merged.to_csv(args.out / RESULTS_CSV, index=False, columns=list(COLUMNS))
    rows = json.loads(merged.to_json(orient="records"))
    (args.out / RESULTS_JSON).write_text(json.dumps({"runs": runs, "rows": rows}, indent=1))
    print(f"{len(merged)} rows from {len(sources)} sources, {len(runs)} runs -> {args.out}")


if __name__ == "__main__":
    main()
