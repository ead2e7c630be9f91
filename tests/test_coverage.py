"""The coverage suite (harness/coverage.py) in Triton's CPU interpreter on tiny cases: rows in
long format with the kernel that served ours, checked against float64, peers unavailable with
the reason, the report from the rows; the bar's logic on synthetic rows."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from harness import coverage
from harness.features import Case
from harness.timing import kernel_times
from reports import coverage as coverage_report

INTERPRETER_TESTS = True

TINY = [
    Case("sweep", "d16-64-full", 1, 64, 2, 2, causal=False, hdim=16),
    Case("off-grid", "d16-40", 1, 40, 2, 2, hdim=16),
    Case("cross", "q24-k64", 1, 24, 2, 2, hdim=16, seqlen_k=64),
    Case("gqa", "4q-2kv-40", 1, 40, 4, 2, hdim=16),
    Case("varlen", "varlen", 2, 40, 2, 2, lengths=(17, 40), hdim=16),
]


def test_visible_pairs_align_more_keys_bottom_right():
    # query row i of 3 sees keys up to i + 5 of 8: 6 + 7 + 8
    assert Case("g", "v", 1, 3, 1, 1, seqlen_k=8).visible_pairs() == 21
    assert Case("g", "v", 2, 3, 1, 1, causal=False, seqlen_k=8).visible_pairs() == 2 * 24


def test_the_case_list_covers_the_named_shapes_and_quick_is_a_subset():
    full, quick = coverage.cases(False), coverage.cases(True)
    sweep = [c for c in full if c.group == "sweep"]
    assert {(c.hdim, c.seqlen, c.causal) for c in sweep} == {
        (d, n, causal) for d in (64, 96, 128, 192, 256) for n in (2048, 8192) for causal in (False, True)}
    assert all(c.batch * c.seqlen == 16384 and c.heads == 2048 // c.hdim for c in sweep)
    assert {(c.group, c.seqlen, c.keys) for c in full if c.group != "sweep"} >= {
        ("off-grid", 1000, 1000), ("off-grid", 3000, 3000), ("cross", 2048, 8192), ("gqa", 4096, 4096)}
    varlen = next(c for c in full if c.group == "varlen")
    assert varlen.packed and len(set(varlen.lengths)) > 1 and varlen == next(c for c in quick if c.group == "varlen")
    assert set(quick) < set(full)
    assert len({(c.group, c.variant) for c in full}) == len(full)  # distinct names, distinct seeds


def test_on_cpu_the_kernel_column_says_triton_in_the_interpreter():
    cpu = torch.device("cpu")
    for case in TINY:
        served = coverage.kernels_served(case, cpu, coverage.features.our_config(case, cpu, "ours"))
        for mode in ("fwd", "bwd"):
            kernel, reason = served[mode]
            assert kernel.startswith("Triton") and kernel.endswith("(interpreter)"), kernel
            assert reason == "Triton's CPU interpreter runs the Triton kernels"
    assert served["bwd"][0] == "Triton dK/dV, dQ kernel (interpreter)"  # varlen: the atomic-free feature kernels


def test_suite_writes_rows_with_the_kernel_and_a_report_from_them(tmp_path, monkeypatch):
    monkeypatch.setitem(coverage.BUDGET_S, "quick", 1e9)  # every case, however slow the interpreter runs
    coverage.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY, kernel_times=True)
    rows = pd.read_csv(tmp_path / coverage.COVERAGE_CSV, keep_default_na=False)
    assert len(rows) == len(TINY) * len(coverage.PROVIDERS) * 2
    ours = rows[rows.provider == "ours"]
    assert set(ours.status) == {"ok"}, ours[["group", "mode", "status", "reason"]]
    assert set(ours.kernel_us) == {"{}"}  # profiled: no GPU kernel in the interpreter
    assert (ours.rel_err.astype(float) < 1e-5).all() and (ours.tflops.astype(float) > 0).all()
    assert ours.kernel.str.startswith("Triton").all() and ours.kernel.str.endswith("(interpreter)").all()
    assert (ours.kernel_reason != "").all() and ours.config.str.contains('"kernels"').all()
    cross = ours[ours.group == "cross"]
    assert set(cross.seqlen_q) == {24} and set(cross.seqlen_k) == {64}
    peers = rows[rows.provider != "ours"]
    assert set(peers.status) == {"unavailable"} and (peers.kernel == "").all()
    assert {"gpu", "torch", "triton", "git_commit", "timestamp"} <= set(rows.columns)
    assert pd.to_numeric(rows.sm_clock_mhz, errors="coerce").isna().all()  # no NVML reading in the interpreter
    report = coverage_report.write_coverage_report(tmp_path).read_text()
    assert "| cross: 1 x 24 q, 64 k, 2 heads, d 16, causal | fwd |" in report
    assert "gqa: 1 x 40, 4/2 heads" in report and "varlen: 2 seqs up to 40" in report
    assert "Triton's CPU interpreter runs the Triton kernels" in report
    assert "| ours >= 0.95x fa4 fwd in every case fa4 runs | – | n/a |" in report
    assert "Where the time goes" not in report  # no profile of FA4's kernels beside ours
    assert "| every row of ours on a Gluon kernel or with its stated reason | 0 of 10 on Gluon kernels | met |" in report


def test_odd_rounds_run_a_cases_providers_in_reverse(tmp_path, monkeypatch):
    """Under a power cap a kernel's clock depends on what ran before it: round 0 runs each case's
    providers in PROVIDERS' order, round 1 in reverse, each one's forward then its backward."""
    calls = []

    def measure(case, provider, mode, device, dtype, profile_kernels):
        calls.append((case.variant, provider, mode))
        profiled.append(profile_kernels)
        return {"status": "unsupported", "reason": "not measured here"}

    profiled = []

    monkeypatch.setattr(coverage.features, "measure", measure)
    monkeypatch.setattr(coverage, "unavailable_reason", lambda entry: "")
    coverage.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY[:1], repeats=2,
                           kernel_times=True)
    modes = ("fwd", "bwd")
    forward = [(TINY[0].variant, p, m) for p in coverage.PROVIDERS for m in modes]
    backward = [(TINY[0].variant, p, m) for p in reversed(coverage.PROVIDERS) for m in modes]
    assert calls == forward + backward
    assert profiled == [True] * len(forward) + [False] * len(backward)  # kernels profiled in the first round
    profiled.clear()
    coverage.measure_suite(True, tmp_path / "plain", device=torch.device("cpu"), case_list=TINY[:1])
    assert profiled and not any(profiled)  # only where asked (runner.py --kernel-times)
    rows = pd.read_csv(tmp_path / coverage.COVERAGE_CSV, keep_default_na=False)
    assert list(zip(rows.provider, rows["repeat"])) == [(p, r) for r, order in enumerate(
        (coverage.PROVIDERS, coverage.PROVIDERS[::-1])) for p in order for _ in modes]


def _rows(speeds: dict[str, float], peer: str = "fa4", mode: str = "fwd", kernel: str = "Gluon dense fwd",
          reason: str = "") -> pd.DataFrame:
    """Synthetic rows: per case (a sweep variant), ours at 1 ms and the peer at `speed` ms (ours'
    speed over the peer's is `speed`)."""
    rows = []
    for variant, speed in speeds.items():
        case = {"group": "sweep", "variant": variant, "mode": mode, "batch": 8, "seqlen_q": 2048, "seqlen_k": 2048,
                "heads": 16, "kv_heads": 16, "hdim": int(variant[1:]), "causal": True, "lengths": "", "repeat": 0,
                "status": "ok"}
        rows.append({**case, "provider": "ours", "ms": 1.0, "kernel": kernel, "kernel_reason": reason})
        rows.append({**case, "provider": peer, "ms": speed, "kernel": "", "kernel_reason": ""})
    return pd.DataFrame(rows)


def _checks(df):
    return {name: (value, verdict) for name, value, verdict in coverage_report.bar_checks(df)}


def test_the_bar_names_its_worst_case_and_every_case_below_it():
    fa4 = "ours >= 0.95x fa4 fwd in every case fa4 runs"
    met = _checks(_rows({"d64": 1.2, "d128": 0.97}))
    assert met[fa4] == ("0.97x at sweep: 8 x 2048, 16 heads, d 128, causal", "met")
    below = _checks(_rows({"d64": 0.9, "d128": 0.97, "d256": 0.8}))
    assert below[fa4][0] == "0.80x at sweep: 8 x 2048, 16 heads, d 256, causal"
    assert below[fa4][1] == ("not met in 2: sweep: 8 x 2048, 16 heads, d 64, causal; "
                             "sweep: 8 x 2048, 16 heads, d 256, causal")
    assert below["ours >= 0.9x fa4 bwd in every case fa4 runs"][1] == "n/a"  # no backward rows
    cudnn = _checks(_rows({"d128": 0.99}, peer="sdpa-cudnn", mode="bwd"))
    assert cudnn["ours >= 1.0x sdpa-cudnn bwd in every case sdpa-cudnn runs"][1].startswith("not met in 1")
    # a case the peer ran and ours did not is a failure, named
    failed = _rows({"d64": 1.2})
    failed.loc[failed.provider == "ours", "status"] = "error"
    assert _checks(failed)[fa4][1] == "not met in 1: sweep: 8 x 2048, 16 heads, d 64, causal (ours did not measure)"
    # the median below the bar, one round above it: counted apart
    rounds = pd.concat([_rows({"d64": 0.96, "d128": 0.9}).assign(repeat=0),
                        _rows({"d64": 1.0, "d128": 0.97}).assign(repeat=1)])
    assert _checks(rounds)[fa4][1].endswith("d 128, causal (1 of them at or above it in one of the rounds)")
    # a peer that did not measure is no row of the bar
    absent = _rows({"d64": 0.5})
    absent.loc[absent.provider == "fa4", "status"] = "unsupported"
    assert _checks(absent)[fa4] == ("–", "n/a")


def test_the_clock_section_shows_each_providers_clock():
    df = _rows({"d128": 0.8})
    assert coverage_report.clock_lines(df) == []  # rows without readings (older rows, the interpreter)
    df["sm_clock_mhz"] = [1500.0, 1700.0]  # ours, then FA4
    lines = coverage_report.clock_lines(df)
    assert "| sweep: 8 x 2048, 16 heads, d 128, causal | fwd | 1500 | 1700 | – | – |" in lines
    failed = df.copy()
    failed.loc[failed.provider == "fa4", "status"] = "error"  # a row that did not measure gives no reading
    assert coverage_report.clock_lines(failed)[-1].endswith("| 1500 | – | – | – |")


def test_the_kernels_section_splits_ours_and_fa4s_main_kernel_from_the_rest():
    df = _rows({"d128": 0.8}, mode="bwd")
    assert coverage_report.kernel_lines(df) == []  # rows without profiles (older rows, the interpreter)
    ours = {"_flash_bwd_dkdv_hopper_kernel": 1500.0, "_bwd_preprocess_kernel": 95.0, "_dq_cast": 67.0}
    fa4 = {"kernel_cutlass_kernel_flash_bwd_sm90": 1200.0, "preprocess": 97.0, "postprocess": 67.0}
    df["kernel_us"] = [json.dumps(ours), json.dumps(fa4)]
    df["ms"] = [2.0, 1.364]  # ours' call waits on the host: its kernels are 83% of it; FA4's all of it
    lines = coverage_report.kernel_lines(df)
    assert lines[-1] == ("| sweep: 8 x 2048, 16 heads, d 128, causal | bwd | `_flash_bwd_dkdv_hopper_kernel` | 1500 | "
                         "162 | 1200 | 164 | 0.80x | 0.82x | 83 | 100 |")  # all kernels: 1364 us against 1662
    df.loc[df.provider == "fa4", "kernel_us"] = "{}"  # FA4 not profiled: ours' cells, FA4's blank
    assert coverage_report.kernel_lines(df)[-1] == (
        "| sweep: 8 x 2048, 16 heads, d 128, causal | bwd | `_flash_bwd_dkdv_hopper_kernel` | 1500 | 162 | – | – | – | – "
        "| 83 | – |")
    df.loc[df.provider == "ours", "kernel_us"] = "{}"  # ours not profiled: no section
    assert coverage_report.kernel_lines(df) == []


def test_a_profile_that_fails_leaves_the_rows_timing_and_is_listed(tmp_path, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(coverage.features, "kernel_times", failing)
    coverage.measure_suite(True, tmp_path, device=torch.device("cpu"), case_list=TINY[:1], kernel_times=True)
    rows = pd.read_csv(tmp_path / coverage.COVERAGE_CSV, keep_default_na=False)
    ours = rows[rows.provider == "ours"]
    assert set(ours.status) == {"ok"} and (ours.ms.astype(float) > 0).all()
    assert set(ours.kernel_us) == {"error: RuntimeError: CUPTI unavailable"}
    report = coverage_report.write_coverage_report(tmp_path).read_text()
    assert "- sweep: 1 x 64, 2 heads, d 16, full ours fwd: error: RuntimeError: CUPTI unavailable" in report


def test_kernel_times_off_cuda_is_empty_and_refuses_no_calls():
    assert kernel_times(lambda: None, torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="calls must be >= 1"):
        kernel_times(lambda: None, torch.device("cuda"), calls=0)


def test_a_row_of_ours_off_the_gluon_kernels_needs_its_reason():
    gluon = "every row of ours on a Gluon kernel or with its stated reason"
    assert _checks(_rows({"d64": 1.0, "d128": 1.0}))[gluon] == ("2 of 2 on Gluon kernels", "met")
    explained = _rows({"d96": 1.0}, kernel="Triton fwd (tma-host)", reason="head dim 96: the Gluon kernels have ...")
    assert _checks(explained)[gluon] == ("0 of 1 on Gluon kernels", "met")
    silent = _rows({"d96": 1.0}, kernel="Triton fwd (tma-host)")
    assert _checks(silent)[gluon][1] == "not met in 1: sweep: 8 x 2048, 16 heads, d 96, causal fwd (Triton fwd (tma-host))"


def test_a_peer_that_cannot_take_a_case_is_an_unsupported_row_with_the_reason():
    # SDPA's flash backend runs on CPU too: the features registry's call, measured as the suite does
    cpu = torch.device("cpu")
    cross, varlen = TINY[2], TINY[4]
    row = coverage.features.measure(cross, "sdpa-flash", "fwd", cpu, torch.float32)
    assert row["status"] == "unsupported" and "top-left aligned" in row["reason"]
    row = coverage.features.measure(varlen, "sdpa-flash", "bwd", cpu, torch.float32)
    assert row["status"] == "unsupported" and "packed variable lengths" in row["reason"]
    row = coverage.features.measure(TINY[3], "sdpa-flash", "fwd", cpu, torch.float32)  # GQA, equal lengths
    assert row["status"] == "ok" and row["rel_err"] < 1e-5


def test_on_hopper_the_kernel_column_names_the_varlen_kernels_off_the_grid(monkeypatch):
    """On an sm_90 device (its capability stood in for): a dense call off the 128-row grid on the
    varlen kernels is named so, with no reason; a call left on Triton says why, a feature call
    off the grid that the varlen kernels have no feature for among them."""
    import json

    from kernels import configs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    configs._is_hopper.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        packed = json.dumps({"kernels": {"fwd": "gluon-ws-packed", "bwd": "gluon-ws-packed", "dq": "fused"}})
        triton = json.dumps({"kernels": {"fwd": "pointer", "bwd": "triton", "dq": "dq-kernel"}})
        off_grid = Case("off-grid", "d128-3000", 5, 3000, 16, 16)
        assert coverage.kernels_served(off_grid, cuda, packed) == {
            "fwd": ("Gluon varlen (batch rows packed) fwd", ""),
            "bwd": ("Gluon varlen (batch rows packed) dK/dV, fused dQ", "")}
        short = coverage.kernels_served(Case("off-grid", "d64-500", 32, 500, 32, 32, hdim=64), cuda, triton)
        assert short["fwd"] == ("Triton fwd, pointer", "500 keys: fewer than the forward config's hopper_gluon_min_keys 1000")
        assert short["bwd"] == ("Triton dK/dV, dQ kernel",
                                "500 keys: fewer than the backward config's hopper_gluon_min_keys 512")
        dense = json.dumps({"kernels": {"fwd": "gluon-ws", "bwd": "gluon-ws", "dq": "fused"}})
        d192 = coverage.kernels_served(Case("sweep", "d192", 4, 4096, 10, 10, hdim=192), cuda, dense)
        assert d192["bwd"] == ("Gluon dense dK/dV for wide heads (bwd_wide.py), fused dQ", "")
        assert d192["fwd"] == ("Gluon dense fwd", "")
        d256 = coverage.kernels_served(Case("sweep", "d256", 4, 4096, 8, 8, hdim=256), cuda, dense)
        assert d256["bwd"] == ("Gluon dense dK/dV for wide heads (bwd_wide.py), fused dQ", "")
        d256 = coverage.kernels_served(Case("off-grid", "d256-3000", 2, 3000, 8, 8, hdim=256), cuda, triton)
        assert d256["bwd"][1] == "head dim 256: the Gluon varlen backward kernels take head dims 64, 96 and 128"
        d80 = coverage.kernels_served(Case("sweep", "d80", 4, 4096, 21, 21, hdim=80), cuda, triton)
        assert d80["fwd"][1] == "head dim 80: the Gluon forward kernels take head dims 64, 96, 128, 192 and 256"
        window = coverage.kernels_served(Case("window", "w", 2, 3000, 16, 16, window=(256, 0)), cuda, triton)
        assert window["fwd"][1].startswith("a window, softcap, ALiBi or dropout with lengths off the 128-row grid")
    finally:
        configs._is_hopper.cache_clear()


@pytest.mark.gpu
def test_gpu_kernel_times_name_each_kernel_of_our_calls(tmp_path):
    """On a GPU, `--kernel-times` profiles each call of the first round after its timing: our
    rows' `kernel_us` name the forward's kernel, and the backward's dK/dV kernel as the one with
    the most time beside its preprocess and dQ work; the timings stand."""
    case = Case("sweep", "d128-1024-causal", 2, 1024, 4, 4, causal=True)
    coverage.measure_suite(True, tmp_path, case_list=[case], kernel_times=True)
    rows = pd.read_csv(tmp_path / coverage.COVERAGE_CSV, keep_default_na=False)
    ours = rows[rows.provider == "ours"].set_index("mode")
    assert set(ours.status) == {"ok"} and (ours.ms.astype(float) > 0).all()
    for mode in ("fwd", "bwd"):
        times = json.loads(ours.loc[mode, "kernel_us"])
        assert times and all(t > 0 for t in times.values()), times
        assert mode in max(times, key=times.get), times  # _flash_fwd..., _flash_bwd_dkdv...
    assert len(json.loads(ours.loc["bwd", "kernel_us"])) >= 2  # the preprocess beside the dK/dV kernel
