"""Nsight Compute support (harness/ncu.py, harness/ncu_target.py, reports/counters.py) without a GPU: the
metric names against Hopper's list, parsing saved `ncu --csv --page raw` output, the derived
ratios and the generated sentences, and every failure path with a fake `ncu` on PATH."""

import math
import os
import stat
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from baselines.providers import RUNG_NAMES, Spec
from harness import ncu
from harness.ncu import (
    METRIC_GROUPS,
    METRICS,
    NcuJob,
    build_ncu_command,
    ncu_status,
    parse_ncu_csv,
    profile_providers,
)
from reports import counters
from reports.counters import counter_table, derive, rung_index, write_counter_report

FIXTURES = Path(__file__).parent / "fixtures" / "ncu"
ORDER = [*RUNG_NAMES, "sdpa-flash"]
# Launch statistics are not hardware counters, so `ncu --query-metrics` does not list them: these
# are the LaunchStats / Occupancy section names, all but waves seen working on the H200 (GPU.md).
LAUNCH_STATISTICS = {"launch__grid_size", "launch__waves_per_multiprocessor", "launch__registers_per_thread",
                     "launch__shared_mem_per_block_dynamic", "launch__occupancy_limit_registers",
                     "launch__occupancy_limit_shared_mem"}
ROLLUPS = {"sum", "avg", "min", "max"}
SUBMETRICS = {"pct_of_peak_sustained_active", "pct_of_peak_sustained_elapsed", "per_second",
              "per_cycle_active", "per_cycle_elapsed"}


def hopper_metrics() -> dict[str, str]:
    lines = (FIXTURES / "gh100_metric_names.txt").read_text().splitlines()
    return dict(line.split() for line in lines if not line.startswith("#"))


def valid_suffix(kind: str, suffix: list[str]) -> bool:
    """ncu's naming: a Counter or Throughput takes a rollup then an optional submetric; a Ratio
    takes .pct, .ratio or .max_rate."""
    if kind == "Ratio":
        return suffix in (["pct"], ["ratio"], ["max_rate"])
    return len(suffix) in (1, 2) and suffix[0] in ROLLUPS and all(s in SUBMETRICS for s in suffix[1:])


def test_every_hardware_metric_exists_on_hopper_with_a_valid_suffix():
    known = hopper_metrics()
    assert len(known) > 3000
    for metric in METRICS:
        if metric.startswith("launch__"):
            assert metric in LAUNCH_STATISTICS, metric
            continue
        base, *suffix = metric.split(".")
        assert base in known, f"{base} is not a gh100 metric"
        assert valid_suffix(known[base], suffix), f"{metric}: suffix {suffix} does not fit a {known[base]}"


def test_metric_groups_cover_each_claim_once():
    assert set(METRIC_GROUPS) == {"non-matmul work", "parallelism", "communication", "context", "issue"}
    assert len(METRICS) == len(set(METRICS))
    claims = {column: group for group, names in METRIC_GROUPS.items() for column in names}
    non_matmul = (ncu.FFMA, ncu.MUFU, ncu.HMMA, ncu.GMMA)
    assert {claims[m] for m in non_matmul} == {"non-matmul work"}
    assert {claims[m] for m in (ncu.GRID, ncu.WAVES, ncu.SM_THROUGHPUT)} == {"parallelism"}
    assert {claims[m] for m in (ncu.SHARED_WAVEFRONTS, ncu.BARRIER_STALL)} == {"communication"}
    assert {claims[m] for m in (ncu.SM_CYCLES, ncu.STALL_BARRIER_PER_ISSUE, ncu.L2_HIT)} == {"issue"}


# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------
def test_parse_raw_csv_skips_prof_lines_and_strips_thousands_separators():
    text = (FIXTURES / "raw_triton_fwd.csv").read_text()
    frame = parse_ncu_csv(text)
    assert len(frame) == 1
    kernel = frame.iloc[0]
    assert kernel["Kernel Name"] == "_flash_fwd_kernel"
    assert kernel["Grid Size"] == "(16, 128, 1)"
    # recorded before the "issue" group (a kernel's cycles beside a peer's) was added
    assert set(METRICS) - set(METRIC_GROUPS["issue"]) <= set(frame.columns)
    data_row = text.splitlines()[-1].split('","')
    header = text.splitlines()[-3].split('","')
    as_written = dict(zip(header, data_row))
    assert kernel[ncu.GRID] == int(as_written["launch__grid_size"].replace(",", ""))
    wavefronts = as_written[ncu.SHARED_WAVEFRONTS]
    assert "," in wavefronts and kernel[ncu.SHARED_WAVEFRONTS] == float(wavefronts.replace(",", ""))
    assert frame.attrs["units"][ncu.DURATION] == "nsecond"
    assert frame.attrs["units"][ncu.WARPS_ACTIVE] == "%"


def test_parse_scaled_units_to_base_and_n_a_to_nan():
    frame = parse_ncu_csv((FIXTURES / "raw_sdpa_flash_fwd_scaled_units.csv").read_text())
    kernel = frame.iloc[0]
    assert kernel["Kernel Name"].startswith("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<")
    assert kernel["Kernel Name"].endswith("(pytorch_flash::Flash_fwd_params)")  # commas inside quotes kept
    assert kernel[ncu.DURATION] == pytest.approx(481.50e3)  # usecond -> nanoseconds
    assert kernel[ncu.DRAM_READ] == pytest.approx(224.13e6)  # Mbyte -> bytes
    assert kernel[ncu.SHARED_PER_BLOCK] == pytest.approx(49.15e3)  # Kbyte/block -> byte/block
    assert kernel[ncu.FFMA] == pytest.approx(402.65e6)  # Minst -> inst
    assert math.isnan(kernel[ncu.WAVES])  # 'n/a'
    assert frame.attrs["units"][ncu.SHARED_PER_BLOCK] == "byte/block"


def _raw(metrics: dict[str, tuple[str, str]], units_row: list[str] | None = None) -> str:
    """`ncu --csv --page raw` text of one kernel: metric -> (unit, value as printed)."""
    names = ["ID", "Kernel Name", *metrics]
    units = units_row if units_row is not None else ["", "", *(unit for unit, _ in metrics.values())]
    values = ["0", "_flash_fwd_kernel", *(value for _, value in metrics.values())]
    return "\n".join(",".join(f'"{cell}"' for cell in line) for line in (names, units, values)) + "\n"


def test_parse_converts_every_scaled_unit_and_refuses_unknown_ones():
    frame = parse_ncu_csv(_raw({ncu.DURATION: ("psecond", "481500"), ncu.DRAM_READ: ("KiB", "2"),
                                ncu.DRAM_WRITE: ("Gbyte", "1.5"), ncu.FFMA: ("furlong", "7")}))
    kernel = frame.iloc[0]
    assert kernel[ncu.DURATION] == pytest.approx(481.5)  # psecond -> nanoseconds
    assert kernel[ncu.DRAM_READ] == 2048 and kernel[ncu.DRAM_WRITE] == pytest.approx(1.5e9)
    assert math.isnan(kernel[ncu.FFMA]) and "unknown unit 'furlong'" in frame.attrs["problems"][ncu.FFMA]


def test_parse_counts_pc_samples_in_branches():
    # PC sampling counts stalled branch instructions in 'branches' (Nsight Compute 2025.3)
    stalled = "smsp__pcsamp_warps_issue_stalled_branch_resolving"
    frame = parse_ncu_csv(_raw({stalled: ("branches", "331"), stalled + "_x": ("Kbranches", "1.5")}))
    assert frame.iloc[0][stalled] == 331 and frame.iloc[0][stalled + "_x"] == pytest.approx(1500)
    assert not frame.attrs["problems"]


@pytest.mark.parametrize(("unit", "nanoseconds"), [("nsecond", 2.5), ("ns", 2.5), ("usecond", 2500.0),
                                                  ("us", 2500.0), ("ms", 2.5e6)])
def test_parse_durations_in_long_and_short_unit_names(unit, nanoseconds):
    # Nsight Compute 2025.3 prints the short names ('ns') where earlier versions printed 'nsecond'
    frame = parse_ncu_csv(_raw({ncu.GRID: ("", "128"), ncu.DURATION: (unit, "2.5")}))
    assert frame.iloc[0][ncu.DURATION] == pytest.approx(nanoseconds)
    assert frame.attrs["units"][ncu.DURATION] == "nsecond" and ncu.DURATION not in frame.attrs["problems"]


def test_parse_a_short_units_row_uses_no_value_rather_than_shifted_ones():
    text = _raw({ncu.GRID: ("", "128"), ncu.DURATION: ("usecond", "2.5")}, units_row=["", "", "usecond"])
    frame = parse_ncu_csv(text)
    assert math.isnan(frame.iloc[0][ncu.GRID]) and math.isnan(frame.iloc[0][ncu.DURATION])
    assert "units row has 3 fields for 4 columns" in frame.attrs["problems"][ncu.DURATION]


@pytest.mark.parametrize(("printed", "expected"), [("N/A", math.nan), ("n/a", math.nan), ("1,234,567", 1234567.0),
                                                   ("24,61", math.nan), ("3.5e2", 350.0)])
def test_parse_numbers_reads_thousands_separators_only(printed, expected):
    frame = parse_ncu_csv(_raw({ncu.GRID: ("", printed), ncu.DURATION: ("nsecond", "10")}))
    value = frame.iloc[0][ncu.GRID]
    assert (math.isnan(value) if math.isnan(expected) else value == expected), printed
    if printed == "24,61":
        assert "not a number" in frame.attrs["problems"][ncu.GRID]


def test_parse_a_duplicate_metric_column_keeps_the_first():
    text = _raw({ncu.GRID: ("", "128"), ncu.DURATION: ("nsecond", "10")})
    lines = [line + ',"' + cell + '"' for line, cell in zip(text.splitlines(), [ncu.GRID, "", "999"])]
    frame = parse_ncu_csv("\n".join(lines))
    assert frame.iloc[0][ncu.GRID] == 128 and list(frame.columns).count(ncu.GRID) == 1
    assert "2 times" in frame.attrs["problems"][ncu.GRID]


def test_text_where_a_number_belongs_does_not_crash_the_tables(tmp_path):
    rows = pd.read_csv(FIXTURES / "counters_confirming.csv")
    rows[ncu.DURATION] = rows[ncu.DURATION].astype(object)
    rows.loc[0, ncu.DURATION] = "N/A"
    path = write_counter_report(rows, ORDER, tmp_path)
    assert path.exists() and derive(rows)["duration_us"].isna().iloc[0]


def test_parse_output_without_a_table_is_empty():
    output = "==PROF== Disconnected from process 1\n==WARNING== No kernels were profiled.\n"
    assert parse_ncu_csv(output).empty


def test_command_selects_one_launch_by_name_with_the_metric_list():
    spec = Spec(mode="bwd", causal=True, hdim=128, seqlen=2048, batch=1, heads=16, dtype="bf16")
    target_args = ncu.target_args("rung2-seq-parallel", spec)
    command = build_ncu_command(target_args, "_flash_bwd_dq_kernel", METRICS)
    assert command[0] == "ncu"
    joined = " ".join(command)
    for flag in ("--clock-control none", "--profile-from-start off", "--launch-count 1",
                 "--kernel-name regex:_flash_bwd_dq_kernel", "--csv", "--page raw", "--print-units base"):
        assert flag in joined
    assert command[command.index("--metrics") + 1].split(",") == METRICS
    target = command[command.index(sys.executable):]
    assert target[:3] == [sys.executable, "-m", "harness.ncu_target"]
    assert target[3:] == ["--provider", "rung2-seq-parallel", "--mode", "bwd", "--causal", "1",
                          "--hdim", "128", "--seqlen", "2048", "--batch", "1", "--heads", "16",
                          "--dtype", "bf16"]
    with pytest.raises(ValueError, match="kernel_regex"):
        build_ncu_command([], "", METRICS)


# --------------------------------------------------------------------------------------
# Derived quantities, tables, sentences
# --------------------------------------------------------------------------------------
def test_nonmatmul_ratio_counts_warp_instructions_per_tensor_instruction():
    kernel = parse_ncu_csv((FIXTURES / "raw_triton_fwd.csv").read_text())
    derived = derive(kernel).iloc[0]
    k = kernel.iloc[0]
    fp_warp_instructions = (k[ncu.FFMA] + k[ncu.FADD] + k[ncu.FMUL]) / 32
    expected = (fp_warp_instructions + k[ncu.MUFU]) / (k[ncu.HMMA] + k[ncu.GMMA])
    assert derived["nonmatmul_per_mma"] == pytest.approx(expected)
    assert derived["mma_kind"] == "gmma"
    assert derived["duration_us"] == pytest.approx(k[ncu.DURATION] / 1e3)


def test_rung_index_reads_the_ladder_names():
    assert [rung_index(name) for name in RUNG_NAMES] == [0, 1, 2, 3, 4]
    assert rung_index("sdpa-flash") is None


def table_rows(name: str):
    rows = pd.read_csv(FIXTURES / f"{name}.csv")
    markdown, table = counter_table(rows, ORDER)
    sections = markdown.split("### ")[1:]
    return markdown, table, {section.split(":")[0]: section for section in sections}


def test_table_orders_rungs_and_computes_ratio_to_the_previous_rung():
    _, table, _ = table_rows("counters_confirming")
    for setting, group in table.groupby("setting"):
        assert list(group["provider"]) == ORDER
        rung2, rung1 = (group[group.provider == name].iloc[0] for name in RUNG_NAMES[2:0:-1])
        assert rung2["grid_vs_prev"] == pytest.approx(rung2["grid"] / rung1["grid"])
        assert math.isnan(group[group.provider == "rung0-fa1"]["grid_vs_prev"].item())
        assert math.isnan(group[group.provider == "sdpa-flash"]["grid_vs_prev"].item())


def test_sentences_confirm_each_technique_with_the_numbers():
    markdown, table, sections = table_rows("counters_confirming")
    assert set(sections) == {"Setting A", "Setting B"}
    for setting, section in sections.items():
        group = table[table.setting == setting[-1]].set_index("provider")
        sentences = [line for line in section.splitlines() if line.startswith("- **")]
        assert len(sentences) == 3
        assert all(": confirmed:" in sentence for sentence in sentences)
        old, new = group.loc[["rung0-fa1", "rung1-fewer-nonmatmul"], "nonmatmul_per_mma"]
        shown = f"{counters._fmt(old)} -> {counters._fmt(new)} ({new / old:.2f}x, lower as expected)"
        assert shown in sentences[0]
        grid_ratio = group.loc["rung2-seq-parallel", "grid"] / group.loc["rung1-fewer-nonmatmul", "grid"]
        assert f"({grid_ratio:.2f}x, higher as expected)" in sentences[1]
        assert "shared-memory wavefronts" in sentences[2] and "barrier-stall share" in sentences[2]
    assert "Caution" not in markdown  # rungs 0 and 1 both issue HMMA: their ratios compare like with like


def test_sentences_say_not_confirmed_and_why_for_contradicting_counters():
    _, _, sections = table_rows("counters_contradicting")
    a_sentences = [line for line in sections["Setting A"].splitlines() if line.startswith("- **")]
    assert len(a_sentences) == 3
    assert all(": not confirmed:" in sentence for sentence in a_sentences)
    assert "within 10%: no clear change" in a_sentences[0]  # 1.08x up: too small to count either way
    assert "grid (blocks)" in a_sentences[1] and "higher as expected" in a_sentences[1]  # grid did grow
    assert "SM throughput (% of peak)" in a_sentences[1] and "no clear change" in a_sentences[1]  # 0.90x
    assert "barrier-stall share" in a_sentences[2] and "lower as expected" in a_sentences[2]
    assert "shared-memory wavefronts" in a_sentences[2] and "expected lower" in a_sentences[2]  # 1.15x up
    # rung 4 lost its counters in A and rung 0 in B: both listed; the check needing rung 0 cannot be made
    assert "- rung4-hopper: not profiled (permission: no permission" in sections["Setting A"]
    b_first = next(line for line in sections["Setting B"].splitlines() if line.startswith("- **Fewer"))
    assert "cannot be checked: rung0-fa1 has no counters (timeout" in b_first


def test_caution_when_the_rungs_use_different_tensor_instructions():
    rows = pd.read_csv(FIXTURES / "counters_confirming.csv")
    rung1 = rows.provider == "rung1-fewer-nonmatmul"
    rows.loc[rung1, ncu.GMMA] = rows.loc[rung1, ncu.HMMA] / 8
    rows.loc[rung1, ncu.HMMA] = 0
    markdown, _ = counter_table(rows, ORDER)
    assert "Caution: rung0-fa1 issues HMMA and rung1-fewer-nonmatmul GMMA" in markdown


def test_report_files_are_written(tmp_path):
    rows = pd.read_csv(FIXTURES / "counters_confirming.csv")
    report = write_counter_report(rows, ORDER, tmp_path)
    assert report.read_text() == counter_table(rows, ORDER)[0]
    assert len(pd.read_csv(tmp_path / "counters_table.csv")) == len(rows)


# --------------------------------------------------------------------------------------
# Failure paths with a fake ncu
# --------------------------------------------------------------------------------------
FAKE_NCU = """#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "NVIDIA (R) Nsight Compute Command Line Profiler"; echo "Version 2025.3.1.0 (fake)"; exit 0
fi
case "$*" in
  *"--provider perm "*)
    echo "==PROF== Connected to process 4242 (/usr/bin/python3)"
    echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU \
Performance Counters on the target device 0."
    exit 1 ;;
  *"--provider nomatch "*)
    echo "==PROF== Disconnected from process 4242"; echo "==WARNING== No kernels were profiled."; exit 0 ;;
  *"--provider badmetric "*)
    echo "==ERROR== Failed to find metric smsp__bogus.sum"; exit 1 ;;
  *"--provider crash "*)
    echo "Traceback (most recent call last):" >&2
    echo "ncu_target: crash cannot run Spec(...): needs CUDA (no GPU here)" >&2; exit 2 ;;
  *"--provider slow "*)
    sleep 30 ;;
  *)
    cat "$NCU_FIXTURE" ;;
esac
"""


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ncu"
    script.write_text(FAKE_NCU)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NCU_FIXTURE", str(FIXTURES / "raw_triton_fwd.csv"))
    return script


SPEC = Spec(mode="fwd", causal=True, hdim=128, seqlen=2048, batch=8, heads=16, dtype="bf16")


def test_ncu_status_names_the_missing_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ncu_status() == "ncu not on PATH (install Nsight Compute, or put its folder on PATH)"


def test_ncu_missing_makes_every_job_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    jobs = [("rung1-fewer-nonmatmul", SPEC, "_fa1_fwd"), ("sdpa-flash", SPEC, "flash_fwd")]
    frame = profile_providers(jobs, tmp_path / "out", progress=None)
    assert list(frame["status"]) == ["unavailable", "unavailable"]
    assert frame["reason"].str.startswith("ncu not on PATH").all()
    assert (tmp_path / "out" / "counters.csv").exists()


def test_each_failure_is_a_row_with_a_one_line_reason_and_the_rest_goes_on(tmp_path, fake_ncu):
    assert ncu_status() is None
    names = ["perm", "nomatch", "badmetric", "crash", "slow", "rung3-split-q"]
    jobs = [NcuJob(name, SPEC, "_flash_fwd_kernel", "A") for name in names]
    frame = profile_providers(jobs, tmp_path / "out", timeout_s=1, progress=None)
    status = dict(zip(frame["provider"], frame["status"]))
    reason = dict(zip(frame["provider"], frame["reason"].fillna("")))
    assert status == {"perm": "permission", "nomatch": "no-kernel", "badmetric": "unknown-metric",
                      "crash": "error", "slow": "timeout", "rung3-split-q": "ok"}
    assert "ERR_NVGPUCTRPERM" in reason["perm"]
    assert "regex:_flash_fwd_kernel" in reason["nomatch"]
    assert "smsp__bogus.sum" in reason["badmetric"]
    assert reason["crash"] == ("ncu exited with 2: ncu_target: crash cannot run Spec(...): "
                               "needs CUDA (no GPU here)")
    assert "within 1 s" in reason["slow"]
    assert all("\n" not in text for text in reason.values())
    assert set(frame["status"]) <= set(ncu.STATUSES)
    ok = frame[frame.provider == "rung3-split-q"].iloc[0]
    expected = parse_ncu_csv((FIXTURES / "raw_triton_fwd.csv").read_text()).iloc[0]
    assert ok["kernel_name"] == "_flash_fwd_kernel"
    assert ok[ncu.GMMA] == expected[ncu.GMMA]
    assert (ok["setting"], ok["mode"], ok["batch"]) == ("A", "fwd", 8)
    saved = pd.read_csv(tmp_path / "out" / "counters.csv")
    assert list(saved["status"]) == list(frame["status"])
    assert len(list((tmp_path / "out" / "ncu").glob("*.log"))) == len(jobs)


def test_ncu_target_refuses_to_run_without_cuda(capsys):
    from harness import ncu_target

    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    code = ncu_target.main(["--provider", "fa2", "--hdim", "64", "--seqlen", "128", "--batch", "1",
                            "--heads", "2"])
    assert code == 2
    assert capsys.readouterr().err.startswith("ncu_target: needs a CUDA GPU")


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_ncu_target_step_runs_the_provider_in_each_mode(mode):
    """The profiled step calls the provider on (B, S, H, D) inputs with the spec's mask and
    scale (its forward matches the reference), and the backward modes return three gradients."""
    from baselines.providers import get_provider
    from baselines.reference import attention_reference
    from harness import ncu_target
    from harness.timing import random_inputs

    spec = Spec(mode=mode, causal=True, hdim=32, seqlen=48, batch=1, heads=2, dtype="fp32")
    result = ncu_target.profiled_step(get_provider("fa2"), spec, torch.device("cpu"))()
    if mode == "fwd":
        q, k, v = random_inputs(spec, torch.device("cpu"), ncu_target.SEED, requires_grad=False)
        expected, _ = attention_reference(q, k, v, causal=True)
        torch.testing.assert_close(result.double(), expected, atol=1e-4, rtol=1e-4)
    else:
        assert len(result) == 3
        assert all(grad.shape == (1, 48, 2, 32) and torch.isfinite(grad).all() for grad in result)


def test_parse_real_h200_output_keeps_text_attributes_as_text():
    """A log captured on the H200 (rung 0, setting A): ncu's raw page also lists device
    attributes whose values are text ('No-CC'); they stay text and the metrics are numbers."""
    frame = parse_ncu_csv((FIXTURES / "raw_h200_rung0_with_text_attributes.log").read_text())
    assert len(frame) == 1 and frame["Kernel Name"].iloc[0] == "_ladder_kv_outer_kernel"
    assert frame["device__attribute_confidential_computing_mode"].iloc[0] == "No-CC"
    assert frame["launch__grid_size"].iloc[0] == 128  # one program per (batch, head): 8 x 16
    assert frame["sm__inst_executed_pipe_tensor_op_hmma.sum"].iloc[0] > 0
