"""Result rows (writer, loading, merging, results.json), the environment helpers, and the
figures and report.md made from rows only.

tests/fixtures/h200_anchor_rows.csv holds result rows made from H200 measurements of the
reference kernels (bf16, fwd and fwd_bwd, head dim 64/128, seqlen 512/2048/16384; sdpa-flash,
sdpa-cudnn, pytorch), plus two pytorch 'oom' rows where there is no measurement and an
'unavailable' xformers-cutlass row per configuration.
"""

import csv
import io
import json
import math
import sys
import time
import types
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.environment import (
    INTERPRETER_GPU,
    ClockSampler,
    capture_environment,
    gpu_slug,
    gpu_state,
    throttle_warnings,
)
from harness.results import (
    COLUMNS,
    KEY_COLUMNS,
    ResultWriter,
    RowFileError,
    completed_keys,
    load_results,
    load_runs,
    record_run,
)
from reports.paper_report import build_report, write_report
from reports.plots import plot_suite

FIXTURE = Path(__file__).parent / "fixtures" / "h200_anchor_rows.csv"
FIXTURE_LABELS = ("FA2 official CUDA (SDPA flash)", "cuDNN (SDPA cudnn)", "PyTorch eager (matmul + softmax)")


def _row(**changes) -> dict:
    row = {column: "" for column in COLUMNS}
    row.update(provider="fa2", label="FA2", mode="fwd", causal=True, hdim=64, seqlen=128, batch=1, heads=2,
               dtype="fp16", repeat=0, status="ok", interpreter=True, gpu=INTERPRETER_GPU,
               **{c: math.nan for c in ("ms", "ms_p20", "ms_p80", "tflops", "tflops_p20", "tflops_p80",
                                        "peak_mem_mb", "rel_err")})
    row.update(changes)
    return row


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------
def test_writer_flushes_each_row_before_closing(tmp_path):
    path = tmp_path / "results.csv"
    writer = ResultWriter(path)
    writer.write(_row(ms=1.5, tflops=2.5))
    assert load_results(path)["ms"].tolist() == [1.5]  # readable while the writer is still open
    writer.close()


def test_writer_rejects_unknown_columns_and_statuses(tmp_path):
    with ResultWriter(tmp_path / "results.csv") as writer:
        with pytest.raises(ValueError, match="unknown columns \\['speed'\\]"):
            writer.write({**_row(), "speed": 1})
        with pytest.raises(ValueError, match="status must be one of"):
            writer.write(_row(status="fine"))


def test_writer_refuses_a_csv_with_other_columns(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("provider,ms\nfa2,1.0\n")
    with pytest.raises(ValueError, match="another version of the runner"):
        ResultWriter(path)


def test_rows_round_trip_with_types_and_nan(tmp_path):
    with ResultWriter(tmp_path / "results.csv") as writer:
        writer.write(_row(ms=0.25, tflops=123.5, rel_err=1e-3, setting="A"))
        writer.write(_row(provider="pytorch", status="oom", reason="CUDA out of memory", causal=False))
    rows = load_results(tmp_path)
    assert list(rows.columns) == list(COLUMNS)
    assert rows["causal"].tolist() == [True, False] and rows["interpreter"].dtype == bool
    assert rows["hdim"].dtype.kind == "i" and rows["setting"].tolist() == ["A", ""]
    assert rows.loc[0, "tflops"] == 123.5 and math.isnan(rows.loc[1, "ms"])


def test_a_key_written_twice_keeps_the_later_row(tmp_path):
    with ResultWriter(tmp_path / "results.csv") as writer:
        writer.write(_row(status="oom", reason="first try"))
        writer.write(_row(provider="pytorch", ms=2.0, tflops=1.0))
        writer.write(_row(status="ok", ms=1.0, tflops=2.0))  # the retry of the first key
    rows = load_results(tmp_path)
    assert len(rows) == 2
    assert rows.set_index("provider").loc["fa2", "status"] == "ok"
    assert len(completed_keys(rows)) == 2 and len(KEY_COLUMNS) == len(next(iter(completed_keys(rows))))


def test_record_run_keeps_every_run_and_writes_strict_json(tmp_path):
    with ResultWriter(tmp_path / "results.csv") as writer:
        writer.write(_row(status="error", reason="boom"))
    record_run(tmp_path, {"run_id": "1", "finished": None})
    record_run(tmp_path, {"run_id": "2", "finished": None})
    record_run(tmp_path, {"run_id": "1", "finished": "later"})
    document = json.loads((tmp_path / "results.json").read_text())  # NaN would not parse strictly below
    json.dumps(document, allow_nan=False)
    assert [run["run_id"] for run in load_runs(tmp_path)] == ["2", "1"]
    assert load_runs(tmp_path)[1]["finished"] == "later"
    assert document["rows"][0]["ms"] is None and document["rows"][0]["reason"] == "boom"


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------
def test_gpu_slug_names_baseline_files():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert gpu_slug(INTERPRETER_GPU) == "cpu"


def test_throttle_warnings_read_the_violation_counters_and_final_reasons():
    before = {"state": {"power_violation_ns": 10, "thermal_violation_ns": 0, "clock_event_reasons": []}}
    calm = {"state": {"power_violation_ns": 10, "thermal_violation_ns": 0, "clock_event_reasons": []}}
    hot = {"state": {"power_violation_ns": 10, "thermal_violation_ns": 5_000_000,
                     "clock_event_reasons": ["hardware thermal slowdown"]}}
    assert throttle_warnings(before, calm) == []
    warnings = throttle_warnings(before, hot)
    assert any("thermal-throttled for 5.0 ms" in w for w in warnings)
    assert any("hardware thermal slowdown" in w for w in warnings)
    assert throttle_warnings({}, {}) == []  # no GPU, nothing to say


class _FakeNvml(types.ModuleType):
    """Just enough of pynvml for gpu_state: an H200 that is power-capped, whose UUID lookup
    and temperature query fail, and which lacks the violation counters."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    nvmlClocksThrottleReasonSwPowerCap, nvmlClocksThrottleReasonGpuIdle = 0x4, 0x1

    def __init__(self):
        super().__init__("pynvml")
        self.shutdown = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shutdown = True
    def nvmlDeviceGetHandleByUUID(self, uuid): raise self.NVMLError("Not Found")
    def nvmlDeviceGetHandleByIndex(self, index): return ("handle", index)
    def nvmlDeviceGetName(self, handle): return "NVIDIA H200"
    def nvmlSystemGetDriverVersion(self): return "570.1"
    def nvmlDeviceGetClockInfo(self, handle, clock): return {1: 1755, 2: 3201}[clock]
    def nvmlDeviceGetMaxClockInfo(self, handle, clock): return 1980
    def nvmlDeviceGetTemperature(self, handle, sensor): raise self.NVMLError("Not Supported")
    def nvmlDeviceGetPowerUsage(self, handle): return 650_000
    def nvmlDeviceGetEnforcedPowerLimit(self, handle): return 700_000
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle): return 0x4 | 0x1


class _SampledNvml(_FakeNvml):
    """_FakeNvml whose SM clock steps down each reading (1800, 1700, then 1600) and fails every
    fourth time."""

    def __init__(self):
        super().__init__()
        self.clock_readings = 0

    def nvmlDeviceGetClockInfo(self, handle, clock):
        self.clock_readings += 1
        if self.clock_readings % 4 == 0:
            raise self.NVMLError("Unknown Error")
        return 1900 - 100 * min(self.clock_readings, 3)


def test_the_clock_sampler_averages_nvml_readings_while_its_block_runs(monkeypatch):
    fake = _SampledNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=None))
    with ClockSampler(interval_s=0.001) as sampler:
        while fake.clock_readings < 8:
            time.sleep(0.001)
    assert fake.shutdown and not sampler._thread.is_alive()
    readings, failed = fake.clock_readings, fake.clock_readings // 4
    assert sampler.failed_readings == failed and len(sampler.clocks) == readings - failed
    expected = (1800 + 1700 + 1600 * (readings - failed - 2)) / (readings - failed)
    assert sampler.sm_clock_mhz == pytest.approx(expected)  # the failed readings left out of the mean


def test_without_cuda_the_clock_sampler_reads_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _SampledNvml())  # NVML would answer; CUDA is not there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with ClockSampler() as sampler:
        pass
    assert math.isnan(sampler.sm_clock_mhz) and sampler._thread is None


def test_gpu_state_reads_nvml_and_records_what_it_cannot_read(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="1234-abcd"))
    state = gpu_state()
    assert state["name"] == "NVIDIA H200" and state["driver"] == "570.1"
    assert state["sm_clock_mhz"] == 1755 and state["mem_clock_mhz"] == 3201 and state["power_w"] == 650.0
    assert state["clock_event_reasons"] == ["software power cap"]  # GpuIdle is not a throttle
    assert state["temperature_c"] is None and state["power_violation_ns"] is None
    errors = " ".join(state["nvml_errors"])
    assert "GPU-1234-abcd" in errors and "Not Supported" in errors and "AttributeError" in errors
    assert fake.shutdown


def test_environment_has_every_row_column():
    environment = capture_environment()
    for column in ("gpu", "driver", "cuda", "torch", "triton", "git_commit", "timestamp"):
        assert column in environment
    assert environment["git_commit"]
    if environment["interpreter"]:
        assert environment["gpu"] == INTERPRETER_GPU


# --------------------------------------------------------------------------------------
# Figures and report, from the fixture rows
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_rows() -> pd.DataFrame:
    return load_results(FIXTURE)


def test_one_figure_per_mode_with_every_measured_provider_and_oom_text(fixture_rows, tmp_path):
    paths = plot_suite(fixture_rows, tmp_path)
    assert sorted(p.name for p in paths) == ["fwd_bf16.png", "fwd_bf16.svg", "fwd_bwd_bf16.png", "fwd_bwd_bf16.svg"]
    assert all(p.stat().st_size > 1000 for p in paths)
    fwd_bwd = (tmp_path / "fwd_bwd_bf16.svg").read_text()
    for label in FIXTURE_LABELS:
        assert label in fwd_bwd
    assert ">OOM<" in fwd_bwd  # the pytorch OOM cells are written, not drawn as zero bars
    assert ">OOM<" not in (tmp_path / "fwd_bf16.svg").read_text()
    assert "xformers" not in fwd_bwd  # never measured: in the report's failures, not in the figure
    assert "NVIDIA H200" in fwd_bwd and "bf16" in fwd_bwd


def test_interpreter_rows_say_not_performance_in_figure_and_report(tmp_path):
    rows = pd.DataFrame([_row(ms=30.0, tflops=3e-5, tflops_p20=3e-5, tflops_p80=3e-5)])
    plot_suite(rows, tmp_path)
    assert "NOT performance" in (tmp_path / "fwd_fp16.svg").read_text()
    assert "NOT performance" in build_report(rows)


def test_report_tables_speedups_and_failures_come_from_the_rows(fixture_rows, tmp_path):
    figures = plot_suite(fixture_rows, tmp_path / "plots")
    text = write_report(fixture_rows, tmp_path, runs=[], figures=figures).read_text()
    assert "![fwd bf16](plots/fwd_bf16.png)" in text
    # a cell of the table is the row's value: sdpa-flash fwd causal d128 seqlen 2048
    row = fixture_rows.query("provider == 'sdpa-flash' and mode == 'fwd' and causal and hdim == 128 "
                             "and seqlen == 2048").iloc[0]
    assert f"| 2048 | 8 | 16 | {row['tflops']:.0f} |" in text
    assert "## Speedup vs FA2 official CUDA (SDPA flash)" in text
    assert "## Speedup vs PyTorch eager (matmul + softmax)" in text
    cudnn = fixture_rows.query("provider == 'sdpa-cudnn' and mode == 'fwd' and not causal and hdim == 64")
    flash = fixture_rows.query("provider == 'sdpa-flash' and mode == 'fwd' and not causal and hdim == 64")
    ratios = cudnn.set_index("seqlen")["tflops"] / flash.set_index("seqlen")["tflops"]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    assert f"| fwd bf16 d64 non-causal | {geomean:.2f}x" in text
    assert "| pytorch | oom | 2 |" in text and "| xformers-cutlass | unavailable | 24 |" in text
    assert "| OOM |" in text and "| nan" not in text


def test_a_row_cut_short_by_a_kill_is_dropped_before_appending(tmp_path):
    path = tmp_path / "results.csv"
    with ResultWriter(path) as writer:
        writer.write(_row(provider="pytorch", ms=1.0, tflops=1.0))
        writer.write(_row(ms=2.0, tflops=2.0))
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the last row loses its end (and its newline)
    with pytest.warns(UserWarning, match="skipped 1 incomplete row"):
        assert load_results(path)["provider"].tolist() == ["pytorch"]
    with pytest.warns(UserWarning, match="removed an incomplete last row"):
        writer = ResultWriter(path)
    with writer:
        writer.write(_row(provider="sdpa-math", ms=3.0, tflops=3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is whole again: no warning
        assert load_results(path)["provider"].tolist() == ["pytorch", "sdpa-math"]


def test_a_row_cut_inside_a_quoted_field_loses_only_itself(tmp_path):
    """A kill inside the quoted `config` JSON used to make the CSV parser swallow every row
    appended after it."""
    path = tmp_path / "results.csv"
    config = json.dumps({"block_m": 128, "block_n": 64, "note": "a, b"})
    with ResultWriter(path) as writer:
        writer.write(_row(provider="first", tflops=1.0, config=config))
        writer.write(_row(provider="cut", tflops=1.0, config=config))
    text = path.read_text()
    path.write_text(text[: text.index('""block_n', text.index("\ncut,"))])  # a kill inside the quotes
    with pytest.warns(UserWarning, match="removed an incomplete last row"):
        writer = ResultWriter(path)
    with writer:
        writer.write(_row(provider="after-1", tflops=2.0, config=config))
        writer.write(_row(provider="after-2", tflops=3.0, config=config))
    rows = load_results(path)
    assert rows["provider"].tolist() == ["first", "after-1", "after-2"]
    assert rows["config"].tolist() == [config] * 3
    # a broken line in the middle (e.g. a file edited by hand): the rows after it survive it
    middle = path.read_text().splitlines()
    path.write_text("\n".join([*middle[:2], '"broken,cell', *middle[2:]]) + "\n")
    with pytest.warns(UserWarning, match="skipped 1 incomplete row"):
        assert load_results(path)["provider"].tolist() == ["first", "after-1", "after-2"]


def test_a_truncated_csv_warns_once_however_often_it_is_read(tmp_path):
    path = tmp_path / "results.csv"
    with ResultWriter(path) as writer:
        writer.write(_row(tflops=1.0))
    path.write_text(path.read_text() + "fa2,FA2,,fwd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            load_results(path)
    assert len([w for w in caught if "incomplete row" in str(w.message)]) == 1


def test_text_with_newlines_stays_on_one_line(tmp_path):
    with ResultWriter(tmp_path / "results.csv") as writer:
        writer.write(_row(status="error", reason="Traceback:\n  line 1\r\n  line 2"))
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 2
    assert load_results(tmp_path)["reason"].item() == "Traceback:   line 1   line 2"


def test_inf_and_nan_rows_make_strict_json(tmp_path):
    """An output holding inf used to crash writing results.json ("Out of range float values")."""
    with ResultWriter(tmp_path / "results.csv") as writer:
        writer.write(_row(status="wrong", reason="inf in the output", rel_err=math.inf))
        writer.write(_row(provider="p", status="ok", tflops=-math.inf, ms=math.nan))
    record_run(tmp_path, {"run_id": "1", "finished": None, "note": math.inf})
    document = json.loads((tmp_path / "results.json").read_text())
    assert [row["rel_err"] for row in document["rows"]] == [None, None]
    assert document["runs"][0]["note"] is None
    assert load_results(tmp_path)["rel_err"].iloc[0] == math.inf  # the CSV keeps it


def test_results_json_is_replaced_atomically_under_a_per_process_name(tmp_path, monkeypatch):
    import os

    from harness import io

    names = []
    real_replace = Path.replace

    def spy(self, target):
        names.append(self.name)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", spy)
    record_run(tmp_path, {"run_id": "1"})
    io.atomic_write_text(tmp_path / "x.md", "text")
    assert len(names) == 2 and all(f".{os.getpid()}." in name for name in names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "x.md"]  # no temporary left


def test_a_half_written_results_json_warns_and_is_written_anew(tmp_path):
    record_run(tmp_path, {"run_id": "1"})
    text = (tmp_path / "results.json").read_text()
    (tmp_path / "results.json").write_text(text[: len(text) // 2])
    with pytest.warns(UserWarning, match="unreadable"):
        assert load_runs(tmp_path) == []
    record_run(tmp_path, {"run_id": "2"})  # warned once above
    assert [run["run_id"] for run in load_runs(tmp_path)] == ["2"]


@pytest.mark.parametrize("older", [0, 1, 2],
                         ids=["without the SM clock", "without peer versions either", "without check_shape either"])
def test_earlier_column_sets_are_read_with_the_missing_columns_empty(tmp_path, older):
    from harness.results import OLDER_HEADERS

    header = OLDER_HEADERS[older]
    path = tmp_path / "results.csv"
    row = _row(tflops=1.0, check_shape="b1 n128", flash_attn_4="4.0", sm_clock_mhz=1755.0)
    pd.DataFrame([{c: row[c] for c in header}]).to_csv(path, index=False)
    rows = load_results(path)
    assert list(rows.columns) == list(COLUMNS) and math.isnan(rows["sm_clock_mhz"].item())
    assert rows["flash_attn_4"].item() == ("4.0" if "flash_attn_4" in header else "")
    assert rows["check_shape"].item() == ("b1 n128" if "check_shape" in header else "")


def test_the_sm_clock_is_read_back_as_a_number(tmp_path):
    path = tmp_path / "results.csv"
    with ResultWriter(path) as writer:
        writer.write(_row(tflops=1.0, sm_clock_mhz=1755.0))
        writer.write(_row(provider="fa4", label="FA4", status="oom"))  # no timing: no clock
    rows = load_results(path).set_index("provider")
    assert rows.loc["fa2", "sm_clock_mhz"] == 1755.0 and math.isnan(rows.loc["fa4", "sm_clock_mhz"])
    path.write_text(path.read_text().replace("1755.0", "fast"))
    with pytest.raises(RowFileError, match="'sm_clock_mhz'"):
        load_results(path)


def test_appending_to_an_earlier_file_rewrites_it_with_this_versions_columns(tmp_path):
    from harness.results import PREVIOUS_COLUMNS

    path = tmp_path / "results.csv"
    pd.DataFrame([{c: _row(tflops=1.0)[c] for c in PREVIOUS_COLUMNS}]).to_csv(path, index=False)
    with pytest.warns(UserWarning, match="rewritten with this version's columns"), ResultWriter(path) as writer:
        writer.write(_row(provider="fa4", label="FA4", tflops=2.0, flash_attn_4="4.0.0b36"))
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    rows = load_results(path).set_index("provider")
    assert rows.loc["fa2", "tflops"] == 1.0 and rows.loc["fa2", "flash_attn_4"] == ""
    assert rows.loc["fa4", "flash_attn_4"] == "4.0.0b36"
    assert path.read_bytes().count(b"\r\n") == 3 and b"\n" not in path.read_bytes().replace(b"\r\n", b"")


def test_an_earlier_file_with_a_cut_last_row_is_upgraded_without_it(tmp_path):
    import csv

    from harness.results import PREVIOUS_COLUMNS

    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:  # csv's own line endings, as the runner writes them
        writer = csv.DictWriter(f, fieldnames=PREVIOUS_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerow(_row(tflops=1.0))
    with path.open("ab") as f:
        f.write(b"fa4,FA4,,fwd")  # a row cut by a killed process
    with pytest.warns(UserWarning), ResultWriter(path) as writer:
        writer.write(_row(provider="sdpa-flash", label="x", tflops=2.0))
    rows = load_results(path)
    assert sorted(rows.provider) == ["fa2", "sdpa-flash"] and list(rows.columns) == list(COLUMNS)


def test_a_file_holding_only_a_cut_header_is_started_anew(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text(",".join(COLUMNS))  # the header without its newline: the process died there
    with ResultWriter(path) as writer:
        writer.write(_row(tflops=1.0))
    assert load_results(path).provider.tolist() == ["fa2"]


def _three_rows(path: Path) -> list[bytes]:
    with ResultWriter(path) as writer:
        for provider in ("a", "b", "c"):
            writer.write(_row(provider=provider, ms=1.0, tflops=1.0))
    return path.read_bytes().split(b"\n")


def test_bytes_that_are_not_utf8_are_named_by_file_line_and_column(tmp_path):
    path = tmp_path / "results.csv"
    lines = _three_rows(path)
    lines[2] = lines[2].replace(b"FA2", b"F\xffA2", 1)  # line 3, the label of row b
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RowFileError, match=(rf"{path}, line 3, column 'label': not UTF-8 text \(byte 0xff, the "
                                            r"line's byte \d+\); fix or delete that line .* start a new --out")):
        load_results(path)


def test_a_row_cut_inside_a_character_is_only_an_incomplete_row(tmp_path):
    path = tmp_path / "results.csv"
    with ResultWriter(path) as writer:
        writer.write(_row(provider="a", tflops=1.0))
        writer.write(_row(provider="b", reason="é", status="error"))
    data = path.read_bytes()
    path.write_bytes(data[: data.index("é".encode()) + 1])  # killed between the two bytes of é
    with pytest.warns(UserWarning, match="skipped 1 incomplete row"):
        assert load_results(path)["provider"].tolist() == ["a"]


@pytest.mark.parametrize(("column", "value", "expected"), [
    ("hdim", "abc", "an integer"), ("repeat", "1.5", "an integer"), ("ms", "fast", r"a number \(or empty\)"),
    ("causal", "yes", "True or False")])
def test_a_cell_not_of_its_columns_type_is_named_by_file_line_and_column(tmp_path, column, value, expected):
    path = tmp_path / "results.csv"
    lines = _three_rows(path)
    fields = next(csv.reader([lines[3].decode()]))
    fields[COLUMNS.index(column)] = value
    text = io.StringIO()
    csv.writer(text).writerow(fields)
    lines[3] = text.getvalue().rstrip("\r\n").encode() + b"\r"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RowFileError, match=rf"{path}, line 4, column '{column}': '{value}' is not {expected}; fix or "
                                           "delete that line"):
        load_results(path)


def test_cpu_report_says_perf_counter_and_draws_no_conclusion():
    rows = pd.DataFrame([_row(provider=p, label=p, tflops=t, tflops_p20=t, tflops_p80=t, ms=1.0)
                         for p, t in (("sdpa-flash", 3e-5), ("pytorch", 9e-6), ("fa2", 1e-7))])
    text = build_report(rows)
    assert "perf_counter" in text and "do_bench" not in text
    assert "Speedup" not in text and "No speedup is computed" in text


def test_small_speedups_keep_their_digits(fixture_rows):
    rows = fixture_rows.copy()
    slow = rows["provider"] == "pytorch"
    rows.loc[slow, "tflops"] = rows.loc[slow, "tflops"] * 0.003 / rows.loc[slow, "tflops"].max()
    text = build_report(rows)
    assert "0.00x" not in text
    from reports.tables import ratio_text

    assert ratio_text(0.003) == "0.003x" and ratio_text(0.0347) == "0.035x" and ratio_text(1.234) == "1.23x"


# --------------------------------------------------------------------------------------
# Merging runs (tools/merge_paper_runs.py)
# --------------------------------------------------------------------------------------
def _load_merge_tool():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "merge_paper_runs.py"
    spec = importlib.util.spec_from_file_location("merge_paper_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merged_runs_take_later_rows_filter_sources_and_keep_every_run(tmp_path, monkeypatch):
    first, second, out = tmp_path / "first", tmp_path / "second", tmp_path / "merged"
    with ResultWriter(first / "results.csv") as writer:
        writer.write(_row(seqlen=128, tflops=1.0))
        writer.write(_row(seqlen=256, tflops=1.0))
        writer.write(_row(provider="pytorch", seqlen=128, tflops=0.5))
    record_run(first, {"run_id": "a", "finished": "x"})
    with ResultWriter(second / "results.csv") as writer:
        writer.write(_row(seqlen=128, tflops=2.0))  # replaces first's row of the same key
        writer.write(_row(mode="bwd", seqlen=128, tflops=9.0))  # filtered out by --where
    record_run(second, {"run_id": "b", "finished": "y"})
    tool = _load_merge_tool()
    monkeypatch.setattr(sys, "argv", ["merge_paper_runs.py", "--out", str(out), "--source", str(first),
                                      "--source", str(second), "--where", 'mode == "fwd"',
                                      "--drop", 'provider == "pytorch"'])
    tool.main()
    rows = load_results(out).set_index(["provider", "mode", "seqlen"])["tflops"].to_dict()
    assert rows == {("fa2", "fwd", 128): 2.0, ("fa2", "fwd", 256): 1.0}
    runs = load_runs(out)
    assert [r["run_id"] for r in runs[:2]] == ["a", "b"] and "--drop" in runs[2]["command"]
    json.dumps(json.loads((out / "results.json").read_text()), allow_nan=False)


def test_a_run_without_rows_reports_the_environment_it_recorded(fixture_rows, tmp_path):
    """A run that only profiled (`--ncu-only`) writes no rows: its report's environment is the one
    the run recorded before it started, not dashes."""
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "git_commit": "abc"}
    runs = [{"run_id": "r1", "command": "runner.py --ncu-only", "environment_before": env, "finished": "t"}]
    text = write_report(fixture_rows.iloc[0:0], tmp_path, runs=runs).read_text()
    assert "- gpu: NVIDIA H100 80GB HBM3" in text and "- triton: 3.6.0" in text and "- git_commit: abc" in text
