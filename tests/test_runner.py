"""The sweep engine and runner.py: failures become rows and the sweep goes on, rows survive an
interruption and --resume skips them, TFLOPs/s use the paper's FLOP count, and an
end-to-end `python runner.py --quick` in Triton's interpreter writes every output."""

import json
import math
import os
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
from harness.results import ResultWriter, completed_keys, load_results, load_runs
from harness.sweep import Job, Sweep
from harness.timing import benchmark, time_attention
from reports.environment import capture_environment

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
                   "--cuda-graph"):
        assert option in out, option
    assert "default: fp16" in out and "examples:" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--hdims", "64,x"], "--hdims must be positive integers"),
    (["--modes", "fwd,sideways"], "unknown ['sideways']"),
    (["--providers", "nope"], "unknown provider 'nope'"),
    (["--tolerance", "2"], "--tolerance must be a fraction"),
    (["--cuda-graph"], "--cuda-graph times forward passes only"),
    (["--cuda-graph", "--modes", "fwd,bwd"], "add --modes fwd"),
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
