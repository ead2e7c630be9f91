"""The regression check (harness/regression.py) on fixture result sets in the runner's row
format: tests/fixtures/regression/baseline_run.csv is the run the committed baseline JSON was
saved from; the current_*.csv files are later runs of the same sweep (noise within the
measured spread, one configuration 15% slower, one 15% faster, one dropped, one failing and
one new)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.regression import (
    KEY_COLUMNS,
    BaselineError,
    BaselineMismatch,
    baseline_path,
    compare_to_baseline,
    load_baseline,
    merge_remeasured,
    save_baseline,
    summarise,
    suspected_regressions,
)
from reports.comparison import format_comparison, write_comparison

FIXTURES = Path(__file__).parent / "fixtures" / "regression"
BASELINE_JSON = FIXTURES / "baseline_nvidia-h200.json"
ENVIRONMENT_FIELDS = ["gpu", "driver", "cuda", "torch", "triton", "git_commit", "timestamp"]


def rows(name: str) -> pd.DataFrame:
    return pd.read_csv(FIXTURES / f"{name}.csv", keep_default_na=True)


def environment_of(results: pd.DataFrame) -> dict:
    return {key: str(results[key].iloc[0]) for key in ENVIRONMENT_FIELDS}


def compare(name: str, **kwargs):
    results = rows(name)
    return compare_to_baseline(results, load_baseline(BASELINE_JSON), environment_of(results), **kwargs)


def verdict_of(comparison, **key) -> str:
    table = comparison.table
    match = np.logical_and.reduce([table[column] == value for column, value in key.items()])
    assert match.sum() == 1, f"expected one row for {key}, found {match.sum()}"
    return table.loc[match, "verdict"].item()


def test_committed_baseline_matches_the_run_it_was_saved_from(tmp_path):
    results = rows("baseline_run")
    saved = save_baseline(results, tmp_path / "b.json", environment_of(results))
    assert saved.read_text() == BASELINE_JSON.read_text()


def test_save_load_round_trip_keeps_medians_bands_and_environment(tmp_path):
    results = rows("baseline_run")
    environment = environment_of(results)
    loaded = load_baseline(save_baseline(results, tmp_path / "nested" / "b.json", environment))
    assert loaded.environment == environment
    expected = summarise(results)
    pd.testing.assert_frame_equal(loaded.entries[KEY_COLUMNS], expected[KEY_COLUMNS])
    for column in ("tflops", "tflops_lo", "tflops_hi"):
        np.testing.assert_allclose(loaded.entries[column], expected[column], atol=5e-4)
    assert (loaded.entries["repeats"] == 3).all()
    assert (loaded.entries["tflops_lo"] < loaded.entries["tflops"]).all()
    assert (loaded.entries["tflops"] < loaded.entries["tflops_hi"]).all()


def test_band_spans_repeat_medians_and_percentiles():
    results = rows("baseline_run")
    one = results[(results.provider == "fa2") & (results["mode"] == "fwd") & ~results.causal]
    entry = summarise(results).query("provider == 'fa2' and mode == 'fwd' and not causal")
    assert entry["tflops"].item() == pytest.approx(one["tflops"].median())
    assert entry["tflops_lo"].item() == pytest.approx(one[["tflops", "tflops_p20", "tflops_p80"]].min().min())
    assert entry["tflops_hi"].item() == pytest.approx(one[["tflops", "tflops_p20", "tflops_p80"]].max().max())


def test_baseline_path_follows_the_gpu_slug_convention():
    assert baseline_path("NVIDIA H200").parts[-4:] == ("reports", "h200", "regression", "baseline.json")
    assert baseline_path("NVIDIA H200").is_file()  # the committed baseline


def test_noise_within_the_spread_is_not_a_regression():
    comparison = compare("current_noise")
    assert not comparison.regressed
    assert set(comparison.table["verdict"]) == {"unchanged"}
    assert comparison.table["ratio"].min() < 0.975  # the fixture does move: a 3% dip stays unchanged


def test_real_regression_is_caught_and_named():
    comparison = compare("current_regressed")
    assert comparison.regressed
    assert verdict_of(comparison, provider="fa2", mode="fwd", causal=True) == "regression"
    assert comparison.counts()["regression"] == 1
    suspects = suspected_regressions(comparison)
    assert list(suspects.columns) == KEY_COLUMNS
    assert suspects[["provider", "mode", "causal"]].values.tolist() == [["fa2", "fwd", True]]


def test_improvement_is_reported_but_does_not_fail():
    comparison = compare("current_improved")
    assert not comparison.regressed
    assert verdict_of(comparison, provider="sdpa-flash", mode="fwd_bwd", causal=False) == "improvement"


def test_failed_missing_and_new_configurations_are_listed():
    """A baseline configuration this run tried and did not measure ok (here an error) fails
    the check with its reason; one it did not try is only listed as missing."""
    comparison = compare("current_missing_new")
    assert comparison.regressed
    failed = comparison.table[comparison.table.verdict == "failed"]
    assert (failed["provider"] + "/" + failed["mode"]).tolist() == ["fa2/fwd_bwd"]
    failed_note = failed["note"].item()
    assert failed_note.startswith("now error") and "OutOfResources" in failed_note
    missing = comparison.table[comparison.table.verdict == "missing"]
    assert (missing["provider"] + "/" + missing["mode"]).tolist() == ["sdpa-flash/fwd_bwd"]
    assert verdict_of(comparison, verdict="new")  # exactly one new row
    assert comparison.table.loc[comparison.table.verdict == "new", "hdim"].item() == 64
    assert any("did not measure" in warning for warning in comparison.warnings)


@pytest.mark.parametrize("tolerance", [0.02, 0.05, 0.10])
def test_rule_boundary_is_tolerance_beyond_the_band(tolerance):
    """A run whose best timing sits 1% inside the threshold baseline_lo * (1 - tol) is
    unchanged; 1% outside it is a regression (and symmetrically for improvements)."""
    baseline = load_baseline(BASELINE_JSON)
    entry = baseline.entries.iloc[0]
    template = rows("baseline_run")
    template = template[(template[KEY_COLUMNS] == entry[KEY_COLUMNS]).all(axis=1)].head(1)

    def verdict_at(tflops: float) -> str:
        run = template.assign(tflops=tflops, tflops_p20=tflops, tflops_p80=tflops)
        comparison = compare_to_baseline(run, baseline, environment_of(run), tolerance=tolerance)
        return verdict_of(comparison, **entry[KEY_COLUMNS].to_dict())

    low, high = entry["tflops_lo"] * (1 - tolerance), entry["tflops_hi"] * (1 + tolerance)
    assert verdict_at(low * 1.01) == "unchanged"
    assert verdict_at(low * 0.99) == "regression"
    assert verdict_at(high * 0.99) == "unchanged"
    assert verdict_at(high * 1.01) == "improvement"


def test_remeasured_rows_replace_the_suspect_and_can_clear_it():
    results = rows("current_regressed")
    comparison = compare("current_regressed")
    suspects = suspected_regressions(comparison)
    healthy = rows("current_noise").merge(suspects, on=KEY_COLUMNS)  # the re-run came back at normal speed
    merged = merge_remeasured(results, healthy)
    assert len(merged) == len(results)
    again = compare_to_baseline(merged, load_baseline(BASELINE_JSON), environment_of(merged))
    assert not again.regressed
    still_slow = merge_remeasured(results, results.merge(suspects, on=KEY_COLUMNS))
    assert compare_to_baseline(still_slow, load_baseline(BASELINE_JSON), environment_of(results)).regressed


def test_a_sweep_sharing_no_configuration_with_the_baseline_warns():
    results = rows("current_noise").assign(seqlen=1024)
    comparison = compare_to_baseline(results, load_baseline(BASELINE_JSON), environment_of(results))
    assert not comparison.regressed
    assert comparison.counts()["missing"] == comparison.counts()["new"] == 8
    assert any("nothing was compared" in warning for warning in comparison.warnings)


def test_gpu_mismatch_is_refused_with_both_models_named():
    results = rows("current_noise")
    environment = {**environment_of(results), "gpu": "NVIDIA A100-SXM4-80GB"}
    names = r"NVIDIA H200.*NVIDIA A100-SXM4-80GB.*a100-sxm4-80gb/regression/baseline\.json"
    with pytest.raises(BaselineMismatch, match=names):
        compare_to_baseline(results, load_baseline(BASELINE_JSON), environment)


def test_dtype_absent_from_the_baseline_is_refused():
    results = rows("current_noise").assign(dtype="fp16")
    with pytest.raises(BaselineMismatch, match=r"\['fp16'\].*\['bf16'\]"):
        compare_to_baseline(results, load_baseline(BASELINE_JSON), environment_of(results))


def test_interpreter_results_are_refused():
    results = rows("current_noise").assign(interpreter=True)
    with pytest.raises(BaselineMismatch, match="interpreter"):
        compare_to_baseline(results, load_baseline(BASELINE_JSON), environment_of(results))


def test_version_differences_are_warnings_not_refusals():
    results = rows("current_noise")
    environment = {**environment_of(results), "torch": "2.12.0+cu130", "triton": "3.7.0"}
    comparison = compare_to_baseline(results, load_baseline(BASELINE_JSON), environment)
    assert not comparison.regressed
    assert len(comparison.warnings) == 2
    assert any("torch" in w and "2.11.0+cu130" in w and "2.12.0+cu130" in w for w in comparison.warnings)
    assert any("triton" in w and "3.7.0" in w for w in comparison.warnings)
    assert "Warnings:" in format_comparison(comparison)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[: len(text) // 2], "truncated"),
    (lambda text: text[: len(text) // 3] + "}}garbage{" + text[len(text) // 3:], "corrupted"),
    (lambda text: "", "empty"),
    (lambda text: text.replace('"schema_version": 1', '"schema_version": 99'), "schema_version is 99"),
    (lambda text: "[1, 2, 3]\n", "top level is a JSON list"),
    (lambda text: text.replace('"tflops_lo"', '"tflops_low"', 1), r"entry 0 lacks \['tflops_lo'\]"),
])
def test_damaged_baseline_gives_a_clear_error(tmp_path, damage, message):
    broken = tmp_path / "nvidia-h200.json"
    broken.write_text(damage(BASELINE_JSON.read_text()))
    with pytest.raises(BaselineError, match=message) as info:
        load_baseline(broken)
    assert str(broken) in str(info.value)
    assert "--save-baseline" in str(info.value)


def test_missing_baseline_file_says_how_to_make_one(tmp_path):
    with pytest.raises(BaselineError, match=r"no such file.*--save-baseline"):
        load_baseline(tmp_path / "nvidia-h100.json")


def test_save_refuses_interpreter_rows_and_empty_results(tmp_path):
    results = rows("baseline_run")
    with pytest.raises(ValueError, match="interpreter"):
        save_baseline(results.assign(interpreter=True), tmp_path / "b.json", environment_of(results))
    with pytest.raises(ValueError, match="no `ok` measurement"):
        save_baseline(results.assign(status="error"), tmp_path / "b.json", environment_of(results))


def test_report_groups_by_verdict_with_a_generated_summary(tmp_path):
    comparison = compare("current_regressed")
    report = format_comparison(comparison)
    assert report.index("### regression (1)") < report.index("### unchanged (7)")
    assert "**FAIL**: 1 regression, 0 failed, 0 improvement, 0 missing, 0 new, 7 unchanged" in report
    ratio = comparison.table.loc[comparison.table.verdict == "regression", "ratio"].item()
    assert f"{ratio:.3f}x" in report
    written = write_comparison(comparison, tmp_path / "out")
    assert written.read_text() == report
    table = pd.read_csv(tmp_path / "out" / "comparison.csv")
    assert list(table["verdict"]).count("regression") == 1
