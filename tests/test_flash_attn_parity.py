"""The public functions take arguments as flash-attn's do and return what its do, in Triton's CPU
interpreter: bool-likes, numpy scalars and 0-d tensors where flash-attn reads a Python number,
window_size as a tuple, a list or a 2-element integer tensor; softcap with dropout refused;
S_dmask empty without dropout and in flash-attn's convention with it; `block_table` (a paged
KV cache) in flash_attn_varlen_func. Against baselines/reference.py's float64 attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baselines.reference import _scores, attention_reference, attention_reference_varlen
from kernels import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from kernels.dropout import dropout_keep_mask
from kernels.interface import _get_block_size_n

INTERPRETER_TESTS = True


def _qkv(batch=1, seqlen_q=24, seqlen_k=40, heads=2, kv_heads=1, headdim=16, requires_grad=False):
    q = torch.randn(batch, seqlen_q, heads, headdim, requires_grad=requires_grad)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, headdim, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [1, 0, np.bool_(True), np.True_, torch.tensor(True)])
def test_bool_like_causal_is_taken_as_its_bool(causal):
    q, k, v = _qkv()
    out = flash_attn_func(q, k, v, causal=causal, deterministic=None)
    ref, _ = attention_reference(q, k, v, causal=bool(causal))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [2, "yes", 0.5, None])
def test_causal_that_is_not_bool_like_is_refused(causal):
    with pytest.raises(TypeError, match=r"causal must be a bool \(or 0/1\)"):
        flash_attn_func(*_qkv(), causal=causal)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), torch.tensor(0.3).double()])
def test_numpy_and_0d_tensor_softmax_scales(scale):
    q, k, v = _qkv()
    ref, _ = attention_reference(q, k, v, 0.3)
    torch.testing.assert_close(flash_attn_func(q, k, v, softmax_scale=scale).double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [(5, 2), [5, 2], torch.tensor([5, 2]), torch.tensor([5, 2], dtype=torch.int32),
                                    (np.int64(5), np.int64(2)), (5.0, 2.0)])
def test_window_size_as_flash_attn_takes_it(window):
    q, k, v = _qkv()
    ref, _ = attention_reference(q, k, v, window_size=(5, 2))
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window).double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [(5.5, 2), torch.tensor([5.0, 2.0]), (1, 2, 3), (float("inf"), -1)])
def test_a_window_side_that_is_not_a_whole_number_is_refused_not_truncated(window):
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flash_attn_func(*_qkv(), window_size=window)


def test_softcap_with_dropout_is_refused_as_flash_attn_does():
    with pytest.raises(ValueError, match=r"softcap \(5.0\) cannot be combined with dropout_p \(0.1\)"):
        flash_attn_func(*_qkv(), dropout_p=0.1, softcap=5.0)


@pytest.mark.parametrize("varlen", [False, True])
def test_return_attn_probs_without_dropout_returns_an_empty_s_dmask(varlen):
    q, k, v = _qkv(batch=1, seqlen_q=24, seqlen_k=24)
    if varlen:
        cu = torch.tensor([0, 10, 24], dtype=torch.int32)
        out, lse, s_dmask = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 14, 14, return_attn_probs=True)
    else:
        out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def _normalized_like_flash_attn(s_dmask, scores64, block_n):
    """flash-attn's tests' `normalize_flash_attn_S`, written out: |S| of key block j times
    exp(m_j - lse), m_j the row's max over blocks j, j + 1, ... of the float64 scores."""
    seqlen_k = scores64.shape[-1]
    lse = torch.logsumexp(scores64, dim=-1, keepdim=True)
    out = torch.zeros_like(scores64)
    for start in range(0, seqlen_k, block_n):
        m = scores64[..., start:].amax(-1, keepdim=True)
        block = s_dmask[..., start:start + block_n].double().abs()
        out[..., start:start + block_n] = (block * torch.exp(m - lse)).nan_to_num(0.0)
    return out


@pytest.mark.parametrize("headdim,kw", [(16, {"causal": True}), (80, {"window_size": (20, 3)}),
                                        (16, {"alibi_slopes": torch.tensor([0.3, 0.6])})])
def test_s_dmask_with_dropout_is_in_flash_attn_convention(headdim, kw):
    """flash-attn's tests recover the probabilities from S_dmask by its block-wise running max;
    the sign bits are the kernel's own keep-mask (the seed the API draws)."""
    q, k, v = _qkv(seqlen_q=50, seqlen_k=150, headdim=headdim)
    torch.manual_seed(4)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True, **kw)
    torch.manual_seed(4)
    seed = torch.randint(0, 2**62, (2,), dtype=torch.int64)  # the API's draw (kernels/interface.py)
    keep = dropout_keep_mask(seed, 0.3, 1, 2, 50, 150)
    assert torch.equal(~torch.signbit(s_dmask), keep)
    causal = kw.get("causal", False)
    scores = _scores(q, k, 1 / headdim ** 0.5, causal, kw.get("window_size", (-1, -1)), 0.0, kw.get("alibi_slopes"))
    block_n = _get_block_size_n(q.device, headdim, True, causal)
    assert block_n < 150  # several key blocks: the running max differs between them
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(_normalized_like_flash_attn(s_dmask, scores, block_n), probs, atol=1e-5, rtol=1e-4)
    ref, _ = attention_reference(q, k, v, dropout_p=0.3, dropout_keep=keep, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def _paged(k, v, cu_seqlens_k, page_size, max_pages):
    """A shuffled page pool holding the packed k/v's sequences (NaN in unused rows) and its table."""
    batch = cu_seqlens_k.shape[0] - 1
    num_pages = batch * max_pages + 3
    k_pages = torch.full((num_pages, page_size, *k.shape[1:]), float("nan"))
    v_pages = torch.full_like(k_pages, float("nan"))
    table = torch.randperm(num_pages)[:batch * max_pages].reshape(batch, max_pages).to(torch.int32)
    bounds = cu_seqlens_k.tolist()
    for b in range(batch):
        for i in range(bounds[b + 1] - bounds[b]):
            page, row = table[b, i // page_size], i % page_size
            k_pages[page, row], v_pages[page, row] = k[bounds[b] + i], v[bounds[b] + i]
    return k_pages, v_pages, table


def test_varlen_with_a_block_table_reads_the_paged_cache():
    lengths_q, lengths_k = [5, 1, 9], [37, 16, 9]
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32) for lengths in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, 16)
    k, v = (torch.randn(sum(lengths_k), 2, 16) for _ in range(2))
    k_pages, v_pages, table = _paged(k, v, cu_k, 16, 3)
    k_pages.requires_grad_()
    kw = {"causal": True, "window_size": (12, 0)}
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 37, block_table=table, **kw)
    ref, _ = attention_reference_varlen(q, k, v, cu_q, cu_k, None, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out.sum().backward()  # gradients reach the pages the sequences use, and only those
    used = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for b, length in enumerate(lengths_k):
        for i in range(length):
            used[table[b, i // 16], i % 16] = True
    assert torch.isfinite(k_pages.grad).all() and not k_pages.grad[~used].any() and k_pages.grad[used].any()


def test_varlen_block_table_entries_outside_the_pool_are_refused():
    cu = torch.tensor([0, 20], dtype=torch.int32)
    k_pages, v_pages = torch.randn(2, 16, 1, 16), torch.randn(2, 16, 1, 16)
    with pytest.raises(ValueError, match=r"block_table entries .* page indices in \[0, 2\)"):
        flash_attn_varlen_func(torch.randn(20, 1, 16), k_pages, v_pages, cu, cu, 20, 20,
                               block_table=torch.tensor([[1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="must fit their block_table rows"):
        flash_attn_varlen_func(torch.randn(20, 1, 16), k_pages, v_pages, cu, cu, 20, 20,
                               block_table=torch.tensor([[1]], dtype=torch.int32))


def test_kvcache_takes_flash_attn_argument_types():
    """window_size as a 2-element int tensor (flash-attn's tests pass one), numpy causal and scale."""
    k_cache, v_cache = torch.randn(2, 48, 1, 16), torch.randn(2, 48, 1, 16)
    q = torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([30, 48], dtype=torch.int32)
    kw = {"cache_seqlens": seqlens, "return_softmax_lse": True}
    expected = flash_attn_with_kvcache(q, k_cache, v_cache, window_size=(7, 0), causal=True, softmax_scale=0.2, **kw)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, window_size=torch.tensor([7, 3]), causal=np.True_,
                                  softmax_scale=np.float32(0.2), **kw)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    ref, _ = attention_reference(q, k_cache[:, :30], v_cache[:, :30], 0.2, True, (7, 0))
    torch.testing.assert_close(got[0][:1].double(), ref[:1], atol=2e-5, rtol=1e-4)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flash_attn_with_kvcache(q, k_cache, v_cache, window_size=(7.5, 0), **kw)
