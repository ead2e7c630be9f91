"""The regression rule (harness/regression.py) and its calibration (harness/calibrate.py) on
synthetic runs in the runner's row format: fresh random noise of a known size, a machine-wide
slowdown that the ratio to the reference must cancel, and known slowdowns of our kernel.
The committed H200 baseline (schema 1) must load as ratios."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import runner
from harness.calibrate import calibrate
from harness.calibrate import main as calibrate_main
from harness.regression import (
    REFERENCE,
    BaselineError,
    BaselineMismatch,
    baseline_path,
    calibrated_sigma,
    compare_to_baseline,
    load_baseline,
    save_baseline,
    summarise,
)
from harness.results import COLUMNS
from reports.comparison import format_comparison, write_comparison

COMMITTED = Path(__file__).resolve().parents[1] / "reports" / "h200" / "regression" / "baseline.json"
# A baseline of the first schema (a TFLOPs/s band per provider and configuration), as saved on the H200
SCHEMA_1 = Path(__file__).resolve().parent / "fixtures" / "regression" / "baseline_schema1.json"
ENVIRONMENT = {"gpu": "NVIDIA H200", "driver": "580", "cuda": "13.0", "torch": "2.11.0+cu130", "triton": "3.6.0",
               "git_commit": "abc1234", "timestamp": "2026-12-01T00:00:00+00:00"}
CONFIGS = [(mode, causal, seqlen) for mode in ("fwd", "fwd_bwd") for causal in (False, True)
           for seqlen in (1024, 4096)]


def run_rows(rng, repeats=3, machine=1.0, slowdown=None, noise=0.01, drift=0.01, status=None) -> pd.DataFrame:
    """One synthetic run: fa2 and the reference on CONFIGS. `machine` scales both (a slower
    machine); `slowdown` {config index: fraction} slows fa2 only; `drift`: this run's
    per-configuration log-normal offset of fa2 against the reference; `noise`: per repeat."""
    records = []
    for index, (mode, causal, seqlen) in enumerate(CONFIGS):
        offset = rng.normal(0, drift)
        for repeat in range(repeats):
            for provider, base in (("fa2", 500.0), (REFERENCE, 450.0)):
                tflops = base * machine * math.exp(rng.normal(0, noise))
                if provider == "fa2":
                    tflops *= math.exp(offset) / (1 + (slowdown or {}).get(index, 0.0))
                row = {column: "" for column in COLUMNS}
                row.update(ENVIRONMENT, provider=provider, label=provider, setting="", mode=mode, causal=causal,
                           hdim=128, seqlen=seqlen, batch=16384 // seqlen, heads=16, dtype="bf16", repeat=repeat,
                           status="ok", tflops=tflops, ms=1.0, interpreter=False)
                records.append(row)
    frame = pd.DataFrame(records)
    if status:
        for (provider, index), (new_status, tflops) in status.items():
            mode, causal, seqlen = CONFIGS[index]
            mask = (frame.provider == provider) & (frame["mode"] == mode) & (frame.causal == causal) & \
                (frame.seqlen == seqlen)
            frame.loc[mask, ["status", "tflops", "reason"]] = [new_status, tflops, "boom"]
    return frame


@pytest.fixture
def rng():
    return np.random.default_rng(20261201)


@pytest.fixture
def baseline(rng, tmp_path):
    return load_baseline(save_baseline(run_rows(rng), tmp_path / "baseline.json", ENVIRONMENT))


def verdicts(comparison) -> list[str]:
    return comparison.table.sort_values(["mode", "causal", "seqlen"])["verdict"].tolist()


def test_the_committed_baseline_loads_as_ratios_to_the_reference():
    loaded = load_baseline(COMMITTED)
    assert set(loaded.entries["provider"]) == {"fa2", "fa4"} and loaded.reference == REFERENCE
    document = json.loads(COMMITTED.read_text())
    entry = loaded.entries.iloc[0]
    saved = next(e for e in document["entries"] if e["provider"] == "fa2" and e["mode"] == entry["mode"]
                 and e["causal"] == entry["causal"] and e["seqlen"] == entry["seqlen"])
    assert entry["log_ratio"] == pytest.approx(saved["log_ratio"])
    assert baseline_path("NVIDIA H200") == COMMITTED


@pytest.mark.parametrize("gpu, folder", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),  # torch's name for the SXM H100: its results live in reports/h100
    ("NVIDIA H100 PCIe", "h100-pcie"),  # another model, another folder
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
])
def test_the_baseline_lives_in_the_folder_of_the_gpus_other_results(gpu, folder):
    assert baseline_path(gpu, Path("reports")) == Path("reports") / folder / "regression" / "baseline.json"


def test_the_committed_h100_baseline_is_found_by_the_name_torch_gives_the_gpu():
    assert baseline_path("NVIDIA H100 80GB HBM3").is_file()


def test_a_schema_1_baseline_loads_as_ratios_to_the_reference():
    loaded = load_baseline(SCHEMA_1)
    assert set(loaded.entries["provider"]) == {"fa2"} and loaded.reference == REFERENCE
    document = json.loads(SCHEMA_1.read_text())
    entry = loaded.entries.iloc[0]
    mine = next(e for e in document["entries"] if e["provider"] == "fa2" and e["mode"] == entry["mode"]
                and e["causal"] == entry["causal"] and e["seqlen"] == entry["seqlen"])
    ref = next(e for e in document["entries"] if e["provider"] == REFERENCE and e["mode"] == entry["mode"]
               and e["causal"] == entry["causal"] and e["seqlen"] == entry["seqlen"])
    assert entry["log_ratio"] == pytest.approx(math.log(mine["tflops"] / ref["tflops"]))


def test_a_slower_machine_is_not_a_regression_because_the_ratio_cancels_it(rng, baseline):
    comparison = compare_to_baseline(run_rows(rng, machine=0.8), baseline, ENVIRONMENT, sigma=0.02)
    assert set(verdicts(comparison)) == {"unchanged"} and comparison.compared == len(CONFIGS)


def test_a_ten_percent_slowdown_of_our_kernel_is_caught_and_named(rng, baseline):
    comparison = compare_to_baseline(run_rows(rng, slowdown={2: 0.10}), baseline, ENVIRONMENT, sigma=0.02)
    assert comparison.regressed and comparison.counts()["regression"] == 1
    row = comparison.table[comparison.table.verdict == "regression"].iloc[0]
    assert (row["mode"], row["causal"], row["seqlen"]) == CONFIGS[2]
    assert row["change"] == pytest.approx(-0.09, abs=0.04)


def test_the_threshold_is_z_sigma_or_the_tolerance_whichever_is_larger(baseline, rng):
    current = run_rows(rng)
    wide = compare_to_baseline(current, baseline, ENVIRONMENT, tolerance=0.0, false_positive_rate=0.01, sigma=0.03)
    assert wide.table["threshold"].iloc[0] == pytest.approx(2.3263 * 0.03, rel=1e-3)
    floor = compare_to_baseline(current, baseline, ENVIRONMENT, tolerance=0.2, sigma=0.01)
    assert floor.table["threshold"].iloc[0] == pytest.approx(-math.log(0.8))


def test_without_calibration_sigma_comes_from_the_repeats_and_says_so(rng, baseline):
    comparison = compare_to_baseline(run_rows(rng), baseline, ENVIRONMENT)
    assert any("run-to-run drift is not included" in w for w in comparison.warnings)
    assert (comparison.table["sigma"] >= 0.01).all()


def test_failed_missing_new_and_a_failed_reference_are_listed(rng, baseline):
    current = run_rows(rng, status={("fa2", 0): ("error", math.nan), (REFERENCE, 1): ("oom", math.nan),
                                    ("fa2", 2): ("ok", math.nan)})
    current = current[~((current["mode"] == "fwd_bwd") & current.causal & (current.seqlen == 4096))]
    extra = run_rows(rng).assign(hdim=64)
    comparison = compare_to_baseline(pd.concat([current, extra]), baseline, ENVIRONMENT, sigma=0.02)
    table = comparison.table.set_index(["hdim", "mode", "causal", "seqlen"]).sort_index()
    assert table.loc[(128, *CONFIGS[0]), "verdict"] == "failed"
    assert table.loc[(128, *CONFIGS[0]), "note"].startswith("now error: boom")
    assert table.loc[(128, *CONFIGS[1]), "verdict"] == "failed"
    assert "reference sdpa-flash now oom" in table.loc[(128, *CONFIGS[1]), "note"]
    assert table.loc[(128, *CONFIGS[2]), "verdict"] == "failed"  # ok but no TFLOPs/s: not a measurement
    assert table.loc[(128, *CONFIGS[7]), "verdict"] == "missing"
    assert (table.loc[64, "verdict"] == "new").all()
    assert comparison.regressed


def test_a_peer_not_installed_here_is_missing_not_failed(rng, tmp_path):
    """A baseline saved where FA4 ran, compared on a machine without it: its entries are missing
    (with nothing regressed, the check passes); a peer that ran and broke still fails."""
    with_peer = run_rows(rng)
    peer = with_peer[with_peer.provider == "fa2"].assign(provider="fa4", label="fa4")
    baseline = load_baseline(save_baseline(pd.concat([with_peer, peer]), tmp_path / "baseline.json", ENVIRONMENT))
    current = run_rows(rng)
    absent = current[current.provider == "fa2"].assign(provider="fa4", label="fa4", status="unavailable",
                                                        tflops=math.nan, reason="flash-attn-4 does not import here")
    comparison = compare_to_baseline(pd.concat([current, absent]), baseline, ENVIRONMENT, sigma=0.02)
    table = comparison.table
    assert set(table[table.provider == "fa4"]["verdict"]) == {"missing"}
    assert set(table[table.provider == "fa2"]["verdict"]) == {"unchanged"} and not comparison.regressed
    broken = absent.assign(status="error", reason="boom")
    comparison = compare_to_baseline(pd.concat([current, broken]), baseline, ENVIRONMENT, sigma=0.02)
    assert set(comparison.table[comparison.table.provider == "fa4"]["verdict"]) == {"failed"}


def test_nothing_compared_is_not_a_pass(rng, baseline):
    all_failed = run_rows(rng).assign(status="error", tflops=math.nan)
    comparison = compare_to_baseline(all_failed, baseline, ENVIRONMENT, sigma=0.02)
    assert comparison.compared == 0 and any("nothing was compared" in w for w in comparison.warnings)
    disjoint = compare_to_baseline(run_rows(rng).assign(hdim=64), baseline, ENVIRONMENT, sigma=0.02)
    assert disjoint.compared == 0 and "NOTHING COMPARED" in format_comparison(disjoint)


def test_compare_without_anything_compared_exits_2(rng, baseline, monkeypatch, tmp_path, capsys):
    from harness import stages

    args = runner.build_parser().parse_args(["--compare", str(baseline.path)])
    code, comparison = stages.regression_check(args, run_rows(rng).assign(hdim=64), ENVIRONMENT)
    assert code == 2 and comparison.compared == 0 and "nothing was compared" in capsys.readouterr().err
    assert stages.regression_check(args, run_rows(rng, slowdown={0: 0.5}), ENVIRONMENT)[0] == 1


def _baseline_text(rng, tmp_path) -> dict:
    return json.loads(save_baseline(run_rows(rng), tmp_path / "b.json", ENVIRONMENT).read_text())


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: d["entries"][0].update(tflops=0), "tflops > 0"),
    (lambda d: d["entries"][0].update(reference_tflops=-3.0), "reference_tflops > 0"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), "share a configuration"),
    (lambda d: d["entries"][0].update(log_ratio=None), "non-finite value"),
    (lambda d: d["entries"][0].update(log_ratio_sd=-1), "log_ratio_sd -1"),
    (lambda d: d.update(schema_version=99), "schema_version is 99"),
    (lambda d: d["entries"][0].pop("repeats"), r"lacks \['repeats'\]"),
])
def test_an_impossible_baseline_is_refused(rng, tmp_path, damage, message):
    document = _baseline_text(rng, tmp_path)
    damage(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(BaselineError, match=message) as info:
        load_baseline(path)
    assert str(path) in str(info.value) and "--reproduce baseline" in str(info.value)


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.update(tflops_lo=e["tflops_hi"] + 1), "tflops_lo <= tflops <= tflops_hi"),
    (lambda e: e.update(tflops_lo=0), "0 < tflops_lo"),
    (lambda e: e.update(tflops=-5), "0 < tflops_lo"),
])
def test_an_impossible_schema_1_band_is_refused(tmp_path, change, message):
    document = json.loads(SCHEMA_1.read_text())
    change(document["entries"][0])
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(document))
    with pytest.raises(BaselineError, match=message):
        load_baseline(path)


@pytest.mark.parametrize(("text", "message"), [("", "empty"), ("{", "truncated"), ("[1]", "JSON list")])
def test_a_damaged_baseline_file_says_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "b.json"
    path.write_text(text)
    with pytest.raises(BaselineError, match=message):
        load_baseline(path)


def test_mismatched_results_are_refused(rng, baseline):
    with pytest.raises(BaselineMismatch, match="NVIDIA A100.*a100/regression/baseline.json"):
        compare_to_baseline(run_rows(rng), baseline, {**ENVIRONMENT, "gpu": "NVIDIA A100"})
    with pytest.raises(BaselineMismatch, match="dtype"):
        compare_to_baseline(run_rows(rng).assign(dtype="fp16"), baseline, ENVIRONMENT)
    with pytest.raises(BaselineMismatch, match="interpreter"):
        compare_to_baseline(run_rows(rng).assign(interpreter=True), baseline, ENVIRONMENT)


def test_compare_refuses_rows_of_another_gpu_in_the_folder(rng, baseline):
    """A --resume into a folder measured on another GPU mixes rows of two GPUs: the ratios of the
    other GPU's rows say nothing about this one's baseline."""
    rows = run_rows(rng)
    rows.loc[rows["seqlen"] == 4096, "gpu"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(BaselineMismatch, match=r"measured on \['NVIDIA H100 80GB HBM3', 'NVIDIA H200'\], this run "
                                               r"is on 'NVIDIA H200': the folder holds rows of another GPU"):
        compare_to_baseline(rows, baseline, ENVIRONMENT)


def test_save_needs_the_reference_and_refuses_interpreter_rows(rng, tmp_path):
    with pytest.raises(ValueError, match="add sdpa-flash to --providers"):
        save_baseline(run_rows(rng).query("provider == 'fa2'"), tmp_path / "b.json", ENVIRONMENT)
    with pytest.raises(ValueError, match="interpreter"):
        save_baseline(run_rows(rng).assign(interpreter=True), tmp_path / "b.json", ENVIRONMENT)


def test_summary_pairs_each_repeat_with_the_references_repeat(rng):
    rows = run_rows(rng, repeats=3)
    entry = summarise(rows).iloc[0]
    mine = rows[(rows.provider == "fa2") & (rows["mode"] == entry["mode"]) & (rows.causal == entry["causal"])
                & (rows.seqlen == entry["seqlen"])].sort_values("repeat")["tflops"].to_numpy()
    ref = rows[(rows.provider == REFERENCE) & (rows["mode"] == entry["mode"]) & (rows.causal == entry["causal"])
               & (rows.seqlen == entry["seqlen"])].sort_values("repeat")["tflops"].to_numpy()
    assert entry["log_ratio"] == pytest.approx(np.median(np.log(mine / ref)))
    assert entry["log_ratio_sd"] == pytest.approx(np.std(np.log(mine / ref), ddof=1))


def test_report_states_the_rule_and_groups_by_verdict(rng, baseline, tmp_path):
    comparison = compare_to_baseline(run_rows(rng, slowdown={0: 0.3}), baseline, ENVIRONMENT, sigma=0.02)
    report = format_comparison(comparison)
    assert "1.0% false-positive rate per configuration" in report
    assert report.index("### regression (1)") < report.index("### unchanged (7)")
    assert "**FAIL**: 1 regression" in report
    assert write_comparison(comparison, tmp_path / "out").read_text() == report
    assert list(pd.read_csv(tmp_path / "out" / "comparison.csv")["verdict"]).count("regression") == 1


# --------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------
def test_calibration_meets_its_false_positive_target_and_detects_ten_percent(rng):
    runs = [run_rows(rng, repeats=3, noise=0.01, drift=0.01, machine=rng.uniform(0.9, 1.1)) for _ in range(8)]
    table = calibrate(runs, slowdowns=(0.05, 0.10, 0.20), tolerance=0.0).set_index(["kind", "slowdown", "repeats"])
    assert set(table.columns) >= {"trials", "flagged_rate", "sigma", "threshold"}
    true_sigma = math.sqrt(2 * (0.01**2 + 2 * 0.01**2 / 3))  # drift twice, repeat noise of both providers
    assert table.loc[("none", 0.0, 3), "sigma"] == pytest.approx(true_sigma, rel=0.35)
    assert table.loc[("none", 0.0, 3), "trials"] == 8 * 7 * len(CONFIGS)
    assert table.loc[("none", 0.0, 3), "flagged_rate"] <= 0.03
    assert table.loc[("scaled", 0.10, 3), "flagged_rate"] >= 0.9
    assert table.loc[("scaled", 0.20, 3), "flagged_rate"] == 1.0
    assert table.loc[("none", 0.0, 1), "sigma"] > table.loc[("none", 0.0, 3), "sigma"]  # fewer repeats: noisier


def test_calibration_counts_injected_slowdowns_by_their_name(rng):
    runs = []
    for _ in range(4):
        plain = run_rows(rng, drift=0.005)
        slowed = run_rows(rng, drift=0.005, slowdown=dict.fromkeys(range(len(CONFIGS)), 0.10))
        runs.append(pd.concat([plain, slowed[slowed.provider == "fa2"].assign(provider="fa2-slowed-10")]))
    table = calibrate(runs, tolerance=0.0).set_index(["kind", "slowdown", "repeats"])
    assert table.loc[("injected", 0.10, 3), "trials"] == 4 * 3 * len(CONFIGS)
    assert table.loc[("injected", 0.10, 3), "flagged_rate"] >= 0.9


def test_calibration_tool_writes_the_csv_compare_reads(rng, tmp_path, capsys):
    from harness.results import ResultWriter

    folders = []
    for index in range(4):
        folder = tmp_path / f"run{index}"
        with ResultWriter(folder / "results.csv") as writer:
            for row in run_rows(rng).to_dict("records"):
                writer.write({**row, **{c: math.nan for c in ("ms_p20", "ms_p80", "tflops_p20", "tflops_p80",
                                                              "peak_mem_mb", "rel_err")}})
        folders.append(str(folder))
    out = tmp_path / "calibration.csv"
    assert calibrate_main([*folders, "--out", str(out)]) == 0
    written = pd.read_csv(out)
    assert {"slowdown", "repeats", "trials", "flagged_rate"} <= set(written.columns)
    sigma = calibrated_sigma(out, 3)
    assert sigma == pytest.approx(written.query("slowdown == 0 and repeats == 3")["sigma"].item())
    assert calibrated_sigma(tmp_path / "absent.csv", 3) is None
    with pytest.raises(SystemExit):  # fewer than 3 runs
        calibrate_main([folders[0], "--out", str(out)])
    assert "at least 3 run folders" in capsys.readouterr().err


def test_collect_measures_runs_until_max_seconds_but_at_least_three(tmp_path):
    from harness.calibrate import collect

    sweep = "--modes fwd --hdims 16 --seqlens 32 --causal false --providers pytorch --warmup-ms 1 --rep-ms 2"
    folders = collect(5, tmp_path / "runs", sweep, max_seconds=0.0)
    assert [folder.name for folder in folders] == ["run1", "run2", "run3"]
    assert all((folder / "results.csv").is_file() for folder in folders)
