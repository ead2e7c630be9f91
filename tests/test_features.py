"""flash-attn's training features in the Triton kernels, forward and backward, against the float64
reference (baselines/reference.py), in Triton's CPU interpreter at tiny sizes: GQA/MQA, sliding
windows, packed variable lengths, softcap, ALiBi, and their combinations. Dropout is in
tests/test_features_dropout.py, real sizes in tests/test_features_gpu.py.

Criterion (flash-attn's): each output's error against float64 is at most twice that of the same
computation in the inputs' dtype in PyTorch, plus a small epsilon. Every buffer the launchers
allocate starts as NaN (poisoned_allocations), so an element a kernel fails to write shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines.reference import attention_reference, attention_reference_varlen, attention_same_dtype
from kernels import backward, dispatch, flash_attn_func, flash_attn_varlen_func, forward
from kernels.configs import BwdConfig, FwdConfig
from tests.attention_checks import LaunchSpy, assert_close_to_reference, poisoned_allocations  # noqa: F401

INTERPRETER_TESTS = True
DTYPES = [torch.float16, torch.float32]


def grads(fn, inputs, dout):
    """(out, dq, dk, dv) of fn(*inputs) under autograd, on detached copies of the inputs."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return (out.detach(), *torch.autograd.grad(out, inputs, dout))


def check_dense(batch, seqlen_q, seqlen_k, heads, kv_heads, headdim, dtype, causal=False, window=(-1, -1),
                softcap=0.0, alibi=None, device="cpu", bwd_config=None, fwd_config=None):
    """out, dq, dk, dv of flash_attn_func with these features (and configs, where given) against
    float64 (flash-attn's criterion)."""
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, headdim, dtype=dtype, device=device) for _ in range(2))
    dout = torch.randn_like(q)
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "alibi_slopes": alibi}
    got = grads(lambda q, k, v: flash_attn_func(q, k, v, fwd_config=fwd_config, bwd_config=bwd_config, **kw), (q, k, v),
                dout)
    ref = grads(lambda q, k, v: attention_reference(q, k, v, None, **kw)[0],
                (q.double(), k.double(), v.double()), dout.double())
    same = grads(lambda q, k, v: attention_same_dtype(q, k, v, None, **kw), (q, k, v), dout)
    for name, g, r, s in zip(("out", "dq", "dk", "dv"), got, ref, same):
        assert g.shape == r.shape and g.dtype == dtype, name
        assert_close_to_reference(name, g, r, s)
    return got


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 2, False), (3, 1, True), (6, 2, True)])
def test_gqa_and_mqa_match_the_reference_and_sum_dk_dv_over_the_group(heads, kv_heads, causal, dtype):
    """k/v with fewer heads than q: q head h reads kv head h // (heads // kv_heads); dK and dV
    (of kv_heads heads) sum the group's q heads."""
    check_dense(2, 37, 53, heads, kv_heads, 16, dtype, causal=causal)


@pytest.mark.usefixtures("poisoned_allocations")
def test_gqa_through_host_descriptors_and_backward_descriptor_loads():
    """Whole blocks below 64 keys take the host's 2D descriptors in the interpreter's table, where
    a kv head's columns start at kv_head * headdim; the backward loads through descriptors too."""
    from kernels.checks import DENSE
    from kernels.configs import INTERPRETER_FWD_CONFIG

    like = torch.empty(2, 32, 4, 16)
    assert dispatch.fwd_memory_path(INTERPRETER_FWD_CONFIG, like, like[:, :, :2], like[:, :, :2], like, False,
                                    DENSE) == "tma-host"
    check_dense(2, 32, 32, 4, 2, 16, torch.float32, bwd_config=BwdConfig(16, 32, 32, 16, 4, 1, query_major=True,
                                                                         tma=True))


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k,window,causal", [
    (48, 48, (8, 4), False),
    (40, 70, (12, 0), False),   # sq < sk: the window is aligned to the bottom right
    (70, 40, (5, 9), False),    # sq > sk
    (50, 50, (6, -1), False),   # left side only
    (50, 66, (-1, 3), False),   # right side only
    (45, 80, (10, -1), True),   # causal + window: right side 0
    (33, 33, (0, 0), False),    # each row sees its diagonal key only
])
def test_sliding_window_matches_the_reference(seqlen_q, seqlen_k, window, causal, dtype):
    check_dense(1, seqlen_q, seqlen_k, 2, 2, 16, dtype, causal=causal, window=window)


def test_key_blocks_outside_the_window_are_never_read():
    """One query block (32 rows) against 160 keys, window (8, 0) bottom-right: the rows see keys
    120..159, so key blocks 0-2 (keys 0..95) lie outside the window. With NaN there, the forward
    and the dQ kernel stay finite only if they skip those blocks, and the dK/dV programs of those
    blocks write exact zeros only if they visit no query block."""
    q = torch.randn(1, 32, 2, 16)
    k, v = torch.randn(1, 160, 2, 16), torch.randn(1, 160, 2, 16)
    dout = torch.randn_like(q)
    kw = {"causal": True, "window_size": (8, 0)}
    ref = grads(lambda q, k, v: attention_reference(q, k, v, None, **kw)[0],
                (q.double(), k.double(), v.double()), dout.double())
    k[:, :96], v[:, :96] = float("nan"), float("nan")
    out, dq, dk, dv = grads(lambda q, k, v: flash_attn_func(q, k, v, **kw), (q, k, v), dout)
    torch.testing.assert_close(out.double(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq.double(), ref[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(dk[:, :96], torch.zeros_like(dk[:, :96])) and torch.equal(dv[:, :96], torch.zeros_like(dv[:, :96]))
    torch.testing.assert_close(dk[:, 96:].double(), ref[2][:, 96:], atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key_output_zeros_with_zero_gradients(dtype):
    """seqlen_q > seqlen_k with a window (0, 0): row i sees key i + sk - sq only, so the first
    sq - sk rows see none. They output 0 with logsumexp +inf, and nothing is NaN."""
    q = torch.randn(1, 40, 2, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 24, 2, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse, _ = flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True)
    out.backward(torch.randn_like(out))
    assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
    assert torch.isinf(lse[:, :, :16]).all() and torch.isfinite(lse[:, :, 16:]).all()
    assert torch.equal(q.grad[:, :16], torch.zeros_like(q.grad[:, :16]))
    for t in (out, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,heads,kv_heads,causal", [(2.0, 2, 2, False), (5.0, 4, 2, True)])
def test_softcap_matches_the_reference(softcap, heads, kv_heads, causal, dtype):
    """softcap * tanh(s / softcap) on the scaled scores; the backward through 1 - tanh^2. Small
    caps against unit-variance scores so that the cap is active."""
    check_dense(1, 41, 57, heads, kv_heads, 16, dtype, causal=causal, softcap=softcap)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch,causal", [(False, True), (True, False)])
def test_alibi_matches_the_reference(per_batch, causal, dtype):
    """Bias -slope * |i + sk - sq - j| on the scaled scores, slopes (heads,) or (batch, heads)."""
    slopes = torch.rand((2, 3) if per_batch else (3,)) + 0.1
    check_dense(2, 39, 51, 3, 3, 16, dtype, causal=causal, alibi=slopes)


def test_alibi_slopes_of_any_strides():
    """Slopes that are a strided view (every other column of a wider tensor) are read as values."""
    wide = torch.rand(2, 6) + 0.1
    check_dense(2, 20, 24, 3, 3, 16, torch.float32, causal=True, alibi=wide[:, ::2])


@pytest.mark.usefixtures("poisoned_allocations")
def test_softcap_alibi_window_and_gqa_together():
    check_dense(1, 45, 60, 4, 2, 24, torch.float16, window=(7, 9), softcap=4.0, alibi=torch.rand(4) + 0.1)


@pytest.mark.usefixtures("poisoned_allocations")
def test_query_major_backward_with_the_features():
    """The query-major dK/dV tiles (S = Q K^T; the features' table at head dim 128 on Hopper)
    with a window, softcap, ALiBi and GQA."""
    check_dense(1, 45, 60, 4, 2, 16, torch.float32, causal=True, window=(9, 0), softcap=4.0,
                alibi=torch.rand(4) + 0.1, bwd_config=BwdConfig(16, 32, 32, 16, 4, 1, query_major=True))


def packed(lengths_q, lengths_k, heads, kv_heads, headdim, dtype, device="cpu"):
    """Fresh packed q, k, v for sequences of these lengths, and their cu_seqlens (int32)."""
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for lengths in (lengths_q, lengths_k))
    q = torch.randn(int(cu_q[-1]), heads, headdim, dtype=dtype, device=device)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, headdim, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, cu_q, cu_k


def same_dtype_varlen(q, k, v, cu_q, cu_k, **kw):
    """attention_same_dtype sequence by sequence, concatenated (the varlen yardstick)."""
    slopes = kw.pop("alibi_slopes", None)
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes_b = slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        outs.append(attention_same_dtype(q[None, qs], k[None, ks], v[None, ks], alibi_slopes=slopes_b, **kw)[0])
    return torch.cat(outs)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths_q,lengths_k,heads,kv_heads,causal,window", [
    ([5, 30, 0, 21], [7, 22, 3, 37], 4, 2, False, (-1, -1)),  # an empty query sequence, lq != lk both ways
    ([17, 1, 48], [17, 0, 64], 2, 2, True, (-1, -1)),         # an empty key sequence: its row outputs 0
    ([38, 9, 26], [20, 45, 26], 4, 1, False, (6, 3)),          # GQA + varlen + window
    ([30, 44], [52, 44], 2, 2, True, (9, -1)),                 # causal + window, per sequence
])
def test_varlen_matches_the_reference_per_sequence(lengths_q, lengths_k, heads, kv_heads, causal, window, dtype):
    """Packed (total, heads, headdim) sequences: each attends only within itself, causal and the
    window aligned to the bottom right of each; lse is (heads, total_q)."""
    check_varlen(lengths_q, lengths_k, heads, kv_heads, 16, dtype, causal=causal, window_size=window)


def check_varlen(lengths_q, lengths_k, heads, kv_heads, headdim, dtype, device="cpu", bwd_config=None, fwd_config=None,
                 **kw):
    """out, dq, dk, dv and lse of flash_attn_varlen_func against float64, per sequence."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads, kv_heads, headdim, dtype, device)
    dout = torch.randn_like(q)

    def kernel(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), fwd_config=fwd_config,
                                      bwd_config=bwd_config, **kw)

    got = grads(kernel, (q, k, v), dout)
    ref = grads(lambda q, k, v: attention_reference_varlen(q, k, v, cu_q, cu_k, None, **kw)[0],
                (q.double(), k.double(), v.double()), dout.double())
    same = grads(lambda q, k, v: same_dtype_varlen(q, k, v, cu_q, cu_k, **kw), (q, k, v), dout)
    for name, g, r, s in zip(("out", "dq", "dk", "dv"), got, ref, same):
        assert g.shape == r.shape and g.dtype == dtype, name
        assert_close_to_reference(name, g, r, s)
    _, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_attn_probs=True,
                                       fwd_config=fwd_config, **kw)
    ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, None, **kw)[1]
    assert lse.shape == (heads, q.shape[0]) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.usefixtures("poisoned_allocations")
def test_varlen_backward_with_descriptor_loads_and_empty_sequences():
    """The backward's TMA path (descriptors per sequence, none with zero rows) with an empty
    query and an empty key sequence."""
    check_varlen([19, 0, 30, 7], [25, 11, 30, 0], 2, 1, 16, torch.float32, causal=True,
                 bwd_config=BwdConfig(16, 32, 32, 16, 4, 1, tma=True))


@pytest.mark.usefixtures("poisoned_allocations")
def test_varlen_with_alibi_per_sequence_and_softcap():
    """ALiBi slopes of shape (batch, heads) are taken per sequence."""
    check_varlen([21, 34], [40, 30], 2, 2, 16, torch.float32, causal=True, softcap=3.0,
                 alibi_slopes=torch.rand(2, 2) + 0.1)


def test_feature_calls_run_the_feature_kernels_and_dense_calls_the_dense_ones(monkeypatch):
    """The dense kernels' launches carry no feature argument; GQA or any feature takes the
    feature kernels (and never the Gluon ones: fwd_memory_path / bwd_dkdv_path say so)."""
    spies = {name: LaunchSpy(getattr(module, name)) for module, name in (
        (forward, "_fwd_launcher"), (forward, "_fwd_features_launcher"), (backward, "_bwd_dkdv_launcher"))}
    for (module, name) in ((forward, "_fwd_launcher"), (forward, "_fwd_features_launcher"),
                           (backward, "_bwd_dkdv_launcher")):
        monkeypatch.setattr(module, name, spies[name])
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert len(spies["_fwd_launcher"].launches) == 1 and not spies["_fwd_features_launcher"].launches
    assert len(spies["_bwd_dkdv_launcher"].launches) == 1
    flash_attn_func(q, k[:, :, :1], v[:, :, :1]).sum().backward()  # MQA
    flash_attn_func(q, k, v, window_size=(4, 4))
    assert len(spies["_fwd_features_launcher"].launches) == 2 and len(spies["_fwd_launcher"].launches) == 1
    assert len(spies["_bwd_dkdv_launcher"].launches) == 1


def test_memory_paths_send_features_to_the_gluon_kernels_but_dropout_and_varlen():
    """A config that sends dense calls to the Gluon kernels sends GQA, windows, softcap and ALiBi
    there too (the backward only where it fuses dQ: the dQ kernel has no features), but not
    dropout, and packed variable lengths never take the host's 2D descriptors (a tile would
    cross sequences)."""
    from kernels.checks import DENSE, Features

    if dispatch.gluon_unavailable:
        pytest.skip(f"the Gluon kernels are unavailable here: {dispatch.gluon_unavailable}")
    q = torch.randn(1, 256, 4, 128, dtype=torch.float16)
    kv = q[:, :, :2]
    config = FwdConfig(128, 128, 8, 3, tma=True, tma_min_keys=0, hopper_gluon_min_keys=128)
    assert dispatch.fwd_memory_path(config, q, q, q, q, True) == dispatch.GluonPath.DENSE
    window = Features(window_left=64)
    slopes = torch.rand(4)
    for features in (window, Features(softcap=5.0), Features(alibi_slopes=slopes), DENSE):
        assert dispatch.fwd_memory_path(config, q, q, q, q, True, features) == dispatch.GluonPath.DENSE
    assert dispatch.fwd_memory_path(config, q, kv.contiguous(), kv.contiguous(), q, True) == dispatch.GluonPath.DENSE
    dropout = Features(dropout_p=0.1, rng_seed=torch.zeros(2, dtype=torch.int64))
    assert dispatch.fwd_memory_path(config, q, q, q, q, True, dropout) == "tma-kernel"
    packed = q[0]
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    varlen = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
    host = FwdConfig(128, 128, 8, 3, tma=True, tma_min_keys=0, tma_host_min_keys=0, tma_host_below_keys=2**20)
    assert dispatch.fwd_memory_path(host, q, q, q, q, False, window) == "tma-host"
    assert dispatch.fwd_memory_path(host, packed, packed, packed, packed, False, varlen) == "tma-kernel"
    assert dispatch.fwd_memory_path(FwdConfig(128, 128, 8, 3), packed, packed, packed, packed, False,
                                    varlen) == "pointer"
    bwd = BwdConfig(64, 128, 128, 32, 8, 3, hopper_gluon_min_keys=128)
    assert dispatch.bwd_dkdv_path(bwd, q, q, q, q, window) == "triton"  # dQ not fused by this config
    fused = dataclasses.replace(bwd, hopper_gluon_fused_dq=True)
    assert dispatch.bwd_dkdv_path(fused, q, q, q, q, window) == dispatch.GluonPath.DENSE
    assert dispatch.bwd_dkdv_path(fused, q, kv.contiguous(), kv.contiguous(), q) == dispatch.GluonPath.DENSE
    assert dispatch.bwd_dkdv_path(fused, q, q, q, q, window, deterministic=True) == "triton"
    assert dispatch.bwd_dkdv_path(fused, q, q, q, q, dropout) == "triton"
    assert dispatch.bwd_dkdv_path(fused, q, q, q, q, Features(softcap=5.0)) == dispatch.GluonPath.DENSE


def test_custom_ops_carry_every_feature():
    """torch.ops.fa2.fwd/bwd (what torch.compile sees) compute what the eager path does for a
    call with GQA, a window, softcap and ALiBi."""
    q, k, v = torch.randn(1, 33, 4, 16), torch.randn(1, 41, 2, 16), torch.randn(1, 41, 2, 16)
    slopes = torch.rand(4)
    kw = {"causal": True, "window_size": (5, 0), "softcap": 3.0, "alibi_slopes": slopes}
    eager_out, eager_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    out, lse = torch.ops.fa2.fwd(q, k, v, None, None, 0, 0, 0.25, True, 5, -1, 3.0, slopes, 0.0, None, False, "", "")
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    dout = torch.randn_like(q)
    dq, dk, dv = torch.ops.fa2.bwd(dout, q, k, v, out, lse, None, None, 0, 0, 0.25, True, 5, -1, 3.0, slopes, 0.0,
                                   None, False, "")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.autograd.backward(flash_attn_func(qg, kg, vg, **kw), dout)
    assert torch.equal(dq, qg.grad) and torch.equal(dk, kg.grad) and torch.equal(dv, vg.grad)


def test_compiled_calls_with_features_equal_eager():
    """torch.compile(fullgraph=True) traces the feature calls as fa2:: ops (aot_eager here) and
    computes what eager does, bit for bit: GQA with a window, softcap and ALiBi, and varlen."""
    q = torch.randn(1, 33, 4, 16, requires_grad=True)
    k, v = (torch.randn(1, 41, 2, 16, requires_grad=True) for _ in range(2))
    slopes = torch.rand(4)

    def call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=3.0, alibi_slopes=slopes)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v)
    eager = call(q, k, v)
    assert torch.equal(compiled, eager)
    dout = torch.randn_like(eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(compiled, (q, k, v), dout),
                                                 torch.autograd.grad(eager, (q, k, v), dout)))
    q, k, v, cu_q, cu_k = packed([10, 23], [17, 23], 4, 2, 16, torch.float32)

    def varlen(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 23, causal=True)

    assert torch.equal(torch.compile(varlen, backend="aot_eager", fullgraph=True)(q, k, v), varlen(q, k, v))


def test_cu_seqlens_values_are_read_once_per_tensor_until_it_changes(monkeypatch):
    """Checking cu_seqlens reads its values to the host (a wait for the GPU): a tensor that passed
    is not read again, unless it was written to or comes with another total or max_seqlen."""
    from kernels.checks import check_cu_seqlens

    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for _ in range(3):
        check_cu_seqlens("cu_seqlens_q", cu, 10, 6, cu.device)
    assert len(reads) == 1
    with pytest.raises(ValueError, match="max_seqlen_q=5 is below the longest sequence"):
        check_cu_seqlens("cu_seqlens_q", cu, 10, 5, cu.device)
    cu[1] = 11
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got \[0, 11, 10\]"):
        check_cu_seqlens("cu_seqlens_q", cu, 10, 6, cu.device)


def test_cu_seqlens_given_as_a_strided_view():
    """cu_seqlens that is every other element of a wider tensor is read by value."""
    cu = torch.tensor([0, 99, 10, 99, 33], dtype=torch.int32)[::2]
    q, k, v = (torch.randn(33, 2, 16) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True)
    ref = attention_reference_varlen(q, k, v, cu.contiguous(), cu.contiguous(), None, True)[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
