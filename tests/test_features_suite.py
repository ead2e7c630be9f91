"""The features suite's pipeline (harness/features.py) in Triton's CPU interpreter on tiny
cases: rows in long format with the environment, our kernels measured and checked against
float64, peers recorded as unavailable with the reason, and the report made from the rows."""

from __future__ import annotations

import pandas as pd
import torch

from harness import features
from reports import features as features_report

INTERPRETER_TESTS = True

TINY = [
    features.Case("gqa", "gqa", 1, 40, 4, 2, hdim=16),
    features.Case("window", "window", 1, 64, 2, 2, window=(8, 0), hdim=16),
    features.Case("window", "full-causal", 1, 64, 2, 2, hdim=16),
    features.Case("varlen", "varlen", 2, 40, 2, 2, lengths=(17, 40), hdim=16),
    features.Case("varlen", "padded", 2, 40, 2, 2, lengths=(17, 40), hdim=16),
    features.Case("score", "dense", 1, 40, 2, 2, hdim=16),
    features.Case("score", "alibi", 1, 40, 2, 2, alibi=True, hdim=16),
    features.Case("score", "softcap", 1, 40, 2, 2, softcap=2.0, hdim=16),
]


def test_visible_pairs_count_the_mask():
    assert features.Case("g", "v", 2, 5, 1, 1).visible_pairs() == 2 * 15  # causal: 5 * 6 / 2 per sequence
    assert features.Case("g", "v", 1, 6, 1, 1, window=(1, 0)).visible_pairs() == 11  # 1 + 2 * 5
    assert features.Case("g", "v", 1, 0, 1, 1, lengths=(3, 4)).visible_pairs() == 6 + 10


def test_suite_writes_rows_and_a_report_from_them(tmp_path, monkeypatch):
    # every case measured however slow the interpreter runs here (the budget's own test is below)
    monkeypatch.setitem(features.BUDGET_S, "quick", 1e9)
    features.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY)
    rows = pd.read_csv(tmp_path / features.FEATURES_CSV, keep_default_na=False)
    ours = rows[rows.provider == "ours"]
    assert len(ours) == 2 * len(TINY) and set(ours.status) == {"ok"}, ours[["variant", "status", "reason"]]
    assert (ours.rel_err.astype(float) < 1e-5).all() and (ours.tflops.astype(float) > 0).all()
    assert set(rows[~rows.provider.str.startswith("ours")].status) == {"unavailable"}
    assert {"gpu", "torch", "triton", "git_commit", "timestamp"} <= set(rows.columns)
    assert rows.interpreter.astype(str).str.lower().eq("true").all()
    report = features_report.write_features_report(tmp_path).read_text()
    for heading in ("## GQA", "## Sliding window", "## Packed variable lengths", "## ALiBi and softcap", "## The bar"):
        assert heading in report
    assert "window (8, 0) at 64 fwd" in report and "needs CUDA" in report


def test_rounds_repeat_the_suite_and_the_report_takes_their_medians(tmp_path):
    features.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY[5:7], repeats=2)
    rows = pd.read_csv(tmp_path / features.FEATURES_CSV, keep_default_na=False)
    ours = rows[rows.provider == "ours"]
    assert sorted(ours.repeat.astype(int)) == [0] * 4 + [1] * 4 and set(ours.status) == {"ok"}
    report = features_report.write_features_report(tmp_path).read_text()
    assert "2 rounds over the suite" in report and "over 2 rounds)" in report


def _score_rows(alibi_ms_by_round, dense_ms=1.0):
    """Rows of the score group: ours' dense and ALiBi forward, one pair per round."""
    base = {"group": "score", "provider": "ours", "mode": "fwd", "status": "ok", "seqlen_q": 8192}
    rows = [{**base, "variant": "dense", "ms": dense_ms, "repeat": r} for r in range(len(alibi_ms_by_round))]
    rows += [{**base, "variant": "alibi", "ms": ms, "repeat": r} for r, ms in enumerate(alibi_ms_by_round)]
    return pd.DataFrame(rows)


def test_a_bar_ratio_is_taken_within_each_round_and_reports_the_rounds_that_disagree():
    checks = {name: (value, verdict) for name, value, verdict in features_report.bar_checks(_score_rows([1.05, 1.12, 1.08]))}
    value, verdict = checks["alibi fwd: time over dense <= 1.1"]
    assert value == "1.08x (1.05x-1.12x over 3 rounds)"
    assert verdict == "met (not met in 1 of 3 rounds)"
    one_round = {name: (value, verdict) for name, value, verdict in features_report.bar_checks(_score_rows([1.2]))}
    assert one_round["alibi fwd: time over dense <= 1.1"] == ("1.20x", "not met")  # no range, no dissent
    # a round whose dense row failed is left out of the ratio, not paired with another round's
    rows = _score_rows([1.05, 1.3])
    rows.loc[(rows.variant == "dense") & (rows.repeat == 1), "status"] = "error"
    assert {n: v for n, v, _ in features_report.bar_checks(rows)}["alibi fwd: time over dense <= 1.1"] == "1.05x"


def test_cases_past_the_budget_are_listed_not_measured(tmp_path, monkeypatch):
    monkeypatch.setitem(features.BUDGET_S, "quick", -1.0)  # spent before the first case
    features.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY[:2])
    rows = pd.read_csv(tmp_path / features.FEATURES_CSV, keep_default_na=False)
    assert rows.empty
    notes = (tmp_path / "notes.txt").read_text()
    assert "budget ran out" in notes and f"{TINY[0].group}/{TINY[0].variant} at {TINY[0].seqlen}" in notes
