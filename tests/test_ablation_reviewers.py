"""The reviewers' studies (ablations/reviewers.py, parts.py, reviewers_report.py): every question
has a section, sentences come from the rows and say "not shown" when spreads overlap, and a
part runs end to end in Triton's interpreter into rows tagged with their question."""

import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest

from ablations.measure import ROW_COLUMNS
from ablations.parts import PARTS
from ablations.questions import QUESTIONS
from ablations.reviewers_report import NOT_SHOWN, SECTIONS, cells, clears, write_reviewers_report

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)

SHAPE = {"mode": "fwd", "causal": True, "hdim": 128, "seqlen": 2048, "batch": 8, "heads": 16, "dtype": "fp16"}


def row(question, variant, ms, spread, setting="A", **extra):
    """A timing row of `ms` milliseconds whose p20-p80 spread is ms +- spread."""
    return {**dict.fromkeys(ROW_COLUMNS, ""), "question": question, "variant": variant, "label": variant,
            "setting": setting, **SHAPE, "repeat": 0, "status": "ok", "ms": ms, "ms_p20": ms - spread,
            "ms_p80": ms + spread, "tflops": 100.0 / ms, "interpreter": False, **extra}


def test_every_question_has_a_section_and_its_row_name():
    assert [q.question for q in QUESTIONS] == ["warp-split-one-tile", "backward-ladder", "block-size-tuning",
                                               "fa1-causal-skip", "occupancy", "smem-vs-sync", "triton-vs-cutlass",
                                               "decode-fa1-cudagraph-compilers"]
    assert set(SECTIONS) == {q.question for q in QUESTIONS}
    for q in QUESTIONS:
        assert q.quote and q.asked_by
        assert q.part == "" or PARTS[q.part].question == q.question, q


def test_clears_means_the_spreads_do_not_overlap():
    a, b = (pd.Series({"ms_lo": lo, "ms_hi": hi}) for lo, hi in ((1.0, 1.1), (1.2, 1.3)))
    assert clears(a, b) and clears(b, a)
    assert not clears(a, pd.Series({"ms_lo": 1.05, "ms_hi": 1.25}))


@pytest.mark.parametrize("spread, clear", [(0.05, True), (1.0, False)])
def test_causal_skip_sentence_follows_the_rows(spread, clear, tmp_path):
    noskip = random.uniform(1.7, 2.5)  # any slower time: the sentence must carry its ratio
    rows = pd.DataFrame([row("fa1-causal-skip", "fwd-rung0-skip", 1.0, spread),
                         row("fa1-causal-skip", "fwd-rung0-noskip", noskip, spread)])
    text = write_reviewers_report(rows, pd.DataFrame(columns=["question"]), tmp_path / "r.md")
    section = text.split("## Causal block skipping in FA1")[1].split("\n## ")[0]
    assert f"{noskip / 1.0:.2f}x" in section
    assert ("beyond the spread" in section) == clear
    assert (f"{NOT_SHOWN}: within the spread" in section) == (not clear)


def test_smem_vs_sync_sentence_says_whether_time_follows_barriers(tmp_path):
    for barrier_ms, verdict in ((1.9, "follows the barriers"), (1.1, "does not follow the barriers alone")):
        rows = pd.DataFrame([row("smem-vs-sync", "fwd-rung2", 2.0, 0.01), row("smem-vs-sync", "fwd-rung3", 1.0, 0.01),
                             row("smem-vs-sync", "fwd-rung3-barriers12", barrier_ms, 0.01)])
        text = write_reviewers_report(rows, pd.DataFrame(columns=["question"]), tmp_path / "r.md")
        section = text.split("## Shared memory versus synchronisation")[1].split("\n## ")[0]
        assert f"recovers {(barrier_ms - 1.0) / 1.0:.0%}" in section and verdict in section


def test_tuning_sentence_reports_the_gain_over_the_fixed_config(tmp_path):
    rows = []
    for seqlen, (fixed_ms, best_ms) in {1024: (1.0, 0.9), 4096: (2.0, 1.6)}.items():
        for name, ms, fixed, stages in (("a", fixed_ms, True, 1), ("b", best_ms, False, 2),
                                        ("c", fixed_ms * 1.5, False, 3)):
            config = (f'{{"kernel": "rung3", "fixed": {str(fixed).lower()}, "block_m": 128, "block_n": 64, '
                      f'"num_warps": 4, "num_stages": {stages}}}')
            rows.append(row("block-size-tuning", f"tune-rung3 {name}", ms, 0.001, setting="sweep", seqlen=seqlen,
                            config=config))
    text = write_reviewers_report(pd.DataFrame(rows), pd.DataFrame(columns=["question"]), tmp_path / "r.md")
    gains = [1.0 / 0.9, 2.0 / 1.6]
    assert f"median {pd.Series(gains).median() - 1:.1%}" in text and f"at most {max(gains) - 1:.1%}" in text
    assert "beyond the spread at 2 of 2 shapes" in text
    stage = pd.Series(gains).median()  # candidate b is the fixed tile with one more stage
    assert f"one more pipelining stage runs at a median {stage:.2f}x" in text


def test_questions_without_rows_say_not_shown(tmp_path):
    text = write_reviewers_report(pd.DataFrame(columns=ROW_COLUMNS), pd.DataFrame(columns=["question"]),
                                  tmp_path / "r.md")
    for q in QUESTIONS:
        section = text.split(f"## {q.title}")[1].split("\n## ")[0]
        assert f"**What the rows show:** {NOT_SHOWN}" in section, q.question


def test_cells_take_the_median_and_the_widest_spread():
    rows = pd.DataFrame([row("q", "v", ms, 0.1) | {"repeat": i} for i, ms in enumerate((1.0, 3.0, 2.0))])
    cell = cells(rows).iloc[0]
    assert cell["ms"] == 2.0 and math.isclose(cell["ms_lo"], 0.9) and math.isclose(cell["ms_hi"], 3.1)
    assert cell["repeats"] == 3


def test_a_part_runs_end_to_end_in_the_interpreter(tmp_path):
    """fa1-causal-skip in the interpreter: rows tagged with their question, both variants ok and
    correct-sized, the report written with the interpreter warning."""
    import argparse

    from ablations.reviewers import COUNTERS_CSV, REPORT_MD, ROWS_CSV, run

    assert run("fa1-causal-skip", argparse.Namespace(dtype="fp16", repeats=1, ncu="off"), tmp_path) == 0
    rows = pd.read_csv(tmp_path / ROWS_CSV)
    assert set(rows["question"]) == {"fa1-causal-skip"}
    assert set(rows["variant"]) == {"fwd-rung0-skip", "fwd-rung0-noskip"}
    assert (rows["status"] == "ok").all() and (rows["ms"] > 0).all()
    assert set(rows["setting"]) == {"A", "B"}
    report = (tmp_path / REPORT_MD).read_text()
    assert "NOT performance" in report and "fwd-rung0-noskip" in report
    assert not (tmp_path / COUNTERS_CSV).exists()


def test_reviewers_cli_rejects_an_unknown_part_by_name(tmp_path, capsys):
    from ablations.reviewers import main

    with pytest.raises(SystemExit):
        main(["nonsense", "--out", str(tmp_path)])
    assert "part must be all or one of" in capsys.readouterr().err


def test_ncu_command_profiles_one_launch_per_job_in_one_process():
    from ablations.measure import ncu_command

    jobs = [{"variant": f"fwd-rung{r}"} for r in range(3)]
    command = ncu_command(jobs, "_ladder_q_outer_kernel", ["gpu__time_duration.sum"])
    assert command[command.index("--launch-count") + 1] == "3"
    assert command[-3:-1] == ["-m", "ablations.ncu_target"] and '"fwd-rung2"' in command[-1]


def test_occupancy_section_shows_counters_and_theoretical_from_limits(tmp_path):
    from ablations.measure import THEORETICAL_OCCUPANCY
    from harness import ncu

    warps_active = {"fwd-rung1": random.uniform(5, 20), "fwd-rung2": random.uniform(30, 60)}
    counters = pd.DataFrame([{"question": "occupancy", "variant": name, "setting": "B", **SHAPE, "status": "ok",
                              "block_size": "(128, 1, 1)", ncu.WARPS_ACTIVE: active, ncu.WAVES: 0.1 * (i + 1),
                              ncu.OCCUPANCY_LIMIT_REGISTERS: 2, ncu.OCCUPANCY_LIMIT_SHARED: 3,
                              THEORETICAL_OCCUPANCY: math.nan}
                             for i, (name, active) in enumerate(warps_active.items())])
    text = write_reviewers_report(pd.DataFrame(columns=ROW_COLUMNS), counters, tmp_path / "r.md")
    section = text.split("## Occupancy")[1].split("\n## ")[0]
    assert f"{warps_active['fwd-rung1']:.0f}% -> {warps_active['fwd-rung2']:.0f}%" in section
    assert "| 12 |" in section  # 2 blocks (the register limit) x 4 warps of 64 slots
    assert "**achieved occupancy**" in section


def test_variants_resolve_by_name_and_unknown_names_are_refused():
    from ablations.variants import get_variant, variants

    for name in variants():
        assert get_variant(name).name == name
    assert get_variant("fwd-rung3-barriers12").config == '{"extra_barriers": 12}'
    with pytest.raises(ValueError, match="unknown variant 'rung9'"):
        get_variant("rung9")


@pytest.mark.parametrize("name", ["fwd-rung0-noskip", "bwd-rung1"])
def test_profiled_step_runs_a_variant_once(name, device):
    """The call ncu profiles: the forward, or the backward alone after one forward."""
    import torch

    from ablations.measure import spec_of
    from ablations.ncu_target import profiled_step
    from ablations.variants import get_variant

    variant = get_variant(name)
    spec = spec_of(variant.mode, True, 32, 40, 1, 2, "fp16")
    result = profiled_step(variant, spec, torch.device(device))()
    tensors = result if isinstance(result, tuple) else (result,)
    assert all(t.shape == (1, 40, 2, 32) and torch.isfinite(t).all() for t in tensors)
    assert len(tensors) == (3 if variant.mode == "bwd" else 1)


def test_backward_counters_compare_the_rungs_each_technique_separates(tmp_path):
    from harness import ncu

    fp32 = {f"bwd-rung{r}": random.uniform(1e8, 1e9) for r in range(4)}
    wavefronts = {f"bwd-rung{r}": random.uniform(1e6, 1e7) for r in range(4)}
    counters = pd.DataFrame([{"question": "backward-ladder", "variant": name, "setting": "A", **SHAPE, "mode": "bwd",
                              "status": "ok", ncu.FFMA: fp32[name] / 2, ncu.FADD: fp32[name] / 4,
                              ncu.FMUL: fp32[name] / 4, ncu.SHARED_WAVEFRONTS: wavefronts[name]} for name in fp32])
    text = write_reviewers_report(pd.DataFrame(columns=ROW_COLUMNS), counters, tmp_path / "r.md")
    section = text.split("## The three techniques in the backward pass")[1].split("\n## ")[0]
    assert f"rung 1 executes {fp32['bwd-rung1'] / fp32['bwd-rung0']:.2f}x rung 0's" in section
    assert f"rung 3 {wavefronts['bwd-rung3'] / wavefronts['bwd-rung2']:.2f}x rung 2's shared-memory" in section


def test_rung3_tuning_candidates_keep_its_warp_split(monkeypatch):
    import torch

    from ablations.measure import Context
    from kernels import configs

    monkeypatch.setattr(configs, "on_hopper", lambda device: True)  # the H200 tables, without a GPU
    from ablations.parts import tuning_candidates
    from kernels.fa_ladder import SPLIT_Q, warp_split

    ctx = Context(device=torch.device("cuda"), interpreter=False, dtype="fp16", warmup_ms=1, rep_ms=1, repeats=1,
                  out_dir=Path("."), ncu=False)
    for headdim in (64, 128):
        candidates, fixed = tuning_candidates(ctx, headdim)["rung3"]
        assert fixed in candidates and len(set(candidates)) == len(candidates)
        assert all(warp_split(c.block_m, headdim) == SPLIT_Q for c in candidates)
        production, fixed = tuning_candidates(ctx, headdim)["production"]
        assert fixed in production


def test_warp_split_sentence_compares_each_variant_with_split_q(tmp_path):
    times = {"ws-split-q": 1.0, "ws-split-k-p": random.uniform(1.2, 1.5), "ws-split-k-o": random.uniform(1.6, 2.0),
             "fwd-rung2": 1.3, "fwd-rung3": 1.1}
    rows = pd.DataFrame([row("warp-split-one-tile", name, ms, 0.01,
                             config=json.dumps({"registers": 200, "spill_bytes": 16 if name == "ws-split-k-p" else 0}))
                         for name, ms in times.items()])
    text = write_reviewers_report(rows, pd.DataFrame(columns=["question"]), tmp_path / "r.md")
    section = text.split("## Split-K versus split-Q at one tile")[1].split("\n## ")[0]
    assert f"split-Q over Triton's split-K: {times['ws-split-k-p']:.2f}x (beyond the spread) (ws-split-k-p spills 16 B)" \
        in section
    assert f"split-Q over FA1's split-K: {times['ws-split-k-o']:.2f}x (beyond the spread)" in section
    assert f"rung 3 over rung 2 (the compiler-chosen pair, tile sides swapped): {1.3 / 1.1:.2f}x" in section


def test_decode_rows_tagged_with_their_question_are_shown(tmp_path):
    ms = random.uniform(0.01, 0.1)
    rows = pd.DataFrame([row("decode-fa1-cudagraph-compilers", "ours-splitkv", ms, 0.001, setting="1 x 64k"),
                         row("decode-fa1-cudagraph-compilers", "fa1-rung0", 2 * ms, 0.001, setting="1 x 64k")])
    text = write_reviewers_report(rows, pd.DataFrame(columns=["question"]), tmp_path / "r.md")
    section = text.split("## FA1 in decoding, CUDA graphs and compilers")[1]
    assert f"{ms:.3f}" in section and "| fa1-rung0 |" in section
    assert "1 x 64k: FA1 -> split-KV: 2.00x (beyond the spread)" in section
