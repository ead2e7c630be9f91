"""Performance regression tracking against a per-GPU baseline.

A baseline is a JSON file, `reports/<gpu>/regression/baseline.json`, made by `save_baseline` from
the result rows of a sweep (`python runner.py <sweep options> --save-baseline`). It holds, per
configuration (`KEY_COLUMNS`), the median TFLOPs/s over the repeats and the band the
measurements fell in, with the environment they were measured in. `compare_to_baseline`
sets the rows of a later sweep against it.

The band of a configuration is [lo, hi]: lo is the smallest, hi the largest of every
repeat's median, 20th and 80th percentile TFLOPs/s (`tflops`, `tflops_p20`, `tflops_p80`),
so it covers both the jitter inside one timing run and the drift between repeats.

The rule, with tolerance `tol` (default 5%):
* regression:  current_hi < baseline_lo * (1 - tol)   (even the current run's best timing is
  more than `tol` below the baseline's worst one);
* improvement: current_lo > baseline_hi * (1 + tol)   (the symmetric case);
* unchanged:   otherwise;
* failed:      in the baseline, tried by this run and not `ok` now (error, wrong, oom, ...: the
  note says which); it fails the check like a regression, since a broken kernel is the worst
  regression;
* missing:     in the baseline, not tried by this run;
* new:         measured `ok` in this run, absent from the baseline.

A suspected regression is re-measured once before it counts: the runner re-runs the keys of
`suspected_regressions(comparison)`, merges the new rows with `merge_remeasured` and
compares again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from reports.environment import ENV_COLUMNS, gpu_slug

SCHEMA_VERSION = 1
KEY_COLUMNS = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]
INT_KEYS = ("hdim", "seqlen", "batch", "heads")
ENTRY_VALUES = ("tflops", "tflops_lo", "tflops_hi", "repeats")
VERSION_FIELDS = ("driver", "cuda", "torch", "triton")  # a difference is a warning, not a refusal
VERDICTS = ("regression", "failed", "improvement", "missing", "new", "unchanged")  # report order
FAILING_VERDICTS = ("regression", "failed")
DEFAULT_TOLERANCE = 0.05
REPORTS_DIR = Path(__file__).resolve().parents[1] / "reports"
REGENERATE = "regenerate it on that GPU with `python runner.py <sweep options> --save-baseline`"


class BaselineError(Exception):
    """A baseline file that cannot be read: missing, empty, truncated, corrupted or of the
    wrong schema. The message names the file, what is wrong and how to regenerate it."""


class BaselineMismatch(Exception):
    """Results that must not be compared with this baseline (another GPU model, a dtype the
    baseline does not hold, numbers from Triton's interpreter)."""


@dataclass(frozen=True)
class Baseline:
    path: Path
    environment: dict
    entries: pd.DataFrame  # KEY_COLUMNS + tflops, tflops_lo, tflops_hi, repeats


@dataclass
class Comparison:
    """Outcome of `compare_to_baseline`. `table` has KEY_COLUMNS, baseline_tflops,
    baseline_lo, baseline_hi, baseline_spread, current_tflops, current_lo, current_hi,
    current_spread (spreads are (hi - lo) / median), ratio (current / baseline median),
    verdict and note."""

    table: pd.DataFrame
    tolerance: float
    baseline_path: Path
    baseline_environment: dict
    environment: dict
    warnings: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return bool(self.table["verdict"].isin(FAILING_VERDICTS).any())

    def counts(self) -> dict[str, int]:
        return {verdict: int((self.table["verdict"] == verdict).sum()) for verdict in VERDICTS}


def baseline_path(gpu: str, directory: Path = REPORTS_DIR) -> Path:
    """Conventional baseline location for a GPU model: reports/<gpu>/regression/baseline.json,
    <gpu> the model's slug without its vendor ('NVIDIA H200' -> reports/h200/...)."""
    slug = gpu_slug(gpu).removeprefix("nvidia-")
    return Path(directory) / slug / "regression" / "baseline.json"


# --------------------------------------------------------------------------------------
# Per-configuration summary of result rows
# --------------------------------------------------------------------------------------
def _as_bool(value) -> bool:
    if isinstance(value, str):
        if value.strip().lower() in ("true", "1", "yes"):
            return True
        if value.strip().lower() in ("false", "0", "no", ""):
            return False
        raise ValueError(f"causal must be a boolean, got {value!r}")
    return bool(value)


def _normal_keys(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` whose key columns have one type each (rows read back from CSV or
    JSON spell `causal` and the sizes in several ways)."""
    missing = [column for column in KEY_COLUMNS if column not in frame.columns]
    if missing:
        raise ValueError(f"result rows lack the key columns {missing}; they need all of {KEY_COLUMNS}")
    frame = frame.copy()
    frame["provider"] = frame["provider"].astype(str)
    frame["mode"] = frame["mode"].astype(str)
    frame["dtype"] = frame["dtype"].astype(str)
    frame["causal"] = frame["causal"].map(_as_bool).astype(bool)
    for column in INT_KEYS:
        frame[column] = frame[column].astype(int)
    return frame


def _ok_rows(results: pd.DataFrame) -> pd.DataFrame:
    if "status" not in results.columns or "tflops" not in results.columns:
        raise ValueError("result rows need `status` and `tflops` columns (see docs/CONTRACTS.md)")
    ok = results[(results["status"] == "ok") & results["tflops"].notna()]
    return _normal_keys(ok)


def _interpreted(rows: pd.DataFrame) -> bool:
    return "interpreter" in rows.columns and bool(rows["interpreter"].map(_as_bool).any())


def summarise(results: pd.DataFrame) -> pd.DataFrame:
    """Per configuration of the `ok` rows: median TFLOPs/s over repeats (`tflops`), the band
    [`tflops_lo`, `tflops_hi`] (see the module docstring) and the number of repeats."""
    ok = _ok_rows(results)
    band = ok.reindex(columns=["tflops", "tflops_p20", "tflops_p80"]).astype(float)
    ok = ok.assign(_lo=band.min(axis=1), _hi=band.max(axis=1))
    summary = ok.groupby(KEY_COLUMNS, sort=True).agg(
        tflops=("tflops", "median"),
        tflops_lo=("_lo", "min"),
        tflops_hi=("_hi", "max"),
        repeats=("tflops", "size"),
    )
    return summary.reset_index()


# --------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------
def save_baseline(results: pd.DataFrame, path, environment: dict) -> Path:
    """Write the baseline of `results` (their `ok` rows) measured in `environment` (gpu,
    driver, cuda, torch, triton, git_commit, timestamp) to `path` as sorted, indented JSON,
    one entry per configuration. Returns the path."""
    if not environment.get("gpu"):
        raise ValueError("environment must name the GPU (environment['gpu']) the results were measured on")
    ok = _ok_rows(results)
    if ok.empty:
        raise ValueError("results hold no `ok` measurement: nothing to save as a baseline")
    if _interpreted(ok):
        raise ValueError("results come from Triton's interpreter (interpreter=True): "
                         "they are not performance")
    if "gpu" in ok.columns and set(ok["gpu"].astype(str)) != {str(environment["gpu"])}:
        raise ValueError(f"results were measured on {sorted(set(ok['gpu'].astype(str)))}, "
                         f"not on environment['gpu'] = {environment['gpu']!r}")
    entries = []
    for record in summarise(ok).to_dict(orient="records"):
        entry = {key: record[key] for key in KEY_COLUMNS}
        entry.update(causal=bool(entry["causal"]), **{key: int(entry[key]) for key in INT_KEYS})
        entry.update({key: round(float(record[key]), 3) for key in ("tflops", "tflops_lo", "tflops_hi")})
        entry["repeats"] = int(record["repeats"])
        entries.append(entry)
    document = {
        "schema_version": SCHEMA_VERSION,
        "environment": {key: str(environment.get(key, "")) for key in ENV_COLUMNS},
        "entries": entries,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return path


def _decode(path: Path) -> dict:
    if not path.is_file():
        raise BaselineError(f"baseline {path}: no such file; {REGENERATE}")
    text = path.read_text()
    if not text.strip():
        raise BaselineError(f"baseline {path}: the file is empty; {REGENERATE}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        ends_early = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        what = "truncated: the JSON ends before it closes" if ends_early else "corrupted: not valid JSON"
        raise BaselineError(f"baseline {path}: {what} ({err.msg} at line {err.lineno}, column {err.colno}); "
                            f"{REGENERATE}") from None


def load_baseline(path) -> Baseline:
    """Read a baseline written by `save_baseline`; BaselineError when it cannot be used."""
    path = Path(path)
    document = _decode(path)

    def wrong(what: str) -> BaselineError:
        return BaselineError(f"baseline {path}: wrong schema: {what}; {REGENERATE}")

    if not isinstance(document, dict):
        raise wrong(f"the top level is a JSON {type(document).__name__}, expected an object with "
                    "schema_version, environment and entries")
    if document.get("schema_version") != SCHEMA_VERSION:
        raise wrong(f"schema_version is {document.get('schema_version')!r}, this code reads {SCHEMA_VERSION}")
    environment = document.get("environment")
    if not isinstance(environment, dict) or not environment.get("gpu"):
        raise wrong("`environment` must be an object naming the GPU (environment.gpu)")
    entries = document.get("entries")
    if not isinstance(entries, list) or not entries:
        raise wrong("`entries` must be a non-empty list of measurements")
    for index, entry in enumerate(entries):
        absent = [key for key in (*KEY_COLUMNS, *ENTRY_VALUES)
                  if not isinstance(entry, dict) or key not in entry]
        if absent:
            raise wrong(f"entry {index} lacks {absent}")
        numeric = (isinstance(entry[key], (int, float)) and math.isfinite(entry[key]) for key in ENTRY_VALUES)
        if not all(numeric):
            raise wrong(f"entry {index} has non-numeric values among {list(ENTRY_VALUES)}")
    try:
        frame = _normal_keys(pd.DataFrame(entries, columns=[*KEY_COLUMNS, *ENTRY_VALUES]))
    except (TypeError, ValueError) as err:
        raise wrong(f"an entry's key has the wrong type ({err})") from None
    return Baseline(path=path, environment=dict(environment), entries=frame)


# --------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------
def _check_comparable(results: pd.DataFrame, baseline: Baseline, environment: dict) -> list[str]:
    """Raise BaselineMismatch where a comparison would be meaningless; return the warnings
    (version differences) where it is meaningful but may not be about the code."""
    base_gpu = str(baseline.environment["gpu"])
    gpu = str(environment.get("gpu", ""))
    if gpu.strip().lower() != base_gpu.strip().lower():
        raise BaselineMismatch(
            f"baseline {baseline.path} was measured on {base_gpu!r}, this run is on {gpu!r}: timings of "
            f"different GPU models are not comparable; make a baseline on this GPU with "
            f"`python runner.py <sweep options> --save-baseline` "
            f"(it goes to {baseline_path(gpu or 'unknown')})")
    if _interpreted(results[results["status"] == "ok"]):
        raise BaselineMismatch("these results come from Triton's interpreter (interpreter=True): "
                               "they are not performance and cannot be compared with a baseline")
    dtypes = set(_normal_keys(results)["dtype"])
    known = set(baseline.entries["dtype"])
    if not dtypes <= known:
        raise BaselineMismatch(
            f"this sweep measures dtype {sorted(dtypes - known)} but baseline {baseline.path} holds only "
            f"{sorted(known)}: sweep with --dtype {' / '.join(sorted(known))}, "
            "or make a baseline for that dtype")
    warnings = []
    for key in VERSION_FIELDS:
        then, now = str(baseline.environment.get(key, "")), str(environment.get(key, ""))
        if then and now and then != now:
            warnings.append(f"{key} differs: baseline {then}, this run {now}; a difference may come from "
                            f"the {key} version rather than from the code")
    return warnings


def _failure_notes(results: pd.DataFrame) -> dict[tuple, str]:
    """Key -> 'status: reason' for configurations the run tried without an `ok` row."""
    failed = _normal_keys(results[results["status"] != "ok"])
    notes = {}
    for row in failed.itertuples(index=False):
        key = tuple(getattr(row, column) for column in KEY_COLUMNS)
        reason = getattr(row, "reason", "")
        notes[key] = f"now {row.status}" + (f": {reason}" if isinstance(reason, str) and reason else "")
    return notes


def _verdicts(table: pd.DataFrame, tolerance: float) -> pd.Series:
    in_base, in_run = table["baseline_tflops"].notna(), table["current_tflops"].notna()
    regression = table["current_hi"] < table["baseline_lo"] * (1.0 - tolerance)
    improvement = table["current_lo"] > table["baseline_hi"] * (1.0 + tolerance)
    verdict = pd.Series("unchanged", index=table.index)
    verdict[regression] = "regression"
    verdict[improvement] = "improvement"
    verdict[in_base & ~in_run] = "missing"
    verdict[~in_base & in_run] = "new"
    return verdict


def compare_to_baseline(results: pd.DataFrame, baseline: Baseline, environment: dict,
                        tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Compare a sweep's result rows with `baseline` by the rule of the module docstring.
    Raises BaselineMismatch for another GPU model, a dtype absent from the baseline or
    interpreter results; version differences (driver, CUDA, torch, Triton) become warnings."""
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be a fraction in [0, 1), e.g. 0.05 for 5%, got {tolerance}")
    warnings = _check_comparable(results, baseline, environment)
    base = baseline.entries.rename(columns={"tflops": "baseline_tflops", "tflops_lo": "baseline_lo",
                                            "tflops_hi": "baseline_hi", "repeats": "baseline_repeats"})
    current = summarise(results).rename(columns={"tflops": "current_tflops", "tflops_lo": "current_lo",
                                                 "tflops_hi": "current_hi", "repeats": "current_repeats"})
    table = base.merge(current, on=KEY_COLUMNS, how="outer")
    table["baseline_spread"] = (table["baseline_hi"] - table["baseline_lo"]) / table["baseline_tflops"]
    table["current_spread"] = (table["current_hi"] - table["current_lo"]) / table["current_tflops"]
    table["ratio"] = table["current_tflops"] / table["baseline_tflops"]
    table["verdict"] = _verdicts(table, tolerance)
    notes = _failure_notes(results)
    keys = list(table[KEY_COLUMNS].itertuples(index=False, name=None))
    tried_and_failed = pd.Series([key in notes for key in keys], index=table.index)
    table.loc[(table["verdict"] == "missing") & tried_and_failed, "verdict"] = "failed"
    table["note"] = [notes.get(key, "") if verdict == "failed" else ""
                     for key, verdict in zip(keys, table["verdict"])]
    if not table["verdict"].isin(["regression", "improvement", "unchanged"]).any():
        warnings.append("no configuration of this run is in the baseline: nothing was compared "
                        "(sweep with the options the baseline was saved with)")
    failed_now = int((table["note"] != "").sum())
    if failed_now:
        warnings.append(f"{failed_now} baseline configuration(s) did not measure `ok` in this run "
                        "(see the notes)")
    order = {verdict: rank for rank, verdict in enumerate(VERDICTS)}
    table = table.sort_values(by=["verdict", *KEY_COLUMNS],
                              key=lambda s: s.map(order) if s.name == "verdict" else s)
    columns = [*KEY_COLUMNS, "baseline_tflops", "baseline_lo", "baseline_hi", "baseline_spread",
               "current_tflops", "current_lo", "current_hi", "current_spread", "ratio", "verdict", "note"]
    return Comparison(table=table[columns].reset_index(drop=True), tolerance=tolerance,
                      baseline_path=baseline.path, baseline_environment=baseline.environment,
                      environment=dict(environment), warnings=warnings)


def suspected_regressions(comparison: Comparison) -> pd.DataFrame:
    """The configurations (KEY_COLUMNS) to re-measure once before a regression counts."""
    table = comparison.table
    return table.loc[table["verdict"] == "regression", KEY_COLUMNS].reset_index(drop=True)


def merge_remeasured(results: pd.DataFrame, remeasured: pd.DataFrame) -> pd.DataFrame:
    """`results` with every row of a configuration present in `remeasured` replaced by the
    re-measured rows (all of them: a re-measurement supersedes the first one, never averages)."""
    if remeasured.empty:
        return results.copy()
    keys = _normal_keys(remeasured)[KEY_COLUMNS].drop_duplicates()
    marked = _normal_keys(results).merge(keys, on=KEY_COLUMNS, how="left", indicator=True)
    kept = results[(marked["_merge"] == "left_only").to_numpy()]
    return pd.concat([kept, remeasured], ignore_index=True)
