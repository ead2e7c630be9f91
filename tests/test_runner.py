"""The sweep engine and runner.py: failures become rows and the sweep goes on, rows survive an
interruption and --resume skips them, TFLOPs/s use the paper's FLOP count, and an
end-to-end `python runner.py --quick` in Triton's interpreter writes every output."""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import runner
from baselines.flops import attention_flops, tflops_per_second
from baselines.providers import Provider, Spec, UnsupportedInput, get_provider
from harness.environment import capture_environment
from harness.results import ResultWriter, completed_keys, load_results, load_runs
from harness.sweep import Job, Sweep
from harness.timing import benchmark, time_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = Spec("fwd", False, 32, 32, 1, 2, "fp16")


def _everywhere():
    return None


def _provider(name, forward, **kw) -> Provider:
    return Provider(name=name, label=name, forward=forward, availability=_everywhere, **kw)


def _raise(exc):
    def forward(q, k, v, causal, scale):
        raise exc

    return forward


def _sweep(path: Path, **kw) -> Sweep:
    return Sweep(ResultWriter(path / "results.csv"), capture_environment(), device=DEVICE, warmup_ms=1, rep_ms=3,
                 cpu_reps=1, **kw)


def _rows(path: Path):
    return load_results(path).set_index("provider")


def test_a_raising_provider_gives_an_error_row_and_the_sweep_goes_on(tmp_path):
    broken = _provider("broken", _raise(RuntimeError("kernel exploded")))
    sweep = _sweep(tmp_path)
    sweep.run([Job(TINY)], [broken, get_provider("pytorch")], progress=False)
    rows = _rows(tmp_path)
    assert rows.loc["broken", "status"] == "error"
    assert "RuntimeError: kernel exploded" in rows.loc["broken", "reason"]
    assert rows.loc["pytorch", "status"] == "ok" and rows.loc["pytorch", "tflops"] > 0


def test_rows_carry_the_peers_package_versions_of_their_run(tmp_path):
    environment = {**capture_environment(), "flash_attn_4": "4.0.0b36", "nvidia_cutlass_dsl": "4.8.1"}
    sweep = Sweep(ResultWriter(tmp_path / "results.csv"), environment, device=DEVICE, warmup_ms=1, rep_ms=3,
                  cpu_reps=1)
    sweep.run([Job(TINY)], [get_provider("pytorch")], progress=False)
    row = _rows(tmp_path).loc["pytorch"]
    assert row["flash_attn_4"] == "4.0.0b36" and row["nvidia_cutlass_dsl"] == "4.8.1" and row["xformers"] == ""


@pytest.mark.parametrize(("exc", "status"), [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB"), "oom"),
    (UnsupportedInput("head dim 512 is too large"), "unsupported"),
    (NotImplementedError("dropout"), "unsupported"),
])
def test_exceptions_map_to_their_status(tmp_path, exc, status):
    sweep = _sweep(tmp_path)
    sweep.run([Job(TINY)], [_provider("p", _raise(exc))], progress=False)
    row = _rows(tmp_path).loc["p"]
    assert row["status"] == status and str(exc).split()[0] in row["reason"]


def test_a_provider_returning_nan_is_wrong_and_not_timed(tmp_path):
    calls = []

    def nan_forward(q, k, v, causal, scale):
        calls.append(q.shape)
        return torch.full_like(q, float("nan"))

    _sweep(tmp_path).run([Job(TINY)], [_provider("nan", nan_forward)], progress=False)
    row = _rows(tmp_path).loc["nan"]
    assert row["status"] == "wrong" and math.isnan(row["rel_err"]) and math.isnan(row["ms"])
    assert len(calls) == 1  # the accuracy check only


def test_a_provider_computing_another_function_is_wrong(tmp_path):
    _sweep(tmp_path).run([Job(TINY)], [_provider("values", lambda q, k, v, c, s: v * 1.0)], progress=False)
    row = _rows(tmp_path).loc["values"]
    assert row["status"] == "wrong" and row["rel_err"] > 0.1 and "tolerance" in row["reason"]


def test_wrong_gradients_make_a_provider_wrong_in_backward_modes_only(tmp_path):
    def scaled_gradients(q, k, v, causal, scale):  # right output, every gradient 1.5x too large
        out = get_provider("pytorch").forward(q, k, v, causal, scale)
        return out + 0.5 * (out - out.detach())

    jobs = [Job(replace(TINY, mode=mode)) for mode in ("fwd", "bwd")]
    _sweep(tmp_path).run(jobs, [_provider("p", scaled_gradients)], progress=False)
    status = load_results(tmp_path).set_index("mode")["status"]
    assert status["fwd"] == "ok" and status["bwd"] == "wrong"


def test_forward_only_provider_is_unsupported_in_backward_modes(tmp_path):
    fwd_only = _provider("fwd-only", get_provider("pytorch").forward, has_backward=False)
    _sweep(tmp_path).run([Job(replace(TINY, mode="fwd_bwd"))], [fwd_only], progress=False)
    row = _rows(tmp_path).loc["fwd-only"]
    assert row["status"] == "unsupported" and "forward only" in row["reason"]


def test_unavailable_provider_row_carries_its_reason(tmp_path):
    gone = Provider(name="gone", label="gone", forward=_raise(AssertionError("never called")),
                    availability=lambda: "needs the moon")
    _sweep(tmp_path).run([Job(TINY)], [gone], progress=False)
    row = _rows(tmp_path).loc["gone"]
    assert row["status"] == "unavailable" and row["reason"] == "needs the moon"


def test_row_tflops_use_the_paper_flop_count(tmp_path):
    jobs = [Job(replace(TINY, causal=c, mode=m)) for m in ("fwd", "fwd_bwd") for c in (False, True)]
    _sweep(tmp_path).run(jobs, [get_provider("pytorch")], progress=False)
    rows = load_results(tmp_path)
    for row in rows.itertuples():
        flops = attention_flops(row.batch, row.heads, row.seqlen, row.seqlen, row.hdim, row.causal, row.mode)
        assert row.tflops == pytest.approx(tflops_per_second(flops, row.ms))
        assert row.tflops_p20 >= row.tflops >= row.tflops_p80  # p20 time is the faster call
        assert row.rel_err < 1e-2


def test_interrupted_sweep_keeps_its_rows_and_resume_skips_them(tmp_path):
    jobs = [Job(replace(TINY, seqlen=n)) for n in (32, 48, 64)]
    calls = []

    def counting(interrupt_at):
        def forward(q, k, v, causal, scale):
            calls.append(q.shape[1])
            if q.shape[1] == interrupt_at:
                raise KeyboardInterrupt
            return get_provider("pytorch").forward(q, k, v, causal, scale)

        return forward

    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path).run(jobs, [_provider("p", counting(interrupt_at=48))], progress=False)
    kept = load_results(tmp_path)
    assert list(kept["seqlen"]) == [32] and list(kept["status"]) == ["ok"]

    calls.clear()
    skip = frozenset(completed_keys(kept))
    _sweep(tmp_path, skip=skip).run(jobs, [_provider("p", counting(interrupt_at=-1))], progress=False)
    assert 32 not in calls and {48, 64} <= set(calls)
    assert sorted(load_results(tmp_path)["seqlen"]) == [32, 48, 64]


def test_timing_quantiles_are_ordered_and_backward_needs_grads():
    timing = benchmark(lambda: torch.randn(64, 64) @ torch.randn(64, 64), torch.device("cpu"), cpu_reps=5)
    assert 0 < timing.ms_p20 <= timing.ms <= timing.ms_p80
    q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))
    with pytest.raises(ValueError, match="requires_grad"):
        time_attention(get_provider("pytorch").forward, q, k, v, False, 0.2, "bwd")


@pytest.mark.parametrize("mode", ["bwd", "fwd_bwd"])
def test_cuda_graph_timing_refuses_the_backward(mode):
    q, k, v = (torch.randn(1, 16, 2, 32, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="forward passes only"):
        time_attention(get_provider("pytorch").forward, q, k, v, False, 0.2, mode, cuda_graph=True)


def test_runner_resume_adds_to_a_folder_without_measuring_again(tmp_path, capsys):
    base = ["--modes", "fwd", "--hdims", "32", "--seqlens", "32", "--causal", "false", "--out", str(tmp_path),
            "--warmup-ms", "1", "--rep-ms", "2"]
    assert runner.main([*base, "--providers", "pytorch"]) == 0
    with pytest.raises(SystemExit) as refused:  # same folder without --resume
        runner.main([*base, "--providers", "pytorch"])
    assert refused.value.code == 2 and "--resume" in capsys.readouterr().err
    assert runner.main([*base, "--providers", "pytorch,sdpa-math", "--resume"]) == 0
    raw = (tmp_path / "results.csv").read_text().splitlines()
    assert sum(line.startswith("pytorch,") for line in raw) == 1  # measured once
    assert set(load_results(tmp_path)["provider"]) == {"pytorch", "sdpa-math"}
    assert len(load_runs(tmp_path)) == 2
    assert (tmp_path / "report.md").exists()


def test_cuda_graph_timing_is_recorded_with_the_run(tmp_path):
    argv = ["--modes", "fwd", "--hdims", "32", "--seqlens", "32", "--causal", "false", "--out", str(tmp_path),
            "--warmup-ms", "1", "--rep-ms", "2", "--providers", "pytorch", "--cuda-graph"]
    assert runner.main(argv) == 0
    assert load_runs(tmp_path)[0]["arguments"]["cuda_graph"] is True


def test_ablation_report_says_how_each_run_timed(tmp_path):
    from ablations.study import _run_lines
    from harness.results import record_run

    record_run(tmp_path, {"run_id": "1", "command": "runner.py --ablation all --cuda-graph",
                          "arguments": {"cuda_graph": True, "ncu": "off"}, "finished": "t"})
    record_run(tmp_path, {"run_id": "2", "command": "runner.py --ablation all --ncu-only",
                          "arguments": {"cuda_graph": False, "ncu": "only"}, "finished": None})
    lines = "\n".join(_run_lines(tmp_path))
    assert "--cuda-graph`: timed with CUDA-graph replay" in lines
    assert "--ncu-only`: Nsight Compute counters only, no timing (did not finish)" in lines


def test_list_prints_every_provider_with_its_availability(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "fa2" in out and "sdpa-flash" in out and "rung3-split-q" in out
    if not torch.cuda.is_available():
        assert "needs CUDA" in out


def test_help_shows_every_option_and_its_default(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--help"])
    out = capsys.readouterr().out
    for option in ("--suite", "--ablation", "--providers", "--modes", "--hdims", "--seqlens", "--causal", "--batch",
                   "--heads", "--dtype", "--repeats", "--out", "--quick", "--list", "--resume", "--warmup-ms",
                   "--rep-ms", "--save-baseline", "--compare", "--tolerance", "--ncu", "--no-ncu", "--ncu-only",
                   "--cuda-graph", "--provider-file", "--reproduce", "--false-positive-rate", "--fa2-fwd-config",
                   "--report-only", "--settings-only", "--ladder-only", "--verbose", "--kernel-times"):
        assert option in out, option
    for target in ("paper", "paper-fp16", "ablation", "counters", "baseline"):
        assert f"  {target} " in out, target  # each --reproduce target with its commands
    assert "exit codes:" in out and "PROVIDERS = {name: forward}" in out
    assert "default: fp16" in out and "examples:" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--hdims", "64,x"], "--hdims must be positive integers"),
    (["--modes", "fwd,sideways"], "unknown ['sideways']"),
    (["--providers", "nope"], "unknown provider 'nope'"),
    (["--tolerance", "2"], "--tolerance must be a fraction"),
    (["--cuda-graph"], "--cuda-graph times forward passes only"),
    (["--cuda-graph", "--modes", "fwd,bwd"], "add --modes fwd"),
    (["--ladder-only"], "--ladder-only goes with --ablation all"),
    (["--ablation", "hopper", "--ladder-only"], "--ladder-only goes with --ablation all"),
    (["--suite", "features", "--kernel-times"], "--kernel-times goes with --suite coverage"),
])
def test_bad_arguments_are_named_in_the_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        runner.main([*argv, "--out", str(tmp_path)])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU end-to-end check")
def test_quick_run_end_to_end_in_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the runner must set it itself
    result = subprocess.run(
        [sys.executable, "runner.py", "--quick", "--providers", "fa2,pytorch,sdpa-flash", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NOT performance" in result.stderr
    rows = load_results(tmp_path)
    assert set(rows.loc[rows["provider"] != "sdpa-flash", "status"]) == {"ok"}
    assert set(rows.loc[rows["provider"] == "sdpa-flash", "status"]) == {"unavailable"}
    assert rows["interpreter"].all() and set(rows["gpu"]) == {"cpu (Triton interpreter)"}
    document = json.loads((tmp_path / "results.json").read_text())
    assert len(document["rows"]) == len(rows) and document["runs"][0]["finished"]
    for name in ("report.md", "plots/fwd_fp16.png", "plots/fwd_fp16.svg", "plots/fwd_bwd_fp16.png"):
        assert (tmp_path / name).stat().st_size > 0, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="times an interpreter run; the GPU path is the same code")
def test_sigterm_keeps_the_rows_and_still_writes_the_report(tmp_path):
    """A time limit's SIGTERM mid-sweep: exit code 130, the rows so far kept, the report written,
    and the run recorded as unfinished."""
    seqlens = ",".join(str(n) for n in range(32, 544, 32))
    process = subprocess.Popen(
        [sys.executable, "runner.py", "--providers", "fa2", "--modes", "fwd_bwd", "--hdims", "32", "--causal",
         "false", "--seqlens", seqlens, "--out", str(tmp_path)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    csv_path = tmp_path / "results.csv"
    deadline = time.monotonic() + 120
    while not (csv_path.exists() and len(csv_path.read_text().splitlines()) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "no row was written"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "INTERRUPTED" in stderr and "--resume" in stderr
    rows = load_results(tmp_path)
    assert 1 <= len(rows) < len(seqlens.split(",")) and set(rows["status"]) == {"ok"}
    assert (tmp_path / "report.md").exists()
    assert load_runs(tmp_path)[0]["finished"] is None


# --------------------------------------------------------------------------------------
# The accuracy gate, per job
# --------------------------------------------------------------------------------------
def test_the_accuracy_check_runs_at_batch_2_and_3_heads_and_names_its_shape(tmp_path):
    seen = []

    def spy(q, k, v, causal, scale):
        seen.append(tuple(q.shape))
        return get_provider("pytorch").forward(q, k, v, causal, scale)

    _sweep(tmp_path).run([Job(TINY)], [_provider("spy", spy)], progress=False)  # TINY: batch 1, 2 heads
    assert seen[0] == (2, TINY.seqlen, 3, TINY.hdim)
    row = _rows(tmp_path).loc["spy"]
    assert row["status"] == "ok" and row["check_shape"].startswith("b2 n32 h3 d32 fwd")


def test_a_kernel_wrong_only_in_the_last_batch_or_head_is_caught_at_the_jobs_size(tmp_path):
    def last_batch_zero(q, k, v, causal, scale):
        out = get_provider("pytorch").forward(q, k, v, causal, scale)
        return torch.cat([out[:-1], torch.zeros_like(out[-1:])])

    def late_heads_doubled(q, k, v, causal, scale):
        out = get_provider("pytorch").forward(q, k, v, causal, scale)
        return torch.cat([out[:, :, :4], 2 * out[:, :, 4:]], dim=2)

    big = replace(TINY, batch=3, heads=6)
    _sweep(tmp_path).run([Job(big)], [_provider("b", last_batch_zero), _provider("h", late_heads_doubled)],
                         progress=False)
    rows = _rows(tmp_path)
    assert rows.loc["b", "status"] == "wrong" and rows.loc["h", "status"] == "wrong"
    assert "worst in the output at batch 2, head 0" in rows.loc["b", "reason"]
    assert re.search(r"worst in the output at batch \d, head [45],", rows.loc["h", "reason"])
    assert "reference on every (batch, head)" in rows.loc["h", "check_shape"]


def test_long_sequences_check_the_first_and_the_last_query_rows_exactly():
    from harness.accuracy import check_accuracy, row_blocks

    assert row_blocks(4096, pairs=4, max_scores=4 * 4096 * 256) == [(0, 128), (3968, 4096)]
    assert row_blocks(200, pairs=4) == [(0, 200)]
    spec = replace(TINY, seqlen=300, causal=True, mode="fwd_bwd", dtype="fp32")
    check = check_accuracy(get_provider("pytorch").forward, spec, DEVICE, max_scores=5 * 300 * 128 * 2)
    assert "query rows 0-127 and 172-299" in check.shape and check.error < 1e-4

    def wrong_tail(q, k, v, causal, scale):  # right everywhere but the last query rows
        out = get_provider("pytorch").forward(q, k, v, causal, scale)
        return torch.cat([out[:, :-10], out[:, -10:] * 1.5], dim=1)

    assert check_accuracy(wrong_tail, spec, DEVICE, max_scores=5 * 300 * 128 * 2).error > 0.02


@pytest.mark.parametrize("causal", [False, True])
def test_the_chunked_reference_of_every_pair_matches_a_right_kernel_in_the_backward(causal):
    """The float64 reference split into chunks of a few pairs, and of a few rows of one pair
    (dK, dV summed over the chunks), agrees with PyTorch's fp32 attention."""
    from harness.accuracy import check_accuracy, chunks

    spec = replace(TINY, seqlen=150, causal=causal, mode="fwd_bwd", dtype="fp32", batch=2, heads=3)
    assert list(chunks(6, [(0, 150)], 150, 150 * 150 * 2))[:2] == [(0, 2, 0, 150), (2, 4, 0, 150)]
    assert list(chunks(6, [(0, 150)], 150, 150 * 100))[:2] == [(0, 1, 0, 100), (0, 1, 100, 150)]
    for chunk_scores in (150 * 150 * 6, 150 * 150 * 2, 150 * 100):
        check = check_accuracy(get_provider("pytorch").forward, spec, DEVICE, chunk_scores=chunk_scores)
        assert check.error < 1e-4 and not check.fault, chunk_scores


def test_exceptions_in_supports_and_config_become_rows_and_the_sweep_goes_on(tmp_path):
    def boom(spec):
        raise RuntimeError("table lookup")

    bad_check = _provider("bad-check", get_provider("pytorch").forward, supports=boom)
    bad_config = _provider("bad-config", get_provider("pytorch").forward, config=boom)
    _sweep(tmp_path).run([Job(TINY)], [bad_check, bad_config, get_provider("pytorch")], progress=False)
    rows = _rows(tmp_path)
    assert rows.loc["bad-check", "status"] == "error"
    assert rows.loc["bad-check", "reason"] == "supports() raised RuntimeError: table lookup"
    assert rows.loc["bad-config", "reason"] == "config() raised RuntimeError: table lookup"
    assert rows.loc["pytorch", "status"] == "ok"


# --------------------------------------------------------------------------------------
# The results folder: resume, one writer, --out
# --------------------------------------------------------------------------------------
BASE = ["--modes", "fwd", "--hdims", "32", "--seqlens", "32", "--causal", "false", "--warmup-ms", "1",
        "--rep-ms", "2"]


def test_resume_does_not_append_unavailable_and_unsupported_rows_again(tmp_path):
    argv = [*BASE, "--providers", "pytorch,sdpa-flash,fa4", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    before = (tmp_path / "results.csv").read_text()
    assert runner.main([*argv, "--resume"]) == 0
    assert runner.main([*argv, "--resume"]) == 0
    assert (tmp_path / "results.csv").read_text() == before


def test_a_second_writer_of_one_folder_is_refused_with_the_first_named(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".runner.lock").write_text(json.dumps(
            {"host": __import__("socket").gethostname(), "pid": holder.pid, "command": "runner.py --suite paper"}))
        assert runner.main([*BASE, "--providers", "pytorch", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"process {holder.pid}" in err and "runner.py --suite paper" in err
        assert not (tmp_path / "results.csv").exists()
    finally:
        holder.kill()
        holder.wait()
    with pytest.warns(UserWarning, match="no longer runs"):  # the holder is gone: its lock is taken over
        assert runner.main([*BASE, "--providers", "pytorch", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / ".runner.lock").exists()


def test_out_pointing_at_a_file_is_a_clear_error(tmp_path, capsys):
    target = tmp_path / "hostname"
    target.write_text("not a folder")
    with pytest.raises(SystemExit) as stop:
        runner.main([*BASE, "--providers", "pytorch", "--out", str(target)])
    assert stop.value.code == 2
    assert f"--out {target} is a file: expected a folder" in capsys.readouterr().err


def test_report_only_survives_a_half_written_results_json(tmp_path):
    assert runner.main([*BASE, "--providers", "pytorch", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.json").read_text()
    (tmp_path / "results.json").write_text(text[:100])
    (tmp_path / "report.md").unlink()
    with pytest.warns(UserWarning, match="unreadable"):
        assert runner.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").exists()


@pytest.mark.parametrize("suite", ["features", "coverage", "decode", "host-overhead", "train"])
def test_other_suites_measure_their_rows_then_report_from_them(suite, tmp_path, monkeypatch, capsys):
    """--suite NAME: harness.suite's measure_rows into the folder, then reports.suites' report
    from those rows; --report-only measures nothing."""
    import importlib

    import harness.suite
    import reports.suites

    module = importlib.import_module(harness.suite.SUITES[suite].module)
    called = []
    monkeypatch.setattr(module, "measure_rows", lambda args, out_dir: called.append(("measure", out_dir)))

    def report(out_dir):
        called.append(("report", out_dir))
        (out_dir / "r.md").write_text("the report")
        return out_dir / "r.md"

    monkeypatch.setitem(reports.suites.REPORTS, suite, report)
    assert runner.main(["--suite", suite, "--out", str(tmp_path)]) == 0
    assert called == [("measure", tmp_path), ("report", tmp_path)]
    assert "the report" in capsys.readouterr().out
    called.clear()
    assert runner.main(["--suite", suite, "--report-only", "--out", str(tmp_path)]) == 0
    assert called == [("report", tmp_path)]


def test_suite_rows_are_on_disk_as_written_and_the_notes_name_what_the_budget_left(tmp_path):
    """harness.suite.SuiteRows: each row is in the CSV once written (a killed run keeps it), the
    environment is there for the rows, and notes.txt lists what was skipped once time ran out."""
    from harness.suite import SuiteRows

    with SuiteRows(tmp_path, "rows.csv", ("case", "gpu"), budget_s=-1.0) as rows:
        rows.write({"case": "first", "gpu": rows.env["gpu"]})
        assert (tmp_path / "rows.csv").read_text().splitlines()[1].startswith("first,")
        assert rows.out_of_time()
        rows.skip("second at 64")
    assert "budget ran out): second at 64" in (tmp_path / "notes.txt").read_text()


def test_reproduce_targets_run_their_steps_into_one_folder(tmp_path, monkeypatch):
    from harness.reproduce import TARGETS

    calls = []
    real_main = runner.main
    monkeypatch.setattr(runner, "main", lambda argv: calls.append(argv) or 0)
    assert real_main(["--reproduce", "ablation", "--out", str(tmp_path)]) == 0
    assert [call[:len(step)] for call, step in zip(calls, TARGETS["ablation"].steps, strict=True)] == \
        [list(step) for step in TARGETS["ablation"].steps]
    assert all(call[call.index("--out") + 1] == str(tmp_path) for call in calls)
    assert "--resume" not in calls[0] and "--resume" in calls[1]


def test_ladder_only_measures_the_ladder_and_skips_the_reviewers_studies(tmp_path, monkeypatch):
    import pandas as pd

    import ablations.reviewers
    import harness.stages

    executed, studies = [], []
    monkeypatch.setattr(harness.stages, "execute", lambda args, jobs, providers, *rest: executed.append(
        (len(jobs), [p.name for p in providers])) or harness.stages.Outcome(0, pd.DataFrame({"status": []})))
    monkeypatch.setattr(runner, "write_reports", lambda *args, **kwargs: None)
    monkeypatch.setattr(ablations.reviewers, "run", lambda *a, **k: studies.append(a) or 0)
    assert runner.main(["--ablation", "all", "--ladder-only", "--no-ncu", "--out", str(tmp_path / "a")]) == 0
    assert executed and not studies
    assert "fa4" in executed[0][1] and "rung0-fa1" in executed[0][1]
    assert runner.main(["--ablation", "all", "--no-ncu", "--out", str(tmp_path / "b")]) == 0
    assert len(studies) == 1  # without it, the reviewers' studies follow the ladder


def test_reproduce_refuses_options_it_would_ignore(tmp_path, capsys):
    with pytest.raises(SystemExit):
        runner.main(["--reproduce", "paper", "--hdims", "64", "--out", str(tmp_path)])
    assert "only --out and -v go with it, not --hdims" in capsys.readouterr().err


def test_an_enlarged_check_that_runs_out_of_memory_is_retried_at_the_jobs_shape(tmp_path):
    shapes = []

    def big_hungry(q, k, v, causal, scale):
        shapes.append(q.shape[0])
        if q.shape[0] > TINY.batch:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return get_provider("pytorch").forward(q, k, v, causal, scale)

    _sweep(tmp_path).run([Job(TINY)], [_provider("hungry", big_hungry)], progress=False)
    row = _rows(tmp_path).loc["hungry"]
    assert row["status"] == "ok" and shapes[:2] == [2, 1] and row["check_shape"].startswith("b1 n32 h2")


def test_the_runner_offers_every_reviewers_study():
    from ablations.reviewers import part_names
    from harness.plan import REVIEWER_PARTS

    assert set(REVIEWER_PARTS) == set(part_names())


def test_host_overhead_times_each_stage_of_a_call():
    """harness/host_overhead.py's calls (measured on a GPU): the backward alone reruns the
    backward of one recorded forward, each call adding the same gradient."""
    from harness.host_overhead import MODES, call_fn

    q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    calls = []

    def attention(q, k, v):
        calls.append(1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    bwd = call_fn(attention, "bwd", q, k, v, dout)
    assert len(calls) == 1  # the forward is recorded once, outside the timed calls
    bwd()
    first = q.grad.clone()
    bwd()
    assert len(calls) == 1 and torch.allclose(q.grad, 2 * first)
    assert not call_fn(attention, "fwd", q, k, v, dout)().requires_grad  # no autograd graph
    q.grad = None
    call_fn(attention, "fwd_bwd", q, k, v, dout)()
    assert len(calls) == 3 and torch.allclose(q.grad, first)  # fwd_bwd: a forward each call
    for mode in MODES:  # every stage the benchmark names builds a call that runs
        call_fn(attention, mode, q, k, v, dout)()
    with pytest.raises(ValueError, match="mode must be one of"):
        call_fn(attention, "sideways", q, k, v, dout)


def test_host_overhead_takes_shapes_of_ones_own(monkeypatch, tmp_path):
    """harness/host_overhead.py's --shapes: "B,H,S,D;..." replaces the suite's shapes (a dense call
    off the 128-row grid times the packed varlen path); a malformed or non-positive shape is refused
    by name before anything runs."""
    from harness import host_overhead

    assert host_overhead.parse_shapes("16,32,1000,64;5,16,3000,128") == ((16, 32, 1000, 64), (5, 16, 3000, 128))
    for bad in ("16,32,1000", "16,32,0,64", "a,b,c,d", "16,32,1000,64;"):
        with pytest.raises(argparse.ArgumentTypeError, match="--shapes takes batch,heads,seqlen,headdim"):
            host_overhead.parse_shapes(bad)
    seen = {}
    monkeypatch.setattr(host_overhead, "measure_suite", lambda *args: seen.setdefault("shapes", args[-1]))
    host_overhead.main(["--out", str(tmp_path), "--shapes", "16,32,1000,64"])
    assert seen["shapes"] == ((16, 32, 1000, 64),)
    with pytest.raises(SystemExit):  # argparse's usage error names the option
        host_overhead.main(["--out", str(tmp_path), "--shapes", "16,32"])


def test_host_overhead_interleaves_the_providers_of_a_cell(monkeypatch):
    """harness/host_overhead.py's host times: after one warm-up call each, every function takes
    its turn in every round (`calls` calls behind one GPU sleep per turn), and each keeps the
    median of its rounds. The GPU sleep and synchronisation are stood in for (CPU)."""
    from harness import host_overhead

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append("sleep"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order, now = [], [0.0]
    monkeypatch.setattr(host_overhead.time, "perf_counter", lambda: now[0])
    # seconds each turn takes (the warm-up call's, then each round's, charged at the turn's first call):
    # a: 0.5 s per call in two rounds of three, b: 1.5 s in two (one outlier round of 4.5 s)
    turn_costs = {"a": iter([5, 1, 1, 2]), "b": iter([5, 3, 9, 3])}

    def call(name):
        order.append(name)
        calls_so_far = order.count(name)  # the warm-up call (1), then two a turn (2-3, 4-5, ...)
        now[0] += next(turn_costs[name]) if calls_so_far % 2 else 0

    fns = {"a": lambda: call("a"), "b": lambda: call("b")}
    turns = []
    ms = host_overhead.interleaved_host_ms(fns, calls=2, rounds=3, before_turn=lambda name: order.append(f"<{name}"),
                                           after_turn=lambda name, turn_ms: turns.append((name, turn_ms)))
    assert order == ["<a", "a", "<b", "b"] + ["<a", "sleep", "a", "a", "<b", "sleep", "b", "b"] * 3
    assert turns == [("a", 500.0), ("b", 1500.0), ("a", 500.0), ("b", 4500.0), ("a", 1000.0), ("b", 1500.0)]
    assert ms == {"a": 500.0, "b": 1500.0}  # each the median of its rounds' ms per call


def test_host_overhead_runs_the_backward_on_the_engine_it_names():
    """harness/host_overhead.py's engines: 'threaded' leaves PyTorch's default (a CUDA backward on
    the engine's device thread), 'calling-thread' turns the engine's threads off for the backward
    alone; the forward is not affected, and an unknown engine is an error naming the choices."""
    from harness.host_overhead import ENGINES, call_fn

    seen = []

    class Recorded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", torch._C._is_multithreading_enabled()))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", torch._C._is_multithreading_enabled()))
            return grad * 2

    q, k, v = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    for mode in ("bwd", "fwd_bwd"):
        for engine, threaded in zip(ENGINES, (True, False)):
            seen.clear()
            call_fn(lambda q, k, v: Recorded.apply(q) + k + v, mode, q, k, v, torch.ones(2, 3), engine)()
            assert ("backward", threaded) in seen and ("forward", True) in seen, (mode, engine, seen)
    assert torch._C._is_multithreading_enabled()  # restored after each call
    with pytest.raises(ValueError, match="engine must be one of"):
        call_fn(lambda q, k, v: q, "bwd", q, k, v, torch.ones(2, 3), "sideways")
