"""Performance regression tracking against a per-GPU baseline, by a rule with a stated
false-positive rate.

What is compared: each configuration's speed relative to a reference provider measured in
the same run (REFERENCE, the official FA2 kernel through SDPA, is always there). A machine
that is slower today (clocks, temperature, a neighbour) slows both kernels and the ratio
cancels it; a change in our code moves only our side. Per configuration and run,
L = median over repeats of log(tflops / reference tflops) (each repeat paired with the
reference's repeat of the same index), and the change is d = L_now - L_baseline.

The rule: with sigma the standard deviation of d between two runs without a code change,
a configuration is a regression when d < -threshold and an improvement when d > threshold,
threshold = max(z * sigma, -log(1 - tolerance)), z the (1 - false_positive_rate) quantile of
the normal distribution. If d is normal, an unchanged configuration is flagged with
probability at most `false_positive_rate` (one-sided), and `tolerance` is the smallest
slowdown worth reporting. sigma comes from calibration (harness.calibrate: repeated runs
without a code change, `calibration.csv` next to the baseline, rows with slowdown 0 for the
run's number of repeats); without a calibration it is estimated from the spread of the
repeats inside the two runs (which misses run-to-run drift: the comparison says so), never
below MIN_SIGMA.

Verdicts: regression, improvement, unchanged; failed (in the baseline, tried now and not
`ok`, or its reference not `ok`: a broken kernel is the worst regression); missing (in the
baseline, not tried now, or a peer `unavailable` here: its package is not installed); new (measured now, not in the baseline). Nothing compared is an
error for the caller (exit code 2), never a pass.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pandas as pd

from harness.environment import ENV_COLUMNS, gpu_slug
from harness.io import atomic_write_text

SCHEMA_VERSION = 2
REFERENCE = "sdpa-flash"
KEY_COLUMNS = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]
CONFIG_COLUMNS = KEY_COLUMNS[1:]  # a configuration without its provider
INT_KEYS = ("hdim", "seqlen", "batch", "heads")
VERSION_FIELDS = ("driver", "cuda", "torch", "triton")  # a difference is a warning, not a refusal
VERDICTS = ("regression", "failed", "improvement", "missing", "new", "unchanged")  # report order
FAILING_VERDICTS = ("regression", "failed")
COMPARED_VERDICTS = ("regression", "improvement", "unchanged")
DEFAULT_TOLERANCE = 0.05
DEFAULT_FALSE_POSITIVE_RATE = 0.01
MIN_SIGMA = 0.01  # no timing is repeatable to better than 1% from run to run
CALIBRATION_CSV = "calibration.csv"
REPORTS_DIR = Path(__file__).resolve().parents[1] / "reports"
REGENERATE = "regenerate it on that GPU with `python runner.py --reproduce baseline`"


class BaselineError(Exception):
    """A baseline file that cannot be used: missing, empty, truncated, corrupted, of the wrong
    schema or with impossible values. The message names the file, what is wrong and how to
    regenerate it."""


class BaselineMismatch(Exception):
    """Results that must not be compared with this baseline (another GPU model, a dtype the
    baseline does not hold, numbers from Triton's interpreter)."""


@dataclass(frozen=True)
class Baseline:
    path: Path
    environment: dict
    entries: pd.DataFrame  # KEY_COLUMNS + tflops, reference_tflops, log_ratio, log_ratio_sd, repeats
    reference: str = REFERENCE


@dataclass
class Comparison:
    """Outcome of `compare_to_baseline`. `table`: KEY_COLUMNS, baseline_tflops,
    current_tflops, baseline_ratio, current_ratio (to the reference), change (current_ratio /
    baseline_ratio - 1), sigma, threshold (as log-ratios), verdict, note."""

    table: pd.DataFrame
    tolerance: float
    false_positive_rate: float
    sigma_source: str
    baseline_path: Path
    baseline_environment: dict
    environment: dict
    reference: str = REFERENCE
    warnings: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return bool(self.table["verdict"].isin(FAILING_VERDICTS).any())

    @property
    def compared(self) -> int:
        return int(self.table["verdict"].isin(COMPARED_VERDICTS).sum())

    def counts(self) -> dict[str, int]:
        return {verdict: int((self.table["verdict"] == verdict).sum()) for verdict in VERDICTS}


def baseline_path(gpu: str, directory: Path = REPORTS_DIR) -> Path:
    """Conventional baseline location for a GPU model: reports/<gpu>/regression/baseline.json,
    <gpu> the model's slug without its vendor and its memory's size and kind, the folder that
    holds the model's other results ('NVIDIA H200' -> reports/h200/...,
    'NVIDIA H100 80GB HBM3' -> reports/h100/...; 'NVIDIA H100 PCIe' keeps its own folder)."""
    words = gpu_slug(gpu).removeprefix("nvidia-").split("-")
    model = [word for word in words if not re.fullmatch(r"\d+gb|hbm\d*e?", word)] or words
    return Path(directory) / "-".join(model) / "regression" / "baseline.json"


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
    for column in ("provider", "mode", "dtype"):
        frame[column] = frame[column].astype(str)
    frame["causal"] = frame["causal"].map(_as_bool).astype(bool)
    for column in INT_KEYS:
        frame[column] = frame[column].astype(int)
    return frame


def _ok_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The rows with status ok and a finite, positive TFLOPs/s (a NaN is not a measurement)."""
    if "status" not in results.columns or "tflops" not in results.columns:
        raise ValueError("result rows need `status` and `tflops` columns (see docs/architecture.md, 'Data flow')")
    tflops = pd.to_numeric(results["tflops"], errors="coerce")
    ok = results[(results["status"] == "ok") & np.isfinite(tflops) & (tflops > 0)]
    frame = _normal_keys(ok)
    frame["tflops"] = frame["tflops"].astype(float)
    if "repeat" not in frame.columns:
        frame["repeat"] = frame.groupby(KEY_COLUMNS).cumcount()
    return frame


def _interpreted(rows: pd.DataFrame) -> bool:
    return "interpreter" in rows.columns and bool(rows["interpreter"].map(_as_bool).any())


def summarise(results: pd.DataFrame, reference: str = REFERENCE, repeats: int | None = None) -> pd.DataFrame:
    """Per configuration of the `ok` rows (the reference's own rows left out): median TFLOPs/s,
    the reference's median, L = median over repeats of log(tflops / reference tflops) of the
    same repeat index (log of the medians where the indices do not pair), its standard
    deviation over repeats (NaN with one) and the number of repeats. `repeats`: use only the
    first `repeats` repeats of each (what calibration does to study fewer repeats)."""
    ok = _ok_rows(results)
    if repeats is not None:
        ok = ok[ok["repeat"].astype(int) < repeats]
    columns = [*KEY_COLUMNS, "tflops", "reference_tflops", "log_ratio", "log_ratio_sd", "repeats"]
    ref = ok[ok["provider"] == reference]
    mine = ok[ok["provider"] != reference]
    if mine.empty:
        return pd.DataFrame(columns=columns)
    ref_by_repeat = ref.set_index([*CONFIG_COLUMNS, "repeat"])["tflops"]
    ref_median = ref.groupby(CONFIG_COLUMNS)["tflops"].median()
    records = []
    for key, group in mine.groupby(KEY_COLUMNS, sort=True):
        config = key[1:]
        record = dict(zip(KEY_COLUMNS, key, strict=True))
        record.update(tflops=group["tflops"].median(), repeats=len(group))
        if config not in ref_median.index:
            record.update(reference_tflops=math.nan, log_ratio=math.nan, log_ratio_sd=math.nan)
        else:
            paired = [math.log(t / ref_by_repeat[(*config, r)]) for t, r in zip(group["tflops"], group["repeat"])
                      if (*config, r) in ref_by_repeat.index]
            if len(paired) == len(group):
                logs = np.array(paired)
            else:
                logs = np.array([math.log(record["tflops"] / ref_median[config])])
            record.update(reference_tflops=float(ref_median[config]), log_ratio=float(np.median(logs)),
                          log_ratio_sd=float(np.std(logs, ddof=1)) if len(logs) > 1 else math.nan)
        records.append(record)
    return pd.DataFrame(records, columns=columns)


# --------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------
def save_baseline(results: pd.DataFrame, path, environment: dict, reference: str = REFERENCE) -> Path:
    """Write the baseline of `results` (their `ok` rows) measured in `environment` to `path`
    as sorted, indented JSON, one entry per configuration. Returns the path."""
    if not environment.get("gpu"):
        raise ValueError("environment must name the GPU (environment['gpu']) the results were measured on")
    ok = _ok_rows(results)
    if ok.empty:
        raise ValueError("results hold no `ok` measurement: nothing to save as a baseline")
    if _interpreted(ok):
        raise ValueError("results come from Triton's interpreter (interpreter=True): they are not performance")
    if "gpu" in ok.columns and set(ok["gpu"].astype(str)) != {str(environment["gpu"])}:
        raise ValueError(f"results were measured on {sorted(set(ok['gpu'].astype(str)))}, "
                         f"not on environment['gpu'] = {environment['gpu']!r}")
    summary = summarise(ok, reference)
    unpaired = summary[summary["log_ratio"].isna()]
    if summary.empty or len(unpaired) == len(summary):
        raise ValueError(f"no configuration has both a provider and the reference {reference!r} measured ok: "
                         f"add {reference} to --providers")
    entries = []
    for record in summary[summary["log_ratio"].notna()].to_dict(orient="records"):
        entry = {key: record[key] for key in KEY_COLUMNS}
        entry.update(causal=bool(entry["causal"]), **{key: int(entry[key]) for key in INT_KEYS})
        entry.update(tflops=round(float(record["tflops"]), 3),
                     reference_tflops=round(float(record["reference_tflops"]), 3),
                     log_ratio=round(float(record["log_ratio"]), 6),
                     log_ratio_sd=None if pd.isna(record["log_ratio_sd"]) else round(float(record["log_ratio_sd"]), 6),
                     repeats=int(record["repeats"]))
        entries.append(entry)
    document = {"schema_version": SCHEMA_VERSION, "reference": reference,
                "environment": {key: str(environment.get(key, "")) for key in ENV_COLUMNS}, "entries": entries}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(document, indent=1, sort_keys=True) + "\n")


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


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _entries_v1(entries: list, reference: str, wrong) -> list[dict]:
    """Schema 1 (absolute TFLOPs/s bands) -> schema 2 entries: the ratio to the same
    configuration's reference entry."""
    values = ("tflops", "tflops_lo", "tflops_hi", "repeats")
    for index, entry in enumerate(entries):
        absent = [key for key in (*KEY_COLUMNS, *values) if not isinstance(entry, dict) or key not in entry]
        if absent:
            raise wrong(f"entry {index} lacks {absent}")
        if not all(_finite(entry[key]) for key in values):
            raise wrong(f"entry {index} has non-numeric values among {list(values)}")
        if not 0 < entry["tflops_lo"] <= entry["tflops"] <= entry["tflops_hi"]:
            raise wrong(f"entry {index} needs 0 < tflops_lo <= tflops <= tflops_hi, got "
                        f"{entry['tflops_lo']}, {entry['tflops']}, {entry['tflops_hi']}")
    refs = {tuple(str(e[k]) for k in CONFIG_COLUMNS): e["tflops"] for e in entries if e["provider"] == reference}
    converted = []
    for entry in entries:
        if entry["provider"] == reference:
            continue
        ref = refs.get(tuple(str(entry[k]) for k in CONFIG_COLUMNS))
        converted.append({**{k: entry[k] for k in KEY_COLUMNS}, "tflops": entry["tflops"],
                          "reference_tflops": ref if ref is not None else math.nan,
                          "log_ratio": math.log(entry["tflops"] / ref) if ref else math.nan,
                          "log_ratio_sd": math.nan, "repeats": entry["repeats"]})
    return converted


def load_baseline(path) -> Baseline:
    """Read a baseline written by `save_baseline` (schema 2, or schema 1 converted to ratios);
    BaselineError when it cannot be used."""
    path = Path(path)
    document = _decode(path)

    def wrong(what: str) -> BaselineError:
        return BaselineError(f"baseline {path}: {what}; {REGENERATE}")

    if not isinstance(document, dict):
        raise wrong(f"wrong schema: the top level is a JSON {type(document).__name__}, expected an object")
    version = document.get("schema_version")
    if version not in (1, SCHEMA_VERSION):
        raise wrong(f"wrong schema: schema_version is {version!r}, this code reads 1 and {SCHEMA_VERSION}")
    environment = document.get("environment")
    if not isinstance(environment, dict) or not environment.get("gpu"):
        raise wrong("wrong schema: `environment` must be an object naming the GPU (environment.gpu)")
    entries = document.get("entries")
    if not isinstance(entries, list) or not entries:
        raise wrong("wrong schema: `entries` must be a non-empty list of measurements")
    reference = document.get("reference", REFERENCE)
    if version == 1:
        entries = _entries_v1(entries, reference, wrong)
    values = ("tflops", "reference_tflops", "log_ratio", "repeats")
    for index, entry in enumerate(entries):
        absent = [key for key in (*KEY_COLUMNS, *values) if not isinstance(entry, dict) or key not in entry]
        if absent:
            raise wrong(f"entry {index} lacks {absent}")
        if not all(_finite(entry[key]) for key in values):
            raise wrong(f"entry {index} ({entry['provider']}) has a missing or non-finite value among {list(values)} "
                        f"(its reference {reference!r} must be in the baseline)")
        if entry["tflops"] <= 0 or entry["reference_tflops"] <= 0 or entry["repeats"] < 1:
            raise wrong(f"entry {index} needs tflops > 0, reference_tflops > 0 and repeats >= 1")
        sd = entry.get("log_ratio_sd")
        if sd is not None and not (isinstance(sd, float) and math.isnan(sd)) and not (_finite(sd) and sd >= 0):
            raise wrong(f"entry {index} has log_ratio_sd {sd!r}: expected a number >= 0 or null")
    try:
        frame = _normal_keys(pd.DataFrame(entries, columns=[*KEY_COLUMNS, *values, "log_ratio_sd"]))
    except (TypeError, ValueError) as err:
        raise wrong(f"an entry's key has the wrong type ({err})") from None
    frame["log_ratio_sd"] = pd.to_numeric(frame["log_ratio_sd"], errors="coerce")
    duplicated = frame.duplicated(subset=KEY_COLUMNS, keep=False)
    if duplicated.any():
        first = frame.loc[duplicated, KEY_COLUMNS].iloc[0].to_dict()
        raise wrong(f"{int(duplicated.sum())} entries share a configuration, e.g. {first}")
    return Baseline(path=path, environment=dict(environment), entries=frame, reference=reference)


def calibrated_sigma(calibration_csv: Path, repeats: int) -> float | None:
    """sigma of d for runs of `repeats` repeats from a calibration.csv (harness.calibrate): the
    `sigma` of its slowdown-0 rows at the nearest number of repeats; None without a file."""
    path = Path(calibration_csv)
    if not path.is_file():
        return None
    table = pd.read_csv(path)
    rows = table[(table["slowdown"] == 0) & table["sigma"].notna()]
    if rows.empty:
        return None
    nearest = rows.iloc[(rows["repeats"] - repeats).abs().argsort()].iloc[0]
    return float(nearest["sigma"])


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
            f"`python runner.py <sweep options> --save-baseline` (it goes to {baseline_path(gpu or 'unknown')})")
    if "gpu" in results.columns:
        found = sorted(set(results["gpu"].astype(str)))
        if [name.strip().lower() for name in found] != [gpu.strip().lower()]:
            raise BaselineMismatch(
                f"the compared rows were measured on {found}, this run is on {gpu!r}: the folder holds rows of "
                "another GPU (a --resume into a folder measured elsewhere); compare a folder measured on this GPU "
                "only (a new --out)")
    if _interpreted(results[results["status"] == "ok"]):
        raise BaselineMismatch("these results come from Triton's interpreter (interpreter=True): "
                               "they are not performance and cannot be compared with a baseline")
    dtypes = set(_normal_keys(results)["dtype"])
    known = set(baseline.entries["dtype"])
    if not dtypes <= known:
        raise BaselineMismatch(
            f"this sweep measures dtype {sorted(dtypes - known)} but baseline {baseline.path} holds only "
            f"{sorted(known)}: sweep with --dtype {' / '.join(sorted(known))}, or make a baseline for that dtype")
    warnings = []
    for key in VERSION_FIELDS:
        then, now = str(baseline.environment.get(key, "")), str(environment.get(key, ""))
        if then and now and then != now:
            warnings.append(f"{key} differs: baseline {then}, this run {now}; a difference may come from "
                            f"the {key} version rather than from the code")
    return warnings


def _failure_notes(results: pd.DataFrame, reference: str) -> dict[tuple, str]:
    """Key -> why a configuration tried by the run has no ratio: its own row or its
    reference's row is not `ok`."""
    frame = _normal_keys(results)
    tflops = pd.to_numeric(frame["tflops"], errors="coerce")
    # a peer whose package is not installed here was not tried: its baseline entries are missing,
    # not failed (the baseline's optional peers, FA4 among them, must not fail a machine without them)
    bad = frame[((frame["status"] != "ok") | ~np.isfinite(tflops))
                & ~((frame["status"] == "unavailable") & (frame["provider"] != reference))]
    notes, ref_notes = {}, {}
    for row in bad.itertuples(index=False):
        reason = getattr(row, "reason", "")
        text = f"now {row.status}" + (f": {reason}" if isinstance(reason, str) and reason else "")
        if row.status == "ok":
            text = "now ok but without a TFLOPs/s value"
        key = tuple(getattr(row, column) for column in KEY_COLUMNS)
        (ref_notes if row.provider == reference else notes)[key[1:] if row.provider == reference else key] = text
    for row in frame[frame["provider"] != reference].itertuples(index=False):
        key = tuple(getattr(row, column) for column in KEY_COLUMNS)
        if key not in notes and key[1:] in ref_notes:
            notes[key] = f"reference {reference} {ref_notes[key[1:]]}"
    return notes


def compare_to_baseline(results: pd.DataFrame, baseline: Baseline, environment: dict,
                        tolerance: float = DEFAULT_TOLERANCE,
                        false_positive_rate: float = DEFAULT_FALSE_POSITIVE_RATE,
                        sigma: float | None = None) -> Comparison:
    """Compare a sweep's result rows with `baseline` by the rule of the module docstring.
    `sigma`: the calibrated standard deviation of d (None: from the repeats' spread)."""
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be a fraction in [0, 1), e.g. 0.05 for 5%, got {tolerance}")
    if not 0.0 < false_positive_rate < 0.5:
        raise ValueError(f"false_positive_rate must be in (0, 0.5), e.g. 0.01, got {false_positive_rate}")
    warnings = _check_comparable(results, baseline, environment)
    base = baseline.entries.rename(columns={"tflops": "baseline_tflops", "log_ratio": "baseline_log_ratio",
                                            "log_ratio_sd": "baseline_sd", "repeats": "baseline_repeats"})
    current = summarise(results, baseline.reference).rename(columns={
        "tflops": "current_tflops", "log_ratio": "current_log_ratio", "log_ratio_sd": "current_sd",
        "repeats": "current_repeats"})
    table = base.drop(columns="reference_tflops").merge(current.drop(columns="reference_tflops"), on=KEY_COLUMNS,
                                                        how="outer")
    for column in ("baseline_tflops", "baseline_log_ratio", "baseline_sd", "baseline_repeats", "current_tflops",
                   "current_log_ratio", "current_sd", "current_repeats"):
        table[column] = pd.to_numeric(table[column], errors="coerce").astype(float)
    d = table["current_log_ratio"] - table["baseline_log_ratio"]
    if sigma is not None:
        table["sigma"] = max(float(sigma), MIN_SIGMA)
        source = f"calibrated: {float(sigma):.4f} from repeated runs without a code change"
    else:
        pooled = float(np.sqrt(np.nanmean(np.concatenate([table["baseline_sd"], table["current_sd"]]) ** 2))) \
            if table[["baseline_sd", "current_sd"]].notna().any().any() else math.nan
        sd_b = table["baseline_sd"].fillna(pooled)
        sd_c = table["current_sd"].fillna(pooled)
        within = np.sqrt(sd_b**2 / table["baseline_repeats"] + sd_c**2 / table["current_repeats"])
        table["sigma"] = within.fillna(MIN_SIGMA).clip(lower=MIN_SIGMA)
        source = ("the repeats' spread within the two runs (no calibration.csv next to the baseline): run-to-run "
                  "drift is not included, so the false-positive rate may be above the stated one")
        warnings.append(f"sigma from {source}")
    z = NormalDist().inv_cdf(1.0 - false_positive_rate)
    table["threshold"] = np.maximum(z * table["sigma"], -math.log(1.0 - tolerance))
    table["change"] = np.exp(d) - 1.0
    table["baseline_ratio"] = np.exp(table["baseline_log_ratio"])
    table["current_ratio"] = np.exp(table["current_log_ratio"])
    in_base, measured = table["baseline_tflops"].notna(), table["current_tflops"].notna()
    has_ratio = table["current_log_ratio"].notna()
    verdict = pd.Series("unchanged", index=table.index)
    verdict[d < -table["threshold"]] = "regression"
    verdict[d > table["threshold"]] = "improvement"
    notes = _failure_notes(results, baseline.reference)
    keys = list(table[KEY_COLUMNS].itertuples(index=False, name=None))
    tried = pd.Series([key in notes for key in keys], index=table.index)
    verdict[in_base & ~measured] = "missing"
    verdict[in_base & (~has_ratio | ~measured) & tried] = "failed"
    verdict[in_base & measured & ~has_ratio] = "failed"
    verdict[~in_base & measured] = "new"
    table["verdict"] = verdict
    table["note"] = [notes.get(key, "") if v == "failed" else "" for key, v in zip(keys, verdict, strict=True)]
    table.loc[(table["verdict"] == "failed") & (table["note"] == ""), "note"] = \
        f"reference {baseline.reference} not measured in this run"
    order = {v: rank for rank, v in enumerate(VERDICTS)}
    table = table.sort_values(by=["verdict", *KEY_COLUMNS], key=lambda s: s.map(order) if s.name == "verdict" else s)
    columns = [*KEY_COLUMNS, "baseline_tflops", "current_tflops", "baseline_ratio", "current_ratio", "change",
               "sigma", "threshold", "verdict", "note"]
    comparison = Comparison(table=table[columns].reset_index(drop=True), tolerance=tolerance,
                            false_positive_rate=false_positive_rate, sigma_source=source,
                            baseline_path=baseline.path, baseline_environment=baseline.environment,
                            environment=dict(environment), reference=baseline.reference, warnings=warnings)
    if comparison.compared == 0:
        warnings.append("nothing was compared: no configuration of this run has a ratio to the reference in "
                        "the baseline (sweep with the options the baseline was saved with, and include "
                        f"{baseline.reference})")
    failed_now = int((comparison.table["verdict"] == "failed").sum())
    if failed_now:
        warnings.append(f"{failed_now} baseline configuration(s) did not measure `ok` in this run (see the notes)")
    return comparison
