"""Bring your own kernel: `runner.py --provider-file` with misbehaving kernels
(tests/fixtures/misbehaving_providers.py) run end to end on the CPU: each fault becomes the
right row, the run still writes results.json and the report, and the folder resumes without
measuring or appending anything again."""

import json
from pathlib import Path

import pytest

import runner
from harness.provider_file import ProviderFileError, file_digest, load_provider_file
from harness.results import load_results, load_runs

FIXTURE = Path(__file__).parent / "fixtures" / "misbehaving_providers.py"
SWEEP = ["--modes", "fwd", "--hdims", "16", "--causal", "false", "--batch", "2", "--heads", "4",
         "--warmup-ms", "1", "--rep-ms", "2", "--provider-file", str(FIXTURE)]
EXPECTED = {  # provider -> status at seqlen 32 and at seqlen 128
    "good": ("ok", "ok"),
    "inf-out": ("wrong", "wrong"),
    "nan-out": ("wrong", "wrong"),
    "batch0-copy": ("wrong", "wrong"),
    "heads-from-3-zero": ("wrong", "wrong"),
    "wrong-above-64": ("ok", "wrong"),
    "raises-mid-timing": ("error", "error"),
    "raises-in-supports": ("error", "error"),
    "raises-in-config": ("unsupported", "unsupported"),
}


def _statuses(out: Path, names=tuple(EXPECTED)) -> dict[str, tuple[str, str]]:
    rows = load_results(out).set_index(["provider", "seqlen"])
    return {name: (rows.loc[(name, 32), "status"], rows.loc[(name, 128), "status"]) for name in names}


def test_misbehaving_provider_file_gives_the_right_rows_report_and_a_resumable_folder(tmp_path):
    out = tmp_path / "out"
    argv = [*SWEEP, "--seqlens", "32,128", "--providers", ",".join(EXPECTED), "--out", str(out)]
    assert runner.main(argv) == 0
    assert _statuses(out) == EXPECTED
    rows = load_results(out).set_index(["provider", "seqlen"])
    assert "inf in the output" in rows.loc[("inf-out", 32), "reason"]
    assert "NaN in the output" in rows.loc[("nan-out", 128), "reason"]
    assert "supports() raised KeyError" in rows.loc[("raises-in-supports", 32), "reason"]
    assert "config() raised" in rows.loc[("raises-in-config", 32), "reason"]
    assert "illegal memory access" in rows.loc[("raises-mid-timing", 32), "reason"]
    assert rows.loc[("good", 128), "check_shape"].startswith("b2 n128 h4 d16 fwd; reference on every (batch, head)")
    document = json.loads((out / "results.json").read_text())  # inf and NaN did not break the JSON
    assert len(document["rows"]) == len(rows)
    assert document["runs"][0]["provider_files"] == {str(FIXTURE): file_digest(FIXTURE)}
    report = (out / "report.md").read_text()
    assert "good" in report and "raises-in-supports" in report
    assert (out / "plots" / "fwd_fp16.png").stat().st_size > 0

    before = (out / "results.csv").read_text()
    assert runner.main([*argv, "--resume"]) == 0
    assert (out / "results.csv").read_text() == before  # nothing measured or appended again
    assert len(load_runs(out)) == 2


def test_the_gate_catches_one_wrong_batch_of_four_one_wrong_head_and_inputs_modified_in_place(tmp_path):
    """Batch 1 and head 1 of four are neither the first, the last nor the middle one (what a
    sample of pairs would check); the mutating provider's output is right for the inputs it got."""
    names = ("good", "wrong-in-batch-1", "wrong-in-head-1", "mutates-inputs")
    argv = [*SWEEP, "--seqlens", "32", "--batch", "4", "--heads", "4", "--providers", ",".join(names),
            "--out", str(tmp_path)]
    assert runner.main(argv) == 0
    rows = load_results(tmp_path).set_index("provider")
    assert rows["status"].to_dict() == {"good": "ok", "wrong-in-batch-1": "wrong", "wrong-in-head-1": "wrong",
                                        "mutates-inputs": "wrong"}
    assert "worst in the output at batch 1, head" in rows.loc["wrong-in-batch-1", "reason"]
    assert ", head 1, rows 0-31" in rows.loc["wrong-in-head-1", "reason"]
    assert rows.loc["mutates-inputs", "reason"].startswith("the provider modified its input k in place")


def test_the_accuracy_verdict_does_not_depend_on_the_sweep_order(tmp_path):
    names = ("good", "wrong-above-64", "batch0-copy")
    for order in ("32,128", "128,32"):
        out = tmp_path / order.replace(",", "-")
        assert runner.main([*SWEEP, "--seqlens", order, "--providers", ",".join(names), "--out", str(out)]) == 0
        assert _statuses(out, names) == {name: EXPECTED[name] for name in names}, order


def test_provider_file_providers_join_the_default_list(tmp_path, capsys):
    assert runner.main(["--list", "--provider-file", str(FIXTURE)]) == 0
    listed = capsys.readouterr().out
    assert "batch0-copy" in listed and "sdpa-flash" in listed


@pytest.mark.parametrize(("text", "message"), [
    ("X = 1\n", "must define PROVIDERS"),
    ("PROVIDERS = {'fa2': lambda q, k, v, c, s: q}\n", "'fa2' is already defined by the registry: rename it"),
    ("import sys\nsys.exit(0)\n", r"importing it called sys.exit\(0\); a provider file must define PROVIDERS"),
    ("f = g = print\nPROVIDERS = {\n    'a': f,\n    'b': g,\n    'a': g,\n}\n",
     r"kernels_of_mine.py, line 5: PROVIDERS has the key 'a' twice \(lines 3 and 5\)"),
    ("PROVIDERS = {'a': print\n", r"kernels_of_mine.py, line 1: not valid Python"),
    ("PROVIDERS = {'mine': 3}\n", "must be a forward"),
    ("raise ImportError('no triton here')\n", "importing it raised ImportError: no triton here"),
    ("PROVIDERS = {'a b': lambda q, k, v, c, s: q}\n", "without commas or spaces"),
])
def test_a_bad_provider_file_is_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "kernels_of_mine.py"
    path.write_text(text)
    with pytest.raises(ProviderFileError, match=message):
        load_provider_file(path, {"fa2": "the registry"})


def test_one_name_in_two_provider_files_names_both_files(tmp_path, capsys):
    other = tmp_path / "other.py"
    other.write_text("from baselines.providers import get_provider\nPROVIDERS = {'good': get_provider('pytorch').forward}\n")
    with pytest.raises(SystemExit) as stop:
        runner.main(["--list", "--provider-file", str(FIXTURE), "--provider-file", str(other)])
    assert stop.value.code == 2
    assert (f"--provider-file {other}: provider name 'good' is already defined by --provider-file {FIXTURE}"
            in capsys.readouterr().err)


def test_a_missing_provider_file_is_a_clear_command_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        runner.main(["--provider-file", str(tmp_path / "nope.py"), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "nope.py: no such file" in capsys.readouterr().err


def test_the_calibration_slowdown_file_loads_and_needs_a_gpu(tmp_path):
    import torch

    slowed = load_provider_file(Path(__file__).resolve().parents[1] / "harness" / "slowdown.py",
                                {"fa2": "the registry"})
    assert [provider.name for provider in slowed] == ["fa2-slowed-10"]
    if not torch.cuda.is_available():
        q = torch.randn(1, 16, 2, 16)
        with pytest.raises(NotImplementedError, match="needs CUDA"):
            slowed[0].forward(q, q, q, False, 0.25)
