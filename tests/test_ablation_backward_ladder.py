"""The backward ladder (kernels/ladder_backward.py): every rung's dQ, dK, dV against autograd of
the float64 reference, no further than twice PyTorch's same-dtype error (plus a small epsilon);
on CPU in Triton's interpreter (fp16 and fp32, tiny ragged shapes), with `-m gpu` at real sizes
in bf16/fp16, where the compiled kernel's warp split is checked too. dK and dV start as NaN so
that an element no program writes cannot pass; dQ's float32 accumulator must start at zero."""

import itertools

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels.fa_ladder import SPLIT_K, SPLIT_Q, ladder_forward
from kernels.ladder_backward import (
    BWD_LADDER,
    HOPPER_BWD_LADDER_CONFIGS,
    LadderBwdConfig,
    bwd_warp_split,
    default_bwd_ladder_config,
    ladder_attention,
    ladder_backward,
)
from tests.attention_checks import assert_close_to_reference, make_qkv, poisoned_allocations  # noqa: F401

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)

RUNGS = range(len(BWD_LADDER))
# (dtype, causal, seqlen_q, seqlen_k, headdim)
CPU_CASES = [
    (torch.float16, False, 64, 64, 64),
    (torch.float32, True, 70, 20, 40),  # seqlen_q > seqlen_k: the first 50 rows see no key
    (torch.float32, True, 17, 113, 16),
    (torch.float16, True, 50, 50, 32),
]


def check_backward_rung(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device, batch=2, heads=3):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device, requires_grad=True)
    dout = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    grads = torch.autograd.grad(ladder_attention(q, k, v, causal, rung=rung), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(attention_reference(q64, k64, v64, causal=causal)[0], (q64, k64, v64),
                                    dout.double())
    same_grads = torch.autograd.grad(attention_same_dtype(q, k, v, causal=causal), (q, k, v), dout)
    for name, g, ref, same in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
        assert g.shape == ref.shape and g.dtype == dtype
        assert_close_to_reference(f"backward rung {rung} {name}", g, ref, same)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype, causal, seqlen_q, seqlen_k, headdim", CPU_CASES)
def test_backward_rung_matches_reference(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device):
    check_backward_rung(rung, dtype, causal, seqlen_q, seqlen_k, headdim, device)


def test_strided_inputs_match_contiguous(device):
    """q, k, v, dO as views of packed tensors give the contiguous result, in every rung."""
    qkv = torch.randn(1, 37, 3, 2, 24, dtype=torch.float32, device=device)
    q, k, v = qkv.unbind(dim=2)
    out, stats = ladder_forward(q, k, v, causal=True, rung=1)
    do = torch.randn(1, 37, 2, 2, 24, dtype=torch.float32, device=device)[:, :, 0]
    for rung in (1, 2, 3):
        got = ladder_backward(do, q, k, v, out, stats, causal=True, rung=rung)
        want = ladder_backward(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out, stats,
                               causal=True, rung=rung)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_backward_rejects_bad_arguments_by_name(device):
    q, k, v = make_qkv(1, 8, 8, 1, 16, torch.float32, device)
    out, stats = ladder_forward(q, k, v, rung=1)
    do = torch.randn_like(q)
    with pytest.raises(ValueError, match="rung must be an int in 0..3"):
        ladder_backward(do, q, k, v, out, stats, rung=4)
    with pytest.raises(ValueError, match=r"stats must be a tuple of 2 float32 tensors .* FA1 m and l"):
        ladder_backward(do, q, k, v, out, stats, rung=0)
    with pytest.raises(ValueError, match="do must be a tensor like q"):
        ladder_backward(do[:, :4], q, k, v, out, stats, rung=1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        ladder_backward(do, q, k, v, out, stats, causal=1, rung=1)


# --------------------------------------------------------------------------------------
# The ladder's structure
# --------------------------------------------------------------------------------------
def test_each_backward_rung_adds_exactly_one_technique():
    for before, after in itertools.pairwise(BWD_LADDER):
        changed = [field for field in ("fewer_nonmatmul", "kv_parallel", "warp_split")
                   if getattr(before, field) != getattr(after, field)]
        assert len(changed) == 1, (before, after)
    assert (BWD_LADDER[0].fewer_nonmatmul, BWD_LADDER[0].kv_parallel, BWD_LADDER[0].warp_split) == \
        (False, False, SPLIT_K)
    assert BWD_LADDER[-1].warp_split == SPLIT_Q


def test_hopper_backward_tiles_hold_all_but_the_technique_equal():
    """Rungs 0-2 share one tile; rung 3 swaps its sides; warps and stages are one value per
    head dim, and each rung's tile gives it its warp split."""
    for (rung, block_d), cfg in HOPPER_BWD_LADDER_CONFIGS.items():
        assert bwd_warp_split(cfg.block_n, block_d) == BWD_LADDER[rung].warp_split, (rung, block_d, cfg)
    for block_d in (32, 64, 128, 256):
        configs = {rung: cfg for (rung, d), cfg in HOPPER_BWD_LADDER_CONFIGS.items() if d == block_d}
        assert len({(c.block_m, c.block_n) for r, c in configs.items() if r < 3}) == 1, block_d
        assert len({(c.num_warps, c.num_stages) for c in configs.values()}) == 1, block_d
        if 3 in configs:
            assert (configs[3].block_m, configs[3].block_n) == (configs[2].block_n, configs[2].block_m)


def test_backward_rung3_at_head_dim_256_says_why_it_has_no_tile():
    with pytest.raises(NotImplementedError, match="needs BLOCK_N >= 256"):
        default_bwd_ladder_config(3, 256, torch.device("cuda"))


# --------------------------------------------------------------------------------------
# GPU: real sizes and the compiled code's warp split
# --------------------------------------------------------------------------------------
GPU_CASES = [(torch.bfloat16, 128, True), (torch.float16, 128, False), (torch.float16, 64, True),
             (torch.bfloat16, 64, False)]


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype, headdim, causal", GPU_CASES)
def test_backward_rung_matches_reference_on_gpu(rung, dtype, headdim, causal):
    check_backward_rung(rung, dtype, causal, 1000, 1537 if causal else 1000, headdim, "cuda", batch=2, heads=2)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
def test_compiled_backward_rung_has_its_warp_split_on_gpu(rung):
    """The TTGIR of the compiled kernel: mma.sync (versionMajor 2); warps across head-dim columns
    ([1, W], rungs 0-2) or across the program's key rows ([W, 1], rung 3)."""
    from kernels.fa_ladder import _mma_sync_only
    from kernels.ladder_backward import plan_ladder_backward

    q, k, v = make_qkv(1, 512, 512, 2, 128, torch.float16, "cuda")
    out, stats = ladder_forward(q, k, v, causal=True, rung=0 if rung == 0 else 1)
    *_, launches = plan_ladder_backward(torch.randn_like(q), q, k, v, out, stats, None, True, rung=rung)
    kernel, grid, args, meta = launches[-1]
    with _mma_sync_only():
        ttgir = kernel[grid](*args, **meta).asm["ttgir"]
    warps = meta["num_warps"]
    rows, columns = (f"versionMajor = 2, versionMinor = 0, warpsPerCTA = {w}" for w in (f"[{warps}, 1]",
                                                                                       f"[1, {warps}]"))
    if BWD_LADDER[rung].warp_split == SPLIT_Q:
        assert rows in ttgir  # dK's and dV's dots; dQ's partial sums keep their own layout
    else:
        assert columns in ttgir and rows not in ttgir


@pytest.mark.gpu
def test_backward_config_with_the_wrong_warp_split_is_refused_on_gpu():
    q, k, v = make_qkv(1, 64, 64, 1, 128, torch.float16, "cuda")
    out, stats = ladder_forward(q, k, v, rung=1)
    with pytest.raises(ValueError, match="it needs split-Q"):
        ladder_backward(torch.randn_like(q), q, k, v, out, stats, rung=3, config=LadderBwdConfig(128, 64, 8, 1))
