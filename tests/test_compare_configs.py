"""tools/compare_configs.py on the CPU (Triton's interpreter, tiny shapes): it runs end to end,
writes long-format rows with the environment, alternates the configs, checks both against the
float64 reference first, and refuses unknown or ambiguous config fields by name."""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import compare_configs

from harness.environment import ROW_ENV_COLUMNS
from harness.timing import Timing


def test_two_configs_are_timed_in_alternating_rounds_into_long_rows(tmp_path, capsys):
    out = compare_configs.main(["--call", "fwd_bwd", "--shape", "1,64,2,32", "--causal", "--dtype", "fp16",
                                "--a", "block_m=32", "--b", "block_m=16,bwd.block_m1=16", "--rounds", "2",
                                "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B", "B", "A"]  # A first in even rounds, B in odd
    assert [row["fields"] for row in rows[:2]] == ["block_m=32", "block_m=16,bwd.block_m1=16"]
    assert all(float(row["ms"]) > 0 and row["call"] == "fwd_bwd" and row["causal"] == "True" for row in rows)
    assert set(ROW_ENV_COLUMNS) <= set(rows[0]) and rows[0]["torch"] == torch.__version__
    assert all(row["checked_shape"] == "" for row in rows)  # the whole call was checked
    printed = capsys.readouterr().out
    assert "B / A" in printed and "block_m=16" in printed
    assert "MHz" not in printed and all(row["sm_clock_mhz"] == "nan" for row in rows)  # no NVML reading on a CPU
    # a label names config B in the rows instead of its fields; A without one keeps its fields
    out = compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--dtype", "fp16", "--a", "block_m=32",
                                "--b", "block_m=16", "--b-label", "half the rows", "--rounds", "1",
                                "--out", str(tmp_path / "labelled.csv")])
    with out.open() as f:
        assert [row["fields"] for row in csv.DictReader(f)] == ["block_m=32", "half the rows"]
    assert (tmp_path / "rows.notes.txt").exists()  # clocks lowered during the run, if any (none on a CPU)


def test_the_summary_names_the_clock_each_configs_timings_ran_at(tmp_path, capsys, monkeypatch):
    """Where NVML read the SM clock (a GPU), the summary gives each config's median beside its time
    and the rows carry each timing's."""
    clocks = iter([1500.0, 1700.0, 1800.0, 1600.0])  # rounds A, B then B, A

    def timed(fn, device, cpu_reps=1):
        fn()
        return Timing(1.0, 1.0, 1.0, math.nan, next(clocks))

    monkeypatch.setattr(compare_configs, "benchmark", timed)
    out = compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--dtype", "fp16", "--b", "block_m=16",
                                "--rounds", "2", "--out", str(tmp_path / "rows.csv")])
    printed = capsys.readouterr().out
    assert "(the table)  at 1550 MHz" in printed and "block_m=16  at 1750 MHz" in printed
    with out.open() as f:
        assert [float(row["sm_clock_mhz"]) for row in csv.DictReader(f)] == [1500.0, 1700.0, 1800.0, 1600.0]


def test_a_packed_call_is_checked_and_timed(tmp_path):
    out = compare_configs.main(["--call", "bwd", "--shape", "0,0,2,32", "--lengths", "40,0,70", "--causal", "--dtype", "fp16",
                                "--a", "", "--b", "bwd.block_n1=16", "--rounds", "1",
                                "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B"] and rows[0]["lengths"] == "40 0 70"


def test_a_dropout_call_is_checked_under_its_own_mask_and_timed(tmp_path):
    """--dropout: each config runs under the seed whose keep-mask the references take, so a config
    that drops other entries (or none) would be off them; the rows carry dropout_p."""
    out = compare_configs.main(["--call", "fwd_bwd", "--shape", "1,48,2,32", "--causal", "--dropout", "0.2",
                                "--dtype", "fp16", "--a", "", "--b", "block_m=16", "--rounds", "1",
                                "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B"] and all(row["dropout_p"] == "0.2" for row in rows)
    with pytest.raises(SystemExit):  # a probability, and dense calls only
        compare_configs.main(["--call", "fwd", "--shape", "1,48,2,32", "--dropout", "1.5", "--out",
                              str(tmp_path / "x.csv")])


def test_a_windowed_call_is_checked_and_timed(tmp_path):
    """--window: the call and both references take the sliding window (a config that ignored it would
    be off them); the rows carry it, and a packed call or a bad window is refused."""
    out = compare_configs.main(["--call", "fwd_bwd", "--shape", "1,48,2,32", "--window", "7", "3", "--dtype", "fp16",
                                "--b", "block_m=16", "--rounds", "1", "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B"] and all(row["window"] == "7,3" for row in rows)
    for bad in (["--window", "-2", "3"], ["--window", "7", "3", "--lengths", "40,70"]):
        with pytest.raises(SystemExit):
            compare_configs.main(["--call", "fwd", "--shape", "1,48,2,32", *bad, "--out", str(tmp_path / "x.csv")])


def test_a_call_with_more_keys_than_queries_is_checked_and_timed(tmp_path, capsys, monkeypatch):
    """--seqlen-k: keys of another length than the queries (cross-attention, a chunk of queries
    against a longer cache; causal aligned bottom-right): the call and both references take them
    (a config that ignored the extra keys would be off them), the rows carry seqlen_k and the
    generated table names both lengths; packed lengths refuse it."""
    from reports import embed

    out = compare_configs.main(["--call", "fwd_bwd", "--shape", "1,40,2,32", "--seqlen-k", "72", "--causal",
                                "--dtype", "fp16", "--b", "block_m=16", "--rounds", "1",
                                "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B"]
    assert all(row["seqlen"] == "40" and row["seqlen_k"] == "72" for row in rows)
    assert "keys 72" in capsys.readouterr().out
    monkeypatch.setattr(embed, "_repository_path", lambda p: p.name)  # rows outside the repository
    assert "| fwd_bwd | 1 x 40 q, 72 k | 2 | 32 | True |" in embed.compare_configs_table(out, "a", "b")
    for bad in (["--seqlen-k", "-1"], ["--seqlen-k", "72", "--lengths", "40,70"]):
        with pytest.raises(SystemExit):
            compare_configs.main(["--call", "fwd", "--shape", "1,40,2,32", *bad, "--out", str(tmp_path / "x.csv")])


@pytest.mark.parametrize("fields,call,message", [
    ("blok_m=64", "fwd", "unknown config field 'blok_m'"),
    ("block_m1=64", "fwd", "unknown config field 'block_m1'"),  # a BwdConfig field, for the forward
    ("hopper_gluon_min_keys=0", "fwd_bwd", "write fwd.hopper_gluon_min_keys or bwd.hopper_gluon_min_keys"),
    ("bwd.block_m=64", "fwd_bwd", "unknown config field 'bwd.block_m'"),
    ("bwd.block_m1=64", "fwd", "the prefix must be one of fwd."),
    ("block_m", "fwd", "name=value"),
])
def test_unknown_or_ambiguous_fields_are_refused_by_name(fields, call, message):
    with pytest.raises(ValueError, match=message):
        compare_configs.parse_fields(fields, call)


def test_a_bad_field_on_the_command_line_exits_with_the_fields_listed(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--a", "block_m=32", "--b", "warps=8",
                              "--out", str(tmp_path / "rows.csv")])
    err = capsys.readouterr().err
    assert "unknown config field 'warps'" in err and "num_warps" in err
    assert not (tmp_path / "rows.csv").exists()


def test_values_are_python_literals_or_bare_strings():
    fields = compare_configs.parse_fields("hopper_gluon_dq_first=None,hopper_gluon_head_section=l2,num_warps=8", "bwd")
    assert fields["bwd"] == {"hopper_gluon_dq_first": None, "hopper_gluon_head_section": "l2", "num_warps": 8}


def test_a_feature_call_is_compared_on_the_tiles_it_takes_without_a_config():
    """Dropout, packed lengths and causal GQA run the feature kernels, whose Triton backward takes its
    tiles from HOPPER_FEATURE_BWD_CONFIGS when no config is passed, while the Gluon dispatch reads
    the backward table's entry: the config compared as "the table" has both, and a field set on it
    changes that field alone."""
    from kernels.configs import HOPPER_BWD_CONFIGS, HOPPER_FEATURE_BWD_CONFIGS

    table, features = HOPPER_BWD_CONFIGS[128], HOPPER_FEATURE_BWD_CONFIGS[128]
    merged = compare_configs.feature_call_bwd_config(table, features)
    tiles = ("block_m1", "block_n1", "block_m2", "block_n2", "num_warps", "num_stages", "dq_num_stages", "query_major")
    assert all(getattr(merged, name) == getattr(features, name) for name in tiles)
    assert [getattr(merged, name) for name in tiles] != [getattr(table, name) for name in tiles]
    gluon = [name for name in vars(table) if name.startswith("hopper_gluon_")]
    assert all(getattr(merged, name) == getattr(table, name) for name in gluon) and merged.hopper_gluon_min_keys


def test_a_config_off_the_reference_is_not_timed():
    """check_accuracy passes the kernels' output and fails one 2% off it: more than twice PyTorch's
    own fp16 error against float64."""
    class Args:
        shape, kv_heads, dtype, causal, lengths, dropout, window = (1, 32, 2, 32), 0, "fp16", False, None, 0.0, (-1, -1)
        seqlen_k = 0

    call = compare_configs.Call(Args, torch.device("cpu"))
    fwd, bwd = compare_configs.make_configs({"fwd": {}, "bwd": {}}, 32, False, torch.device("cpu"))
    ref, same = call.reference(double=True), call.reference(double=False)
    compare_configs.check_accuracy(call, "A", fwd, bwd, ref, same)
    run = call.run
    call.run = lambda *args: run(*args) * 1.02
    with pytest.raises(SystemExit, match="config B: out is off the float64 reference"):
        compare_configs.check_accuracy(call, "B", fwd, bwd, ref, same)


def test_a_call_whose_reference_does_not_fit_is_checked_on_its_first_rows_and_heads():
    """checked_args keeps the lengths, head dim and GQA group and cuts batch rows, then kv heads,
    until the float64 reference fits REFERENCE_BYTES; a call that fits stays whole; packed lengths keep
    every sequence and lose kv heads alone."""
    import argparse

    def args(shape, kv_heads=0, lengths=None):
        return argparse.Namespace(shape=shape, kv_heads=kv_heads, lengths=lengths, causal=True, dtype="bf16")

    small = args((2, 1024, 16, 128))
    assert compare_configs.checked_args(small) is small
    per_head = compare_configs.SCORE_TENSORS * 8 * 16384**2
    fit = compare_configs.REFERENCE_BYTES // per_head
    checked = compare_configs.checked_args(args((1, 16384, 32, 64)))
    assert checked.shape == (1, 16384, max(fit, 1), 64) and checked.kv_heads == 0
    # 8k keys: five heads' references fit; GQA 32/8 keeps its group of 4: one kv head, one batch row
    assert compare_configs.REFERENCE_BYTES // (compare_configs.SCORE_TENSORS * 8 * 8192**2) == 5
    gqa = compare_configs.checked_args(args((4, 8192, 32, 64), kv_heads=8))
    assert gqa.shape == (1, 8192, 4, 64) and gqa.kv_heads == 1
    empty = args((2, 0, 32, 64))  # no rows at all: nothing to cut
    assert compare_configs.checked_args(empty) is empty
    packed = args((2, 0, 32, 64), lengths=[1024, 3000])
    assert compare_configs.checked_args(packed) is packed
    # eight sequences up to 7422 at 32 heads: one float64 score tensor of the longest alone is 13 GiB;
    # over all eight the reference holds about 8 GiB a head, so two heads fit
    lengths = [6040, 3336, 945, 4133, 6181, 1141, 7422, 2684]
    assert compare_configs.REFERENCE_BYTES // (compare_configs.SCORE_TENSORS * 8 * sum(n * n for n in lengths)) == 2
    cut = compare_configs.checked_args(args((8, 0, 32, 64), lengths=lengths))
    assert cut.shape == (8, 0, 2, 64) and cut.lengths == lengths and cut.kv_heads == 0
    grouped = compare_configs.checked_args(args((8, 0, 32, 64), kv_heads=8, lengths=lengths))
    assert grouped.shape == (8, 0, 4, 64) and grouped.kv_heads == 1  # a group of 4 kept whole, over the fit


def test_a_plan_runs_each_line_in_one_process_and_goes_on_past_a_failed_one(tmp_path, capsys):
    """--plan: each line a comparison after the arguments beside --plan, rows per line (OUT's stem +
    _NN.csv unless the line names --out); a line that fails is named at the end (exit 1), the
    lines after it still run."""
    plan = tmp_path / "plan.txt"
    plan.write_text("# forward, then a bad field, then the backward\n"
                    "--call fwd --shape 1,64,2,32 --b block_m=16\n\n"
                    "--call fwd --shape 1,64,2,32 --b warps=8\n"
                    f"--call bwd --shape 1,64,2,32 --causal --b bwd.block_n1=16 --out {tmp_path / 'bwd.csv'}\n")
    with pytest.raises(SystemExit) as exc:
        compare_configs.main(["--plan", str(plan), "--dtype", "fp16", "--rounds", "1",
                              "--out", str(tmp_path / "cmp.csv")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "[1] --call fwd --shape 1,64,2,32 --b warps=8: bad arguments" in err and "[0]" not in err.split("failed:")[1]
    for path, call in ((tmp_path / "cmp_00.csv", "fwd"), (tmp_path / "bwd.csv", "bwd")):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        assert [row["config"] for row in rows] == ["A", "B"] and {row["call"] for row in rows} == {call}
        assert rows[0]["dtype"] == "fp16"  # the arguments beside --plan
    assert not (tmp_path / "cmp_01.csv").exists()


def test_a_plan_line_in_a_process_of_its_own_writes_its_rows_or_fails_alone_when_it_runs_out_of_time(tmp_path,
                                                                                                     capsys):
    """--line-timeout: each line a process of its own (in the interpreter here), its rows written as
    in one process; a line whose process fails is named with its exit status, and one that runs past
    the limit (here: too short for the process to start) is killed and named with the limit (exit 1),
    the lines after either still run."""
    plan = tmp_path / "plan.txt"
    plan.write_text("--call fwd --shape 1,64,2,32 --b warps=8\n--call fwd --shape 1,64,2,32 --b block_m=16\n")
    with pytest.raises(SystemExit) as exc:
        compare_configs.main(["--plan", str(plan), "--dtype", "fp16", "--rounds", "1", "--line-timeout", "600",
                              "--out", str(tmp_path / "cmp.csv")])
    assert exc.value.code == 1  # a line whose process fails (a bad field: argparse's exit 2) is named
    assert "[0] --call fwd --shape 1,64,2,32 --b warps=8: its process exited 2" in capsys.readouterr().err
    with (tmp_path / "cmp_01.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B"] and rows[0]["dtype"] == "fp16"
    plan.write_text("--call fwd --shape 1,64,2,32 --b block_m=16\n--call fwd --shape 1,64,2,32 --b block_m=32\n")
    with pytest.raises(SystemExit) as exc:
        compare_configs.main(["--plan", str(plan), "--rounds", "1", "--line-timeout", "0.01",
                              "--out", str(tmp_path / "late.csv")])
    assert exc.value.code == 1
    err = capsys.readouterr().err.split("failed:")[1]
    assert "[0] --call fwd --shape 1,64,2,32 --b block_m=16: no result within 0.01 s" in err
    assert "[1] --call fwd --shape 1,64,2,32 --b block_m=32: no result within 0.01 s" in err
    assert not (tmp_path / "late_00.csv").exists()
    with pytest.raises(SystemExit):
        compare_configs.main(["--plan", str(plan), "--line-timeout", "-1"])
    assert "--line-timeout takes seconds" in capsys.readouterr().err


def test_without_a_plan_the_call_and_shape_are_required(capsys):
    with pytest.raises(SystemExit):
        compare_configs.main(["--b", "block_m=16"])
    assert "--call and --shape are required (or --plan FILE)" in capsys.readouterr().err


@pytest.mark.parametrize("argv,shared", [
    (["--plan", "p.txt", "--rounds", "3"], ["--rounds", "3"]),
    (["--rounds", "3", "--plan=p.txt", "--dtype", "fp16"], ["--rounds", "3", "--dtype", "fp16"]),
    (["--pl", "p.txt", "--out", "x.csv"], ["--out", "x.csv"]),  # argparse's abbreviation
])
def test_the_arguments_beside_a_plan_are_the_command_line_but_the_plan(argv, shared):
    assert compare_configs._without_plan(argv) == shared


def _other_tree(tmp_path: Path) -> Path:
    """A checkout holding a copy of this one's kernels/ (what --a-tree and --b-tree read)."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(Path(compare_configs.__file__).resolve().parents[1] / "kernels", other / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return other


def test_two_trees_run_each_config_in_a_process_of_its_own_with_its_kernels(tmp_path, capsys, monkeypatch):
    """--b-tree: config B's kernels from the other checkout, A's from this one, each in its own
    process (checked against float64 there), the rounds still alternating; the rows name the tree."""
    other = _other_tree(tmp_path)
    workers = []
    real_init = compare_configs.TreeWorker.__init__

    def recorded(self, *args):
        real_init(self, *args)
        workers.append(self)

    monkeypatch.setattr(compare_configs.TreeWorker, "__init__", recorded)
    out = compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--dtype", "fp16", "--b-tree", str(other),
                                "--b", "block_m=16", "--rounds", "2", "--out", str(tmp_path / "rows.csv")])
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["config"] for row in rows] == ["A", "B", "B", "A"]
    assert all(float(row["ms"]) > 0 for row in rows)
    assert rows[1]["fields"] == f"kernels of {other}; block_m=16"
    mine = Path(compare_configs.__file__).resolve().parents[1]
    assert rows[0]["fields"] == f"kernels of {mine}"
    assert [Path(w.kernels).resolve().parents[1] for w in workers] == [mine, other.resolve()]
    assert all(w.process.returncode == 0 for w in workers)  # closed when the comparison ended
    assert "B / A" in capsys.readouterr().out
    # --a-label / --b-label name the configs in the rows instead
    out = compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--dtype", "fp16", "--b-tree", str(other),
                                "--rounds", "1", "--a-label", "the kept kernels", "--b-label", "a trial's kernels",
                                "--out", str(tmp_path / "labelled.csv")])
    with out.open() as f:
        assert [row["fields"] for row in csv.DictReader(f)] == ["the kept kernels", "a trial's kernels"]


def test_a_tree_without_kernels_or_a_trees_bad_field_is_refused(tmp_path, capfd):
    """A tree without kernels/ is refused by name; a bad field of a tree's config ends its process,
    whose error (on the inherited stderr) names the field, and the comparison stops, naming the tree."""
    with pytest.raises(SystemExit):
        compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--a-tree", str(tmp_path),
                              "--out", str(tmp_path / "rows.csv")])
    assert f"--a-tree {tmp_path}: no kernels/ there" in capfd.readouterr().err
    other = _other_tree(tmp_path)
    with pytest.raises(SystemExit, match=r"config B \(kernels of .*other; no_such_field=1\): its process ended"):
        compare_configs.main(["--call", "fwd", "--shape", "1,64,2,32", "--dtype", "fp16", "--b-tree", str(other),
                              "--b", "no_such_field=1", "--out", str(tmp_path / "rows.csv")])
    assert "unknown config field 'no_such_field'" in capfd.readouterr().err
