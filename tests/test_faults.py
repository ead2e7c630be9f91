"""The harness under faults: a provider call that hangs (in Python, in C), a provider that
calls sys.exit() or raises KeyboardInterrupt, a disk that fills up or a results.csv that cannot
be written mid-sweep. Each ends as a row and the sweep goes on, or ends the run with a message,
a non-zero exit code and a folder that `--resume` goes on from."""

import errno
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import runner
from baselines.providers import Provider, Spec, get_provider
from harness import results
from harness.deadline import CallTimeout, call_deadline
from harness.environment import capture_environment
from harness.results import ResultWriter, load_results
from harness.sweep import Job, Sweep

REPO_ROOT = Path(__file__).resolve().parents[1]
HANGING = Path(__file__).parent / "fixtures" / "hanging_providers.py"
TINY = Spec("fwd", False, 16, 32, 1, 2, "fp16")
SWEEP = ["--modes", "fwd", "--hdims", "16", "--seqlens", "32", "--causal", "false", "--batch", "1", "--heads", "2",
         "--warmup-ms", "1", "--rep-ms", "2"]


def _provider(name, forward) -> Provider:
    return Provider(name=name, label=name, forward=forward, availability=lambda: None)


def _sweep(path: Path, **kw) -> Sweep:
    return Sweep(ResultWriter(path / "results.csv"), capture_environment(), device=torch.device("cpu"),
                 warmup_ms=1, rep_ms=2, cpu_reps=1, **kw)


def _rows(path: Path):
    return load_results(path).set_index("provider")


# --------------------------------------------------------------------------------------
# A call that hangs
# --------------------------------------------------------------------------------------
def test_the_deadline_interrupts_python_code_that_swallows_every_exception():
    from tests.fixtures.hanging_providers import hangs_in_python

    start = time.monotonic()
    with pytest.raises(CallTimeout), call_deadline(0.3, "a test call", on_hang=lambda: None):
        hangs_in_python(None, None, None, False, 1.0)
    assert time.monotonic() - start < 5


def test_a_call_that_hangs_in_python_is_a_timeout_row_and_the_sweep_goes_on(tmp_path):
    from tests.fixtures.hanging_providers import hangs_in_python

    calls = []

    def hangs_while_timed(q, k, v, causal, scale):  # passes the accuracy check, then hangs in its timing
        calls.append(1)
        if len(calls) > 1:
            return hangs_in_python(q, k, v, causal, scale)
        return get_provider("pytorch").forward(q, k, v, causal, scale)

    sweep = _sweep(tmp_path, call_timeout=0.5)
    sweep.run([Job(TINY)], [_provider("hangs", hangs_in_python), _provider("hangs-timed", hangs_while_timed),
                            get_provider("pytorch")], progress=False)
    rows = _rows(tmp_path)
    assert rows.loc["hangs", "status"] == "timeout"
    assert rows.loc["hangs", "reason"] == "the accuracy check gave no result within 0.5 s (--call-timeout)"
    assert rows.loc["hangs-timed", "status"] == "timeout" and "timing repeat 0" in rows.loc["hangs-timed", "reason"]
    assert rows.loc["hangs-timed", "check_shape"]  # the check it passed is kept with the row
    assert rows.loc["pytorch", "status"] == "ok"


def test_resume_skips_what_timed_out_unless_asked_to_retry_it(tmp_path, capsys):
    argv = [*SWEEP, "--provider-file", str(HANGING), "--providers", "hangs-in-python,pytorch", "--call-timeout",
            "0.5", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    assert _rows(tmp_path).loc["hangs-in-python", "status"] == "timeout"
    before = (tmp_path / "results.csv").read_bytes()
    capsys.readouterr()

    start = time.monotonic()
    assert runner.main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipping 1 (provider, configuration) that timed out before" in err
    assert "'skipped: timed out before': 1" in err and time.monotonic() - start < 30
    assert (tmp_path / "results.csv").read_bytes() == before

    assert runner.main([*argv, "--resume", "--retry-timeouts"]) == 0  # tried again: the same timeout, not appended
    assert "'already recorded': 1" in capsys.readouterr().err
    assert (tmp_path / "results.csv").read_bytes() == before


def test_a_call_stuck_in_c_code_writes_its_row_exits_3_and_resume_goes_on(tmp_path):
    """SIGALRM cannot reach a call stuck in C code: the watchdog writes its timeout row and ends
    the process; --resume then skips that row and finishes."""
    command = [sys.executable, "runner.py", *SWEEP, "--provider-file", str(HANGING), "--providers",
               "pytorch,hangs-in-c,sdpa-math", "--call-timeout", "1", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "CALL HUNG" in done.stderr and "--resume" in done.stderr
    rows = _rows(tmp_path)
    assert rows.loc["pytorch", "status"] == "ok" and rows.loc["hangs-in-c", "status"] == "timeout"
    assert "could not be interrupted" in rows.loc["hangs-in-c", "reason"] and "sdpa-math" not in rows.index

    resumed = subprocess.run([*command, "--resume"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(tmp_path)
    assert rows.loc["sdpa-math", "status"] == "ok" and rows.loc["hangs-in-c", "status"] == "timeout"


def test_call_timeout_must_be_seconds_and_retrying_needs_a_folder_to_resume(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        runner.main(["--call-timeout", "-1"])
    assert stop.value.code == 2 and "--call-timeout must be seconds >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        runner.main([*SWEEP, "--retry-timeouts", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--retry-timeouts goes with --resume" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# sys.exit() and KeyboardInterrupt from provider code
# --------------------------------------------------------------------------------------
def test_sys_exit_in_a_provider_is_an_error_row_and_the_sweep_goes_on(tmp_path):
    argv = [*SWEEP, "--provider-file", str(HANGING), "--providers", "exits,pytorch", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    rows = _rows(tmp_path)
    assert rows.loc["exits", "status"] == "error"
    assert rows.loc["exits", "reason"].startswith("the accuracy check called sys.exit(0) (SystemExit)")
    assert rows.loc["pytorch", "status"] == "ok" and (tmp_path / "report.md").exists()


def test_sys_exit_in_supports_is_an_error_row(tmp_path):
    def exits(spec):
        sys.exit("no table")

    provider = Provider(name="p", label="p", forward=get_provider("pytorch").forward, availability=lambda: None,
                        supports=exits)
    _sweep(tmp_path).run([Job(TINY)], [provider, get_provider("pytorch")], progress=False)
    rows = _rows(tmp_path)
    assert rows.loc["p", "status"] == "error" and "supports() called sys.exit('no table')" in rows.loc["p", "reason"]
    assert rows.loc["pytorch", "status"] == "ok"


def test_keyboard_interrupt_in_a_provider_stops_with_the_resume_hint(tmp_path, capsys):
    argv = [*SWEEP, "--provider-file", str(HANGING), "--providers", "pytorch,interrupts,sdpa-math",
            "--out", str(tmp_path)]
    assert runner.main(argv) == 130
    err = capsys.readouterr().err
    assert "INTERRUPTED" in err and "--resume" in err
    assert list(load_results(tmp_path)["provider"]) == ["pytorch"]
    assert (tmp_path / "report.md").exists()


def test_a_provider_file_that_exits_or_is_interrupted_at_import_is_named(tmp_path, capsys):
    exiting = tmp_path / "exiting.py"
    exiting.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(SystemExit) as stop:
        runner.main(["--provider-file", str(exiting), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert f"--provider-file {exiting}: importing it called sys.exit(0)" in capsys.readouterr().err
    interrupted = tmp_path / "interrupted.py"
    interrupted.write_text("raise KeyboardInterrupt\n")
    assert runner.main(["--provider-file", str(interrupted), "--out", str(tmp_path / "out")]) == 130
    assert f"INTERRUPTED while importing --provider-file {interrupted}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------
# Disk errors mid-sweep
# --------------------------------------------------------------------------------------
def test_a_full_disk_mid_sweep_ends_with_the_resume_hint_and_resume_goes_on(tmp_path, monkeypatch, capsys):
    argv = [*SWEEP, "--providers", "pytorch,sdpa-math", "--out", str(tmp_path)]
    real_write, writes = results.os.write, []

    def fills_up(fd, data):  # the header and one row fit, then the disk is full
        writes.append(len(data))
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(results.os, "write", fills_up)
    assert runner.main(argv) == 3
    err = capsys.readouterr().err
    assert f"No space left on device (appending a row): '{tmp_path / 'results.csv'}'" in err
    assert "--resume to go on" in err
    assert list(load_results(tmp_path)["provider"]) == ["pytorch"]

    monkeypatch.setattr(results.os, "write", real_write)
    assert runner.main([*argv, "--resume"]) == 0
    rows = _rows(tmp_path)
    assert set(rows.index) == {"pytorch", "sdpa-math"} and set(rows["status"]) == {"ok"}


def test_a_results_csv_that_cannot_be_opened_ends_with_the_resume_hint(tmp_path, monkeypatch, capsys):
    argv = [*SWEEP, "--providers", "pytorch", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    real_open = results.os.open

    def read_only(path, flags, *rest):
        if flags & results.os.O_APPEND:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *rest)

    monkeypatch.setattr(results.os, "open", read_only)
    assert runner.main([*argv, "--providers", "pytorch,sdpa-math", "--resume"]) == 3
    err = capsys.readouterr().err
    assert f"Permission denied (opening it to append rows): '{tmp_path / 'results.csv'}'" in err
    assert "--resume to go on" in err


# --------------------------------------------------------------------------------------
# A damaged results.csv
# --------------------------------------------------------------------------------------
def test_resume_into_a_results_csv_with_bad_bytes_names_the_file_and_line(tmp_path, capsys):
    argv = [*SWEEP, "--providers", "pytorch", "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    path = tmp_path / "results.csv"
    path.write_bytes(path.read_bytes().replace(b"pytorch,", b"pyt\xffrch,", 1))
    assert runner.main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"runner.py: error: {path}, line 2, column 'provider': not UTF-8 text" in err
    assert "start a new --out folder" in err
