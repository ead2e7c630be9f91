"""The ablation ladder (kernels/fa_ladder.py, ablations/ladder.py, ablations/study.py).

Every rung is checked against the float64 reference with flash-attn's criterion (error at
most twice PyTorch's same-dtype error, plus a small epsilon): on CPU in Triton's interpreter
(fp16 and fp32, tiny ragged shapes, causal and not), and with `-m gpu` in bf16/fp16 at real
sizes, where the compiled kernels' warp split is checked too. Outputs start as NaN so that an
element no program writes cannot pass.
"""

import itertools
import math

import pandas as pd
import pytest
import torch

from ablations.ladder import RUNGS, SETTINGS, STUDIES
from baselines.reference import attention_reference, attention_same_dtype, causal_mask
from kernels.fa_ladder import (
    HOPPER_LADDER_CONFIGS,
    LADDER,
    SPLIT_K,
    SPLIT_Q,
    FwdConfig,
    default_ladder_config,
    ladder_block_d,
    ladder_forward,
    logsumexp_from_stats,
    warp_split,
)

# shared with the FA2 kernel's tests; the fixture is used through @pytest.mark.usefixtures
from tests.attention_checks import assert_close_to_reference, make_qkv, poisoned_allocations  # noqa: F401

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)

LADDER_RUNGS = range(len(LADDER))
# (dtype, causal, seqlen_q, seqlen_k, headdim): ragged lengths both ways, odd head dims
CPU_CASES = [
    (torch.float16, False, 64, 64, 64),
    (torch.float16, True, 113, 17, 40),  # seqlen_q > seqlen_k: the first 96 rows see no key
    (torch.float32, True, 17, 113, 16),
    (torch.float16, True, 50, 50, 64),
    (torch.float32, False, 1, 33, 40),
]


def check_rung(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device, batch=2, heads=3, config=None):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device)
    out, stats = ladder_forward(q, k, v, causal=causal, rung=rung, config=config)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_reference(f"rung {rung} out", out, ref_out, attention_same_dtype(q, k, v, causal=causal))
    lse = logsumexp_from_stats(stats)
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


# --------------------------------------------------------------------------------------
# CPU (Triton's interpreter): the math of every rung
# --------------------------------------------------------------------------------------
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("rung", LADDER_RUNGS)
@pytest.mark.parametrize("dtype, causal, seqlen_q, seqlen_k, headdim", CPU_CASES)
def test_rung_matches_reference(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device):
    check_rung(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("rung", LADDER_RUNGS)
def test_rows_that_see_no_key_are_zero_with_infinite_logsumexp(rung, device):
    """Causal with seqlen_q > seqlen_k: rows i < seqlen_q - seqlen_k see no key (bottom-right
    mask); their whole Q blocks are never visited by rungs 0-1, which must still write them."""
    q, k, v = make_qkv(1, 70, 20, 2, 32, torch.float16, device)
    out, stats = ladder_forward(q, k, v, causal=True, rung=rung)
    empty = ~causal_mask(70, 20).any(dim=1)  # (seqlen_q,)
    assert empty.sum() == 50
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isposinf(logsumexp_from_stats(stats)[:, :, empty]).all()
    assert not out[:, ~empty].isnan().any()


def test_rung0_stores_fa1_row_max_and_sum(device):
    """Rung 0 keeps FA1's m = rowmax(tau S) and l = rowsum(exp(tau S - m)) (FA1 Alg. 1 line
    13), not the logsumexp that rungs 1-3 store."""
    q, k, v = make_qkv(1, 40, 56, 2, 32, torch.float32, device)
    _, stats = ladder_forward(q, k, v, causal=True, rung=0)
    assert len(stats) == 2
    m, l = stats
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(32)
    scores = scores.masked_fill(~causal_mask(40, 56), float("-inf"))
    ref_m = scores.amax(dim=-1)
    torch.testing.assert_close(m.double(), ref_m, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(l.double(), torch.exp(scores - ref_m[..., None]).sum(-1), atol=1e-4, rtol=1e-4)
    for rung in (1, 2, 3):
        assert len(ladder_forward(q, k, v, causal=True, rung=rung)[1]) == 1


@pytest.mark.parametrize("rung", LADDER_RUNGS)
def test_strided_inputs_match_contiguous(rung, device):
    """q, k, v as views of one packed (B, S, 3, H, D) tensor give the contiguous result."""
    qkv = torch.randn(2, 37, 3, 2, 24, dtype=torch.float16, device=device)
    q, k, v = qkv.unbind(dim=2)
    out, _ = ladder_forward(q, k, v, causal=True, rung=rung)
    expected, _ = ladder_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, rung=rung)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_softmax_scale_is_used(device):
    q, k, v = make_qkv(1, 33, 33, 2, 32, torch.float32, device)
    for rung in LADDER_RUNGS:
        out, _ = ladder_forward(q, k, v, 0.3, False, rung=rung)
        ref, _ = attention_reference(q, k, v, softmax_scale=0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_no_keys_gives_zeros_and_infinite_logsumexp(device):
    q = torch.randn(1, 5, 2, 32, device=device)
    k = v = torch.randn(1, 0, 2, 32, device=device)
    for rung in LADDER_RUNGS:
        out, stats = ladder_forward(q, k, v, rung=rung)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isposinf(logsumexp_from_stats(stats)).all()


def test_ladder_rejects_bad_arguments_by_name(device):
    q, k, v = make_qkv(1, 8, 8, 1, 16, torch.float16, device)
    with pytest.raises(ValueError, match="rung must be an int in 0..3"):
        ladder_forward(q, k, v, rung=4)
    with pytest.raises(ValueError, match="rung must be an int"):
        ladder_forward(q, k, v, rung=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ladder_forward(q, k, v, causal=1, rung=0)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        ladder_forward(q, k, v[:, :4], rung=0)


# --------------------------------------------------------------------------------------
# The ladder's structure: one technique per rung, tiles that give each rung its warp split
# --------------------------------------------------------------------------------------
def test_each_rung_adds_exactly_one_technique():
    for before, after in itertools.pairwise(LADDER):
        changed = [field for field in ("fewer_nonmatmul", "seq_parallel", "warp_split")
                   if getattr(before, field) != getattr(after, field)]
        assert len(changed) == 1, (before, after)
    assert LADDER[0] == type(LADDER[0])(fewer_nonmatmul=False, seq_parallel=False, warp_split=SPLIT_K)
    assert LADDER[-1] == type(LADDER[0])(fewer_nonmatmul=True, seq_parallel=True, warp_split=SPLIT_Q)


def test_warp_split_follows_the_pv_tile_rule():
    """Triton 3.6 gives mma.sync warps [num_warps, 1] (split-Q) iff P@V's output block_m x
    block_d is at least as tall as wide (AccelerateMatmul's warpsPerTileV2, chained dots)."""
    assert warp_split(64, 128) == SPLIT_K
    assert warp_split(128, 128) == SPLIT_Q
    assert warp_split(128, 64) == SPLIT_Q
    assert ladder_block_d(16) == 32 and ladder_block_d(40) == 64 and ladder_block_d(256) == 256


def test_hopper_tiles_give_each_rung_its_warp_split():
    """Rungs 0-2 share one tile; rung 3 keeps rung 2's tile area, warps and stages and swaps
    the tile's sides so that warps split Q."""
    for (rung, block_d), cfg in HOPPER_LADDER_CONFIGS.items():
        assert warp_split(cfg.block_m, block_d) == LADDER[rung].warp_split, (rung, block_d, cfg)
    for block_d in (32, 64, 128):
        rung2, rung3 = HOPPER_LADDER_CONFIGS[(2, block_d)], HOPPER_LADDER_CONFIGS[(3, block_d)]
        assert (rung2.block_m, rung2.block_n) == (rung3.block_n, rung3.block_m)
        assert (rung2.num_warps, rung2.num_stages) == (rung3.num_warps, rung3.num_stages)
        tiles = {(HOPPER_LADDER_CONFIGS[(rung, block_d)].block_m, HOPPER_LADDER_CONFIGS[(rung, block_d)].block_n,
                  HOPPER_LADDER_CONFIGS[(rung, block_d)].num_warps) for rung in (0, 1, 2)}
        assert len(tiles) == 1, tiles


def test_neighbouring_rungs_share_warps_and_stages():
    """Pipelining depth and warps are not paper techniques: one value per head dim for every
    rung, so no step of the ladder mixes them in."""
    for block_d in (32, 64, 128, 256):
        configs = [cfg for (rung, d), cfg in HOPPER_LADDER_CONFIGS.items() if d == block_d]
        assert len({(cfg.num_warps, cfg.num_stages) for cfg in configs}) == 1, (block_d, configs)


def test_rung4_is_labelled_as_several_changes():
    assert "beyond the paper: several changes" in RUNGS[4].label
    assert "not one technique" in RUNGS[4].technique


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype, seqlen_q, seqlen_k, headdim", [(torch.float16, 50, 50, 64), (torch.float32, 113, 17, 40),
                                                                (torch.float16, 17, 113, 16)])
@pytest.mark.parametrize("rung", [0, 1])
def test_fa1_without_causal_block_skipping_matches_reference(rung, dtype, seqlen_q, seqlen_k, headdim, device):
    """skip_masked_blocks=False computes the blocks above the diagonal with the mask; the result
    is the same attention."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 3, headdim, dtype, device)
    out, stats = ladder_forward(q, k, v, causal=True, rung=rung, skip_masked_blocks=False)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert_close_to_reference(f"rung {rung} without skipping", out, ref_out,
                              attention_same_dtype(q, k, v, causal=True))
    lse = logsumexp_from_stats(stats)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


def test_block_skipping_switch_is_refused_where_it_does_not_exist(device):
    q, k, v = make_qkv(1, 8, 8, 1, 16, torch.float16, device)
    with pytest.raises(ValueError, match="skip_masked_blocks=False needs FA1's loop order"):
        ladder_forward(q, k, v, causal=True, rung=2, skip_masked_blocks=False)
    with pytest.raises(TypeError, match="skip_masked_blocks must be a bool"):
        ladder_forward(q, k, v, causal=True, rung=0, skip_masked_blocks=0)


def test_extra_barriers_are_refused_where_they_do_not_exist(device):
    q, k, v = make_qkv(1, 50, 50, 2, 32, torch.float16, device)
    with pytest.raises(ValueError, match="extra_barriers needs FA2's loop order"):
        ladder_forward(q, k, v, causal=True, rung=0, extra_barriers=1)
    with pytest.raises(ValueError, match="extra_barriers must be an int >= 0"):
        ladder_forward(q, k, v, causal=True, rung=3, extra_barriers=-1)


@pytest.mark.gpu
def test_extra_barriers_change_nothing_but_synchronisation_on_gpu():
    """The shared-memory-versus-synchronisation variant: added CTA barriers (inline bar.sync,
    which the interpreter lacks) leave the output bit-identical and appear in the PTX."""
    import re

    from kernels.fa_ladder import plan_ladder_forward

    q, k, v = make_qkv(1, 1000, 1000, 2, 128, torch.float16, "cuda")
    plain, _ = ladder_forward(q, k, v, causal=True, rung=3)
    with_barriers, _ = ladder_forward(q, k, v, causal=True, rung=3, extra_barriers=3)
    torch.testing.assert_close(with_barriers, plain, atol=0, rtol=0)
    counts = []
    for extra in (0, 3):
        _, _, launch = plan_ladder_forward(q, k, v, None, True, rung=3, extra_barriers=extra)
        counts.append(len(re.findall(r"\bbar\.sync\b", launch.run().asm["ptx"])))
    assert counts[1] == counts[0] + 2 * 3  # two K/V loops (unmasked, masked), three barriers each


def test_rung3_at_head_dim_256_says_why_it_has_no_tile():
    with pytest.raises(NotImplementedError, match="split-Q needs BLOCK_M >= 256"):
        default_ladder_config(3, 256, torch.device("cuda"))


def test_ladder_tables_match_the_contract():
    assert [rung.name for rung in RUNGS] == ["rung0-fa1", "rung1-fewer-nonmatmul", "rung2-seq-parallel",
                                             "rung3-split-q", "rung4-hopper"]
    assert [rung.index for rung in RUNGS] == list(range(5))
    assert STUDIES["all"] == [0, 1, 2, 3, 4]
    for study, rungs in STUDIES.items():
        if study != "all":
            assert len(rungs) == 2 and rungs[1] == rungs[0] + 1, study
    assert {name: s["batch"] for name, s in SETTINGS.items()} == {"A": 8, "B": 1}
    for setting in SETTINGS.values():
        assert (setting["mode"], setting["causal"], setting["hdim"], setting["seqlen"], setting["heads"]) == \
            ("fwd", True, 128, 2048, 16)


@pytest.mark.parametrize("rung", range(len(RUNGS)))
def test_rung_forward_takes_the_provider_signature(rung, device):
    q, k, v = make_qkv(1, 33, 33, 2, 32, torch.float16, device)
    out = RUNGS[rung].forward(q, k, v, True, None)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert_close_to_reference(RUNGS[rung].name, out, ref, attention_same_dtype(q, k, v, causal=True))


# --------------------------------------------------------------------------------------
# The report, from rows only
# --------------------------------------------------------------------------------------
def fake_rows(interpreter: bool) -> pd.DataFrame:
    """Result rows of an ablation run: rungs 0-4 and two peers, two settings, two repeats,
    TFLOPs/s drawn at random; a sweep shape (seqlen 1024) and one failed sweep row."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    providers = [(r.name, r.label) for r in RUNGS] + [("sdpa-flash", "FA2 official"), ("sdpa-cudnn", "cuDNN")]
    for name, setting in SETTINGS.items():
        for provider, label in providers:
            for repeat, seqlen in ((0, setting["seqlen"]), (1, setting["seqlen"]), (0, 1024)):
                rows.append({"provider": provider, "label": label, "setting": name, **setting, "seqlen": seqlen,
                             "repeat": repeat,
                             "status": "ok", "reason": "",
                             "tflops": 10 + 300 * torch.rand(1, generator=generator).item(),
                             "interpreter": interpreter, "gpu": "TestGPU", "torch": "2", "triton": "3.6.0"})
    rows.append({**rows[-1], "provider": "rung3-split-q", "hdim": 256, "status": "unsupported",
                 "reason": "no split-Q tile at head dim 256", "tflops": float("nan")})
    return pd.DataFrame(rows)


def test_ablation_report_is_built_from_rows(tmp_path):
    from ablations.study import load_paper_numbers, write_ablation_report

    rows = fake_rows(interpreter=False)
    report = write_ablation_report(rows, tmp_path).read_text()
    for setting in SETTINGS:
        assert f"## Setting {setting}:" in report
    for path in ("plots/ablation.png", "plots/ablation.svg", "plots/ablation_sweep.png"):
        assert (tmp_path / path).stat().st_size > 0
    ok = rows[(rows.status == "ok") & (rows.setting == "A") & (rows.seqlen == SETTINGS["A"]["seqlen"])]
    medians = ok.groupby("provider")["tflops"].median()
    gain = medians["rung1-fewer-nonmatmul"] / medians["rung0-fa1"]
    assert f"{medians['rung0-fa1']:.1f}" in report and f"{gain:.2f}x" in report
    paper = load_paper_numbers()
    assert f"{paper.tflops.iloc[0]:.0f}" in report and paper.source.iloc[0] in report
    assert "no split-Q tile at head dim 256" not in report.split("## Sweep")[0]  # a sweep row, not a setting
    assert "unsupported" in report.split("## Sweep")[1]
    assert "NOT performance" not in report


def test_interpreter_report_says_numbers_are_not_performance(tmp_path):
    from ablations.study import write_ablation_report

    report = write_ablation_report(fake_rows(interpreter=True), tmp_path).read_text()
    assert "NOT performance" in report


# --------------------------------------------------------------------------------------
# GPU: real sizes, bf16/fp16, and the compiled code's warp split
# --------------------------------------------------------------------------------------
# (dtype, head dim, causal): each dtype with each head dim, each causal flag with each head dim
GPU_CASES = [(torch.bfloat16, 128, True), (torch.float16, 128, False), (torch.float16, 64, True),
             (torch.bfloat16, 64, False), (torch.float16, 256, True), (torch.bfloat16, 256, False)]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("rung", LADDER_RUNGS)
@pytest.mark.parametrize("dtype, headdim, causal", GPU_CASES)
def test_rung_matches_reference_on_gpu(rung, dtype, headdim, causal):
    if rung == 3 and headdim == 256:
        pytest.skip("rung 3 has no split-Q tile at head dim 256 (test_rung3_at_head_dim_256_says_why...)")
    check_rung(rung, dtype, causal, 1000, 1537 if causal else 1000, headdim, "cuda", batch=2, heads=4)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", LADDER_RUNGS)
def test_compiled_rung_has_its_warp_split_on_gpu(rung):
    """The TTGIR of the compiled kernel: mma.sync (versionMajor 2), warps split the keys
    ([1, W], rungs 0-2) or the query rows ([W, 1], rung 3)."""
    from kernels.fa_ladder import plan_ladder_forward

    q, k, v = make_qkv(1, 512, 512, 2, 128, torch.float16, "cuda")
    _, _, launch = plan_ladder_forward(q, k, v, None, True, rung=rung)
    ttgir = launch.run().asm["ttgir"]
    warps = launch.meta["num_warps"]
    expected = f"[{warps}, 1]" if LADDER[rung].warp_split == SPLIT_Q else f"[1, {warps}]"
    assert f"versionMajor = 2, versionMinor = 0, warpsPerCTA = {expected}" in ttgir


@pytest.mark.gpu
def test_config_with_the_wrong_warp_split_is_refused_on_gpu():
    q, k, v = make_qkv(1, 64, 64, 1, 128, torch.float16, "cuda")
    with pytest.raises(ValueError, match="rung 3 needs split-Q"):
        ladder_forward(q, k, v, rung=3, config=FwdConfig(64, 128, 4, 2))


def test_rung4_is_the_triton_kernel_not_the_gluon_forward(monkeypatch):
    """Rung 4 times the Triton forward it was measured as: where the Hopper table would take the
    Gluon forward (head dim 128, 1k keys and more), rung 4 switches it off."""
    from kernels import configs, dispatch, forward

    seen = []
    monkeypatch.setattr(configs, "default_fwd_config",
                        lambda headdim, causal, device: configs.HOPPER_FWD_CONFIGS[(128, causal)])
    monkeypatch.setattr(forward, "flash_attn_forward",
                        lambda q, k, v, scale, causal, config=None: seen.append(config) or (q, None))
    q = torch.randn(1, 1024, 1, 128, dtype=torch.float16)
    RUNGS[4].forward(q, q, q, True, None)
    hopper = configs.HOPPER_FWD_CONFIGS[(128, True)]
    assert seen and seen[0].hopper_gluon_min_keys == 0
    assert dispatch.fwd_memory_path(seen[0], q, q, q, q, True) != dispatch.GluonPath.DENSE
    assert dispatch.fwd_memory_path(hopper, q, q, q, q, True) == dispatch.GluonPath.DENSE
