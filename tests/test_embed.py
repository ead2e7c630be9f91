"""Generated Markdown sections (reports/embed.py): numbers come from rows, rewriting is idempotent."""

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


def test_kernel_vs_fa2_cells_are_ratios_of_the_same_run():
    table = embed.kernel_vs_fa2_table(_rows())
    assert "| fwd | 128 | True | 300 · 1.50x · 0.75x | 330 · 1.10x · n/a |" in table


def test_utilisation_is_a_fraction_of_the_matmul_ceiling():
    table = embed.utilisation_table(_rows(), ceiling=660.0)
    assert "| fwd | 128 | True | 50% | 45% | n/a |" in table  # seqlen 4096: 330/660, 300/660


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


def test_runs_ratio_table_has_one_column_per_run(tmp_path):
    paths = []
    for i, ours in enumerate([300.0, 360.0]):
        path = tmp_path / f"run{i}.csv"
        _rows().assign(status="ok", tflops=lambda r, ours=ours: r.tflops.where(
            ~((r.provider == "fa2") & (r.seqlen == 2048)), ours)).to_csv(path, index=False)
        paths.append((f"run{i}", path))
    table = embed.runs_ratio_table(paths, (128,), (2048,))
    assert "| mode | hdim | causal | seqlen | run0 | run1 |" in table
    assert "| fwd | 128 | True | 2048 | 1.500x | 1.800x |" in table


def test_targets_report_the_worst_ratio_and_the_verdict():
    rows = _rows()  # fwd, hdim 128, causal: 1.50x official at 2k, 1.10x at 4k
    table = embed.targets_table([rows])
    assert "| fwd >= 1.3x official FA2, seqlen >= 2k | dtype bf16, hdim 128, causal True | 1.100x (seqlen 4096) | not met |" in table
    better = rows.assign(tflops=[300.0, 200.0, 400.0, 400.0, 300.0])  # 1.33x at 4k
    assert "1.333x (seqlen 4096) | met |" in embed.targets_table([better])


def test_targets_check_the_ablation_settings():
    base = {"mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048, "status": "ok"}
    ablation = pd.DataFrame([
        {**base, "setting": "A", "provider": "rung4-hopper", "tflops": 260.0},
        {**base, "setting": "A", "provider": "sdpa-flash", "tflops": 200.0},
        {**base, "setting": "B", "provider": "rung4-hopper", "tflops": 250.0},
        {**base, "setting": "B", "provider": "sdpa-flash", "tflops": 200.0},
    ])
    table = embed.targets_table([_rows()], ablation)
    assert "| ablation fwd >= 1.3x official FA2 | setting A | 1.300x | met |" in table
    assert "| ablation fwd >= 1.3x official FA2 | setting B | 1.250x | not met |" in table


def test_extract_kernel_vs_fa2_refuses_mixed_dtypes(tmp_path):
    from harness.results import COLUMNS

    rows = pd.concat([_rows(), _rows().assign(dtype="fp16")]).assign(status="ok", repeat=0, setting="",
                                                                      interpreter=False)
    path = tmp_path / "results.csv"
    rows.reindex(columns=COLUMNS).to_csv(path, index=False)
    with pytest.raises(ValueError, match="one dtype"):
        embed.extract_kernel_vs_fa2(path, tmp_path / "out.csv")


def test_backward_parts_table_has_a_column_per_seqlen_and_causal_mode(tmp_path):
    rows = [{"seqlen": n, "hdim": 256, "causal": c, "config": "cfg", "part": part, "ms": ms, "status": "ok"}
            for n in (4096, 16384) for c in (False, True) for part, ms in ((None, n / 1000 + c), ("dq", 0.5))]
    path = tmp_path / "exp_bwd.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    lines = embed.backward_parts_table(path).splitlines()
    assert lines[0] == ("| config | kernels timed | ms, n4096 non-causal | ms, n4096 causal | ms, n16384 non-causal | "
                        "ms, n16384 causal |")
    assert lines[2] == "| cfg | all | 4.096 | 5.096 | 16.384 | 17.384 |"
    assert lines[3] == "| cfg | dq | 0.500 | 0.500 | 0.500 | 0.500 |"


def test_host_time_table_shows_gpu_host_and_do_bench_per_provider(tmp_path):
    rows = [{"seqlen": 512, "hdim": 128, "causal": True, "provider": p, "mode": m, "gpu_ms": g, "host_ms": h,
             "do_bench_ms": d, "dtype": "fp16", "status": "ok"}
            for p, g, h, d in (("fa2", 0.6, 0.8, 0.82), ("sdpa-flash", 0.7, 0.3, 0.71)) for m in ("fwd", "fwd_bwd")]
    path = tmp_path / "host.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    lines = embed.host_time_table(path, ("fwd_bwd",)).splitlines()
    assert lines[0].startswith("| seqlen | hdim | causal | mode | fa2 GPU | fa2 host | fa2 do_bench | sdpa-flash GPU")
    assert lines[2] == "| 512 | 128 | True | fwd_bwd | 0.600 | 0.800 | 0.820 | 0.700 | 0.300 | 0.710 |"
    assert len([line for line in lines if line.startswith("| 512")]) == 1
    assert lines[-1].startswith("Milliseconds per call, fp16, paper shapes")
