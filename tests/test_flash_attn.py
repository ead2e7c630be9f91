"""The FA2 kernel (kernels/flash_attn.py) against the float64 reference.

Criterion (flash-attn's own tests): the kernel's error against float64 is at most twice the
error of the same computation done by PyTorch in the inputs' dtype, plus a small epsilon.
On CPU the kernels run in Triton's interpreter (fp16/fp32, small shapes); the `gpu` tests
repeat the checks in bf16/fp16 at real sizes on a CUDA device.
"""

import dataclasses
import math

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels import flash_attn as fa
from kernels import flash_attn_func, flash_attn_hopper, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from kernels.flash_attn import FwdConfig, flash_attn_forward, fwd_memory_path, tma_compatible

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)
ABS_EPS = {torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float32: 1e-5}


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every buffer the launchers allocate starts as NaN, so an element the kernel fails to
    write shows up as NaN instead of hiding behind whatever memory held."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)


def make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device, requires_grad=False):
    """Fresh random inputs (never zeros)."""
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads, headdim, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def assert_close_to_reference(name, actual, reference64, same_dtype):
    """`actual` is no further from float64 than twice PyTorch's same-dtype result."""
    assert not torch.isnan(actual).any(), f"{name} has NaN"
    err = (actual.double() - reference64).abs().max().item()
    yardstick = (same_dtype.double() - reference64).abs().max().item()
    bound = 2 * yardstick + ABS_EPS[actual.dtype]
    assert err <= bound, f"{name}: max error {err:.3e} > 2 x same-dtype error {yardstick:.3e} + eps"


def check_forward(batch, seqlen_q, seqlen_k, heads, headdim, causal, dtype, device):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32
    assert_close_to_reference("out", out, ref_out, attention_same_dtype(q, k, v, causal=causal))
    # rows that see no key have L = +inf in both; every other row agrees to float32 rounding
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


def check_backward(batch, seqlen_q, seqlen_k, heads, headdim, causal, dtype, device, bwd_config=None):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device, requires_grad=True)
    dout = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    grads = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal, bwd_config=bwd_config),
                                (q, k, v), dout)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(attention_reference(q64, k64, v64, causal=causal)[0],
                                    (q64, k64, v64), dout.double())
    same_grads = torch.autograd.grad(attention_same_dtype(q, k, v, causal=causal), (q, k, v), dout)
    for name, g, ref, same in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
        assert g.shape == ref.shape and g.dtype == dtype
        assert_close_to_reference(name, g, ref, same)


# (batch, seqlen_q, seqlen_k, heads, headdim): ragged lengths, seqlen_q != seqlen_k both ways,
# head dims that are not powers of two, several batch/head counts.
CPU_SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 17, 17, 2, 32),
    (1, 113, 113, 2, 64),
    (2, 64, 128, 1, 72),
    (1, 113, 203, 2, 59),
    (1, 203, 113, 1, 40),
    (3, 32, 17, 2, 128),
    (1, 1, 97, 3, 8),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_forward_matches_reference(shape, causal, poisoned_allocations):
    check_forward(*shape, causal, torch.float16, "cpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 45, 45, 2, 32), (2, 33, 70, 1, 24)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_forward_fp32_matches_reference(shape, causal, poisoned_allocations):
    check_forward(*shape, causal, torch.float32, "cpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 17, 17, 2, 16), (2, 113, 70, 1, 59), (1, 40, 97, 2, 64),
                                   (1, 64, 64, 1, 128)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_backward_matches_reference(shape, causal, poisoned_allocations):
    check_backward(*shape, causal, torch.float16, "cpu")


class LaunchSpy:
    """Stands in for a jitted kernel (monkeypatched onto the module): records each launch's
    keyword arguments, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def spy_backward_kernels(monkeypatch):
    """(dK/dV kernel spy, dQ kernel spy), both in place of their launchers in kernels.flash_attn."""
    spies = LaunchSpy(fa._bwd_dkdv_launcher), LaunchSpy(fa._bwd_dq_launcher)
    monkeypatch.setattr(fa, "_bwd_dkdv_launcher", spies[0])
    monkeypatch.setattr(fa, "_bwd_dq_launcher", spies[1])
    return spies


@pytest.mark.parametrize("query_major", [False, True], ids=["key-major", "query-major"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 17, 17, 2, 16), (2, 113, 70, 1, 59), (1, 40, 97, 2, 64),
                                   (1, 64, 64, 2, 16)],  # whole blocks: the unmasked atomics
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_backward_with_fused_dq_matches_reference(shape, causal, query_major, poisoned_allocations, monkeypatch):
    """dQ added by the dK/dV kernel (element-wise atomics here: the interpreter has no TMA
    reduce) instead of the dQ kernel, which must not run: ragged lengths both ways, whole blocks,
    both dK/dV layouts."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1, query_major=query_major)
    check_backward(*shape, causal, torch.float16, "cpu", bwd_config=fusing)
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [1] and not dq.launches


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward(deterministic, monkeypatch):
    """flash_attn_func's `deterministic` decides, with a config that fuses dQ, whether the dQ
    kernel runs (True) or the dK/dV kernel adds dQ (False)."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1)
    q, k, v = make_qkv(1, 32, 32, 1, 16, torch.float16, "cpu", requires_grad=True)
    flash_attn_func(q, k, v, bwd_config=fusing, deterministic=deterministic).sum().backward()
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [0 if deterministic else 1]
    assert len(dq.launches) == (1 if deterministic else 0)


def test_fused_dq_follows_min_rows_and_deterministic():
    config = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1024)
    assert fa.bwd_fuses_dq(config, 1024) and not fa.bwd_fuses_dq(config, 1023)
    assert not fa.bwd_fuses_dq(config, 4096, deterministic=True)
    assert not fa.bwd_fuses_dq(fa.INTERPRETER_BWD_CONFIG, 4096)  # 0: never
    assert all(not table_entry.fused_dq_min_rows for table_entry in fa.HOPPER_BWD_CONFIGS.values())  # measured slower


def test_deterministic_must_be_a_bool():
    q, k, v = make_qkv(1, 8, 8, 1, 16, torch.float16, "cpu")
    with pytest.raises(TypeError, match="deterministic"):
        flash_attn_func(q, k, v, deterministic=None)


# The query-major dK/dV layout (the head-dim-256 production config on Hopper) with the
# interpreter's block sizes: ragged lengths both ways, a head dim that is not a power of two.
QUERY_MAJOR_BWD_CONFIG = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, query_major=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 113, 70, 1, 59), (1, 40, 97, 2, 64), (1, 64, 64, 1, 32)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_backward_query_major_matches_reference(shape, causal, poisoned_allocations):
    check_backward(*shape, causal, torch.float16, "cpu", bwd_config=QUERY_MAJOR_BWD_CONFIG)


def test_backward_fp32_matches_reference(poisoned_allocations):
    check_backward(1, 50, 37, 2, 24, True, torch.float32, "cpu")


def test_causal_bottom_right_when_sq_gt_sk_gives_zero_rows_not_nan(poisoned_allocations):
    """seqlen_q > seqlen_k with causal: the first seqlen_q - seqlen_k rows see no key, so
    they output exactly 0 with L = +inf (flash-attn's convention) and their grads are 0."""
    q, k, v = make_qkv(1, 40, 10, 2, 32, torch.float16, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :30] == 0) and torch.all(torch.isposinf(lse[:, :, :30]))
    assert torch.isfinite(lse[:, :, 30:]).all() and out[:, 30:].abs().sum() > 0
    out.backward(torch.randn_like(out))
    assert torch.all(q.grad[:, :30] == 0)
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))


def test_causal_bottom_right_when_sq_lt_sk_sees_the_key_prefix():
    """seqlen_q < seqlen_k with causal: the last query row sees every key, the first sees
    seqlen_k - seqlen_q + 1 keys (bottom-right alignment, flash-attn >= 2.1)."""
    q, k, v = make_qkv(1, 3, 20, 1, 16, torch.float32, "cpu")
    out = flash_attn_func(q, k, v, causal=True)
    first_row = flash_attn_func(q[:, :1], k[:, :18], v[:, :18], causal=False)
    torch.testing.assert_close(out[:, :1], first_row, atol=1e-5, rtol=1e-5)
    last_row = flash_attn_func(q[:, 2:], k, v, causal=False)
    torch.testing.assert_close(out[:, 2:], last_row, atol=1e-5, rtol=1e-5)


def test_custom_softmax_scale_matches_reference(poisoned_allocations):
    q, k, v = make_qkv(1, 30, 30, 2, 32, torch.float16, "cpu")
    out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, causal=True)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, 0.3, causal=True))


def test_non_contiguous_inputs_match_contiguous():
    base = torch.randn(2, 2, 37, 32, 3, dtype=torch.float16)  # (B, H, S, D, 3)
    q, k, v = (base[..., i].transpose(1, 2) for i in range(3))  # last stride 3, not 1
    q2 = torch.randn(2, 2, 37, 32, dtype=torch.float16).transpose(1, 2)  # (B, S, H, D) view
    assert not q.is_contiguous() and not q2.is_contiguous() and q2.stride(-1) == 1
    for query in (q, q2):
        out = flash_attn_func(query, k, v, causal=True)
        ref = flash_attn_func(query.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_packed_variants_equal_unpacked():
    qkv = torch.randn(2, 33, 3, 2, 32, dtype=torch.float16, requires_grad=True)
    out_packed = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out_packed, out, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out_packed.backward(dout)
    out.backward(dout)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2), atol=0, rtol=0)

    kv = torch.stack([k.detach(), v.detach()], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q.detach(), kv, causal=True), out.detach(),
                               atol=0, rtol=0)


def test_block_config_does_not_change_the_result():
    q, k, v = make_qkv(1, 50, 50, 1, 32, torch.float32, "cpu")
    out_a, lse_a = flash_attn_forward(q, k, v, 0.2, True, FwdConfig(16, 16, 4, 1))
    out_b, lse_b = flash_attn_forward(q, k, v, 0.2, True, FwdConfig(64, 32, 4, 1))
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "path"), [
    # ragged seqlens (not block multiples) and head dim 40 (padded to 64 inside the kernel;
    # 80-byte rows, so TMA-compatible): the in-kernel descriptors' zero fill and clipped stores
    ((2, 37, 53, 2, 40), "tma-kernel"),
    # whole blocks, head dim 32, three heads, two batches: the host descriptors' 2D view must
    # land each (batch, head) on its own rows and columns
    ((2, 64, 96, 3, 32), "tma-host"),
], ids=["ragged", "whole-blocks"])
def test_tma_paths_equal_the_pointer_path(shape, path, causal, poisoned_allocations):
    """Each TMA path gives bit-for-bit the pointer path's masked loads and stores."""
    batch, seqlen_q, seqlen_k, heads, headdim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, torch.float16, "cpu")
    tma_config = FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0,
                           tma_host_below_keys=4096)
    assert fwd_memory_path(tma_config, q, k, v, torch.empty_like(q), causal) == path
    out_tma, lse_tma = flash_attn_forward(q, k, v, 0.3, causal, tma_config)
    out_ptr, lse_ptr = flash_attn_forward(q, k, v, 0.3, causal, FwdConfig(32, 32, 4, 1, tma=False))
    torch.testing.assert_close(out_tma, out_ptr, atol=0, rtol=0)
    torch.testing.assert_close(lse_tma, lse_ptr, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("query_major", [False, True], ids=["key-major", "query-major"])
@pytest.mark.parametrize("shape", [(2, 37, 53, 2, 40), (1, 53, 37, 3, 32)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_backward_tma_equals_the_pointer_path(shape, query_major, causal, poisoned_allocations):
    """The backward's descriptor loads (zero fill past seqlen and the head dim) give bit for
    bit the pointer path's masked loads, in both dK/dV layouts, with ragged lengths both ways."""
    batch, seqlen_q, seqlen_k, heads, headdim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, torch.float16, "cpu")
    do = torch.randn_like(q)
    out, lse = flash_attn_forward(q, k, v, 0.3, causal)
    pointer = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, query_major=query_major, tma=False)
    tma = dataclasses.replace(pointer, tma=True)
    assert fa.bwd_uses_tma(tma, q, k, v, do) and not fa.bwd_uses_tma(pointer, q, k, v, do)
    for name, got, want in zip(("dq", "dk", "dv"), fa.flash_attn_backward(do, q, k, v, out, lse, 0.3, causal, tma),
                               fa.flash_attn_backward(do, q, k, v, out, lse, 0.3, causal, pointer)):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


def test_tma_kernel_path_sets_the_descriptor_allocator(monkeypatch):
    launches = []
    real = fa._ensure_descriptor_allocator
    monkeypatch.setattr(fa, "_ensure_descriptor_allocator", lambda: launches.append(1) or real())
    q, k, v = make_qkv(1, 37, 53, 1, 32, torch.float16, "cpu")
    flash_attn_forward(q, k, v, 0.3, False, FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0))
    assert launches == [1], "the TMA config did not take the in-kernel descriptor path"


def test_tma_launch_keeps_an_allocator_the_caller_set():
    """The TMA path sets torch's scratch allocator only where none is set. (The interpreter makes
    descriptors without asking for memory; `test_gpu_tma_launch_uses_the_callers_allocator`
    checks that a GPU launch really asks the caller's allocator.)"""
    from triton.runtime import _allocation

    def recording(size, alignment, stream):
        return fa._torch_scratch(size, alignment, stream)

    token = _allocation._allocator.set(recording)
    try:
        q, k, v = make_qkv(1, 40, 40, 1, 32, torch.float16, "cpu")
        flash_attn_forward(q, k, v, 0.2, False, FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0))
        assert _allocation._allocator.get() is recording
    finally:
        _allocation._allocator.reset(token)


def test_descriptor_scratch_is_aligned_as_asked():
    for alignment in (64, 128, 1024):
        buffer = fa._torch_scratch(100, alignment, None)
        assert buffer.data_ptr() % alignment == 0 and buffer.numel() == 100


@pytest.mark.parametrize(("causal", "paths"), [
    (False, {512: "pointer", 1024: "tma-host", 4096: "tma-host", 8192: "tma-kernel", 16384: "tma-kernel"}),
    # causal visits half the keys on average; in-kernel descriptors from 4096 visited keys (8k)
    (True, {1024: "pointer", 2048: "tma-host", 4096: "tma-host", 8192: "tma-kernel", 16384: "tma-kernel"}),
], ids=["full", "causal"])
def test_hopper_head_dim_128_paths_at_paper_lengths(causal, paths):
    """The path the Hopper table picks for head dim 128 at the paper sweep's lengths (batch x
    seqlen = 16384, 16 heads; layout only, so tensors of one head suffice): the Gluon forward from
    1024 keys, and below it (or with it switched off, as the ablation's rung 4 does) the Triton
    kernel's memory path."""
    config = fa.HOPPER_FWD_CONFIGS[(128, causal)]
    triton_only = dataclasses.replace(config, hopper_gluon_min_keys=0)
    for seqlen, path in paths.items():
        q = torch.empty(16384 // seqlen, seqlen, 1, 128, dtype=torch.float16)
        assert fwd_memory_path(triton_only, q, q, q, q, causal) == path, seqlen
        expected = fa.HOPPER_GLUON_PATH if seqlen >= 1024 else path
        assert fwd_memory_path(config, q, q, q, q, causal) == expected, seqlen


def test_hopper_gluon_forward_scope():
    """The Gluon forward takes only what it implements: equal lengths in whole 128-row blocks,
    head dim 64 or 128, fp16/bf16, exact 2D views; anything else keeps the Triton kernel."""
    config = fa.HOPPER_FWD_CONFIGS[(128, False)]

    def path(q_shape, k_shape=None, dtype=torch.bfloat16, transpose=False):
        q = torch.empty(*q_shape, dtype=dtype)
        k = torch.empty(*(k_shape or q_shape), dtype=dtype)
        if transpose:  # (batch, heads, seqlen, hdim) memory seen as (batch, seqlen, heads, hdim)
            q = torch.empty(q_shape[0], q_shape[2], q_shape[1], q_shape[3], dtype=dtype).transpose(1, 2)
        return fwd_memory_path(config, q, k, k, torch.empty_like(q, memory_format=torch.contiguous_format), False)

    assert path((2, 1024, 4, 128)) == fa.HOPPER_GLUON_PATH
    assert path((2, 1024, 4, 128), dtype=torch.float16) == fa.HOPPER_GLUON_PATH
    assert path((2, 1024, 4, 128), k_shape=(2, 2048, 4, 128)) != fa.HOPPER_GLUON_PATH  # unequal lengths
    assert path((2, 1000, 4, 128)) != fa.HOPPER_GLUON_PATH  # not whole blocks
    assert path((2, 1024, 4, 96)) != fa.HOPPER_GLUON_PATH  # head dims other than 64 and 128
    assert path((2, 1024, 4, 256)) != fa.HOPPER_GLUON_PATH
    assert path((2, 1024, 4, 128), dtype=torch.float32) != fa.HOPPER_GLUON_PATH
    assert path((2, 1024, 4, 128), transpose=True) != fa.HOPPER_GLUON_PATH  # heads not side by side
    assert path((2, 512, 4, 128)) != fa.HOPPER_GLUON_PATH  # below hopper_gluon_min_keys
    # broadcast K and V (stride 0 between rows): not one descriptor row per key
    q = torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16)
    kv = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16).expand(2, 1024, 4, 128)
    assert fwd_memory_path(config, q, kv, kv, torch.empty_like(q), False) != fa.HOPPER_GLUON_PATH
    # more batch x heads than the grid's y dimension takes
    wide = torch.empty(1, 1024, 65536, 128, dtype=torch.bfloat16, device="meta")
    assert fwd_memory_path(config, wide, wide, wide, wide, False) != fa.HOPPER_GLUON_PATH
    # mixed dtypes
    k16 = torch.empty(2, 1024, 4, 128, dtype=torch.float16)
    assert fwd_memory_path(config, q, k16, k16, torch.empty_like(q), False) != fa.HOPPER_GLUON_PATH
    # views whose rows are longer than heads x head dim: q, k, v of a packed qkv, padded rows
    qkv = torch.empty(2, 1024, 3, 4, 128, dtype=torch.bfloat16)
    out = torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16)
    assert fwd_memory_path(config, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, False) == fa.HOPPER_GLUON_PATH
    padded = torch.empty(2, 1024, 4 * 128 + 64, dtype=torch.bfloat16)[..., :512].unflatten(-1, (4, 128))
    assert fwd_memory_path(config, padded, padded, padded, out, False) == fa.HOPPER_GLUON_PATH


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_head_dim_64_takes_the_gluon_forward_from_4k_keys(causal):
    """At head dim 64 the table takes the Gluon forward from 4096 keys, where it was measured."""
    config = fa.HOPPER_FWD_CONFIGS[(64, causal)]
    for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
        q = torch.empty(16384 // seqlen, seqlen, 1, 64, dtype=torch.bfloat16)
        assert (fwd_memory_path(config, q, q, q, q, causal) == fa.HOPPER_GLUON_PATH) == (seqlen >= 4096), seqlen


@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_hopper_backward_takes_the_gluon_dkdv_kernel_at_head_dim_128_from_1k_keys(hdim):
    """The Hopper table's dK/dV kernel at the paper sweep's lengths: the Gluon one at head dim 128
    from 1024 keys (measured faster there too since v8), adding dQ itself, the Triton one below
    that and at head dims 64 (measured no faster) and 256 (outside the Gluon kernel's scope)."""
    config = fa.HOPPER_BWD_CONFIGS[hdim]
    for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
        q = torch.empty(16384 // seqlen, seqlen, 2048 // hdim, hdim, dtype=torch.bfloat16)
        gluon = hdim == 128 and seqlen >= 1024
        assert (fa.bwd_dkdv_path(config, q, q, q, q) == fa.HOPPER_GLUON_PATH) == gluon, seqlen
    # the Gluon kernel adds dQ itself at head dim 128 (FA3's scheme) unless asked to be deterministic
    assert fa.bwd_gluon_fuses_dq(config, hdim) == (hdim == 128)
    assert not fa.bwd_gluon_fuses_dq(config, hdim, deterministic=True)
    # never at other head dims, even where a config asks for it (the consumers split 128 columns)
    assert not fa.bwd_gluon_fuses_dq(dataclasses.replace(config, hopper_gluon_fused_dq=True), 64)
    assert not fa.bwd_fuses_dq(config, 16384)  # the Triton kernels never fuse in the table


def test_hopper_gluon_dkdv_scope():
    """The Gluon dK/dV kernel has the Gluon forward's scope (hopper_gluon_applies), with dO in the
    output's place: anything else keeps the Triton kernel."""
    config = fa.HOPPER_BWD_CONFIGS[128]
    q = torch.empty(2, 2048, 4, 128, dtype=torch.bfloat16)
    assert fa.bwd_dkdv_path(config, q, q, q, torch.empty_like(q)) == fa.HOPPER_GLUON_PATH
    assert fa.bwd_dkdv_path(config, q[:, :2000], q[:, :2000], q[:, :2000], q[:, :2000]) == "triton"  # ragged
    k = torch.empty(2, 4096, 4, 128, dtype=torch.bfloat16)
    assert fa.bwd_dkdv_path(config, q, k, k, q) == "triton"  # unequal lengths
    do_t = torch.empty(2, 4, 2048, 128, dtype=torch.bfloat16).transpose(1, 2)  # heads not side by side
    assert fa.bwd_dkdv_path(config, q, q, q, do_t) == "triton"
    q32 = q.float()
    assert fa.bwd_dkdv_path(config, q32, q32, q32, q32) == "triton"


def test_a_hopper_bwd_config_elsewhere_takes_the_triton_dkdv_kernel(poisoned_allocations, monkeypatch):
    """A Hopper backward config whose rule picks the Gluon dK/dV kernel (with dQ fused), on another
    device (here the CPU interpreter), runs the Triton dK/dV and dQ kernels instead, with the right
    gradients."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    config = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, hopper_gluon_min_keys=128, hopper_gluon_fused_dq=True)
    q = torch.empty(1, 128, 1, 64, dtype=torch.float16)
    assert fa.bwd_dkdv_path(config, q, q, q, q) == fa.HOPPER_GLUON_PATH
    check_backward(1, 128, 128, 1, 64, True, torch.float16, "cpu", bwd_config=config)
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [0] and len(dq.launches) == 1


def test_a_hopper_config_elsewhere_falls_back_to_the_triton_kernel(poisoned_allocations):
    """A Hopper table entry passed as fwd_config on another device (here the CPU interpreter) does
    not launch the sm_90-only Gluon kernel: the Triton kernel runs, with the right result."""
    config = fa.HOPPER_FWD_CONFIGS[(128, False)]
    q, k, v = make_qkv(1, 1024, 1024, 1, 128, torch.float16, "cpu")
    assert fwd_memory_path(config, q, k, v, torch.empty_like(q), False) == fa.HOPPER_GLUON_PATH
    out, lse = flash_attn_forward(q, k, v, 128 ** -0.5, False, config)
    ref, ref_lse = attention_reference(q, k, v, 128 ** -0.5, False)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, 128 ** -0.5, False))
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)


def test_hopper_gluon_kernels_compile_for_sm90():
    """Gluon has no CPU interpreter: compile the forward and the dK/dV kernel (with and without dQ
    fused) for sm_90 (Triton's bundled ptxas, in a process without TRITON_INTERPRET) and check
    what makes them fast is there: warp specialisation, TMA loads (and the fused dQ's TMA
    reduce-adds) and a wgmma left in flight (wait_group 1), no wgmma serialised for want of
    registers, within sm_90's shared memory. The GPU tests run them against the float64
    reference."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in __import__("os").environ.items() if key != "TRITON_INTERPRET"}
    report = subprocess.run([sys.executable, str(root / "tools" / "compile_check_sm90.py"), "--hopper-gluon"],
                            capture_output=True, text=True, env=env, check=True).stdout
    forward = [line for line in report.splitlines() if line.startswith("_flash_fwd_hopper_kernel ")]
    backward = [line for line in report.splitlines() if line.startswith("_flash_bwd_dkdv_hopper_kernel ")]
    # head dims 64 and 128, causal or not; the backward also with dQ fused at head dim 128
    assert len(forward) == 4 and len(backward) == 6, report
    fused = [line for line in backward if "fused dQ" in line]
    assert len(fused) == 2 and all("tma-reduce" in line for line in fused), report
    # v6: the causal flag at compile time left the non-causal head-dim-128 forward without spills
    assert "spill stores 0 B" in next(line for line in forward if "d128 causal=False" in line), report
    for line in forward + backward:
        assert "warp-specialised yes" in line and "tma yes" in line and "serialised" not in line, line
        assert "1" in re.search(r"wait_group values ([\d ]+)", line).group(1).split(), line
        assert int(re.search(r"smem (\d+) B", line).group(1)) <= 232448, line  # sm_90's per-block limit





def test_fwd_memory_path_follows_the_key_count_rules():
    """Visited keys (half of seqlen_k when causal) pick the path: host descriptors in
    [tma_host_min_keys, tma_host_below_keys) where the 2D view is exact, in-kernel ones from
    tma_min_keys, pointer tiles otherwise."""
    config = FwdConfig(128, 128, 8, 3, tma=True, tma_min_keys=2048, tma_host_min_keys=1024,
                       tma_host_below_keys=8192)

    def path(seqlen, causal, headdim=128, batch=2):
        like = torch.empty(batch, seqlen, 4, headdim, dtype=torch.float16, device="meta")
        return fwd_memory_path(config, like, like, like, like, causal)

    assert path(1024, False) == "tma-host" and path(4096, False) == "tma-host"
    assert path(8192, False) == "tma-kernel" and path(16384, True) == "tma-kernel"
    assert path(8192, True) == "tma-host"
    assert path(512, False) == "pointer" and path(2048, True) == "tma-host"  # 512 / 1024 keys
    assert path(1000, False) == "pointer"  # not whole blocks and too short for in-kernel ones
    assert path(4000, False) == "tma-kernel"  # not whole blocks: the bounded per-head descriptors
    assert path(1024, False, headdim=96) == "pointer"  # padding columns: no 2D view
    assert path(4096, False, headdim=96) == "tma-kernel"
    assert fwd_memory_path(FwdConfig(128, 128, 8, 3), *[torch.empty(1, 16384, 1, 128, device="meta")] * 4,
                           False) == "pointer"


def test_flat_view_needs_heads_side_by_side_and_batches_back_to_back():
    config = FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0, tma_host_below_keys=4096)
    bshd = torch.empty(2, 64, 3, 32, dtype=torch.float16, device="meta")
    bhsd = torch.empty(2, 3, 64, 32, dtype=torch.float16, device="meta").transpose(1, 2)
    assert fwd_memory_path(config, bshd, bshd, bshd, bshd, False) == "tma-host"
    assert fwd_memory_path(config, bhsd, bhsd, bhsd, bshd, False) == "tma-kernel"
    # a seqlen slice of a longer buffer: batch b's rows do not start at row b * seqlen
    longer = torch.empty(2, 128, 3, 32, dtype=torch.float16, device="meta")
    assert fwd_memory_path(config, longer[:, :64], bshd, bshd, bshd, False) == "tma-kernel"
    # one key tensor broadcast over the batch (stride 0): rows b * seqlen do not exist
    shared_k = torch.empty(1, 64, 3, 32, dtype=torch.float16, device="meta").expand(2, 64, 3, 32)
    assert fwd_memory_path(config, bshd, shared_k, bshd, bshd, False) == "tma-kernel"
    # keys not a whole number of blocks: the last tile would run into the next batch's keys
    ragged_k = torch.empty(2, 40, 3, 32, dtype=torch.float16, device="meta")
    assert fwd_memory_path(config, bshd, ragged_k, ragged_k, bshd, False) == "tma-kernel"
    # 2^31 rows or more would overflow the kernel's int32 row coordinate
    huge = torch.empty(2**16, 2**15, 1, 32, dtype=torch.float16, device="meta")
    assert fwd_memory_path(dataclasses.replace(config, tma_host_below_keys=2**16), huge, huge, huge, huge,
                           False) == "tma-kernel"


def test_tma_compatible_needs_16_byte_rows_and_bases():
    q = torch.randn(1, 8, 2, 59, dtype=torch.float16)  # 118-byte rows
    assert not tma_compatible(q)
    aligned = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    assert tma_compatible(aligned)
    assert not tma_compatible(aligned[..., 1:])  # base pointer 2 bytes past an aligned one


def test_backward_passes_no_gradient_on_when_out_gets_none():
    """With set_materialize_grads(False) an upstream node that returns no gradient for `out`
    reaches the backward as None, which it passes on as no gradients."""
    assert fa.FlashAttnFunc.backward(None, None, None) == (None,) * 8  # one per forward input


def test_autograd_materialises_no_gradient_for_lse(monkeypatch):
    """The non-differentiable lse gets no zero-filled gradient (an allocation and a fill per
    backward): the backward sees None for it, and the gradient of out still arrives."""
    seen = []
    real = fa.FlashAttnFunc.backward

    def spy(ctx, dout, dlse):
        seen.append((dout is None, dlse is None))
        return real(ctx, dout, dlse)

    monkeypatch.setattr(fa.FlashAttnFunc, "backward", staticmethod(spy))
    q, k, v = make_qkv(1, 20, 20, 1, 16, torch.float32, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not lse.requires_grad
    out.sum().backward()
    assert seen == [(False, True)]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_device_capability_is_asked_once_per_device(monkeypatch):
    """The config lookup asks torch for the device's capability once (it costs ~7 us a call)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: calls.append(index) or (9, 0))
    fa._is_hopper.cache_clear()
    try:
        for _ in range(3):
            assert fa.default_bwd_config(256, torch.device("cuda", 0)) is fa.HOPPER_BWD_CONFIGS[256]
            assert fa.default_fwd_config(128, True, torch.device("cuda", 0)) is fa.HOPPER_FWD_CONFIGS[(128, True)]
        assert calls == [0]
    finally:
        fa._is_hopper.cache_clear()


def test_backward_tma_with_a_broadcast_dout_equals_the_pointer_path(poisoned_allocations):
    """A dO broadcast along the sequence (stride 0, e.g. the gradient of out.mean(1)) is a valid
    descriptor source: the descriptor loads give the pointer loads' gradients bit for bit."""
    q, k, v = make_qkv(1, 37, 53, 2, 32, torch.float16, "cpu")
    do = torch.randn(1, 1, 2, 32, dtype=torch.float16).expand(1, 37, 2, 32)
    out, lse = flash_attn_forward(q, k, v, 0.3, True)
    pointer = dataclasses.replace(fa.INTERPRETER_BWD_CONFIG, query_major=True)
    tma = dataclasses.replace(pointer, tma=True)
    assert do.stride(1) == 0 and fa.bwd_uses_tma(tma, q, k, v, do)
    for got, want in zip(fa.flash_attn_backward(do, q, k, v, out, lse, 0.3, True, tma),
                         fa.flash_attn_backward(do, q, k, v, out, lse, 0.3, True, pointer)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_training_step_reduces_the_loss():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 2, 16)
    proj = torch.nn.Linear(16, 3 * 16)
    opt = torch.optim.SGD(proj.parameters(), lr=0.5)
    target = torch.randn(2, 16, 2, 16)
    losses = []
    for _ in range(3):
        q, k, v = proj(x).chunk(3, dim=-1)
        loss = (flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
                - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_zero_length_sequences(seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 16, torch.float16, "cpu", requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 2, seqlen_q)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))  # vacuous when seqlen_q == 0
    out.sum().backward()
    assert all(g is not None and torch.all(g == 0) for g in (q.grad, k.grad, v.grad))


def _valid():
    return make_qkv(1, 8, 8, 2, 16, torch.float16, "cpu")


@pytest.mark.parametrize("mutate,error,match", [
    (lambda q, k, v: (q.float(), k, v), TypeError, "share one dtype"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "float16, bfloat16 or float32"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "float16, bfloat16 or float32"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dim 16"),
    (lambda q, k, v: (q, k[:, :4], v), ValueError, "same shape"),
    (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, "batch size 1"),
    (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)),
     ValueError, "must divide q heads"),
    (lambda q, k, v: (torch.randn(1, 8, 2, 264, dtype=torch.float16),) * 3, ValueError,
     "between 1 and 256"),
    (lambda q, k, v: (q, k, "v"), TypeError, "v must be a torch.Tensor"),
])
def test_bad_input_raises_naming_the_argument(mutate, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*mutate(*_valid()))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale_raises(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        flash_attn_func(*_valid(), softmax_scale=scale)


def test_gqa_is_reported_as_not_implemented():
    q, k, v = make_qkv(1, 8, 8, 4, 16, torch.float16, "cpu")
    with pytest.raises(NotImplementedError, match="GQA"):
        flash_attn_func(q, k[:, :, :2], v[:, :, :2])


def test_cpu_tensor_without_interpreter_says_how_to_enable_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attn_func(*_valid())


@pytest.mark.parametrize("kwargs,name", [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"window_size": (8, 0)}, "window_size"),
    ({"softcap": 30.0}, "softcap"),
    ({"alibi_slopes": torch.ones(2)}, "alibi_slopes"),
])
def test_unimplemented_features_raise_naming_the_argument(kwargs, name):
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_func(*_valid(), **kwargs)


# ---------------------------------------------------------------------------------------
# GPU: the same checks in bf16 and fp16 at real sizes (skipped without CUDA).
# ---------------------------------------------------------------------------------------
GPU_SHAPES = [
    (2, 1024, 1024, 4, 64),
    (1, 2048, 2048, 2, 128),
    (1, 8192, 8192, 1, 128),
    (1, 1100, 4200, 2, 128),  # ragged, >= 2048 keys per program: the TMA path's zero fill and clipping
    (2, 1024, 2048, 3, 128),  # whole blocks, several batches and heads: host-made TMA descriptors
    (2, 512, 1024, 3, 256),
    (1, 1000, 1000, 2, 256),
    (2, 777, 1500, 3, 96),
    (1, 1500, 777, 2, 80),
    (1, 513, 513, 2, 111),
    (4, 1, 129, 2, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_forward_matches_reference(shape, causal, dtype, poisoned_allocations):
    check_forward(*shape, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 3, 128), (1, 4096, 4096, 2, 128), (4, 2048, 2048, 1, 128),
                                   (1, 16384, 16384, 1, 128), (2, 4096, 4096, 3, 64), (1, 8192, 8192, 2, 64)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_hopper_gluon_forward_matches_reference(shape, causal, dtype, poisoned_allocations):
    """The Gluon forward (kernels/flash_attn_hopper.py), which the Hopper table takes at head dim
    128 from 1k keys and 64 from 4k, against float64: several batches and heads, both causal modes."""
    if not fa._on_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward is compiled for Hopper (sm_90) only")
    q = torch.empty(shape[0], shape[1], shape[3], shape[4], dtype=dtype, device="cuda")
    config = fa.default_fwd_config(shape[4], causal, q.device)
    assert fwd_memory_path(config, q, q, q, q, causal) == fa.HOPPER_GLUON_PATH
    check_forward(*shape, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["qkv-packed", "padded-rows"])
def test_gpu_hopper_gluon_forward_on_strided_views(layout, causal, poisoned_allocations):
    """The Gluon kernels' scope admits views whose rows are longer than heads x head dim (q, k, v
    sliced out of a packed qkv, or rows padded at the end): their 2D descriptors step by stride(1).
    Forward against float64, and the backward through autograd for the packed layout (at 2048 keys
    the Gluon backward, with dQ fused)."""
    if not fa._on_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward is compiled for Hopper (sm_90) only")
    batch, seqlen, heads, headdim = 2, 2048, 3, 128
    if layout == "qkv-packed":
        qkv = torch.randn(batch, seqlen, 3, heads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        rows = torch.randn(3, batch, seqlen, heads * headdim + 64, device="cuda", dtype=torch.bfloat16)
        q, k, v = (r[..., :heads * headdim].unflatten(-1, (heads, headdim)) for r in rows)
    assert q.stride(1) > heads * headdim
    config = fa.default_fwd_config(headdim, causal, q.device)
    assert fwd_memory_path(config, q, k, v, torch.empty_like(q, memory_format=torch.contiguous_format),
                           causal) == fa.HOPPER_GLUON_PATH
    out = flash_attn_func(q, k, v, causal=causal)
    ref, _ = attention_reference(q, k, v, causal=causal)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, causal=causal))
    if layout == "qkv-packed":
        dout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, qkv, dout)
        qkv64 = qkv.detach().double().requires_grad_()
        ref_out, _ = attention_reference(qkv64[:, :, 0], qkv64[:, :, 1], qkv64[:, :, 2], causal=causal)
        (ref_grad,) = torch.autograd.grad(ref_out, qkv64, dout.double())
        same_out = attention_same_dtype(q, k, v, causal=causal)
        (same_grad,) = torch.autograd.grad(same_out, qkv, dout)
        assert_close_to_reference("dqkv", grad, ref_grad, same_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 2, 64), (1, 2048, 2048, 2, 128),
                                   (1, 4096, 4096, 1, 128), (1, 1000, 1000, 1, 256), (2, 1024, 1024, 2, 256),
                                   (1, 777, 1500, 2, 96), (1, 1500, 777, 2, 59),
                                   # padded to 256 with descriptor loads: ragged both ways
                                   (1, 777, 1500, 2, 192), (1, 1500, 777, 2, 160)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_backward_matches_reference(shape, causal, dtype, poisoned_allocations):
    check_backward(*shape, causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fused_dq", [True, False], ids=["fused-dq", "dq-kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 3, 128), (1, 4096, 4096, 2, 128), (4, 2048, 2048, 1, 128),
                                   (1, 16384, 16384, 1, 128), (2, 4096, 4096, 3, 64), (1, 8192, 8192, 2, 64)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_hopper_gluon_dkdv_matches_reference(shape, causal, dtype, fused_dq, poisoned_allocations, monkeypatch):
    """The backward with the Gluon dK/dV kernel (kernels/flash_attn_hopper.py), which the Hopper
    table takes at head dim 128 from 1k keys with dQ fused (here also at head dim 64, and without
    fusing, by a config), against float64. The Triton dK/dV kernel must not run; the Triton
    dQ kernel must run exactly where dQ is not fused (always at head dim 64)."""
    if not fa._on_hopper(torch.device("cuda")):
        pytest.skip("the Gluon dK/dV kernel is compiled for Hopper (sm_90) only")
    dkdv, dq = spy_backward_kernels(monkeypatch)
    gluon_calls = []
    gluon_dkdv = flash_attn_hopper.flash_attn_backward_dkdv_hopper

    def counted(*args, **kwargs):
        gluon_calls.append(args[0].shape)
        return gluon_dkdv(*args, **kwargs)

    monkeypatch.setattr(flash_attn_hopper, "flash_attn_backward_dkdv_hopper", counted)
    config = dataclasses.replace(fa.default_bwd_config(shape[4], torch.device("cuda")), hopper_gluon_min_keys=1024,
                                 hopper_gluon_fused_dq=fused_dq)
    check_backward(*shape, causal, dtype, "cuda", bwd_config=config)
    fuses = fused_dq and shape[4] == 128
    assert len(gluon_calls) == 1 and not dkdv.launches and len(dq.launches) == (0 if fuses else 1)


def test_reference_softmax_scale_default_is_inverse_sqrt_headdim():
    q, k, v = make_qkv(1, 5, 5, 1, 16, torch.float32, "cpu")
    a, _ = attention_reference(q, k, v)
    b, _ = attention_reference(q, k, v, softmax_scale=1 / math.sqrt(16))
    torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("fusing", ["table", "triton-fused-dq"])
def test_gpu_backward_is_deterministic_at_real_size(fusing):
    """deterministic=True (the dQ kernel, no atomics), with configs that would fuse dQ otherwise
    (on Hopper the table's Gluon dK/dV kernel at head dim 128 from 1k keys; the Triton dK/dV kernel
    with fused_dq_min_rows): five backward passes at a size that spans many programs agree bit for
    bit."""
    q, k, v = make_qkv(2, 2048, 2048, 8, 128, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn_like(q)
    table = fa.default_bwd_config(128, q.device)
    fusing = table if fusing == "table" else dataclasses.replace(table, fused_dq_min_rows=1, hopper_gluon_min_keys=0)

    def grads():
        out = flash_attn_func(q, k, v, causal=True, deterministic=True, bwd_config=fusing)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads()
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 1024, 1024, 2, 64), (1, 4096, 4096, 2, 128), (1, 1100, 4200, 2, 128),
                                   (1, 1500, 777, 2, 96)],
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_backward_with_fused_dq_matches_reference(shape, causal, dtype, poisoned_allocations, monkeypatch):
    """dQ fused into the dK/dV kernel (TMA reduce-adds into a float32 accumulator on Hopper,
    element-wise atomics elsewhere; the CPU tests run the atomic form): ragged lengths both ways
    (the descriptor drops rows past seqlen_q), a head dim padded to 128, both causal modes."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(fa.default_bwd_config(shape[4], torch.device("cuda")), fused_dq_min_rows=1,
                                 hopper_gluon_min_keys=0)  # the Triton dK/dV kernel, not the Gluon one
    check_backward(*shape, causal, dtype, "cuda", bwd_config=fusing)
    expected = 2 if fa._on_hopper(torch.device("cuda")) else 1
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [expected] and not dq.launches


def _tma_forward_in(run_in_thread: bool, allocator=None):
    """A TMA forward on the GPU, optionally in a fresh thread and under `allocator`."""
    import threading

    from triton.runtime import _allocation

    q, k, v = make_qkv(1, 512, 512, 2, 128, torch.bfloat16, "cuda")
    config = FwdConfig(128, 128, 8, 3, tma=True, tma_min_keys=0)
    results = []

    def run():
        token = _allocation._allocator.set(allocator) if allocator is not None else None
        try:
            results.append(flash_attn_forward(q, k, v, 0.1, True, config))
        except Exception as exc:  # noqa: BLE001 -- reported by the caller
            results.append(exc)
        finally:
            if token is not None:
                _allocation._allocator.reset(token)

    if run_in_thread:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    return (q, k, v), results[0]


class CountingKernel:
    """Stands in for a CachedLauncher's kernel: counts the launches that go through the JIT."""

    def __init__(self, kernel):
        self.kernel, self.jit_launches = kernel, 0

    @property
    def arg_names(self):
        return self.kernel.arg_names

    def __getitem__(self, grid):
        self.jit_launches += 1
        return self.kernel[grid]


def count_launches(monkeypatch, launchers) -> dict[str, int]:
    """Counts every launch of `launchers` ('all') and those that go through the JIT ('jit'),
    each launcher's cache emptied first."""
    counts = {"all": 0, "jit": 0}
    for launcher in launchers:
        counting = CountingKernel(launcher.kernel)
        real_launch = launcher.launch

        def launch(grid, args, kwargs, counting=counting, real_launch=real_launch):
            jit_before = counting.jit_launches
            result = real_launch(grid, args, kwargs)
            counts["all"] += 1
            counts["jit"] += counting.jit_launches - jit_before
            return result
        monkeypatch.setattr(launcher, "kernel", counting)
        monkeypatch.setattr(launcher, "launch", launch)
        monkeypatch.setattr(launcher, "compiled", {})
    return counts


def misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose address is 2 bytes past a 16-byte boundary (contiguous otherwise)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t).requires_grad_(t.requires_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(4, 512, 512, 2, 256), (4, 512, 512, 3, 128), (2, 1000, 1000, 2, 64),
                                   (2, 1024, 1024, 2, 128), (1, 2048, 2048, 2, 128)],  # the Gluon kernels
                         ids=lambda s: "b{}_sq{}_sk{}_h{}_d{}".format(*s))
def test_gpu_repeated_calls_take_the_cached_launch(shape, causal, poisoned_allocations, monkeypatch):
    """kernels/launch.py: the second call of a shape launches every kernel's compiled kernel
    directly, a call whose inputs are not 16-byte aligned goes through the JIT again (a different
    specialisation, and the pointer path), and every call's forward and gradients match float64."""
    counts = count_launches(monkeypatch, (fa._fwd_launcher, fa._bwd_preprocess_launcher, fa._bwd_dkdv_launcher,
                                          fa._bwd_dq_launcher, flash_attn_hopper._fwd_launcher,
                                          flash_attn_hopper._bwd_dkdv_launcher))
    per_call = []
    for inputs in ("aligned", "aligned", "misaligned"):
        q, k, v = make_qkv(*shape, torch.bfloat16, "cuda", requires_grad=True)
        dout = torch.randn_like(q)
        if inputs == "misaligned":  # dO too: it is all the preprocessing kernel reads besides O
            q, k, v, dout = (misaligned_like(t) for t in (q, k, v, dout))
            assert not tma_compatible(q)
        before = dict(counts)
        out = flash_attn_func(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        per_call.append({key: counts[key] - before[key] for key in counts})
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out, _ = attention_reference(q64, k64, v64, causal=causal)
        ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
        same_out = attention_same_dtype(q, k, v, causal=causal)
        same_grads = torch.autograd.grad(same_out, (q, k, v), dout)
        assert_close_to_reference("out", out, ref_out, same_out)
        for name, g, ref, same in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
            assert_close_to_reference(name, g, ref, same)
    first, second, misaligned = per_call
    # misaligned inputs also change the path constexprs of the forward, dK/dV and dQ launches (no TMA,
    # no Gluon kernel); the preprocessing kernel's key differs by its inputs' alignment alone
    assert first["all"] >= 3 and first["jit"] == first["all"], first
    assert second == {"all": first["all"], "jit": 0}, "the second call went through the JIT"
    assert misaligned["all"] >= 3 and misaligned["jit"] == misaligned["all"], \
        "misaligned inputs took a launch compiled for aligned ones"


@pytest.mark.gpu
def test_gpu_tma_launch_works_in_a_fresh_thread():
    """Triton keeps its allocator per context: a thread that never set one still gets torch's."""
    (q, k, v), result = _tma_forward_in(run_in_thread=True)
    assert not isinstance(result, Exception), result
    expected = flash_attn_forward(q, k, v, 0.1, True, FwdConfig(128, 128, 8, 3, tma=False))
    torch.testing.assert_close(result[0], expected[0], atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_tma_launch_uses_the_callers_allocator():
    calls = []

    def recording(size, alignment, stream):
        calls.append(size)
        return fa._torch_scratch(size, alignment, stream)

    _, result = _tma_forward_in(run_in_thread=False, allocator=recording)
    assert not isinstance(result, Exception), result
    assert calls, "the TMA launch did not ask the caller's allocator for descriptor memory"
