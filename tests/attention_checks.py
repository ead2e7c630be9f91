"""Shared checks of the attention kernels against the float64 reference, for the test modules.

Criterion (flash-attn's own tests): the kernel's error against float64 is at most twice the
error of the same computation done by PyTorch in the inputs' dtype, plus a small epsilon
(`ABS_EPS`). Inputs are fresh random tensors (never zeros); `poisoned_allocations` fills every
buffer the launchers allocate with NaN, so an element a kernel fails to write shows.

A test module uses the fixture by importing it (pytest finds fixtures by name in the module's
namespace) and asking for it by name:
`from tests.attention_checks import poisoned_allocations  # noqa: F401` and
`@pytest.mark.usefixtures("poisoned_allocations")` on the test.
"""

from __future__ import annotations

import pytest
import torch

from baselines.reference import attention_reference, attention_reference_varlen, attention_same_dtype
from harness.accuracy import within_twice_the_error
from kernels import backward, flash_attn_func

ABS_EPS = {torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float32: 1e-5}

# (batch, seqlen_q, seqlen_k, heads, headdim) for Triton's interpreter: ragged lengths,
# seqlen_q != seqlen_k both ways, head dims that are not powers of two, several batch/head counts.
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
# The same at real sizes on a CUDA device.
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


def shape_id(shape) -> str:
    """pytest id of a (batch, seqlen_q, seqlen_k, heads, headdim) shape."""
    return "b{}_sq{}_sk{}_h{}_d{}".format(*shape)


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


def varlen_reference_under_mask(q, k, v, cu_q, cu_k, lengths_q, lengths_k, probs, dropout_p, dout, causal=True):
    """(out, dq, dk, dv) of float64 attention over packed sequences under the keep-mask a kernel
    reported in `probs` (S_dmask, (batch, heads, max_seqlen_q, max_seqlen_k), dropped entries
    negated): sequence b's is the corner [b, :, :len_q, :len_k]."""
    keep = ~torch.signbit(probs)
    masks = [keep[b:b + 1, :, :lq, :lk] for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k))]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference_varlen(q64, k64, v64, cu_q, cu_k, None, causal, dropout_p=dropout_p,
                                     dropout_keep=masks)[0]
    return (ref, *torch.autograd.grad(ref, (q64, k64, v64), dout.double()))


def make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, dtype, device, requires_grad=False):
    """Fresh random inputs (never zeros)."""
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads, headdim, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def assert_close_to_reference(name, actual, reference64, same_dtype):
    """`actual` is no further from float64 than twice PyTorch's same-dtype result."""
    assert not torch.isnan(actual).any(), f"{name} has NaN"
    ok, err, yardstick = within_twice_the_error(actual, reference64, same_dtype, ABS_EPS[actual.dtype])
    assert ok, f"{name}: max error {err:.3e} > 2 x same-dtype error {yardstick:.3e} + eps"


def check_forward(batch, seqlen_q, seqlen_k, heads, headdim, causal, dtype, device):
    """flash_attn_func's out and logsumexp against float64, on fresh inputs of this shape."""
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
    """dq, dk, dv through autograd against float64, on fresh inputs and a fresh dout."""
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


class LaunchSpy:
    """Stands in for a kernel's launcher (monkeypatched onto its module): records each launch's
    keyword arguments, then launches through the real launcher."""

    def __init__(self, launcher):
        self.launcher, self.launches = launcher, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.launcher[grid](*args, **kwargs)
        return launch


def spy_backward_kernels(monkeypatch) -> tuple[LaunchSpy, LaunchSpy]:
    """(dK/dV kernel spy, dQ kernel spy), both in place of their launchers in kernels.backward."""
    spies = LaunchSpy(backward._bwd_dkdv_launcher), LaunchSpy(backward._bwd_dq_launcher)
    monkeypatch.setattr(backward, "_bwd_dkdv_launcher", spies[0])
    monkeypatch.setattr(backward, "_bwd_dq_launcher", spies[1])
    return spies
