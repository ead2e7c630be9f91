"""How the kernels move tiles: TMA descriptors made on the host or in the kernel, or pointer
tiles (kernels/dispatch.py's rules, kernels/forward.py and kernels/backward.py's launches), the
scratch allocator in-kernel descriptors need (kernels/common.py), and strided or broadcast
views. Every path gives the pointer path's result bit for bit."""

import dataclasses

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels import common, configs, flash_attn_func, forward
from kernels.backward import flash_attn_backward
from kernels.configs import INTERPRETER_BWD_CONFIG, FwdConfig
from kernels.dispatch import GluonPath, bwd_uses_tma, fwd_memory_path, tma_compatible
from kernels.forward import flash_attn_forward
from tests.attention_checks import (  # noqa: F401 (poisoned_allocations: a fixture, used by name)
    assert_close_to_reference,
    make_qkv,
    poisoned_allocations,
    shape_id,
)

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "path"), [
    # ragged seqlens (not block multiples) and head dim 40 (padded to 64 inside the kernel;
    # 80-byte rows, so TMA-compatible): the in-kernel descriptors' zero fill and clipped stores
    ((2, 37, 53, 2, 40), "tma-kernel"),
    # whole blocks, head dim 32, three heads, two batches: the host descriptors' 2D view must
    # land each (batch, head) on its own rows and columns
    ((2, 64, 96, 3, 32), "tma-host"),
], ids=["ragged", "whole-blocks"])
@pytest.mark.usefixtures("poisoned_allocations")
def test_tma_paths_equal_the_pointer_path(shape, path, causal):
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
@pytest.mark.parametrize("shape", [(2, 37, 53, 2, 40), (1, 53, 37, 3, 32)], ids=shape_id)
@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_tma_equals_the_pointer_path(shape, query_major, causal):
    """The backward's descriptor loads (zero fill past seqlen and the head dim) give bit for
    bit the pointer path's masked loads, in both dK/dV layouts, with ragged lengths both ways."""
    batch, seqlen_q, seqlen_k, heads, headdim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, headdim, torch.float16, "cpu")
    do = torch.randn_like(q)
    out, lse = flash_attn_forward(q, k, v, 0.3, causal)
    pointer = dataclasses.replace(INTERPRETER_BWD_CONFIG, query_major=query_major, tma=False)
    tma = dataclasses.replace(pointer, tma=True)
    assert bwd_uses_tma(tma, q, k, v, do) and not bwd_uses_tma(pointer, q, k, v, do)
    for name, got, want in zip(("dq", "dk", "dv"), flash_attn_backward(do, q, k, v, out, lse, 0.3, causal, tma),
                               flash_attn_backward(do, q, k, v, out, lse, 0.3, causal, pointer)):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


@pytest.mark.usefixtures("poisoned_allocations")
def test_backward_tma_with_a_broadcast_dout_equals_the_pointer_path():
    """A dO broadcast along the sequence (stride 0, e.g. the gradient of out.mean(1)) is a valid
    descriptor source: the descriptor loads give the pointer loads' gradients bit for bit."""
    q, k, v = make_qkv(1, 37, 53, 2, 32, torch.float16, "cpu")
    do = torch.randn(1, 1, 2, 32, dtype=torch.float16).expand(1, 37, 2, 32)
    out, lse = flash_attn_forward(q, k, v, 0.3, True)
    pointer = dataclasses.replace(INTERPRETER_BWD_CONFIG, query_major=True)
    tma = dataclasses.replace(pointer, tma=True)
    assert do.stride(1) == 0 and bwd_uses_tma(tma, q, k, v, do)
    for got, want in zip(flash_attn_backward(do, q, k, v, out, lse, 0.3, True, tma),
                         flash_attn_backward(do, q, k, v, out, lse, 0.3, True, pointer)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_non_contiguous_inputs_match_contiguous():
    base = torch.randn(2, 2, 37, 32, 3, dtype=torch.float16)  # (B, H, S, D, 3)
    q, k, v = (base[..., i].transpose(1, 2) for i in range(3))  # last stride 3, not 1
    q2 = torch.randn(2, 2, 37, 32, dtype=torch.float16).transpose(1, 2)  # (B, S, H, D) view
    assert not q.is_contiguous() and not q2.is_contiguous() and q2.stride(-1) == 1
    for query in (q, q2):
        out = flash_attn_func(query, k, v, causal=True)
        ref = flash_attn_func(query.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_tma_kernel_path_sets_the_descriptor_allocator(monkeypatch):
    launches = []
    real = forward.ensure_descriptor_allocator
    monkeypatch.setattr(forward, "ensure_descriptor_allocator", lambda: launches.append(1) or real())
    q, k, v = make_qkv(1, 37, 53, 1, 32, torch.float16, "cpu")
    flash_attn_forward(q, k, v, 0.3, False, FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0))
    assert launches == [1], "the TMA config did not take the in-kernel descriptor path"


def test_tma_launch_keeps_an_allocator_the_caller_set():
    """The TMA path sets torch's scratch allocator only where none is set. (The interpreter makes
    descriptors without asking for memory; `test_gpu_tma_launch_uses_the_callers_allocator`
    checks that a GPU launch really asks the caller's allocator.)"""
    from triton.runtime import _allocation

    def recording(size, alignment, stream):
        return common.torch_scratch(size, alignment, stream)

    token = _allocation._allocator.set(recording)
    try:
        q, k, v = make_qkv(1, 40, 40, 1, 32, torch.float16, "cpu")
        flash_attn_forward(q, k, v, 0.2, False, FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0))
        assert _allocation._allocator.get() is recording
    finally:
        _allocation._allocator.reset(token)


def test_descriptor_scratch_is_aligned_as_asked():
    for alignment in (64, 128, 1024):
        buffer = common.torch_scratch(100, alignment, None)
        assert buffer.data_ptr() % alignment == 0 and buffer.numel() == 100


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


# ---------------------------------------------------------------------------------------
# GPU (skipped without CUDA).
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["qkv-packed", "padded-rows"])
@pytest.mark.usefixtures("poisoned_allocations")
def test_gpu_hopper_gluon_forward_on_strided_views(layout, causal):
    """The Gluon kernels' scope admits views whose rows are longer than heads x head dim (q, k, v
    sliced out of a packed qkv, or rows padded at the end): their 2D descriptors step by stride(1).
    Forward against float64, and the backward through autograd for the packed layout (at 2048 keys
    the Gluon backward, with dQ fused)."""
    if not configs.on_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward is compiled for Hopper (sm_90) only")
    batch, seqlen, heads, headdim = 2, 2048, 3, 128
    if layout == "qkv-packed":
        qkv = torch.randn(batch, seqlen, 3, heads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        rows = torch.randn(3, batch, seqlen, heads * headdim + 64, device="cuda", dtype=torch.bfloat16)
        q, k, v = (r[..., :heads * headdim].unflatten(-1, (heads, headdim)) for r in rows)
    assert q.stride(1) > heads * headdim
    config = configs.default_fwd_config(headdim, causal, q.device)
    assert fwd_memory_path(config, q, k, v, torch.empty_like(q, memory_format=torch.contiguous_format),
                           causal) == GluonPath.DENSE
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
        return common.torch_scratch(size, alignment, stream)

    _, result = _tma_forward_in(run_in_thread=False, allocator=recording)
    assert not isinstance(result, Exception), result
    assert calls, "the TMA launch did not ask the caller's allocator for descriptor memory"
