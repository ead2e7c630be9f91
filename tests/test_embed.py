"""Generated Markdown sections (reports/embed.py): numbers come from rows, rewriting is idempotent."""

from pathlib import Path

import pandas as pd
import pytest

from reports import embed


def _rows():
    base = {"mode": "fwd", "hdim": 128, "causal": True, "batch": 8, "heads": 16, "dtype": "bf16", "gpu": "NVIDIA H200",
                "torch": "2.11", "triton": "3.6", "git_commit": "abc", "timestamp": "t"}
    return pd.DataFrame([
        {**base, "provider": "fa2", "seqlen": 2048, "tflops": 300.0},
        {**base, "provider": "sdpa-flash", "seqlen": 2048, "tflops": 200.0},
        {**base, "provider": "sdpa-cudnn", "seqlen": 2048, "tflops": 400.0},
        {**base, "provider": "fa2", "seqlen": 4096, "tflops": 330.0},
        {**base, "provider": "sdpa-flash", "seqlen": 4096, "tflops": 300.0},
    ])


def test_utilisation_is_a_fraction_of_the_matmul_ceiling():
    table = embed.utilisation_table(_rows(), ceiling=660.0)
    # seqlen 4096, causal only: 330/660, 300/660, no cuDNN row; the non-causal cells are n/a
    assert "| fwd | 128 | n/a | n/a | n/a | 50% | 45% | n/a |" in table


def test_update_markdown_rewrites_marked_sections_and_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.setitem(embed.SECTIONS, "kernel_vs_fa2", lambda: "generated\ntable")
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- BEGIN kernel_vs_fa2 -->\n<!-- END kernel_vs_fa2 -->\noutro\n")
    assert embed.update_markdown(page) == ["kernel_vs_fa2"]
    once = page.read_text()
    assert once == "intro\n<!-- BEGIN kernel_vs_fa2 -->\ngenerated\ntable\n<!-- END kernel_vs_fa2 -->\noutro\n"
    embed.update_markdown(page)
    assert page.read_text() == once


def test_matmul_ceiling_without_a_figure_is_an_error(tmp_path):
    path = tmp_path / "ceiling.txt"
    path.write_text("no number here")
    with pytest.raises(ValueError, match="TFLOP/s"):
        embed.matmul_ceiling_tflops(path)


def test_anchor_table_counts_cells_outside_the_band():
    anchors = pd.DataFrame([
        {"method": "sdpa_flash", "mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048, "batch": 8,
         "heads": 16, "ms": 1.0, "tflops": 200.0},
        {"method": "sdpa_flash", "mode": "fwd", "causal": True, "hdim": 128, "seqlen": 4096, "batch": 8,
         "heads": 16, "ms": 1.0, "tflops": 250.0},
    ])
    rows = _rows().assign(status="ok")
    table = embed.anchor_table(rows, anchors)
    # 200/200 = 1.00 inside the band; 300/250 = 1.20 outside it
    assert "| sdpa-flash | fwd | 2 | 1.00 | 1.10 | 1.20 | 1 |" in table


def test_anchor_table_counts_a_configuration_once_whatever_its_repeats():
    anchors = pd.DataFrame([{"method": "sdpa_flash", "mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048,
                             "batch": 8, "heads": 16, "ms": 1.0, "tflops": 200.0}])
    rows = _rows().assign(status="ok")
    flash = rows[(rows.provider == "sdpa-flash") & (rows.seqlen == 2048)]
    repeats = pd.concat([flash.assign(repeat=i, tflops=t) for i, t in enumerate([150.0, 210.0, 230.0])])
    table = embed.anchor_table(repeats, anchors)
    assert "| sdpa-flash | fwd | 1 | 1.05 | 1.05 | 1.05 | 0 |" in table  # the median repeat, 210/200


def test_extract_kernel_vs_fa2_refuses_mixed_dtypes(tmp_path):
    from harness.results import COLUMNS

    rows = pd.concat([_rows(), _rows().assign(dtype="fp16")]).assign(status="ok", repeat=0, setting="",
                                                                      interpreter=False)
    path = tmp_path / "results.csv"
    rows.reindex(columns=COLUMNS).to_csv(path, index=False)
    with pytest.raises(ValueError, match="one dtype"):
        embed.extract_kernel_vs_fa2(path, tmp_path / "out.csv")


def _decision(tmp_path, unit="ms"):
    rows = [{"row": r, "column": c, "unit": unit, "value": v, "tool": "tools/x.py, bf16", "git_commit": "abc1234"}
            for r, values in (("slow kernel", (2.0, 4.0)), ("fast kernel", (1.0, 3.0)))
            for c, v in zip(("n1024 full", "n1024 causal"), values)]
    path = tmp_path / "choice.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_decision_table_keeps_file_order_and_computes_ratios_from_the_rows(tmp_path):
    lines = embed.decision_table(_decision(tmp_path), (("speed-up", "slow kernel", "fast kernel"),)).splitlines()
    assert lines[0] == "| ms | n1024 full | n1024 causal |"
    assert lines[2] == "| slow kernel | 2.000 | 4.000 |"
    assert lines[3] == "| fast kernel | 1.000 | 3.000 |"
    assert lines[4] == "| **speed-up** | 2.00x | 1.33x |"
    assert lines[-1] == "tools/x.py, bf16; rows: `reports/h200/decisions/choice.csv`."


def test_decision_table_names_a_peer_that_did_not_run_in_its_footer(tmp_path):
    """A row with no time at all (FA4 not installed there) is left out of the table and named in
    the footer with its reason; a ratio that needs it keeps it as an empty row."""
    path = _decision(tmp_path)
    rows = pd.read_csv(path)
    peer = rows.head(2).assign(row="fa4", value=float("nan"), tool="tools/x.py, bf16; unsupported: not installed")
    pd.concat([rows, peer]).to_csv(path, index=False)
    lines = embed.decision_table(path).splitlines()
    assert not any(line.startswith("| fa4 |") for line in lines)
    assert lines[-1] == ("tools/x.py, bf16; not timed: fa4 (unsupported: not installed); "
                         "rows: `reports/h200/decisions/choice.csv`.")
    kept = embed.decision_table(path, (("over fa4", "fast kernel", "fa4"),)).splitlines()
    assert "| fa4 |  |  |" in kept and "not timed" not in kept[-1]


def test_decision_writer_rows_render_and_survive_before_close(tmp_path):
    """reports.decisions.DecisionWriter (the experiments' rows): each row is on disk once
    written, `append` keeps an earlier run's rows, and decision_table reads the file."""
    from reports.decisions import DecisionWriter

    (tmp_path / "written").mkdir()
    path = tmp_path / "written" / "choice.csv"
    writer = DecisionWriter(path, "tools/x.py, bf16", commit="abc1234")
    writer.write("slow kernel", "n1024 full", "ms", 2.0)
    assert len(pd.read_csv(path)) == 1  # flushed before the run ends
    writer.write("slow kernel", "n1024 causal", "ms", 4.0)
    writer.close()
    with DecisionWriter(path, "tools/x.py, bf16", commit="abc1234", append=True) as writer:
        writer.write("fast kernel", "n1024 full", "ms", 1.0)
        writer.write("fast kernel", "n1024 causal", "ms", 3.0)
    assert embed.decision_table(path).splitlines() == embed.decision_table(_decision(tmp_path)).splitlines()
    with DecisionWriter(path, "tools/x.py, bf16", commit="abc1234") as writer:  # a new run replaces
        writer.write("fast kernel", "n1024 full", "ms", 1.0)
    assert len(pd.read_csv(path)) == 1


def test_experiment_checks_gate_what_is_timed_and_rounds_interleave_the_variants(tmp_path):
    """DecisionWriter.write_checks returns only the variants that matched float64 (each check a
    row, a failure's notes kept); time_interleaved selects each variant before each case's call,
    round after round, and a call without a time is a NaN row with its reason, not a missing one."""
    from reports.decisions import DecisionWriter

    path = tmp_path / "exp.csv"
    calls = []
    with DecisionWriter(path, "tools/x.py, bf16", commit="abc1234") as writer:
        passed = writer.write_checks({"a": (True, ""), "b": (False, "dq 3e-1 (table 1e-2)"), "c": (True, "fine")})
        assert passed == ["a", "c"]
        writer.time_interleaved({name: name.upper() for name in passed}, {"2x8k": 2, "8x2k": 8}, calls.append,
                                lambda case, value: ({"ms": case * 0.5} if value == "A" else
                                                     {"status": "error", "reason": "out of shared memory"}),
                                repeats=2)
    assert calls == ["A", "C"] * 4
    rows = pd.read_csv(path)
    checks = rows[rows.column == "check against float64"]
    assert checks.set_index("row")["unit"].to_dict() == {"a": "ok", "b": "wrong", "c": "ok"}
    assert "dq 3e-1" in checks.set_index("row").loc["b", "tool"]
    times = rows[rows.unit == "ms"]
    assert list(times.row) == ["a", "c", "a", "c"] * 2
    assert times[times.row == "a"].value.tolist() == [1.0, 4.0, 1.0, 4.0]
    assert times[times.row == "c"].value.isna().all()
    assert times[times.row == "c"].tool.str.endswith("error: out of shared memory").all()
    assert (times[times.row == "a"].tool == "tools/x.py, bf16").all()

    # in microseconds; a call timed but not ok (its output wrong) is NaN with its reason too
    path = tmp_path / "exp_us.csv"
    with DecisionWriter(path, "tools/x.py, bf16", commit="abc1234") as writer:
        writer.time_interleaved({"ok": 0, "wrong": 1}, {"1 x 1k": None}, lambda value: None,
                                lambda case, value: ({"ms": 0.01, "status": "ok"} if value == 0 else
                                                     {"ms": 0.02, "status": "wrong", "reason": "relative error 0.5"}),
                                repeats=1, unit="us")
    rows = pd.read_csv(path).set_index("row")
    assert (rows.unit == "us").all() and rows.loc["ok", "value"] == 10.0
    assert pd.isna(rows.loc["wrong", "value"]) and rows.loc["wrong", "tool"].endswith("wrong: relative error 0.5")


def test_the_schedule_table_takes_the_launchers_rule_and_lists_a_failed_cell(tmp_path):
    """bwd_schedule_table: medians over rounds, each choice's speed-up, cuDNN against the schedule
    kernels/flash_attn_hopper.py's own rule takes (dQ first with GQA, not for dense MHA), and a
    cell the experiment could not measure listed with its reason."""
    from reports.decisions import DecisionWriter

    tool = "tools/experiments/exp_bwd_schedule.py, bf16"
    path = tmp_path / "bwd_schedule.csv"
    times = {(False, False): (4.0, 8.0), (False, True): (4.4, 7.6), (True, False): (3.0, 6.0),
             (True, True): (3.3, 5.0)}
    with DecisionWriter(path, tool, commit="abc1234") as writer:
        for (stats, dq_first), values in times.items():
            writer.write(embed.bwd_schedule_label(stats, dq_first), "check against float64", "ok", 1.0)
        for _ in range(2):  # two rounds: the table shows their median
            for (stats, dq_first), values in times.items():
                for column, value in zip(("dense 2x8k 16/16h", "gqa 2x8k 32/8h"), values, strict=True):
                    writer.write(embed.bwd_schedule_label(stats, dq_first), column, "ms", value)
            writer.write("sdpa-cudnn", "dense 2x8k 16/16h", "ms", 3.0)
            writer.write("sdpa-cudnn", "gqa 2x8k 32/8h", "ms", float("nan"),
                         tool=f"{tool}; error: RuntimeError: no kernel")
    lines = embed.bwd_schedule_table(path).splitlines()
    assert lines[5] == "| L, D in shared memory, dQ before dK | 3.300 | 5.000 |"
    assert "| **L, D in shared memory: speed-up (dQ after dK)** | 1.33x | 1.33x |" in lines
    assert "| **dQ before dK: speed-up (L, D in shared memory)** | 0.91x | 1.20x |" in lines
    # dense MHA: dQ after dK (cuDNN 3.0 / 3.0); GQA: dQ first, but cuDNN was not measured there
    assert "| **speed over cuDNN (cuDNN time / the launcher's schedule)** | 1.00x | n/a |" in lines
    assert lines[-1].startswith("bf16; every schedule matched")  # the settings, not the script or commit
    assert "not measured or not ok: sdpa-cudnn, gqa 2x8k 32/8h: error: RuntimeError: no kernel" in lines[-1]


def test_decision_table_names_a_missing_ratio_row(tmp_path):
    with pytest.raises(ValueError, match="no row 'nowhere'"):
        embed.decision_table(_decision(tmp_path), (("speed-up", "nowhere", "fast kernel"),))


def test_decision_table_refuses_an_unknown_unit(tmp_path):
    with pytest.raises(ValueError, match="one unit"):
        embed.decision_table(_decision(tmp_path, unit="furlongs"))


def test_every_decision_section_renders_from_its_committed_rows():
    for name in embed.DECISION_RATIOS:
        table = embed.SECTIONS[name]()
        assert f"rows: `reports/h200/decisions/{name}.csv`" in table
        assert "nan" not in table


@pytest.mark.parametrize("page", ["README.md", "docs/performance.md", "reports/h200/README.md"])
def test_committed_pages_match_the_rows_they_are_generated_from(tmp_path, page):
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / page
    copy = tmp_path / source.name
    copy.write_text(source.read_text())
    assert embed.update_markdown(copy), f"{page} has no generated section"
    assert copy.read_text() == source.read_text(), f"{page} is stale: run python -m reports.embed {page}"


def test_peers_table_states_where_ours_stands_against_each_peer_and_the_compilers():
    rows = _rows().assign(status="ok", reason="")
    extra = pd.DataFrame([
        {**rows.iloc[0].to_dict(), "provider": "fa4", "seqlen": 2048, "tflops": 250.0},
        {**rows.iloc[0].to_dict(), "provider": "fa4", "seqlen": 4096, "tflops": 440.0},
        {**rows.iloc[0].to_dict(), "provider": "flex-attention", "seqlen": 2048, "tflops": 150.0},
        {**rows.iloc[0].to_dict(), "provider": "flex-attention", "seqlen": 4096, "status": "error", "tflops": None,
         "reason": "OutOfResources: shared memory; more"},
        {**rows.iloc[0].to_dict(), "provider": "sdpa-cudnn", "seqlen": 4096, "tflops": 330.0,
         "timestamp": "t2"},  # resumed in a second process
    ])
    table = embed.peers_table(pd.concat([rows, extra], ignore_index=True))
    assert "| fwd | 128 | True | 300 · 1.20x · 0.75x · 1.50x | 330 · 0.75x · 1.00x · 1.10x |" in table
    assert ("ahead of FA4 in 1 of 2 configurations (by 20%), behind in 1 (by 25%); "
            "ahead of cuDNN in 0 of 2 configurations, level (within 1%) in 1, behind in 1 (by 25%)") in table
    assert "ahead of FlexAttention in 1 of 1 configurations (by 100%)" in table
    assert "- FlexAttention: 1 configurations error (OutOfResources: shared memory)" in table
    assert "the same gpu, torch, triton, git_commit, as the rows record them" in table
    assert "configurations whose providers span two of them: fwd, 128, True, 4096." in table


def _host_rows():
    env = {"causal": True, "dtype": "bfloat16", "gpu": "NVIDIA H200", "torch": "2.11", "git_commit": "abc",
           "status": "ok", "reason": "", "gpu_ms": float("nan"), "wall_ms": float("nan")}
    shape = {"batch": 1, "heads": 16, "seqlen": 1024, "hdim": 128}
    rows = []
    for provider, threaded, caller in (("fa2", 0.6, 0.4), ("sdpa-flash", 0.3, 0.2)):
        for mode in ("fwd", "fwd_bwd"):
            rows.append({**env, **shape, "provider": provider, "mode": mode, "compiled": False, "engine": "threaded",
                         "host_ms": threaded / (3 if mode == "fwd" else 1)})
        rows.append({**env, **shape, "provider": provider, "mode": "fwd_bwd", "compiled": False,
                     "engine": "calling-thread", "host_ms": caller})
        rows.append({**env, **shape, "provider": provider, "mode": "fwd_bwd", "compiled": True, "engine": "threaded",
                     "host_ms": 2 * threaded})
    return pd.DataFrame(rows)


def test_the_host_table_reads_the_default_engine_and_the_engine_table_both():
    rows = _host_rows()
    main = embed.host_overhead_table(rows)
    # the calling-thread rows stay out of the main table: eager 0.6 against 0.3, compiled 1.2 against 0.6
    assert "| fwd_bwd | 1, 16, 1024, 128 | 0.600 | 0.300 | 2.00x | 1.200 | 0.600 | 2.00x |" in main
    older = rows[rows.engine == "threaded"].drop(columns="engine")  # rows from before the column: one engine
    assert embed.host_overhead_table(older) == main
    engines = embed.host_engine_table(rows)
    assert "| fwd_bwd | 1, 16, 1024, 128 | 0.600 | 0.400 | 0.300 | 0.200 | 2.00x |" in engines
    assert "| fwd |" not in engines  # no backward, no engine
    assert "faster than the device thread in 1 of 1 cells for ours, 1 of 1 for SDPA flash" in engines
    with pytest.raises(ValueError, match="calling thread"):
        embed.host_engine_table(rows[rows.engine == "threaded"])


def _experiment_rows(tmp_path, name, values):
    from reports.decisions import DecisionWriter

    path = tmp_path / f"{name}.csv"
    with DecisionWriter(path, f"tools/experiments/exp_{name}.py", commit="abc") as writer:
        for row in dict.fromkeys(r for r, _, _ in values):
            writer.write(row, "check against float64", "ok", 1.0)
        for row, column, value in values:
            writer.write(row, column, "ms", value)
    return path


def test_the_alibi_table_gives_each_way_s_time_over_the_dense_forward(tmp_path):
    path = _experiment_rows(tmp_path, "alibi_column_term", [
        ("no ALiBi (the dense forward)", "2x8k", 1.0), ("ALiBi, registers", "2x8k", 1.2),
        ("ALiBi, matmul", "2x8k", 1.1), ("ALiBi, matmul", "2x8k", 1.3)])
    lines = embed.alibi_column_term_table(path).splitlines()
    assert lines[0] == ("| case | no ALiBi ms | ALiBi, registers ms | ALiBi, matmul ms | ALiBi, registers / no ALiBi "
                        "| ALiBi, matmul / no ALiBi |")
    assert "| 2x8k | 1.000 | 1.200 | 1.200 | 1.20x | 1.20x |" in lines  # the matmul's median of 1.1 and 1.3
    assert "each matched float64" in lines[-1] and "exp_alibi" not in lines[-1] and "abc" not in lines[-1]




def test_the_host_overhead_suite_reports_from_its_rows(tmp_path):
    """runner.py --suite host-overhead's report: both tables from the folder's rows, naming them."""
    import shutil

    from reports.host_overhead import write_host_overhead_report

    shutil.copy(embed.HOST_OVERHEAD_CSV, tmp_path / "host_overhead.csv")
    report = write_host_overhead_report(tmp_path).read_text()
    assert report.startswith("# Host time per call") and "## The backward's engine" in report
    assert "rows: `host_overhead.csv`" in report and "nan" not in report


def test_the_compare_configs_table_says_where_clocks_were_throttled(tmp_path, monkeypatch):
    """compare_configs_table: per shape each config's median and B's speed-up over A, and, where the
    rows' notes file (harness.suite.SuiteRows) records throttled clocks, a sentence naming it."""
    columns = ["call", "batch", "seqlen", "lengths", "heads", "kv_heads", "headdim", "causal", "dtype", "config",
               "ms", "gpu"]
    rows = [["fwd", 2, 1024, "", 4, 4, 96, False, "bf16", config, ms, "GPU X"]
            for config, ms in (("A", 2.0), ("B", 1.0), ("A", 4.0), ("B", 1.0))]
    path = tmp_path / "ab.csv"
    pd.DataFrame(rows, columns=columns).to_csv(path, index=False)
    monkeypatch.setattr(embed, "_repository_path", lambda p: p.name)  # rows outside the repository
    table = embed.compare_configs_table(path, "old", "new")
    assert "| fwd | 2 x 1024 | 4 | 96 | False | 3.000 | 1.000 | 3.00x |" in table
    assert "median of at least 2 interleaved rounds" in table and "throttled" not in table
    (tmp_path / "ab.notes.txt").write_text("clocks were power-throttled for 12.0 ms during the run: numbers may be low\n")
    assert "Clocks were throttled during some of these runs" in embed.compare_configs_table(path, "old", "new")


def test_the_compare_configs_table_without_labels_names_each_runs_fields(tmp_path, monkeypatch):
    """compare_configs_table without labels: one line per run (its timestamp), each naming A's and
    B's fields, so that several fields compared on one shape keep their own lines."""
    columns = ["call", "batch", "seqlen", "lengths", "heads", "kv_heads", "headdim", "causal", "dtype", "config",
               "fields", "ms", "gpu", "timestamp"]
    rows = [["fwd", 2, 8192, "", 21, 21, 96, False, "bf16", config, fields, ms, "GPU X", stamp]
            for stamp, b_fields, b_ms in (("t1", "hopper_gluon_block_m=192", 0.5), ("t2", "hopper_gluon_pingpong=True", 2.0))
            for config, fields, ms in (("A", "", 1.0), ("B", b_fields, b_ms))]
    path = tmp_path / "fields.csv"
    pd.DataFrame(rows, columns=columns).to_csv(path, index=False)
    monkeypatch.setattr(embed, "_repository_path", lambda p: p.name)
    lines = embed.compare_configs_table(path).splitlines()
    assert lines[0] == "| call | batch x seqlen | heads (kv) | head dim | causal | A | A, ms | B | B, ms | B's speed-up |"
    assert "| fwd | 2 x 8192 | 21 | 96 | False | the table | 1.000 | hopper_gluon_block_m=192 | 0.500 | 2.00x |" in lines
    assert "| fwd | 2 x 8192 | 21 | 96 | False | the table | 1.000 | hopper_gluon_pingpong=True | 2.000 | 0.50x |" in lines


def test_peer_counters_table_sets_ours_beside_the_peer_per_call(tmp_path, monkeypatch):
    """reports/embed.py's peer_counters_table: a `runner.py --ncu-only` folder (counters.csv and
    results.json) as one table a call, ours (fa2) first, the columns of where the cycles go, and
    the command and environment under them; a metric the run did not take is a dash."""
    from harness import ncu
    from harness.results import record_run

    rows = pd.read_csv(Path(__file__).parent / "fixtures" / "ncu" / "counters_confirming.csv")
    rows = rows[rows["setting"] == "A"].head(2).copy()
    rows["provider"], rows["setting"] = ["fa4", "fa2"], ""  # a sweep's rows have no ablation setting
    rows[ncu.SM_CYCLES] = [2.4e6, 2.6e6]
    rows[ncu.STALL_BARRIER_PER_ISSUE] = [0.55, 2.91]
    rows.to_csv(tmp_path / "counters.csv", index=False)
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "git_commit": "abc",
           "flash_attn_4": "4.0.0b36"}
    record_run(tmp_path, {"run_id": "r1", "command": "python3 runner.py --providers fa2,fa4 --ncu-only --out /x/y",
                          "environment_before": env})
    monkeypatch.setattr(embed, "_repository_path", lambda p: p.name)  # rows outside the repository
    text = embed.peer_counters_table(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("### fwd, causal, hdim 128") and "| SM cycles active |" in lines[2]
    ours, peer = (line for line in lines if line.startswith("| fa"))
    assert ours.startswith("| fa2 |") and "2.6 M" in ours and "2.91" in ours
    assert peer.startswith("| fa4 |") and "2.4 M" in peer and "0.55" in peer
    assert "| - |" in ours  # L2 hit rate: not in these rows
    assert "`python runner.py --providers fa2,fa4 --ncu-only`" in text
    assert "NVIDIA H100 80GB HBM3, torch 2.11.0, triton 3.6.0, commit abc, FA4 4.0.0b36" in text
