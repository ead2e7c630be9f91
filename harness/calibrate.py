"""Calibrate the regression rule (harness.regression) from repeated runs.

    python -m harness.calibrate RUN_DIR RUN_DIR ... --out reports/h200/regression/calibration.csv
    python -m harness.calibrate --collect 6 --out reports/h200/regression/calibration.csv   # on the GPU

Each RUN_DIR is a runner output folder of the same sweep (the one CI compares, e.g.
`--quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3`), measured with no code change.
From them:

* sigma, the standard deviation of d = L_run2 - L_run1 between two runs (L: a configuration's
  median log-ratio to the reference, harness.regression), pooled over configurations:
  sigma = sqrt(2) x the pooled standard deviation of L across the runs, for 1..R repeats
  (the first r repeats of each run);
* the rule's false-positive rate: every ordered pair of runs (baseline, current) and every
  configuration is one trial, with sigma estimated from the other runs (so a run is never
  judged by a sigma it helped estimate); the share flagged as a regression;
* its detection rate for slowdowns s (default 5%, 10%, 20%): the same trials with the current
  run's TFLOPs/s divided by 1 + s (a known slowdown, on real noise);
* for providers named `<provider>-slowed-<percent>` (harness/slowdown.py, through
  --provider-file): the detection rate of that measured slowdown against `<provider>` of
  the other runs (kind 'injected').

calibration.csv has one row per (kind, slowdown, repeats): kind (none | scaled | injected),
slowdown, repeats, runs, trials, flagged, flagged_rate, sigma, threshold (as a slowdown
fraction), false_positive_target, tolerance. `runner.py --compare` reads the `sigma` of the
slowdown-0 rows from the calibration.csv next to the baseline.

--collect N first measures N runs of CI's sweep (COLLECT_SWEEP: our kernel, the reference and
fa2-slowed-10) into runs/run1..N next to --out, stopping early (after 3 runs at least) when
--max-seconds have passed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from statistics import NormalDist

import pandas as pd

from harness.io import atomic_write_text
from harness.regression import (
    DEFAULT_FALSE_POSITIVE_RATE,
    DEFAULT_TOLERANCE,
    KEY_COLUMNS,
    MIN_SIGMA,
    REFERENCE,
    summarise,
)
from harness.results import load_results

SLOWED = re.compile(r"^(?P<base>.+)-slowed-(?P<percent>\d+(\.\d+)?)$")
DEFAULT_SLOWDOWNS = (0.05, 0.10, 0.20)
COLLECT_SWEEP = ("--quick --providers fa2,sdpa-flash,fa2-slowed-10 --provider-file harness/slowdown.py "
                 "--dtype bf16 --repeats 3")
REPO_ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["kind", "slowdown", "repeats", "runs", "trials", "flagged", "flagged_rate", "sigma", "threshold",
           "false_positive_target", "tolerance"]


def _log_ratios(rows: pd.DataFrame, repeats: int, reference: str) -> tuple[pd.Series, pd.Series]:
    """(plain, injected) median log-ratios by KEY_COLUMNS; injected providers renamed to their
    base provider, their slowdown in the series' attrs."""
    summary = summarise(rows, reference, repeats=repeats).dropna(subset=["log_ratio"])
    summary = summary[summary["repeats"] >= repeats]
    slowed = summary["provider"].str.match(SLOWED)
    plain = summary[~slowed].set_index(KEY_COLUMNS)["log_ratio"]
    injected = summary[slowed].copy()
    injected["slowdown"] = [float(SLOWED.match(p)["percent"]) / 100 for p in injected["provider"]]
    injected["provider"] = [SLOWED.match(p)["base"] for p in injected["provider"]]
    return plain, injected.set_index(KEY_COLUMNS)[["log_ratio", "slowdown"]]


def pooled_sigma(table: pd.DataFrame) -> float:
    """sigma of d from a (configurations x runs) table of L: sqrt(2) x pooled sd over runs."""
    variances = table.var(axis=1, ddof=1).dropna()
    if variances.empty:
        return math.nan
    return math.sqrt(2.0 * float(variances.mean()))


def calibrate(runs: list[pd.DataFrame], repeats: list[int] | None = None, slowdowns=DEFAULT_SLOWDOWNS,
              false_positive_rate: float = DEFAULT_FALSE_POSITIVE_RATE, tolerance: float = DEFAULT_TOLERANCE,
              reference: str = REFERENCE) -> pd.DataFrame:
    """The rows of calibration.csv (see the module docstring) from the result rows of >= 3 runs."""
    if len(runs) < 3:
        raise ValueError(f"calibration needs at least 3 runs of the same sweep, got {len(runs)}")
    most = min(int(pd.to_numeric(r.loc[r["status"] == "ok", "repeat"]).max()) + 1 for r in runs if len(r))
    repeats = repeats or list(range(1, most + 1))
    z = NormalDist().inv_cdf(1.0 - false_positive_rate)
    floor = -math.log(1.0 - tolerance)
    out = []
    for r in repeats:
        if r > most:
            raise ValueError(f"repeats {r}: the runs hold at most {most} repeats per configuration")
        logs = [_log_ratios(run, r, reference) for run in runs]
        table = pd.concat([plain for plain, _ in logs], axis=1, join="inner")
        table.columns = range(len(runs))
        if table.empty:
            raise ValueError("the runs share no configuration with a ratio to the reference: are they runs of "
                             f"one sweep that includes {reference}?")
        sigma_all = max(pooled_sigma(table), MIN_SIGMA)
        counts: dict[tuple, list[int]] = {}
        for i, j in itertools.permutations(range(len(runs)), 2):
            others = [c for c in table.columns if c not in (i, j)]
            sigma = pooled_sigma(table[others]) if len(others) >= 2 else sigma_all
            threshold = max(z * max(sigma, MIN_SIGMA), floor)
            d = table[j] - table[i]
            for s in (0.0, *slowdowns):
                flagged = d - math.log1p(s) < -threshold
                tally = counts.setdefault(("none" if s == 0 else "scaled", s), [0, 0])
                tally[0] += int(flagged.sum())
                tally[1] += len(d)
            injected = logs[j][1]
            if not injected.empty:
                shared = injected.index.intersection(table.index)
                for s, group in injected.loc[shared].groupby("slowdown"):
                    flagged = group["log_ratio"] - table.loc[group.index, i] < -threshold
                    tally = counts.setdefault(("injected", float(s)), [0, 0])
                    tally[0] += int(flagged.sum())
                    tally[1] += len(group)
        threshold_all = -math.expm1(-max(z * sigma_all, floor))  # as a slowdown
        for (kind, s), (flagged, trials) in counts.items():
            out.append({"kind": kind, "slowdown": s, "repeats": r, "runs": len(runs), "trials": trials,
                        "flagged": flagged, "flagged_rate": flagged / trials if trials else math.nan,
                        "sigma": sigma_all, "threshold": threshold_all,
                        "false_positive_target": false_positive_rate, "tolerance": tolerance})
    order = {"none": 0, "scaled": 1, "injected": 2}
    frame = pd.DataFrame(out, columns=COLUMNS)
    return frame.sort_values(["repeats", "kind", "slowdown"], key=lambda s: s.map(order) if s.name == "kind" else s,
                             ignore_index=True)


def collect(count: int, folder: Path, sweep: str, max_seconds: float) -> list[Path]:
    """Run `runner.py <sweep>` `count` times into folder/run1..; returns the folders measured."""
    from tqdm import tqdm

    start, done = time.monotonic(), []
    for index in tqdm(range(1, count + 1), desc="calibration runs", unit="run"):
        if len(done) >= 3 and time.monotonic() - start > max_seconds:
            tqdm.write(f"--max-seconds {max_seconds:g} reached after {len(done)} runs")
            break
        out = folder / f"run{index}"
        command = [sys.executable, str(REPO_ROOT / "runner.py"), *shlex.split(sweep), "--out", str(out)]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        (folder / f"run{index}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise SystemExit(f"calibration run {index} failed (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout)[-2000:]}")
        done.append(out)
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.calibrate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="runner output folders of one sweep (>= 3)")
    parser.add_argument("--collect", type=int, metavar="N",
                        help="first measure N runs of --sweep into runs/ next to --out (needs a GPU)")
    parser.add_argument("--sweep", default=COLLECT_SWEEP, help="runner arguments of each collected run "
                        "(default: %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=math.inf,
                        help="with --collect: start no run after this many seconds, once 3 are done")
    parser.add_argument("--out", type=Path, required=True, help="the calibration.csv to write")
    parser.add_argument("--false-positive-rate", type=float, default=DEFAULT_FALSE_POSITIVE_RATE,
                        help="per-configuration false-positive target of the rule (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="smallest slowdown the rule reports, as a fraction (default: %(default)s)")
    parser.add_argument("--slowdowns", default=",".join(str(s) for s in DEFAULT_SLOWDOWNS),
                        help="known slowdowns applied to the runs' TFLOPs/s, as fractions (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.collect is not None:
        if args.collect < 3:
            parser.error(f"--collect needs at least 3 runs, got {args.collect}")
        args.runs = [*args.runs, *collect(args.collect, args.out.parent / "runs", args.sweep, args.max_seconds)]
    if len(args.runs) < 3:
        parser.error(f"runs: give at least 3 run folders (or --collect N), got {len(args.runs)}")
    missing = [str(run) for run in args.runs if not (run / "results.csv").is_file()]
    if missing:
        parser.error(f"runs: no results.csv in {', '.join(missing)}")
    try:
        slowdowns = tuple(float(s) for s in args.slowdowns.split(","))
    except ValueError:
        parser.error(f"--slowdowns must be fractions separated by commas, got {args.slowdowns!r}")
    if not all(0 < s < 1 for s in slowdowns):
        parser.error(f"--slowdowns must be fractions in (0, 1), got {args.slowdowns!r}")
    try:
        frame = calibrate([load_results(run) for run in args.runs], slowdowns=slowdowns,
                          false_positive_rate=args.false_positive_rate, tolerance=args.tolerance)
    except ValueError as err:
        print(f"calibration: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, frame.to_csv(index=False, float_format="%.6g"))
    print(frame.to_string(index=False))
    print(f"calibration: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
