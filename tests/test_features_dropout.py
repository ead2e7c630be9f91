"""Dropout in the Triton kernels (kernels/dropout.py), in Triton's CPU interpreter: the keep rate,
reproducibility under torch.manual_seed, the kernel against the float64 reference under the
kernel's own keep-mask (forward and backward, dense and packed), a bit-identical backward, and
the kernel's mask read back through flash-attn's S_dmask (tests/test_flash_attn_parity.py has its
convention): `return_attn_probs=True` with dropout returns S_dmask with dropped entries negated,
so an entry was kept iff its sign bit is clear (a masked-out 0 that was dropped is -0.0).
"""

from __future__ import annotations

import math

import pytest
import torch

from baselines.reference import attention_reference
from kernels import flash_attn_func, flash_attn_varlen_func
from kernels.dropout import dropout_keep_mask
from tests.attention_checks import poisoned_allocations, varlen_reference_under_mask  # noqa: F401

INTERPRETER_TESTS = True


def _qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype=torch.float32):
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, headdim, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def _run(seed, q, k, v, dout, **kw):
    """(out, S_dmask, dq, dk, dv) of one forward and backward under torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    out, _, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return (out, probs, *grads)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.83])
def test_keep_rate_is_one_minus_p(dropout_p):
    """The keep-mask's mean over 2 x 3 x 64 x 96 entries is within 5 standard deviations of 1 - p."""
    seed = torch.tensor([123456789, 42], dtype=torch.int64)
    keep = dropout_keep_mask(seed, dropout_p, 2, 3, 64, 96)
    std = math.sqrt(dropout_p * (1 - dropout_p) / keep.numel())
    assert abs(keep.float().mean().item() - (1 - dropout_p)) < 5 * std
    # another offset draws another mask
    other = dropout_keep_mask(torch.tensor([123456789, 43], dtype=torch.int64), dropout_p, 2, 3, 64, 96)
    assert not torch.equal(keep, other)


def test_the_same_seed_reproduces_a_run_and_another_seed_does_not():
    q, k, v = _qkv(1, 32, 40, 2, 1, 16)
    dout = torch.randn(1, 32, 2, 16)
    first = _run(7, q, k, v, dout, dropout_p=0.3, causal=True)
    again = _run(7, q, k, v, dout, dropout_p=0.3, causal=True)
    (out, probs, *grads), (out_again, probs_again, *grads_again) = first, again
    for a, b in zip((out, *grads), (out_again, *grads_again)):
        assert torch.equal(a, b)  # the kernels' outputs bit-identical, forward and backward
    assert torch.equal(torch.signbit(probs), torch.signbit(probs_again))  # the same keep-mask
    # S_dmask's magnitudes are PyTorch's CPU recomputation (kernels/probs.py), whose exp was seen to
    # round differently between two calls on identical inputs: equal to within one float32 rounding.
    torch.testing.assert_close(probs, probs_again, rtol=2.5e-7, atol=0)
    other = _run(8, q, k, v, dout, dropout_p=0.3, causal=True)
    assert not torch.equal(first[0], other[0])


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("kw", [
    {"causal": False},
    {"causal": True, "window_size": (9, 0)},
    {"alibi_slopes": torch.tensor([0.3, 0.7, 0.2, 0.5])},
])
def test_kernel_matches_the_reference_under_its_own_mask(kw):
    """out, dq, dk, dv against float64 attention with the keep-mask the kernel drew (GQA 4/2)."""
    dropout_p = 0.25
    q, k, v = _qkv(1, 37, 45, 4, 2, 16)
    dout = torch.randn(1, 37, 4, 16)
    out, probs, *grads = _run(11, q, k, v, dout, dropout_p=dropout_p, deterministic=True, **kw)
    keep = ~torch.signbit(probs)
    assert 0.6 < keep.float().mean().item() < 0.9
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, None, dropout_p=dropout_p, dropout_keep=keep, **kw)[0]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), expected.detach(), atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.usefixtures("poisoned_allocations")
def test_varlen_dropout_matches_the_reference_per_sequence():
    lengths_q, lengths_k = [13, 0, 29], [21, 5, 29]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    q = torch.randn(int(cu_q[-1]), 2, 16, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 1, 16, requires_grad=True) for _ in range(2))
    dout = torch.randn(int(cu_q[-1]), 2, 16)
    torch.manual_seed(5)
    out, _, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 29, 29, dropout_p=0.2, causal=True,
                                           return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = varlen_reference_under_mask(q, k, v, cu_q, cu_k, lengths_q, lengths_k, probs, 0.2, dout)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), refs):
        torch.testing.assert_close(got.double(), expected.detach(), atol=2e-5, rtol=1e-4, msg=name)


def test_float16_dropout_is_finite_and_reproducible():
    q, k, v = _qkv(1, 33, 50, 2, 1, 16, torch.float16)
    dout = torch.randn(1, 33, 2, 16, dtype=torch.float16)
    first = _run(1, q, k, v, dout, dropout_p=0.5, window_size=(6, 6))
    again = _run(1, q, k, v, dout, dropout_p=0.5, window_size=(6, 6))
    for a, b in zip(first, again):
        assert torch.isfinite(a).all() and torch.equal(a, b)
