"""Which kernel and path serves a call (kernels/dispatch.py) with the block-size tables of
kernels/configs.py: the Hopper table's choices at the paper sweep's lengths, the Gluon kernels'
scope, the rules for fusing dQ, and the fall-back to the Triton kernels where the Gluon ones are
not on this device or cannot be built. Where a rule sends work to the Triton kernels, the result
is checked against float64 in Triton's interpreter."""

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from kernels import backward, configs, dispatch, flash_attn_func, forward
from kernels.configs import (
    HOPPER_BWD_CONFIGS,
    HOPPER_FWD_CONFIGS,
    INTERPRETER_BWD_CONFIG,
    FwdConfig,
    hopper_fwd_config,
)
from kernels.dispatch import (
    GluonPath,
    bwd_dkdv_path,
    bwd_fuses_dq,
    bwd_gluon_fuses_dq,
    fwd_memory_path,
)
from kernels.forward import flash_attn_forward
from tests.attention_checks import (  # noqa: F401 (poisoned_allocations: a fixture, used by name)
    assert_close_to_reference,
    check_backward,
    make_qkv,
    poisoned_allocations,
    spy_backward_kernels,
)

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward(deterministic, monkeypatch):
    """flash_attn_func's `deterministic` decides, with a config that fuses dQ, whether the dQ
    kernel runs (True) or the dK/dV kernel adds dQ (False)."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    fusing = dataclasses.replace(INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1)
    q, k, v = make_qkv(1, 32, 32, 1, 16, torch.float16, "cpu", requires_grad=True)
    flash_attn_func(q, k, v, bwd_config=fusing, deterministic=deterministic).sum().backward()
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [0 if deterministic else 1]
    assert len(dq.launches) == (1 if deterministic else 0)


def test_fused_dq_follows_min_rows_and_deterministic():
    config = dataclasses.replace(INTERPRETER_BWD_CONFIG, fused_dq_min_rows=1024)
    assert bwd_fuses_dq(config, 1024) and not bwd_fuses_dq(config, 1023)
    assert not bwd_fuses_dq(config, 4096, deterministic=True)
    assert not bwd_fuses_dq(INTERPRETER_BWD_CONFIG, 4096)  # 0: never
    assert all(not table_entry.fused_dq_min_rows for table_entry in HOPPER_BWD_CONFIGS.values())  # measured slower


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
    config = HOPPER_FWD_CONFIGS[(128, causal)]
    triton_only = dataclasses.replace(config, hopper_gluon_min_keys=0)
    for seqlen, path in paths.items():
        q = torch.empty(16384 // seqlen, seqlen, 1, 128, dtype=torch.float16)
        assert fwd_memory_path(triton_only, q, q, q, q, causal) == path, seqlen
        expected = GluonPath.DENSE if seqlen >= 1024 else path
        assert fwd_memory_path(config, q, q, q, q, causal) == expected, seqlen


def test_hopper_gluon_forward_scope():
    """The Gluon forward takes only what it implements: equal lengths in whole 128-row blocks,
    head dim 64, 96, 128, 192 or 256, fp16/bf16, exact 2D views; anything else keeps the Triton kernel."""
    config = HOPPER_FWD_CONFIGS[(128, False)]

    def path(q_shape, k_shape=None, dtype=torch.bfloat16, transpose=False):
        q = torch.empty(*q_shape, dtype=dtype)
        k = torch.empty(*(k_shape or q_shape), dtype=dtype)
        if transpose:  # (batch, heads, seqlen, hdim) memory seen as (batch, seqlen, heads, hdim)
            q = torch.empty(q_shape[0], q_shape[2], q_shape[1], q_shape[3], dtype=dtype).transpose(1, 2)
        return fwd_memory_path(config, q, k, k, torch.empty_like(q, memory_format=torch.contiguous_format), False)

    assert path((2, 1024, 4, 128)) == GluonPath.DENSE
    assert path((2, 1024, 4, 128), dtype=torch.float16) == GluonPath.DENSE
    assert path((2, 1024, 4, 128), k_shape=(2, 2048, 4, 128)) != GluonPath.DENSE  # unequal lengths
    assert path((2, 1000, 4, 128)) != GluonPath.DENSE  # not whole blocks
    assert path((2, 1024, 4, 80)) != GluonPath.DENSE  # head dims other than 64, 96, 128, 192 and 256
    assert path((2, 1024, 4, 96)) == path((2, 1024, 4, 192)) == GluonPath.DENSE
    assert path((2, 1024, 4, 256)) != GluonPath.DENSE  # this config's 128-key blocks: 1 K block would fit
    assert path((2, 1024, 4, 128), dtype=torch.float32) != GluonPath.DENSE
    assert path((2, 1024, 4, 128), transpose=True) != GluonPath.DENSE  # heads not side by side
    assert path((2, 512, 4, 128)) != GluonPath.DENSE  # below hopper_gluon_min_keys
    # broadcast K and V (stride 0 between rows): not one descriptor row per key
    q = torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16)
    kv = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16).expand(2, 1024, 4, 128)
    assert fwd_memory_path(config, q, kv, kv, torch.empty_like(q), False) != GluonPath.DENSE
    # more batch x heads than the grid's y dimension takes
    wide = torch.empty(1, 1024, 65536, 128, dtype=torch.bfloat16, device="meta")
    assert fwd_memory_path(config, wide, wide, wide, wide, False) != GluonPath.DENSE
    # mixed dtypes
    k16 = torch.empty(2, 1024, 4, 128, dtype=torch.float16)
    assert fwd_memory_path(config, q, k16, k16, torch.empty_like(q), False) != GluonPath.DENSE
    # views whose rows are longer than heads x head dim: q, k, v of a packed qkv, padded rows
    qkv = torch.empty(2, 1024, 3, 4, 128, dtype=torch.bfloat16)
    out = torch.empty(2, 1024, 4, 128, dtype=torch.bfloat16)
    assert fwd_memory_path(config, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, False) == GluonPath.DENSE
    padded = torch.empty(2, 1024, 4 * 128 + 64, dtype=torch.bfloat16)[..., :512].unflatten(-1, (4, 128))
    assert fwd_memory_path(config, padded, padded, padded, out, False) == GluonPath.DENSE


def test_hopper_gluon_varlen_forward_scope():
    """Packed sequences take the Gluon varlen forward with nothing but causal beside them, from
    hopper_gluon_min_keys keys in the longest sequence, head dim 64, 96, 128, 192 or 256 (in key
    blocks that fit), fp16/bf16, heads side by side in each row; anything else keeps the Triton
    kernel. The varlen backward's scope (mode "backward") has the dK/dV kernel's head dims."""
    from kernels.checks import Features

    config = HOPPER_FWD_CONFIGS[(128, True)]
    cu = torch.tensor([0, 700, 1500, 3000], dtype=torch.int32)

    def path(max_k=1500, heads=8, kv_heads=2, headdim=128, dtype=torch.bfloat16, config=config, **feature):
        q = torch.empty(3000, heads, headdim, dtype=dtype)
        k = torch.empty(3000, kv_heads, headdim, dtype=dtype)
        features = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=max_k, **feature)
        return fwd_memory_path(config, q, k, k, torch.empty_like(q), True, features)

    assert path() == GluonPath.DENSE
    assert path(dtype=torch.float16, kv_heads=1) == GluonPath.DENSE
    assert path(headdim=64, max_k=999, config=HOPPER_FWD_CONFIGS[(64, True)]) != GluonPath.DENSE  # below 1000 keys
    assert path(headdim=64, max_k=1000, config=HOPPER_FWD_CONFIGS[(64, True)]) == GluonPath.DENSE
    assert path(max_k=512) != GluonPath.DENSE  # below hopper_gluon_min_keys
    assert path(headdim=80) != GluonPath.DENSE and path(dtype=torch.float32) != GluonPath.DENSE
    assert path(headdim=96) == path(headdim=192) == GluonPath.DENSE  # two head-dim sections
    wide = HOPPER_FWD_CONFIGS[(256, True)]
    assert path(headdim=256, config=wide) == GluonPath.DENSE
    assert path(headdim=256, config=dataclasses.replace(wide, hopper_gluon_block_n=128)) != GluonPath.DENSE
    q, k = torch.empty(3000, 8, 192, dtype=torch.bfloat16), torch.empty(3000, 2, 192, dtype=torch.bfloat16)
    features = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
    assert dispatch.hopper_gluon_varlen_refusal(config, q, k, k, q, features, "backward") == (
        "head dim 192: the Gluon varlen backward kernels take head dims 64, 96 and 128")
    q, k = torch.empty(3000, 8, 96, dtype=torch.bfloat16), torch.empty(3000, 2, 96, dtype=torch.bfloat16)
    assert not dispatch.hopper_gluon_varlen_refusal(config, q, k, k, q, features, "backward")
    assert path(kv_heads=3) != GluonPath.DENSE  # 3 does not divide 8
    assert path(window_left=256) != GluonPath.DENSE and path(softcap=1.0) != GluonPath.DENSE
    assert path(alibi_slopes=torch.ones(8)) != GluonPath.DENSE
    assert path(dropout_p=0.1, rng_seed=torch.zeros(2, dtype=torch.int64)) != GluonPath.DENSE
    assert path(config=dataclasses.replace(config, hopper_gluon_min_keys=0)) != GluonPath.DENSE
    # a packed qkv's q, k and v (rows of 3 x heads x head dim): still one 2D view each
    qkv = torch.empty(3000, 3, 8, 128, dtype=torch.bfloat16)
    features = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
    assert fwd_memory_path(config, qkv[:, 0], qkv[:, 1], qkv[:, 2], torch.empty(3000, 8, 128, dtype=torch.bfloat16),
                           True, features) == GluonPath.DENSE
    # heads not side by side in a row (a transposed view)
    q = torch.empty(8, 3000, 128, dtype=torch.bfloat16).transpose(0, 1)
    assert fwd_memory_path(config, q, q, q, torch.empty(3000, 8, 128, dtype=torch.bfloat16), True,
                           features) != GluonPath.DENSE


def test_dense_calls_off_the_grid_take_the_gluon_varlen_kernels():
    """A dense call the dense Gluon kernels do not take (a length off the 128-row grid, fewer or
    more queries than keys) goes to the Gluon varlen kernels with each batch row a packed sequence
    ('gluon-ws-packed') where their rules hold for the packed views: forward at head dims 64, 96,
    128, 192 and 256, backward at 64, 96 and 128 with dQ fused (not deterministic); features, other
    head dims and short keys keep the Triton kernels."""
    from kernels.checks import Features
    from kernels.dispatch import GluonPath, packed_features, packed_view

    def fwd(q_shape, k_shape=None, kv_heads=None, causal=True, features=None, dtype=torch.bfloat16):
        q = torch.empty(*q_shape, dtype=dtype)
        k_shape = list(k_shape or q_shape)
        k_shape[2] = kv_heads or k_shape[2]
        k = torch.empty(*k_shape, dtype=dtype)
        config = HOPPER_FWD_CONFIGS[(q_shape[3] if q_shape[3] in (64, 128) else 128, causal)]
        return fwd_memory_path(config, q, k, k, torch.empty_like(q), causal, features or dispatch.DENSE)

    assert fwd((2, 3000, 4, 128)) == GluonPath.PACKED  # off the grid
    assert fwd((2, 2048, 4, 128), (2, 8192, 4, 128)) == GluonPath.PACKED  # 2k queries on 8k keys
    assert fwd((2, 8192, 4, 128), (2, 2048, 4, 128), causal=False) == GluonPath.PACKED
    assert fwd((2, 3000, 8, 128), kv_heads=2) == GluonPath.PACKED  # GQA
    assert fwd((1, 4500, 4, 64)) == GluonPath.PACKED
    assert fwd((2, 2048, 4, 128)) == GluonPath.DENSE  # on the grid: the dense kernel
    assert fwd((2, 1000, 4, 128)) not in (GluonPath.DENSE, GluonPath.PACKED)  # below 1024 keys
    assert fwd((2, 999, 4, 64)) not in (GluonPath.DENSE, GluonPath.PACKED)  # below 1000 keys at d64 causal
    assert fwd((2, 3000, 4, 64)) == GluonPath.PACKED
    assert fwd((2, 3000, 4, 80)) not in (GluonPath.DENSE, GluonPath.PACKED)
    assert fwd((2, 3000, 4, 96)) == GluonPath.PACKED
    assert fwd((2, 3000, 4, 128), dtype=torch.float32) not in (GluonPath.DENSE, GluonPath.PACKED)
    window = Features(window_left=256)
    assert fwd((2, 3000, 4, 128), features=window) != GluonPath.PACKED
    # batches not back to back: no packed view
    spread = torch.empty(2, 3000 * 2, 4, 128, dtype=torch.bfloat16)[:, :3000]
    assert packed_view(spread) is None
    config = HOPPER_FWD_CONFIGS[(128, True)]
    assert fwd_memory_path(config, spread, spread, spread, torch.empty_like(spread), True) != GluonPath.PACKED
    # a packed qkv's q: a strided view of its rows
    qkv = torch.empty(2, 3000, 3, 4, 128, dtype=torch.bfloat16)
    view = packed_view(qkv[:, :, 1])
    assert view.shape == (6000, 4, 128) and view.data_ptr() == qkv[:, :, 1].data_ptr()
    assert torch.equal(view[3001], qkv[1, 1, 1])
    # the sequences: each batch row, queries and keys of their own lengths
    packed = packed_features(torch.empty(3, 100, 1, 64), torch.empty(3, 250, 1, 64))
    assert packed.cu_seqlens_q.tolist() == [0, 100, 200, 300] and packed.cu_seqlens_k.tolist() == [0, 250, 500, 750]
    assert (packed.max_seqlen_q, packed.max_seqlen_k) == (100, 250)

    def bwd(shape, deterministic=False):
        q = torch.empty(*shape, dtype=torch.bfloat16)
        config = configs.hopper_bwd_config(shape[3])
        return bwd_dkdv_path(config, q, q, q, q, deterministic=deterministic)

    assert bwd((2, 3000, 4, 128)) == GluonPath.PACKED
    assert bwd((2, 3000, 4, 128), deterministic=True) == "triton"
    assert bwd((1, 4500, 4, 64)) == GluonPath.PACKED  # dQ in turns at head dim 64
    assert bwd((2, 3000, 4, 96)) == GluonPath.PACKED  # two head-dim sections, dQ in turns
    assert bwd((1, 4500, 4, 192)) == "triton"  # the varlen dK/dV kernel takes head dims 64, 96 and 128 only
    assert bwd((16, 1000, 4, 64)) == GluonPath.PACKED  # from 512 keys at head dim 64
    assert bwd((16, 500, 4, 64)) == "triton"  # fewer keys than the table's hopper_gluon_min_keys
    assert bwd((2, 2048, 4, 128)) == GluonPath.DENSE


def test_the_gluon_paths_name_their_reason_when_they_refuse(monkeypatch):
    """fwd_gluon_path and bwd_gluon_path give the path or the reason, the one the coverage suite's
    kernel_reason shows: the table's key threshold, a head dim, a feature off the grid (the varlen
    kernels have no features), the packed rows' own reason where only the lengths keep the dense
    kernel off, and the import failure itself where the Gluon kernels did not import."""
    from kernels.checks import Features

    def tensors(seqlen_q, headdim=128, seqlen_k=None, heads=4):
        q = torch.empty(2, seqlen_q, heads, headdim, dtype=torch.bfloat16)
        return q, torch.empty(2, seqlen_k or seqlen_q, heads, headdim, dtype=torch.bfloat16)

    fwd, bwd = HOPPER_FWD_CONFIGS[(128, True)], HOPPER_BWD_CONFIGS[128]
    q, k = tensors(2048)
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True) == (GluonPath.DENSE, "")
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q) == (GluonPath.DENSE, "")
    q, k = tensors(512)
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True) == (
        "", "512 keys: fewer than the forward config's hopper_gluon_min_keys 1024")
    q, k = tensors(2048, headdim=96)
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q) == (GluonPath.DENSE, "")
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True) == (GluonPath.DENSE, "")
    q, k = tensors(2048, headdim=80)
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q)[1] == (
        "head dim 80: the Gluon backward kernels take head dims 64, 96, 128, 192 and 256")
    # head dims 192 and 256: the kernel for wide heads, dense or GQA, dQ fused; no window, softcap or ALiBi
    wide = HOPPER_BWD_CONFIGS[256]
    for headdim in (192, 256):
        q, k = tensors(2048, headdim=headdim)
        assert dispatch.bwd_gluon_path(wide, q, k, k, q) == (GluonPath.DENSE, "")
        assert dispatch.bwd_gluon_path(wide, q, k[:, :, :2], k[:, :, :2], q) == (GluonPath.DENSE, "")
        assert dispatch.bwd_gluon_path(wide, q, k, k, q, Features(softcap=1.0))[1] == (
            f"head dim {headdim}: its Gluon backward takes no window, softcap, ALiBi or dropout")
        assert dispatch.bwd_gluon_path(wide, q, k, k, q, deterministic=True)[1] == (
            f"head dim {headdim}: its Gluon backward always fuses dQ (not with deterministic=True or a config "
            "without hopper_gluon_fused_dq)")
        q, k = tensors(3000, headdim=headdim)  # off the grid: the varlen kernel has no head dim 192 or 256
        assert dispatch.bwd_gluon_path(wide, q, k, k, q)[1] == (
            f"head dim {headdim}: the Gluon varlen backward kernels take head dims 64, 96 and 128")
    q, k = tensors(2048, headdim=80)
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True)[1] == (
        "head dim 80: the Gluon forward kernels take head dims 64, 96, 128, 192 and 256")
    q, k = tensors(2048, headdim=256)
    assert dispatch.fwd_gluon_path(HOPPER_FWD_CONFIGS[(256, True)], q, k, k, q, True) == (GluonPath.DENSE, "")
    window = Features(window_left=256, window_right=-1)
    q, k = tensors(3000)
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True, window) == ("", dispatch.OFF_GRID_FEATURES)
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q, window) == ("", dispatch.OFF_GRID_FEATURES)
    # a feature off the grid below the key threshold: the threshold, not the features
    q, k = tensors(1000)
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True, window)[1].startswith("1000 keys: fewer than")
    assert dispatch.fwd_gluon_path(fwd, q, k, k, q, True) == (
        "", "1000 keys: fewer than the forward config's hopper_gluon_min_keys 1024")
    # off the grid and dense: the packed rows' path, or their reason
    q, k = tensors(3000)
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q) == (dispatch.GluonPath.PACKED, "")
    assert dispatch.bwd_gluon_path(bwd, q, k, k, q, deterministic=True) == (
        "", "deterministic: the dQ reduce-adds' order varies between runs")
    # the Gluon kernels did not import: that reason, whatever the call
    monkeypatch.setattr(dispatch, "flash_attn_hopper", None)
    monkeypatch.setattr(dispatch, "gluon_unavailable", "the Gluon kernels do not import here")
    q, k = tensors(2048, heads=8)
    kv = torch.empty(2, 2048, 2, 128, dtype=torch.bfloat16)
    for path in (dispatch.fwd_gluon_path(fwd, q, kv, kv, q, True, window), dispatch.bwd_gluon_path(bwd, q, kv, kv, q),
                 dispatch.bwd_gluon_path(bwd, q, kv, kv, q, window)):
        assert path == ("", "the Gluon kernels do not import here")
    assert dispatch.fwd_memory_path(fwd, q, kv, kv, q, True) in dispatch.FWD_MEMORY_PATHS
    assert dispatch.bwd_dkdv_path(bwd, q, kv, kv, q) == "triton"


def test_hopper_gluon_varlen_backward_scope():
    """The varlen backward takes the Gluon dK/dV kernel with dQ fused in the forward's scope at
    head dims 64, 96 and 128, unless asked to be deterministic."""
    from kernels.checks import Features

    cu = torch.tensor([0, 700, 1500, 3000], dtype=torch.int32)
    features = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)

    def applies(headdim=128, deterministic=False, config=HOPPER_BWD_CONFIGS[128], features=features):
        q = torch.empty(3000, 8, headdim, dtype=torch.bfloat16)
        k = torch.empty(3000, 2, headdim, dtype=torch.bfloat16)
        return dispatch.hopper_gluon_varlen_bwd_applies(config, q, k, k, torch.empty_like(q), features, deterministic)

    assert applies()
    assert not applies(deterministic=True)
    assert applies(headdim=64, config=HOPPER_BWD_CONFIGS[64])
    assert applies(headdim=96) and not applies(headdim=192)
    assert not applies(config=dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_fused_dq=False))
    assert not applies(features=dataclasses.replace(features, max_seqlen_k=512))  # below 1k keys
    assert not applies(features=dataclasses.replace(features, softcap=1.0))
    # a longest sequence of more key blocks than the grid's second axis takes (flash_attn_hopper.bwd_grid)
    blocks = dispatch.flash_attn_hopper.BWD_MAX_KEY_BLOCKS
    assert not applies(features=dataclasses.replace(features, max_seqlen_k=blocks * 128 + 1))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_head_dim_64_takes_the_gluon_forward_on_192_rows_where_it_was_measured_faster(causal):
    """At head dim 64 the table takes the Gluon forward on 192 query rows from 1024 keys full and
    1000 causal, on a persistent grid below 4096 keys, where causal calls take 128 rows
    (fwd_gluon_rows): the dense kernel where the lengths are whole blocks of the call's rows (192
    full, not causal: its diagonal blocks must be whole key blocks of a query block), else its
    varlen kernel on the batch rows."""
    config = HOPPER_FWD_CONFIGS[(64, causal)]
    assert config.hopper_gluon_block_m == 192 and config.hopper_gluon_persistent_below_keys == 4096
    for seqlen in (512, 1000, 1024, 2048, 3072, 4096, 8192, 16384):
        q = torch.empty(max(1, 16384 // seqlen), seqlen, 1, 64, dtype=torch.bfloat16)
        gluon = fwd_memory_path(config, q, q, q, q, causal)
        assert (gluon in (GluonPath.DENSE, GluonPath.PACKED)) == (seqlen >= (1000 if causal else 1024)), seqlen
        rows = dispatch.fwd_gluon_rows(config, causal=causal, keys=seqlen)
        assert rows == (128 if causal and seqlen < 4096 else 192), seqlen
        if gluon in (GluonPath.DENSE, GluonPath.PACKED):
            dense = seqlen % rows == 0 and not (causal and rows % config.hopper_gluon_block_n)
            assert (gluon == GluonPath.DENSE) == dense, seqlen


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_forward_on_192_query_rows_takes_the_dense_kernel_on_its_grid_and_the_varlen_one_elsewhere(causal):
    """FwdConfig.hopper_gluon_block_m = 192 (three consumer warpgroups): the dense Gluon forward takes
    equal lengths in whole 192-row and 128-key blocks, not causal (whose diagonal blocks must be whole
    key blocks of a query block); other lengths, unequal ones and causal take its varlen kernel on the
    batch rows; with 64-key blocks causal stays dense. A window, softcap or ALiBi keeps 128 rows
    (fwd_gluon_rows), so the dense kernel; a row count the kernels have no warps for is refused,
    naming the field; the plan refuses causal blocks that are not whole key blocks of a query block."""
    from kernels.checks import Features

    config = dataclasses.replace(HOPPER_FWD_CONFIGS[(64, causal)], hopper_gluon_min_keys=1024,
                                 hopper_gluon_block_m=192, hopper_gluon_persistent_below_keys=0)

    def path(seqlen_q, seqlen_k=None, features=dispatch.DENSE, cfg=config):
        q = torch.empty(2, seqlen_q, 4, 64, dtype=torch.bfloat16)
        k = torch.empty(2, seqlen_k or seqlen_q, 4, 64, dtype=torch.bfloat16)
        return dispatch.fwd_gluon_path(cfg, q, k, k, q, causal, features)

    for seqlen in (1152, 3072):  # 6 and 16 blocks of 192 rows, 9 and 24 of 128 keys
        assert path(seqlen) == (GluonPath.PACKED if causal else GluonPath.DENSE, ""), seqlen
    for lengths in ((2048,), (8192,), (3000,), (2048, 4096)):
        assert path(*lengths) == (GluonPath.PACKED, ""), lengths
    narrow = dataclasses.replace(config, hopper_gluon_block_n=64)
    assert path(1152, cfg=narrow) == (GluonPath.DENSE, "")
    window = Features(window_left=256, window_right=-1 if causal else 256)
    assert (dispatch.fwd_gluon_rows(config), dispatch.fwd_gluon_rows(config, window)) == (192, 128)
    assert path(2048, features=window) == (GluonPath.DENSE, "")
    wide = dataclasses.replace(config, hopper_gluon_block_m=256)
    assert "hopper_gluon_block_m must be one of (128, 192), got 256" in path(3072, cfg=wide)[1]
    # three consumers hold O, S and P of head dims 64 in 128-key blocks and 96 and 128 in 64-key
    # blocks; wider tiles spill (at 256 ptxas does not assemble): refused with the reason, not built
    for headdim, block_n, fits in ((96, 64, True), (128, 64, True), (96, 128, False), (128, 128, False),
                                   (192, 64, False), (256, 64, False)):
        tile = dataclasses.replace(config, hopper_gluon_block_n=block_n)
        q = torch.empty(2, 3072, 4, headdim, dtype=torch.bfloat16)
        reason = dispatch.fwd_gluon_path(tile, q, q, q, q, False)[1]
        assert (reason == "") == fits and (fits or f"192 at head dim {headdim} in {block_n}-key" in reason), reason
    q = torch.empty(1, 3072, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must divide the Gluon forward's 192 query rows"):
        dispatch.flash_attn_hopper.forward_hopper_plan(q, q, q, q, True, block_n=128, block_m=192)


def test_dropout_takes_the_triton_forward_and_the_gluon_backward_where_the_config_asks():
    """A dropout call's forward runs on the Triton kernels, dense on the grid, off it and packed, with
    the reason named (the Gluon forwards' dropout was slower, and was removed).
    BwdConfig.hopper_gluon_dropout sends its backward to the dense dK/dV kernel: the table's asks at
    head dims 64 and 128 (and 96, which that entry serves), where it was timed against the Triton
    backward a dropout call takes without it."""
    from kernels.checks import Features

    seed = torch.zeros(2, dtype=torch.int64)
    dropout = Features(dropout_p=0.1, rng_seed=seed)
    table = HOPPER_FWD_CONFIGS[(128, True)]
    q = torch.empty(2, 2048, 4, 128, dtype=torch.bfloat16)
    off_grid = torch.empty(2, 1500, 4, 128, dtype=torch.bfloat16)
    assert dispatch.fwd_gluon_path(table, q, q, q, q, True) == (GluonPath.DENSE, "")
    on_triton = ("", "dropout: on the Triton forward (the Gluon forwards have none)")
    assert dispatch.fwd_gluon_path(table, q, q, q, q, True, dropout) == on_triton
    assert dispatch.fwd_gluon_path(table, off_grid, off_grid, off_grid, off_grid, True, dropout) == on_triton
    cu = torch.tensor([0, 1500, 3000], dtype=torch.int32)
    varlen = Features(dropout_p=0.1, rng_seed=seed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500,
                      max_seqlen_k=1500)
    packed = torch.empty(3000, 4, 128, dtype=torch.bfloat16)
    without = Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1500, max_seqlen_k=1500)
    assert dispatch.fwd_gluon_path(table, packed, packed, packed, packed, True, without) == (GluonPath.DENSE, "")
    assert dispatch.fwd_gluon_path(table, packed, packed, packed, packed, True, varlen) == on_triton
    assert dispatch.hopper_gluon_varlen_refusal(table, packed, packed, packed, packed, varlen, "backward") == (
        "dropout: the Gluon varlen backward kernels have none")
    assert HOPPER_BWD_CONFIGS[64].hopper_gluon_dropout and HOPPER_BWD_CONFIGS[128].hopper_gluon_dropout
    unasked = dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_dropout=False)
    assert bwd_dkdv_path(unasked, q, q, q, q, dropout) == "triton"
    # BwdConfig.hopper_gluon_dropout: the dense dK/dV kernel (dQ fused) on its grid; not off it (the
    # varlen dK/dV kernel has no dropout), nor at head dim 192 (bwd_wide.py's has none)
    asked = HOPPER_BWD_CONFIGS[128]
    assert bwd_dkdv_path(asked, q, q, q, q, dropout) == GluonPath.DENSE
    assert bwd_dkdv_path(asked, off_grid, off_grid, off_grid, off_grid, dropout) == "triton"
    assert dispatch.bwd_gluon_path(asked, off_grid, off_grid, off_grid, off_grid, dropout)[1] == dispatch.OFF_GRID_FEATURES
    assert "dropout" in dispatch.OFF_GRID_FEATURES
    wide = torch.empty(2, 2048, 4, 192, dtype=torch.bfloat16)
    assert "dropout" in dispatch.bwd_gluon_path(dataclasses.replace(HOPPER_BWD_CONFIGS[256], hopper_gluon_dropout=True),
                                                wide, wide, wide, wide, dropout)[1]
    assert not dispatch.hopper_gluon_varlen_bwd_applies(asked, packed, packed, packed, packed, varlen)


@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
def test_hopper_backward_takes_the_gluon_dkdv_kernels_at_head_dims_64_to_256_from_512_or_1k_keys(hdim):
    """The Hopper table's dK/dV kernel at the paper sweep's lengths: the Gluon ones at head dims 64
    and 256 (the kernel for wide heads) from 512 keys, 96 (the head-dim-128 entry's), 128 and 192
    (the kernel for wide heads, its own entry) from 1024 keys, adding dQ themselves, the Triton one
    below that."""
    config = configs.hopper_bwd_config(hdim)
    assert config is HOPPER_BWD_CONFIGS[{96: 128}.get(hdim, hdim)]
    for seqlen in (256, 512, 1024, 2048, 4096, 8192, 16384):
        q = torch.empty(16384 // seqlen, seqlen, max(2048 // hdim, 1), hdim, dtype=torch.bfloat16)
        gluon = seqlen >= (512 if hdim in (64, 256) else 1024)
        assert (bwd_dkdv_path(config, q, q, q, q) == GluonPath.DENSE) == gluon, seqlen
    # the Gluon kernel adds dQ itself (FA3's scheme) unless asked to be deterministic
    assert bwd_gluon_fuses_dq(config, hdim)
    assert not bwd_gluon_fuses_dq(config, hdim, deterministic=True)
    # where a config asks for it, at the head dims the Gluon kernels serve only
    fusing = dataclasses.replace(config, hopper_gluon_fused_dq=True)
    assert bwd_gluon_fuses_dq(fusing, 64) and not bwd_gluon_fuses_dq(fusing, 80)
    assert not bwd_fuses_dq(config, 16384)  # the Triton kernels never fuse in the table


def test_hopper_gluon_dkdv_scope():
    """The Gluon dK/dV kernel has the dense Gluon kernels' scope (hopper_gluon_applies with mode
    "backward": head dims 64, 96 and 128), with dO in the output's place, and off it the varlen kernel's (test_dense_calls_off_the_grid_take_the_gluon_varlen_kernels):
    anything else keeps the Triton kernel."""
    config = HOPPER_BWD_CONFIGS[128]
    q = torch.empty(2, 2048, 4, 128, dtype=torch.bfloat16)
    assert bwd_dkdv_path(config, q, q, q, torch.empty_like(q)) == GluonPath.DENSE
    assert bwd_dkdv_path(config, q[:, :2000], q[:, :2000], q[:, :2000], q[:, :2000]) == "triton"  # ragged
    k = torch.empty(2, 4096, 4, 128, dtype=torch.bfloat16)
    # unequal lengths: the varlen kernel with each batch row a packed sequence
    assert bwd_dkdv_path(config, q, k, k, q) == dispatch.GluonPath.PACKED
    do_t = torch.empty(2, 4, 2048, 128, dtype=torch.bfloat16).transpose(1, 2)  # heads not side by side
    assert bwd_dkdv_path(config, q, q, q, do_t) == "triton"
    q32 = q.float()
    assert bwd_dkdv_path(config, q32, q32, q32, q32) == "triton"
    # more key blocks than the grid's second axis takes (flash_attn_hopper.bwd_grid): the Triton kernel
    from kernels import flash_attn_hopper as hopper

    for blocks, path in ((hopper.BWD_MAX_KEY_BLOCKS, GluonPath.DENSE), (hopper.BWD_MAX_KEY_BLOCKS + 1, "triton")):
        long = torch.empty(1, blocks * hopper.BWD_BLOCK_N, 1, 128, dtype=torch.bfloat16, device="meta")
        assert bwd_dkdv_path(config, long, long, long, long) == path, blocks


@pytest.mark.usefixtures("poisoned_allocations")
def test_a_hopper_bwd_config_elsewhere_takes_the_triton_dkdv_kernel(monkeypatch):
    """A Hopper backward config whose rule picks the Gluon dK/dV kernel (with dQ fused), on another
    device (here the CPU interpreter), runs the Triton dK/dV and dQ kernels instead, with the right
    gradients."""
    dkdv, dq = spy_backward_kernels(monkeypatch)
    config = dataclasses.replace(INTERPRETER_BWD_CONFIG, hopper_gluon_min_keys=128, hopper_gluon_fused_dq=True)
    q = torch.empty(1, 128, 1, 64, dtype=torch.float16)
    assert bwd_dkdv_path(config, q, q, q, q) == GluonPath.DENSE
    check_backward(1, 128, 128, 1, 64, True, torch.float16, "cpu", bwd_config=config)
    assert [launch["FUSED_DQ"] for launch in dkdv.launches] == [0] and len(dq.launches) == 1


@pytest.mark.usefixtures("poisoned_allocations")
def test_a_hopper_config_elsewhere_falls_back_to_the_triton_kernel():
    """A Hopper table entry passed as fwd_config on another device (here the CPU interpreter) does
    not launch the sm_90-only Gluon kernel: the Triton kernel runs, with the right result."""
    config = HOPPER_FWD_CONFIGS[(128, False)]
    q, k, v = make_qkv(1, 1024, 1024, 1, 128, torch.float16, "cpu")
    assert fwd_memory_path(config, q, k, v, torch.empty_like(q), False) == GluonPath.DENSE
    out, lse = flash_attn_forward(q, k, v, 128 ** -0.5, False, config)
    ref, ref_lse = attention_reference(q, k, v, 128 ** -0.5, False)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, 128 ** -0.5, False))
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-4)


# A small Gluon-eligible call for the interpreter: one 128-row block, head dim 64, fp16; configs
# whose rules pick the Gluon kernels from 128 keys.
GLUON_SHAPE = (1, 128, 128, 2, 64)
GLUON_FWD_CONFIG = FwdConfig(32, 32, 4, 1, hopper_gluon_min_keys=128)
GLUON_BWD_CONFIG = dataclasses.replace(INTERPRETER_BWD_CONFIG, hopper_gluon_min_keys=128)


@pytest.fixture
def gluon_that_fails_to_build(monkeypatch):
    """A Triton whose Gluon cannot build the kernels, on a device taken for Hopper: both Gluon
    plans (made at a shape's first call, where the kernel compiles) raise AttributeError (as an
    API that a later Triton removed does) and count their calls. dispatch.gluon_unavailable is
    restored afterwards."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[0].shape)
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute 'thread_barrier'")

    if dispatch.gluon_unavailable:
        pytest.skip(f"nothing to fall back from: {dispatch.gluon_unavailable}")
    monkeypatch.setattr(dispatch, "gluon_unavailable", dispatch.gluon_unavailable)
    monkeypatch.setattr(dispatch.flash_attn_hopper, "forward_hopper_plan", failing)
    monkeypatch.setattr(dispatch.flash_attn_hopper, "backward_dkdv_hopper_plan", failing)
    for module in (forward, backward):  # they import on_hopper by name
        monkeypatch.setattr(module, "on_hopper", lambda device: True)
    return calls


def calls_and_warnings(call, times: int) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            call()
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "Gluon" in str(w.message)]


@pytest.mark.usefixtures("poisoned_allocations")
def test_a_gluon_forward_that_fails_to_build_warns_once_and_routes_to_triton(gluon_that_fails_to_build):
    """The first call that reaches the Gluon forward, on a Triton that cannot build it, warns once
    and runs the Triton kernel (right result); dispatch.gluon_unavailable then says why, and later
    calls go to the Triton kernel without trying the Gluon one again."""
    q, k, v = make_qkv(*GLUON_SHAPE, torch.float16, "cpu")
    out_like = torch.empty_like(q)
    assert fwd_memory_path(GLUON_FWD_CONFIG, q, k, v, out_like, True) == GluonPath.DENSE
    outs = []
    caught = calls_and_warnings(lambda: outs.append(flash_attn_func(q, k, v, causal=True,
                                                                    fwd_config=GLUON_FWD_CONFIG)), times=2)
    assert len(gluon_that_fails_to_build) == 1, "a later call tried the Gluon forward again"
    assert len(caught) == 1 and "thread_barrier" in str(caught[0].message), [str(w.message) for w in caught]
    assert "failed to compile" in dispatch.gluon_unavailable and "thread_barrier" in dispatch.gluon_unavailable
    assert fwd_memory_path(GLUON_FWD_CONFIG, q, k, v, out_like, True) != GluonPath.DENSE
    ref, _ = attention_reference(q, k, v, causal=True)
    for out in outs:
        assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, causal=True))


@pytest.mark.usefixtures("poisoned_allocations")
def test_a_gluon_features_forward_that_fails_to_build_computes_every_row_on_triton(gluon_that_fails_to_build):
    """The features' path (GQA here) on a Gluon forward that fails to build: the Triton kernel's
    grid covers every query row (more than a Gluon program's 128 or 192), not a Gluon block's."""
    q = torch.randn(1, 384, 4, 64, dtype=torch.float16)
    k, v = (torch.randn(1, 384, 2, 64, dtype=torch.float16) for _ in range(2))
    config = dataclasses.replace(GLUON_FWD_CONFIG, hopper_gluon_min_keys=256)
    assert fwd_memory_path(config, q, k, v, torch.empty_like(q), True, dispatch.DENSE) == GluonPath.DENSE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = flash_attn_func(q, k, v, causal=True, fwd_config=config)
    assert len(gluon_that_fails_to_build) == 1  # the Gluon forward was tried, and failed
    ref, _ = attention_reference(q, k, v, causal=True)
    assert_close_to_reference("out", out, ref, attention_same_dtype(q, k, v, causal=True))


@pytest.mark.usefixtures("poisoned_allocations")
def test_a_gluon_dkdv_kernel_that_fails_to_build_warns_once_and_routes_to_triton(gluon_that_fails_to_build,
                                                                                monkeypatch):
    """The same for the backward's Gluon dK/dV kernel: one warning, the Triton dK/dV and dQ
    kernels give the gradients, and the next backward does not try the Gluon kernel."""
    q = torch.empty(GLUON_SHAPE[0], GLUON_SHAPE[1], GLUON_SHAPE[3], GLUON_SHAPE[4], dtype=torch.float16)
    assert bwd_dkdv_path(GLUON_BWD_CONFIG, q, q, q, q) == GluonPath.DENSE
    dkdv, dq = spy_backward_kernels(monkeypatch)
    caught = calls_and_warnings(lambda: check_backward(*GLUON_SHAPE, True, torch.float16, "cpu",
                                                       bwd_config=GLUON_BWD_CONFIG), times=2)
    assert len(gluon_that_fails_to_build) == 1, "a later call tried the Gluon dK/dV kernel again"
    assert len(caught) == 1 and "thread_barrier" in str(caught[0].message), [str(w.message) for w in caught]
    assert "failed to compile" in dispatch.gluon_unavailable
    assert len(dkdv.launches) == 2 and len(dq.launches) == 2
    assert bwd_dkdv_path(GLUON_BWD_CONFIG, q, q, q, q) == "triton"


def test_gluon_kernels_that_do_not_import_leave_every_call_to_triton(monkeypatch):
    """On a Triton whose Gluon API the module cannot import (dispatch.flash_attn_hopper is None),
    the Hopper table's rules send every forward and backward to the Triton kernels."""
    monkeypatch.setattr(dispatch, "flash_attn_hopper", None)
    monkeypatch.setattr(dispatch, "gluon_unavailable", "the Gluon kernels do not import on this Triton")
    fwd_config, bwd_config = HOPPER_FWD_CONFIGS[(128, False)], HOPPER_BWD_CONFIGS[128]
    q = torch.empty(2, 2048, 4, 128, dtype=torch.bfloat16)  # in both Gluon kernels' scope
    triton_only = dataclasses.replace(fwd_config, hopper_gluon_min_keys=0)
    assert fwd_memory_path(fwd_config, q, q, q, q, False) == fwd_memory_path(triton_only, q, q, q, q, False)
    assert bwd_dkdv_path(bwd_config, q, q, q, q) == "triton"


def test_device_capability_is_asked_once_per_device(monkeypatch):
    """The config lookup asks torch for the device's capability once (it costs ~7 us a call)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: calls.append(index) or (9, 0))
    configs._is_hopper.cache_clear()
    try:
        for _ in range(3):
            assert configs.default_bwd_config(256, torch.device("cuda", 0)) is HOPPER_BWD_CONFIGS[256]
            assert configs.default_fwd_config(128, True, torch.device("cuda", 0)) is HOPPER_FWD_CONFIGS[(128, True)]
        assert calls == [0]
    finally:
        configs._is_hopper.cache_clear()


def test_hopper_gluon_kernels_compile_for_sm90():
    """Gluon has no CPU interpreter: compile the forward and the dK/dV kernel (with and without dQ
    fused) for sm_90 (Triton's bundled ptxas, in a process without TRITON_INTERPRET) and check
    what makes them fast is there: warp specialisation, TMA loads (and the fused dQ's TMA
    reduce-adds) and a wgmma left in flight (wait_group 1), no wgmma serialised for want of
    registers, within sm_90's shared memory. The GPU tests run them against the float64
    reference."""
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    report = subprocess.run([sys.executable, str(root / "tools" / "compile_check_sm90.py"), "--hopper-gluon"],
                            capture_output=True, text=True, env=env, check=True).stdout
    forward_lines = [line for line in report.splitlines() if line.startswith("_flash_fwd_hopper_kernel ")]
    backward_lines = [line for line in report.splitlines() if line.startswith("_flash_bwd_dkdv_hopper_kernel ")]
    wide_lines = [line for line in report.splitlines() if line.startswith("_flash_bwd_dkdv_hopper_wide_kernel ")]
    # the kernel for wide heads (bwd_wide.py), causal or not, dQ fused, within 227 KiB, the table's dQ
    # matmuls first (BwdConfig.hopper_gluon_dq_first None), waited for with dV's and dK's in flight:
    # at 192 without spills, dQ staged for the writer warp's TMA reduce-adds; at 256 dQ added from
    # registers, each warpgroup its own section's columns (ptxas spills a few words there, at most 36
    # bytes); then 192 with dQ after dV and dK (False)
    assert len(wide_lines) == 6, report
    d192, d256 = wide_lines[:2] + wide_lines[4:], wide_lines[2:4]
    assert all("tma-reduce" in line and "spill stores 0 B" in line for line in d192), report
    assert all("dq atomic, dq by section" in line and "tma-reduce" not in line for line in d256), report
    assert all(int(re.search(r"spill stores (\d+) B", line).group(1)) <= 36 for line in d256), report
    assert ["dQ first" in line for line in wide_lines] == [True] * 4 + [False] * 2, report
    assert all(re.search(r"wait_group values 0 2( |$)", line) for line in wide_lines[:4]), report
    # the forward at head dims 64 (the table's 192 query rows; causal takes them in the varlen
    # kernel, so the dense causal one is built on 128), 96, 128, 192 and 256 (96 and 192 in two
    # head-dim sections, 192 and 256 in 64-key blocks), the backward at 64, 96 and 128 (96 in two
    # sections), causal or not; the backward also with dQ fused at each (at 64 and 96 the consumers
    # take turns); then each of the window, softcap and ALiBi, causal or not, forward and backward
    # (dQ fused); causal in launch groups of 4 rows at 128 and 256; with a second Q buffer (a
    # persistent grid's) at 64 and 96, causal or not; one at 128 without the softmax pinned
    # (hopper_gluon_pin_softmax off); then two with the consumers in no fixed order
    # (hopper_gluon_pingpong off)
    assert len(forward_lines) == 10 + 6 + 2 + 4 + 4 + 1 + 2 and len(backward_lines) == 12 + 6 + 6, report
    assert sum(" group shift" in line for line in forward_lines) == 2, report
    assert sum(" q buffers 2" in line for line in forward_lines) == 4, report
    fused = [line for line in backward_lines if "fused dQ" in line]
    assert len(fused) == 6 + 6 + 6 and all("tma-reduce" in line for line in fused), report
    # a warp of its own issues the fused dQ's reduce-adds (bwd._bwd_dq_writer, and the wide
    # kernel's _wide_dq_writer_partition); the dK/dV-only kernels have none
    assert all(("dq-writer" in line) == ("fused dQ" in line) for line in backward_lines), report
    assert all(("dq-writer" in line) == ("dq atomic" not in line) for line in wide_lines), report
    # the backward with dropout (BwdConfig.hopper_gluon_dropout) at head dims 128, 96 and 64: the keep-mask
    # held from P^T to dS^T beside the step's tiles spills (up to 3 KB a thread at 128, a few hundred
    # bytes at 64), which its timing weighs
    dropout_spills = {line.split()[1]: max(int(n) for n in re.findall(r"spill stores (\d+) B", line))
                      for line in backward_lines if " dropout " in line and "causal=True" in line}
    assert sum(" dropout " in line for line in backward_lines) == 6, report
    assert dropout_spills["d64"] <= 512 and dropout_spills["d128"] <= 3072, report
    for flag in ("window", "softcap", "alibi"):
        assert sum(line.endswith(flag) or f" {flag} " in line for line in forward_lines + backward_lines) == 4, flag
    varlen_lines = [line for line in report.splitlines() if line.startswith("_flash_fwd_hopper_varlen_kernel ")]

    def spills(line):
        return int(re.search(r"spill stores (\d+) B", line).group(1))

    def loop_spills(line):  # each consumer loop's spills and fills a step (compile_check_sm90.loop_spills)
        counts = re.search(r"loop spills ([\d ]+|-)$", line).group(1)
        return [] if counts == "-" else [int(n) for n in counts.split()]

    # every Gluon forward's key loops run without local-memory traffic (causal ALiBi's: a word a
    # step); so do the dense dK/dV kernels' step loops without a mask (non-causal, no feature)
    assert all(loop_spills(line) for line in forward_lines + varlen_lines + backward_lines), report
    for line in forward_lines + varlen_lines:
        assert max(loop_spills(line)) <= (1 if " alibi " in line and "causal=True" in line else 0), line
    # on two consumers the key blocks every row sees whole run in a loop without mask code, the masked
    # ones in a loop of their own (fwd._fwd_blocks): two loops a consumer in the varlen kernel and in the
    # dense causal one on 64-key blocks (on 128-key blocks ptxas may make the one diagonal block no loop); three
    # consumers keep one loop
    for line in varlen_lines + [line for line in forward_lines if "causal=True" in line and "x64 x" in line]:
        assert len(loop_spills(line)) == (3 if " 192x" in line else 4), line
    for line in backward_lines:
        if "causal=False" in line and not any(f" {flag}" in line for flag in ("window", "softcap", "alibi", "dropout")):
            assert max(loop_spills(line)) == 0, line
    # v6: the causal flag at compile time left the non-causal head-dim-128 forward without spills
    assert "spill stores 0 B" in next(line for line in forward_lines if "d128 causal=False" in line), report
    # at 256 a few words of a tile's state may live in local memory (stored once, loaded once a tile)
    assert all(spills(line) <= 16 and "128x64 x 3/2" in line for line in forward_lines if "d256" in line), report
    # head dim 192 with Q in registers (FwdConfig.hopper_gluon_q_in_registers, the table's there only):
    # a few bytes of spills, no serialised wgmma
    for line in forward_lines + varlen_lines:
        assert (" q in regs " in line) == (line.split()[1] == "d192"), line
        if line.split()[1] == "d192":
            assert "128x64 x 3/3" in line and spills(line) <= 64 and "serialised" not in line, line
    assert all("spill stores 0 B" in line and "128x128 x 3/3" in line for line in forward_lines
               if "d96" in line and "192x" not in line)
    # head dims 64, 96, 128, 192 and 256, causal or not (64 on 192 rows); causal in launch groups of 4
    # rows at 128, spilling at most a word more than the same build in the grid's order (its tile
    # loop's state, stored and loaded once a tile); then two Q buffers at 64 and 96; then 192 rows at
    # 96 and 128
    assert len(varlen_lines) == 10 + 1 + 4 + 4, report
    grouped = [line for line in varlen_lines if " group shift" in line]

    in_grid_order = next(line for line in varlen_lines if " d128 causal=True " in line and " 128x128 " in line)
    assert len(grouped) == 1 and spills(grouped[0]) <= spills(in_grid_order) + 4, report
    # three consumer warpgroups at 160 registers a thread (FwdConfig.hopper_gluon_block_m = 192): at head
    # dim 64 in 128-key blocks (the table's; causal: the varlen kernel only), at 96 and 128 in 64-key
    # blocks, without spills or serialised wgmma (at 64 also with two Q buffers)
    three = [line for line in forward_lines + varlen_lines if " 192x" in line]
    assert len(three) == 15 and sum(" d64 " in line for line in three) == 7, report
    assert sum(" d128 " in line for line in three) == 4 and not any("serialised" in line for line in three), report
    # the consumers' matmuls in turns (FwdConfig.hopper_gluon_pingpong, the table's) at head dims 64, 96
    # and 128, two or three consumers, not at 192 and 256; off in the last two forwards built
    assert all((" pingpong " in line) == (line.split()[1] in ("d64", "d96", "d128"))
               for line in forward_lines[:-2] + varlen_lines), report
    assert not any(" pingpong " in line for line in forward_lines[-2:]), report
    # the softmax pinned under P V (FwdConfig.hopper_gluon_pin_softmax, the table's) at head dims 96 and
    # 128: all of a block's exp2 (a thread's half of its 64 rows' scores, and more) between the wait for
    # S and the wait for P V; unpinned, ptxas moves the second above them (none there at 128)
    def exp2_under_pv(line):
        return int(re.search(r"exp2 under P V (\d+)", line).group(1))

    unpinned = [line for line in forward_lines + varlen_lines
                if line.split()[1] in ("d96", "d128") and " pin softmax " not in line]
    assert len(unpinned) == 1 and " d128 causal=False " in unpinned[0] and exp2_under_pv(unpinned[0]) == 0, report
    for line in forward_lines + varlen_lines:
        assert (" pin softmax " in line) == (line.split()[1] in ("d96", "d128") and line not in unpinned), line
        if " pin softmax " in line:
            assert exp2_under_pv(line) >= int(re.search(r" \d+x(\d+) x ", line).group(1)) // 2, line
    # (at 128, not a table's tile, ptxas keeps some of the tile loop's state in local memory)
    assert all(spills(line) <= (128 if " d128 " in line else 0) for line in three), report
    varlen_bwd = [line for line in report.splitlines() if line.startswith("_flash_bwd_dkdv_hopper_varlen_kernel ")]
    # d64, d96 and d128, dQ fused, causal or not: the longest grid, then the packed grid
    assert len(varlen_bwd) == 12 and all("tma-reduce" in line and "dq-writer" in line for line in varlen_bwd), report
    assert sum("packed grid" in line for line in varlen_bwd) == 6, report
    varlen_lines += varlen_bwd
    # each warpgroup waits for all its matmuls at once (dQ first: dQ's, then dV's and dK's): the two
    # warpgroups overlap each other
    for line in wide_lines:
        assert "warp-specialised yes" in line and "tma yes" in line and "serialised" not in line, line
        assert int(re.search(r"smem (\d+) B", line).group(1)) <= 232448, line
    for line in forward_lines + backward_lines + varlen_lines:
        assert "warp-specialised yes" in line and "tma yes" in line and "serialised" not in line, line
        # some wait leaves a matmul in flight (the next one's, or the tail section's)
        assert set(re.search(r"wait_group values ([\d ]+)", line).group(1).split()) - {"0"}, line
        assert int(re.search(r"smem (\d+) B", line).group(1)) <= 232448, line  # sm_90's per-block limit


def test_the_fused_dq_goes_before_dk_only_where_it_measured_faster():
    """flash_attn_hopper.dq_first, the Gluon backward's schedule rule (docs/performance.md, "The
    Gluon backward's schedule"), the table's hopper_gluon_dq_first None: with GQA/MQA, a window or
    ALiBi; not for dense MHA or softcap alone; a config's True or False forces it either way, but
    at head dim 64. At head dims 192 and 256 (bwd_wide.py) None puts it first too, with GQA or not;
    only a config's False keeps dQ after dV and dK there."""
    from kernels import flash_attn_hopper as hopper

    def flags(**on):
        return {name: on.get(name, False) for name in hopper.GLUON_FEATURE_FLAGS}

    table = HOPPER_BWD_CONFIGS[128]
    assert table.hopper_gluon_dq_first is None
    assert not hopper.dq_first(table, 1, flags())
    assert not hopper.dq_first(table, 1, flags(SOFTCAP=True))
    assert hopper.dq_first(table, 4, flags())
    assert hopper.dq_first(table, 1, flags(WINDOW=True)) and hopper.dq_first(table, 1, flags(ALIBI=True))
    # head dim 64: never, the consumers' turns put dQ after dK (bwd._dq_in_turns), even where a config asks
    forced = dataclasses.replace(table, hopper_gluon_dq_first=True)
    assert hopper.dq_first(forced, 4, flags(WINDOW=True), 128) and not hopper.dq_first(forced, 4, flags(), 64)
    assert hopper.dq_first(dataclasses.replace(table, hopper_gluon_dq_first=True), 1, flags())
    assert not hopper.dq_first(dataclasses.replace(table, hopper_gluon_dq_first=False), 4, flags(WINDOW=True))
    for headdim in (192, 256):
        wide = HOPPER_BWD_CONFIGS[headdim]
        assert wide.hopper_gluon_dq_first is None and hopper.dq_first(wide, 4, flags(), headdim)
        assert hopper.dq_first(wide, 1, flags(), headdim)
        assert not hopper.dq_first(dataclasses.replace(wide, hopper_gluon_dq_first=False), 4, flags(), headdim)


def test_the_wide_backward_adds_dq_from_registers_and_by_section_at_256_only():
    """flash_attn_hopper.wide_bwd_constexprs: at 192 (128 + 64) dQ's three staging tiles fit shared
    memory beside the rest and the dP warpgroup computes all of dQ; at 256 (128 + 128) the four do
    not, so each warpgroup adds its tiles from registers, and each computes its own section's
    columns (10 and 10 of a step's 20 matmul units)."""
    from kernels import flash_attn_hopper as hopper

    assert hopper.wide_bwd_sections(192) == (128, 64) and hopper.wide_bwd_sections(256) == (128, 128)
    assert hopper.wide_bwd_constexprs(192) == {"DQ_ATOMIC": False, "DQ_BY_SECTION": False}
    assert hopper.wide_bwd_constexprs(256) == {"DQ_ATOMIC": True, "DQ_BY_SECTION": True}


def test_the_backward_grid_takes_sections_of_pairs_that_divide_them(monkeypatch):
    """flash_attn_hopper.bwd_grid, the Gluon dK/dV kernels' launch order: (pairs in a section, key
    blocks, sections), the section the largest divisor of the pairs at most the config's
    hopper_gluon_head_section (calls without the causal mask; the tables' 1) or
    hopper_gluon_causal_head_section (causal; the tables' "l2" at head dims 64 to 128); "l2" as many
    pairs as keep their Q, dO and float32 dQ accumulator within the L2 cache; a bad setting is
    refused by name."""
    from kernels import flash_attn_hopper as hopper

    cpu = torch.device("cpu", 0)
    assert hopper.bwd_grid(16, 32, 1, 8192, 128, 2, cpu, section=1) == (1, 16, 32)  # each pair in turn
    assert hopper.bwd_grid(16, 32, 1, 8192, 128, 2, cpu, section=8) == (8, 16, 4)
    assert hopper.bwd_grid(16, 24, 1, 8192, 128, 2, cpu, section=16) == (12, 16, 2)  # 16 does not divide 24
    assert hopper.bwd_grid(16, 7, 1, 8192, 128, 2, cpu, section=64) == (7, 16, 1)
    monkeypatch.setattr(hopper, "l2_cache_bytes", lambda index: 50 << 20)
    # a pair at 8k rows, head dim 128, bf16: Q and dO 4 MiB, the dQ accumulator 4 MiB -> 6 in 50 MiB
    assert hopper.bwd_grid(64, 32, 1, 8192, 128, 2, cpu, section="l2") == (4, 64, 8)
    assert hopper.bwd_grid(64, 36, 1, 8192, 128, 2, cpu, section="l2") == (6, 64, 6)
    assert hopper.bwd_grid(64, 16, 4, 8192, 128, 2, cpu, section="l2") == (1, 64, 16)  # 32 MiB a GQA pair
    # the tables: each pair's key blocks next to each other without the causal mask; causal, L2-sized
    # sections at head dims 64 to 128, each pair in turn at 192 (the 256 entry's)
    assert all(config.hopper_gluon_head_section == 1 for config in HOPPER_BWD_CONFIGS.values())
    assert HOPPER_BWD_CONFIGS[128].hopper_gluon_causal_head_section == "l2"
    assert HOPPER_BWD_CONFIGS[256].hopper_gluon_causal_head_section == 1
    for bad in (0, "all", 1.5):
        with pytest.raises(ValueError, match="hopper_gluon_head_section"):
            hopper.bwd_grid(8, 6, 1, 1024, 128, 2, cpu, section=bad)
    for blocks, pairs in ((hopper.BWD_MAX_KEY_BLOCKS + 1, 6), (0, 6), (8, 0)):
        with pytest.raises(ValueError, match="key blocks"):
            hopper.bwd_grid(blocks, pairs, 1, 1024, 128, 2, cpu, section="l2")


def test_the_causal_forward_starts_groups_of_rows_longest_first_sized_as_asked(monkeypatch):
    """flash_attn_hopper.fwd_group_shift, the Gluon forward's causal launch order (fwd_tiles._fwd_program's
    GROUP_SHIFT): log2 of the largest power of two that divides the (batch x head) rows, is at most
    the config's hopper_gluon_head_section (1: the grid's own order; the tables' 8) and keeps that
    many rows' K and V within the L2 cache ("l2": that bound alone, FA4's forward rule); a bad
    setting is refused by name."""
    from kernels import flash_attn_hopper as hopper

    cpu = torch.device("cpu", 0)
    monkeypatch.setattr(hopper, "l2_cache_bytes", lambda index: 50 << 20)
    assert hopper.fwd_group_shift(1, 16, 8192, 256, 2, cpu) == 0
    assert hopper.fwd_group_shift(4, 16, 2048, 256, 2, cpu) == 2
    assert hopper.fwd_group_shift(8, 12, 2048, 256, 2, cpu) == 2  # 8 does not divide 12
    assert hopper.fwd_group_shift(64, 7, 1024, 128, 2, cpu) == 0
    # a row's K and V at 8k keys, head dim 256, bf16: 8 MiB -> 6 in 50 MiB -> 4, FA4's section there
    assert hopper.fwd_group_shift("l2", 16, 8192, 256, 2, cpu) == 2
    assert hopper.fwd_group_shift(8, 16, 8192, 256, 2, cpu) == 2  # the table's 8, bounded by L2
    assert hopper.fwd_group_shift("l2", 256, 1024, 128, 2, cpu) == 6  # 512 KiB a row: 100 -> 64
    assert hopper.fwd_group_shift(8, 256, 1024, 128, 2, cpu) == 3  # the table's: 8
    assert all(config.hopper_gluon_head_section == 8 for config in HOPPER_FWD_CONFIGS.values())
    for bad in (0, "all", 1.5, True):
        with pytest.raises(ValueError, match="hopper_gluon_head_section"):
            hopper.fwd_group_shift(bad, 16, 1024, 128, 2, cpu)
    assert hopper.fwd_group_shift(8, 0, 1024, 128, 2, cpu) == 0  # no rows


@pytest.mark.parametrize("headdim", [128, 96])
def test_the_varlen_forward_plan_describes_each_calls_own_tensors(headdim, monkeypatch):
    """flash_attn_hopper.varlen_forward_hopper_plan keeps descriptor templates, not tensors: two
    calls of one plan (recorded on the CPU) launch on the same grid with descriptors of each call's
    own Q, K, V and O (and, at head dim 96, their tail sections'), and each call's L, cu_seqlens
    and scale; a plan that kept its first call's tensors would read stale inputs silently. Its
    kernel loops over rounds of tiles only on a persistent grid (PERSISTENT)."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_varlen_launcher", launches)
    lengths = [300, 129, 256]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    config = HOPPER_FWD_CONFIGS[(128, True)]

    def tensors():
        q, k, v = (torch.randn(total, 4, headdim, dtype=torch.bfloat16) for _ in range(3))
        return q, k, v, torch.empty_like(q), torch.empty(4, total)

    first, second = tensors(), tensors()
    plan = hopper.varlen_forward_hopper_plan(*first, len(lengths), max(lengths), max(lengths), True,
                                             config.hopper_gluon_block_n, config.hopper_gluon_block_m, config)
    for (q, k, v, out, lse), scale in ((first, 0.1), (second, 0.2)):
        plan(q, k, v, out, lse, cu, cu.clone(), scale)
        args = launches[-1]["args"]
        assert [args[i].base for i in range(4)] == [q, k, v, out]
        if headdim == 96:  # the tail sections: the same tensors, 32 columns
            assert [args[4 + i].base for i in range(4)] == [q, k, v, out]
        else:  # no tail: L's pointer, not read
            assert all(args[4 + i] is lse for i in range(4))
        assert args[8] is out and args[9] is lse and args[18] == scale
    assert launches[0]["grid"] == launches[1]["grid"] and launches[0]["CAUSAL"] and launches[1]["HEAD_SPLIT"] == (
        headdim == 96)
    # one program a tile (the table's entry), its kernel without the loop over rounds of tiles; on a
    # persistent grid (fewer keys than hopper_gluon_persistent_below_keys) with it
    assert launches[0]["PERSISTENT"] is False
    persistent = dataclasses.replace(config, hopper_gluon_persistent_below_keys=max(lengths) + 1)
    hopper.varlen_forward_hopper_plan(*first, len(lengths), max(lengths), max(lengths), True, config.hopper_gluon_block_n,
                                      config.hopper_gluon_block_m, persistent)(*first, cu, cu, 0.1)
    assert launches[-1]["PERSISTENT"] is True


def test_the_causal_varlen_forward_starts_groups_of_sequence_rows_longest_first(monkeypatch):
    """The Gluon varlen forward's launch (made on the CPU, the launcher recorded) takes the dense
    one's causal launch order over its sequences x heads rows: GROUP_SHIFT is fwd_group_shift's,
    with K and V counted at the longest sequence's keys (lengths vary), for packed sequences and for a dense
    call off the grid (dispatch.GluonPath.PACKED); 0 where not causal or the config's section is 1.
    fwd_group_shift runs with no GPU to ask for its L2 size."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_varlen_launcher", launches)
    table = HOPPER_FWD_CONFIGS[(128, True)]
    assert table.hopper_gluon_head_section == 8

    def launch(lengths, heads, causal=True, config=table):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(total, heads, 128, dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(heads, total)
        hopper.flash_attn_varlen_forward_hopper(q, k, v, out, lse, cu, cu, max(lengths), max(lengths), 0.1, causal,
                                                config.hopper_gluon_block_n, config.hopper_gluon_block_m, config)
        return launches.pop()

    ragged = launch([300, 129, 256, 1000, 64, 700], 4)  # 24 rows: groups of 8, the table's
    assert ragged["GROUP_SHIFT"] == 3 and ragged["CAUSAL"] and ragged["grid"] == (-(-1000 // 128) * 24,)
    assert launch([300, 129, 256, 1000, 64, 700], 4, causal=False)["GROUP_SHIFT"] == 0
    assert launch([300, 129, 256], 4, config=dataclasses.replace(table, hopper_gluon_head_section=1))["GROUP_SHIFT"] == 0
    assert launch([300, 129, 256], 4)["GROUP_SHIFT"] == 2  # 12 rows: groups of 4
    assert launch([300, 129, 256], 3)["GROUP_SHIFT"] == 0  # 9 rows: each its own
    # a dense causal call off the 128-row grid, its 5 x 4 batch rows packed: groups of 4
    q, k, v = (torch.randn(5, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(5, 4, 300)
    forward.forward_packed(q, k, v, out, lse, 0.1, True, table, table.hopper_gluon_block_m)
    (packed,) = launches
    assert packed["GROUP_SHIFT"] == 2 and packed["grid"] == (-(-300 // table.hopper_gluon_block_m) * 20,)
    launches.clear()
    # a group is mostly heads of one sequence: a row's K and V at the longest sequence's keys, in a
    # 2 MiB L2: 4096 keys (2 MiB) -> each row its own, where the mean (1072: 536 KiB) would give 2;
    # 1000 keys (500 KiB) -> 4 rows
    monkeypatch.setattr(hopper, "l2_cache_bytes", lambda index: 2 << 20)
    assert launch([4096, 64, 64, 64], 2)["GROUP_SHIFT"] == 0
    assert launch([1000, 1000, 1000, 1000], 2)["GROUP_SHIFT"] == 2


def test_bank_conflict_report_counts_each_shared_memory_access_of_the_gluon_backward():
    """tools/compile_check_sm90.py --bank-conflicts: Triton's static count for each register-to-
    shared access of the Gluon dK/dV kernel's query step, the fused dQ tile under every swizzle a
    TMA descriptor takes."""
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    report = subprocess.run([sys.executable, str(root / "tools" / "compile_check_sm90.py"), "--bank-conflicts"],
                            capture_output=True, text=True, env=env, check=True).stdout
    counts = {line.rsplit(maxsplit=1)[0].strip(): int(line.rsplit(maxsplit=1)[1])
              for line in report.splitlines()[1:] if line.strip()}
    assert len(counts) == 8, report
    # what docs/performance.md says of them: the dQ tile in rows with the 128-byte default swizzle
    # conflicts, a 32-byte swizzle does not, nor does the kernel's register order, nor the step's
    # other accesses
    assert counts["dQ_i tile store (float32, 128-byte swizzle)"] > 0, report
    assert counts["dQ_i tile store (float32, 32-byte swizzle)"] == 0, report
    assert counts["dQ_i tile store (float32, in register order: the kernel's)"] == 0, report
    assert counts["dS^T store (bf16, into the Q tiles' layout)"] == counts["L_i, D_i row loads (float32)"] == 0, report


def test_the_register_order_dq_tile_lays_each_threads_registers_side_by_side():
    """hopper/shared.py's DQ_TILE_BASES (the fused dQ accumulator's tile order) is the wgmma accumulator's own
    layout with its bases reordered: a thread's first four registers, then the lanes, the warps,
    and its higher registers, so that each warp's store of four registers is one contiguous run."""
    from triton._C.libtriton import gluon_ir, ir

    from kernels.hopper.shared import DQ_TILE_BASES, _wgmma_layout

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    layout = builder.to_linear_layout(_wgmma_layout(64)._to_ir(builder), [64, 64])
    registers, lanes, warps = layout.reg_bases, layout.lane_bases, layout.warp_bases
    expected = [*registers[:2], *lanes, *warps, *registers[2:]]
    assert [list(b) for b in DQ_TILE_BASES] == [list(b) for b in expected]


def test_the_register_add_path_inverts_the_dq_tile_order():
    """hopper/shared.py's _dq_tile_offsets (the offsets bwd_wide.py adds dQ at from registers) sends
    each (row, column) of a 64 x 64 tile to the offset whose set bits' DQ_TILE_BASES reach it: the
    same order the writer warp's reduce-adds and dq_cast.py read."""
    from kernels.hopper.shared import DQ_TILE_BASES, _dq_tile_offsets

    for offset in range(64 * 64):
        row = sum(r for bit, (r, _) in enumerate(DQ_TILE_BASES) if offset >> bit & 1)
        col = sum(c for bit, (_, c) in enumerate(DQ_TILE_BASES) if offset >> bit & 1)
        row_off, col_off = _dq_tile_offsets.fn(row, col)
        assert row_off + col_off == offset, (offset, row, col)


def _register_order(dq: torch.Tensor, tile_cols: int = 64) -> torch.Tensor:
    """dq (batch, seqlen, heads, head dim) as the register-order accumulator holds it, built from
    DQ_TILE_BASES alone: tiles of the (batch x seqlen, heads x head dim) view's 64 x tile_cols
    blocks in that view's order (64 x 32: the bases without the last, column 32), each tile's
    element at offset o the one its set bits' bases reach."""
    from kernels.hopper.shared import DQ_TILE_BASES

    bases = DQ_TILE_BASES if tile_cols == 64 else DQ_TILE_BASES[:-1]
    offsets = torch.arange(64 * tile_cols)
    rows = sum(((offsets >> bit) & 1) * r for bit, (r, _) in enumerate(bases))
    cols = sum(((offsets >> bit) & 1) * c for bit, (_, c) in enumerate(bases))
    view = dq.reshape(-1, dq.shape[-2] * dq.shape[-1])
    blocks = view.reshape(view.shape[0] // 64, 64, view.shape[1] // tile_cols, tile_cols).permute(0, 2, 1, 3)
    return blocks[:, :, rows, cols].reshape(dq.shape).contiguous()


def _varlen_register_order(dq: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed dq (total_q, heads, head dim) as the varlen accumulator in register order holds it:
    sequence b's rows zero-padded to whole 64-row blocks from padded row (start_b + 64 b) // 64 * 64
    (FA3's padded offset), each block's tiles as _register_order lays them; NaN elsewhere."""
    from kernels import flash_attn_hopper as hopper

    heads, headdim = dq.shape[1:]
    batch = len(lengths)
    padded = torch.full((hopper.varlen_dq_accumulator(dq, batch).shape[0], heads, headdim),
                        float("nan"))
    start = 0
    for b, length in enumerate(lengths):
        row0 = (start + 64 * b) // 64 * 64
        blocks = -(-length // 64) * 64
        seq = torch.zeros(blocks, heads, headdim)
        seq[:length] = dq[start:start + length]
        padded[row0:row0 + blocks] = _register_order(seq, 32)  # the same floats as 64-column tiles
        start += length
    return padded


@pytest.mark.parametrize("lengths", [[130, 0, 64, 1, 200], [128, 256, 0, 0, 128], [3789, 615, 1, 127, 129, 2641]])
def test_the_packed_varlen_grid_holds_every_sequences_key_blocks_once(lengths):
    """hopper_gluon_varlen_grid "packed": with sequence b's key blocks from (cu_seqlens_k[b] + 128 b) // 128
    (bwd_varlen._varlen_packed_program's rule: a block belongs to the last sequence that
    starts at or before it), varlen_bwd_key_blocks' axis holds each sequence's blocks exactly once,
    with at most one empty block a sequence, where the "longest" grid idles on the rest. The rule
    is restated here in Python: the Gluon code itself runs only in the GPU tests
    (test_gpu_gluon_varlen's packed-grid case, against float64)."""
    from kernels import flash_attn_hopper as hopper

    block_n = hopper.BWD_BLOCK_N
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    first = [(cu[b] + block_n * b) // block_n for b in range(len(lengths))]
    blocks = hopper.varlen_bwd_key_blocks("packed", len(lengths), cu[-1], max(lengths))
    seen = []
    for block in range(blocks):
        b = sum(f <= block for f in first) - 1
        start_n = (block - first[b]) * block_n
        if start_n < lengths[b]:
            seen.append((b, start_n))
    wanted = [(b, n) for b, length in enumerate(lengths) for n in range(0, length, block_n)]
    assert sorted(seen) == wanted
    assert blocks - len(wanted) <= len(lengths)
    assert hopper.varlen_bwd_key_blocks("longest", len(lengths), cu[-1], max(lengths)) == -(-max(lengths) // block_n)
    with pytest.raises(ValueError, match="'longest' or 'packed'"):
        hopper.varlen_bwd_key_blocks("sorted", len(lengths), cu[-1], max(lengths))


def test_the_varlen_backward_packs_its_grid_where_the_longest_would_be_mostly_empty():
    """varlen_bwd_grid "auto" (the tables' hopper_gluon_varlen_grid): packed for one long sequence
    among short ones (the longest grid more than half empty), the longest grid for the features
    suite's lengths; packed only within a program's scan of the sequences."""
    from kernels import flash_attn_hopper as hopper

    suite = (2641, 2501, 1405, 3002, 2670, 3056, 3789, 615)
    skewed = (8192,) + (512,) * 31
    assert hopper.varlen_bwd_grid(len(suite), sum(suite), max(suite), "auto") == "longest"
    assert hopper.varlen_bwd_grid(len(skewed), sum(skewed), max(skewed), "auto") == "packed"
    assert HOPPER_BWD_CONFIGS[128].hopper_gluon_varlen_grid == "auto"
    lanes = hopper.VARLEN_SCAN_LANES  # batch + 1 cu_seqlens entries a program scans
    assert hopper.varlen_bwd_grid(lanes - 1, (lanes - 1) * 64 + 8192, 8192, "packed") == "packed"
    assert hopper.varlen_bwd_grid(lanes, lanes * 64 + 8192, 8192, "packed") == "longest"
    assert hopper.varlen_bwd_grid(len(suite), sum(suite), max(suite), "packed") == "packed"
    with pytest.raises(ValueError, match="hopper_gluon_varlen_grid"):
        hopper.varlen_bwd_grid(1, 1, 1, "sorted")


@pytest.mark.parametrize("lengths", [[130, 0, 64, 1, 200], [63, 65, 127, 129], [200, 1]])  # the last sequence the shortest
# (the cast's return past a sequence's tiles only keeps its reads within the accumulator: the
# interpreter does not fault on a read past it, so no case here fails without that return)
@pytest.mark.parametrize("heads,headdim", [(2, 64), (3, 96)], ids=["d64", "d96"])
def test_dq_from_varlen_accumulator_reads_each_sequences_padded_tiles(lengths, heads, headdim):
    """hopper/dq_cast.py's dq_from_varlen_accumulator puts each sequence's padded register-order
    tiles back into its packed rows, times the softmax scale (the kernels add dS K unscaled; the
    accumulator's padding is NaN here, so a value from another tile or row shows), each sequence
    writing only its own rows; an accumulator of the wrong size,
    or packed tokens with no sequence, are refused by name. Two heads of 64 columns: two 64-column
    tiles a row block; three of 96: nine 32-column ones."""
    from kernels.hopper import dq_cast

    launcher = dq_cast._dq_rows_from_padded_register_tiles_launcher
    torch.manual_seed(0)
    dq = torch.randn(sum(lengths), heads, headdim)
    tile_cols = dq_cast._tile_cols(heads * headdim)
    assert tile_cols == (64 if headdim == 64 else 32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    accumulator = _varlen_register_order(dq, lengths)
    scale = 0.125  # a power of two: the products exact
    got = dq_cast.dq_from_varlen_accumulator(accumulator, cu, max(lengths), tuple(dq.shape), torch.float32, scale)
    torch.testing.assert_close(got, dq * scale, rtol=0, atol=0)
    # each sequence alone (cu_seqlens of its own, starting at its padded tile by its index): the
    # cast writes its rows and no other (the rest of the output holds a sentinel)
    for b, length in enumerate(lengths):
        start = int(cu[b])
        alone = torch.tensor([start] * (b + 1) + [start + length], dtype=torch.int32)  # b empty ones first
        out = torch.full_like(dq, -7.0)
        tiles = heads * headdim // tile_cols
        launcher[(-(-max(length, 1) // 64), b + 1, tiles)](accumulator, out, alone, tiles, 1.0, COLS=tile_cols)
        written = torch.zeros(dq.shape[0], dtype=torch.bool)
        written[start:start + length] = True
        torch.testing.assert_close(out[written], dq[written], rtol=0, atol=0)
        assert (out[~written] == -7.0).all(), f"sequence {b} wrote rows outside its own"
    with pytest.raises(ValueError, match="dq_accum must be a contiguous float32"):  # a q-shaped one, say
        dq_cast.dq_from_varlen_accumulator(dq, cu, max(lengths), tuple(dq.shape), torch.float32, scale)
    with pytest.raises(ValueError, match="at least one sequence"):  # rows no program would write
        dq_cast.dq_from_varlen_accumulator(accumulator, cu, 0, tuple(dq.shape), torch.float32, scale)


_PREPROCESS_SM90 = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tools']
import triton
from triton.compiler import ASTSource
import compile_check_sm90 as check
from kernels.backward_steps import _bwd_preprocess_kernel as kernel
for zero_dq in (False, True, 2):
    constexprs = {'HEAD_DIM': 128, 'BLOCK_D': 128, 'BLOCK_M': 64, 'ZERO_DQ': zero_dq}
    compiled = triton.compile(ASTSource(kernel, check.signature(kernel, constexprs, 'bf16'), constexprs),
                              target=check.TARGET, options={'num_warps': 4})
    row_products = [line for line in compiled.asm['ttir'].splitlines() if 'arith.muli' in line and 'tensor<64x1x' in line]
    print(zero_dq, len(row_products), all('tensor<64x1xi64>' in line for line in row_products))
"""


def test_the_preprocess_kernel_compiles_for_sm90_with_64_bit_row_offsets():
    """backward_steps._bwd_preprocess_kernel compiled for sm_90 (no GPU needed: tools/compile_check_sm90.py's
    target and signature, in a process without Triton's interpreter) in each ZERO_DQ form; its row
    offsets are 64-bit (a packed batch is one sequence there, whose rows x stride pass 2^31 from
    2^31 elements): every product of the rows by a stride is an i64 tensor in the Triton IR (at
    least the two loads')."""
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    lines = subprocess.run([sys.executable, "-c", _PREPROCESS_SM90, str(root)], capture_output=True, text=True,
                           env=env, check=True).stdout.split("\n")
    results = [line.split() for line in lines if line]
    assert [r[0] for r in results] == ["False", "True", "2"], lines
    assert all(int(count) >= 2 and wide == "True" for _, count, wide in results), lines


def test_the_varlen_preprocess_zeroes_the_whole_padded_accumulator():
    """The preprocess kernel's ZERO_DQ 2 (the varlen accumulator in register order) zeroes every
    row of its grid's blocks, past the packed tokens too, and still writes D = rowsum(dO * O)
    of the packed rows (its (heads, total_q) rows, none past them). The kernel alone, on the grid
    backward._backward_varlen_gluon gives it (one program per 64 accumulator rows and head)."""
    from kernels.forward import varlen_strides
    from kernels.hopper.dq_cast import varlen_dq_accumulator

    torch.manual_seed(0)
    total_q, heads, headdim = 150, 2, 64
    out, do = torch.randn(total_q, heads, headdim), torch.randn(total_q, heads, headdim)
    accumulator = varlen_dq_accumulator(out, 3).fill_(float("nan"))
    delta = torch.full((heads, total_q), float("nan"))
    backward._bwd_preprocess_launcher[(accumulator.shape[0] // 64, heads)](
        out, do, delta, accumulator, *varlen_strides(out), *varlen_strides(do), heads, total_q, HEAD_DIM=headdim,
        BLOCK_D=headdim, BLOCK_M=64, ZERO_DQ=2)
    assert accumulator.shape[0] >= total_q + 3 * 64 - 63 and accumulator.shape[0] % 64 == 0
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    torch.testing.assert_close(delta, (out * do).sum(-1).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dq_from_accumulator_puts_register_order_tiles_back_in_rows(dtype):
    """hopper/dq_cast.py's dq_from_accumulator undoes the register order the dense Gluon dK/dV
    kernel adds dQ in (its Triton kernel, here in the interpreter) and applies the softmax scale
    (the kernel adds dS K unscaled): 64 x 64 tiles, and at head dim 96 64 x 32 ones, which read two
    at a time are the 64 x 64 ones; a tensor of partial blocks is refused by name."""
    from kernels.hopper.dq_cast import dq_from_accumulator

    torch.manual_seed(0)
    dq = torch.randn(2, 128, 3, 128)  # rows of 3 heads x 128 columns: six 64-column tiles a row block
    accumulator = _register_order(dq)
    assert not torch.equal(accumulator, dq)
    assert torch.equal(accumulator, _register_order(dq, 32))  # a 64 x 64 tile is two 64 x 32 ones side by side
    scale = 0.25  # a power of two: the products exact
    torch.testing.assert_close(dq_from_accumulator(accumulator, dtype, scale), (dq * scale).to(dtype), rtol=0, atol=0)
    for heads in (3, 2):  # head dim 96: 32-column tiles for the cast (3 heads), or 64-column ones (2 heads)
        dq = torch.randn(1, 128, heads, 96)
        torch.testing.assert_close(dq_from_accumulator(_register_order(dq, 32), dtype, scale), (dq * scale).to(dtype),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="64 x 32 blocks"):
        dq_from_accumulator(torch.zeros(1, 96, 1, 128), dtype, scale)


class _RecordedLaunches(list):
    """In place of a Gluon kernel's launcher: each launch's grid, arguments ("args") and keyword
    arguments (the constexprs), the kernel not run (Gluon has no CPU interpreter)."""

    def __getitem__(self, grid):
        if not isinstance(grid, tuple):
            return super().__getitem__(grid)
        return lambda *args, **kwargs: self.append({"grid": grid, "args": args, **kwargs})


@pytest.mark.parametrize("dq_first", [None, True, False])
def test_the_gluon_backward_takes_its_schedule_and_launch_order_from_the_config(dq_first, monkeypatch):
    """The dense Gluon dK/dV plan's DQ_FIRST is BwdConfig.hopper_gluon_dq_first (None: the rule,
    here MHA: after dK), its grid's sections BwdConfig.hopper_gluon_causal_head_section causal and
    hopper_gluon_head_section without the mask: no module setting in between. The plan is made and
    launched on the CPU, the launcher recorded."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_bwd_dkdv_launcher", launches)
    q, k, v, do = (torch.randn(2, 256, 4, 128, dtype=torch.bfloat16) for _ in range(4))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32)
    lse, delta = torch.randn(2, 4, 256), torch.randn(2, 4, 256)
    config = dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_dq_first=dq_first,
                                 hopper_gluon_causal_head_section=2, hopper_gluon_head_section=4)
    plan = hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, True, config)
    plan(q, k, v, do, lse, delta, dk, dv, dq_acc, 0.1)
    (launch,) = launches
    assert launch["DQ_FIRST"] is bool(dq_first) and launch["FUSED_DQ"] and launch["CAUSAL"]
    assert launch["grid"] == (2, 2, 4)  # sections of 2 of the 8 (batch, kv head) pairs, 2 key blocks each
    plan = hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, False, config)
    plan(q, k, v, do, lse, delta, dk, dv, dq_acc, 0.1)
    assert not launches[-1]["CAUSAL"] and launches[-1]["grid"] == (4, 2, 2)  # without the mask: sections of 4


@pytest.mark.parametrize("dq_first", [None, True, False])
def test_head_dim_192_launches_the_kernel_for_wide_heads(dq_first, monkeypatch):
    """The dense Gluon dK/dV plan at head dim 192 launches bwd_wide.py's kernel (recorded on the
    CPU) over 64-key blocks, with the head dim's two sections' descriptors and DQ_FIRST as
    BwdConfig.hopper_gluon_dq_first says (None: dQ before dV and dK); it refuses dQ unfused and the
    features it does not have, by name."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_bwd_dkdv_wide_launcher", launches)
    monkeypatch.setattr(hopper, "_bwd_dkdv_launcher", None)  # not this one
    q, k, v, do = (torch.randn(2, 256, 4, 192, dtype=torch.bfloat16) for _ in range(4))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32)
    lse, delta = torch.randn(2, 4, 256), torch.randn(2, 4, 256)
    config = dataclasses.replace(HOPPER_BWD_CONFIGS[256], hopper_gluon_causal_head_section=8,
                                 hopper_gluon_dq_first=dq_first)
    plan = hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, True, config)
    plan(q, k, v, do, lse, delta, dk, dv, dq_acc, 0.1)
    (launch,) = launches
    assert launch["grid"] == (8, 4, 1) and launch["CAUSAL"]  # 256 keys in 64-key blocks, 8 pairs
    assert launch["DQ_FIRST"] is (dq_first is not False)
    assert [d.block_shape for d in launch["args"][:2]] == [[64, 128], [64, 128]]
    assert [d.block_shape for d in launch["args"][7:9]] == [[64, 64], [64, 64]]  # the tail sections
    with pytest.raises(ValueError, match="head dim 192"):
        hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, None, True, config)
    with pytest.raises(ValueError, match="head dim 192"):
        hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, True, config, {"SOFTCAP": True})


@pytest.mark.parametrize("key_grid,scan", [("longest", 0), ("packed", 128), ("auto", 0)])
def test_the_gluon_varlen_backward_takes_its_grid_from_the_config(key_grid, scan, monkeypatch):
    """The varlen Gluon dK/dV launch's key blocks are BwdConfig.hopper_gluon_varlen_grid's ("auto"
    for these lengths: the longest grid), its SCAN the packed grid's lanes; launched on the CPU,
    the launcher recorded."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_bwd_dkdv_varlen_launcher", launches)
    lengths = [300, 129, 256]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, do = (torch.randn(total, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(total, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = hopper.varlen_dq_accumulator(q, len(lengths)).zero_()
    lse, delta = torch.randn(4, total), torch.randn(4, total)
    config = dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_varlen_grid=key_grid,
                                 hopper_gluon_causal_head_section=1)
    hopper.flash_attn_varlen_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, dq_acc, cu, cu, max(lengths),
                                                  0.1, True, config)
    (launch,) = launches
    blocks = hopper.varlen_bwd_key_blocks("packed" if scan else "longest", len(lengths), total, max(lengths))
    pairs = 2 if scan else len(lengths) * 2  # kv heads, or (sequence, kv head) pairs
    assert launch["SCAN"] == scan and launch["grid"] == (1, blocks, pairs)


@pytest.mark.parametrize("headdim", [128, 96])
def test_the_varlen_backward_plan_describes_each_calls_own_tensors(headdim, monkeypatch):
    """flash_attn_hopper.varlen_backward_dkdv_hopper_plan keeps descriptor templates, not tensors:
    two calls of one plan (recorded on the CPU) launch on the same grid with descriptors of each
    call's own Q, dO and dQ accumulator (and, at head dim 96, their tail sections'), and each
    call's L, cu_seqlens and scale; a plan that kept its first call's tensors would read stale
    inputs silently."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_bwd_dkdv_varlen_launcher", launches)
    lengths = [300, 129, 256]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def tensors():
        q, do = (torch.randn(total, 4, headdim, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(total, 2, headdim, dtype=torch.bfloat16) for _ in range(2))
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq_acc = hopper.varlen_dq_accumulator(q, len(lengths)).zero_()
        return q, k, v, do, torch.randn(4, total), torch.randn(4, total), dk, dv, dq_acc

    first, second = tensors(), tensors()
    q, k, v, do, lse, delta, dk, dv, dq_acc = first
    plan = hopper.varlen_backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, len(lengths), max(lengths), True,
                                                   HOPPER_BWD_CONFIGS[128])
    for (q, k, v, do, lse, delta, dk, dv, dq_acc), scale in ((first, 0.1), (second, 0.2)):
        plan(q, k, v, do, lse, delta, dk, dv, dq_acc, cu, cu.clone(), scale)
        args = launches[-1]["args"]
        assert [args[i].base for i in (0, 3, 6)] == [q, do, dq_acc]
        if headdim == 96:  # the tail sections: the same tensors, 32 columns
            assert [args[7 + i].base for i in (0, 3, 6)] == [q, do, dq_acc]
        else:  # no tail: L's pointer, not read
            assert all(args[7 + i] is lse for i in range(7))
        assert args[16] is lse and args[17] is delta and args[24] == scale
    assert launches[0]["grid"] == launches[1]["grid"] and launches[0]["CAUSAL"] and launches[1]["HEAD_SPLIT"] == (
        headdim == 96)


@pytest.mark.parametrize("headdim,causal,flags,v_stages", [
    (128, True, {}, 3), (128, True, {"ALIBI": True}, 2), (64, True, {"ALIBI": True}, 3),
    (128, False, {"ALIBI": True}, 3), (128, True, {"ALIBI": True, "WINDOW": True}, 3)])
def test_the_gluon_forward_holds_v_in_two_stages_only_beside_alibis_matmul_tile(headdim, causal, flags, v_stages,
                                                                                monkeypatch):
    """The dense Gluon forward's launch (made and launched on the CPU, the launcher recorded): V's
    ring holds STAGES blocks but where ALiBi's key term is added by matmul (causal, no window or
    softcap) at head dim 128, whose B tile needs the room: 2 there."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_launcher", launches)
    q, k, v = (torch.randn(1, 256, 2, headdim, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    hopper.forward_hopper_plan(q, k, v, out, causal, flags=flags)(q, k, v, out, lse, 0.1)
    (launch,) = launches
    assert launch["V_STAGES"] == v_stages and launch["STAGES"] == hopper.STAGES == 3
    assert launch["ALIBI"] is bool(flags.get("ALIBI")) and launch["grid"] == (4,)


@pytest.mark.parametrize("headdim,block_n,alibi_tile,stages", [
    (64, 128, False, (3, 3)), (96, 128, True, (3, 3)), (128, 128, False, (3, 3)), (128, 128, True, (3, 2)),
    (192, 64, False, (3, 3)), (256, 64, False, (3, 2)), (256, 64, True, (3, 2)), (192, 128, False, (2, 1))])
def test_the_gluon_forward_keeps_as_many_key_blocks_in_flight_as_shared_memory_holds(headdim, block_n, alibi_tile,
                                                                                     stages):
    """forward_stages: 3 K and 3 V blocks where they fit beside Q (and ALiBi's key tile) in an sm_90
    program's shared memory, else one V block fewer, then one K block fewer, in turn; the tiles it
    picks fit (the compile check reports the compiled kernels' own use) and one more would not."""
    from kernels import flash_attn_hopper as hopper

    assert hopper.forward_stages(headdim, block_n, alibi_tile) == stages

    def tile_bytes(k_stages, v_stages):
        return 2 * (128 * headdim + (k_stages + v_stages) * block_n * headdim + (16 * block_n if alibi_tile else 0))

    assert tile_bytes(*stages) <= hopper.SHARED_MEMORY_BYTES
    more = (stages[0], stages[1] + 1) if stages[1] < stages[0] else (stages[0] + 1, stages[1])
    assert stages == (3, 3) or tile_bytes(*more) > hopper.SHARED_MEMORY_BYTES - 1024


@pytest.mark.parametrize("headdim,block_n,block_m,buffers", [
    (64, 128, 192, 2), (64, 128, 128, 2), (96, 128, 128, 2), (128, 128, 128, 1), (192, 64, 128, 1), (256, 64, 128, 1)])
def test_a_persistent_gluon_forward_takes_a_second_q_buffer_only_where_it_costs_no_key_block(headdim, block_n, block_m,
                                                                                            buffers, monkeypatch):
    """forward_q_buffers: a persistent grid takes two Q buffers where the second fits beside the K and
    V blocks forward_stages gives one (head dims 64 and 96), else one; a grid of one program a tile
    one. The dense launch (made and launched on the CPU, the launcher recorded) of a call with fewer
    keys than the config's hopper_gluon_persistent_below_keys runs one program an SM (132 without a
    GPU to ask) with those buffers and the same blocks in flight, and at that many keys one a tile,
    its kernel then compiled without the loop over rounds of tiles (PERSISTENT False)."""
    from kernels import flash_attn_hopper as hopper

    assert hopper.forward_q_buffers(headdim, block_n, False, block_m, persistent=True) == buffers
    assert hopper.forward_q_buffers(headdim, block_n, False, block_m, persistent=False) == 1
    assert hopper.forward_stages(headdim, block_n, block_m=block_m, q_buffers=buffers) == hopper.forward_stages(
        headdim, block_n, block_m=block_m)
    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_launcher", launches)
    config = dataclasses.replace(hopper_fwd_config(headdim, False), hopper_gluon_block_n=block_n,
                                 hopper_gluon_block_m=block_m)
    seqlen = 384 * 16
    q, k, v = (torch.randn(1, seqlen, 2, headdim, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, seqlen)
    for persistent in (True, False):
        # persistent below a threshold of keys: above the call's, or at it
        schedule = dataclasses.replace(config, hopper_gluon_persistent_below_keys=seqlen + 1 if persistent else seqlen)
        hopper.forward_hopper_plan(q, k, v, out, False, block_n=block_n, block_m=block_m,
                                   schedule=schedule)(q, k, v, out, lse, 0.1)
        launch = launches.pop()
        tiles = seqlen // block_m * 2
        assert launch["grid"] == ((min(tiles, 132),) if persistent else (tiles,))
        assert launch["Q_BUFFERS"] == (buffers if persistent else 1)
        assert launch["PERSISTENT"] is persistent  # the kernel's loop over rounds of tiles, or one tile straight
        assert (launch["STAGES"], launch["V_STAGES"]) == hopper.forward_stages(headdim, block_n, block_m=block_m)
        assert launch["args"][9:11] == (2, 2)  # heads, then batch x heads: the rows the tiles run over


def test_a_key_block_that_leaves_fewer_than_two_k_blocks_in_flight_keeps_the_gluon_forward_off():
    """With one K block in flight the forward's loop would wait for K_{j+1} while block j holds the
    stage (it issues S_{j+1} before it releases block j): forward_stages refuses such a block
    (head dim 256 in 128-key blocks), and dispatch names why the Gluon forward does not take the
    call, dense or packed, as it does for a block that does not divide the 128 query rows."""
    from kernels import flash_attn_hopper as hopper

    with pytest.raises(ValueError, match="fewer than 2 K blocks of 128 keys at head dim 256"):
        hopper.forward_stages(256, 128)
    q = torch.empty(2, 2048, 4, 256, dtype=torch.bfloat16)
    wide = HOPPER_FWD_CONFIGS[(256, True)]
    assert dispatch.fwd_gluon_path(wide, q, q, q, q, True) == (GluonPath.DENSE, "")
    for config, reason in ((dataclasses.replace(wide, hopper_gluon_block_n=128), "fewer than 2 K blocks"),
                           (dataclasses.replace(wide, hopper_gluon_block_n=96), "not a divisor")):
        assert reason in dispatch.fwd_gluon_path(config, q, q, q, q, True)[1]
        off_grid = torch.empty(2, 2000, 4, 256, dtype=torch.bfloat16)
        assert reason in dispatch.fwd_gluon_path(config, off_grid, off_grid, off_grid, off_grid, True)[1]


def test_the_gluon_forward_at_head_dim_256_launches_64_key_blocks(monkeypatch):
    """The table's head-dim-256 entries take the Gluon forward with 64-key blocks: the launch's K and
    V descriptors hold 64 rows, Q's and O's 64 (half a 128-row query block), 3 K and 2 V blocks in
    flight; a block_n that does not divide the 128 query rows is refused."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_launcher", launches)
    q, k, v = (torch.randn(1, 256, 2, 256, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    block_n = HOPPER_FWD_CONFIGS[(256, True)].hopper_gluon_block_n
    hopper.forward_hopper_plan(q, k, v, out, True, block_n=block_n)(q, k, v, out, lse, 0.1)
    (launch,) = launches
    assert (launch["STAGES"], launch["V_STAGES"]) == (3, 2) and launch["grid"] == (4,)
    assert [list(d.block_shape) for d in launch["args"][:4]] == [[64, 256], [64, 256], [64, 256], [64, 256]]
    with pytest.raises(ValueError, match="hopper_gluon_block_n must divide"):
        hopper.forward_hopper_plan(q, k, v, out, True, block_n=96)


@pytest.mark.parametrize("headdim,sections", [(64, (64,)), (80, (64, 16)), (96, (64, 32)), (128, (128,)),
                                              (192, (128, 64)), (256, (256,)), (72, None), (224, None)])
def test_the_gluon_forward_splits_a_head_dim_into_two_power_of_two_sections(headdim, sections):
    """head_sections: register tiles are powers of two, so a head dim that is not one runs as two
    that are (each a TMA box and a matmul), the second at least a wgmma's depth of 16; others are
    refused with the reason."""
    from kernels import flash_attn_hopper as hopper

    if sections is None:
        with pytest.raises(ValueError, match=f"head dim {headdim} is not a power of two"):
            hopper.head_sections(headdim)
    else:
        assert hopper.head_sections(headdim) == sections and sum(sections) == headdim


@pytest.mark.parametrize("headdim,boxes", [(96, [64, 32]), (192, [128, 64])])
def test_the_gluon_forward_launches_a_split_head_dim_as_two_sections(headdim, boxes, monkeypatch):
    """A head dim of two sections launches with HEAD_SPLIT and eight descriptors over the same
    tensors: q, k, v and out in boxes of the first section's width, then of the tail's (read from
    column first-width on by the kernel); the table's keys a block (128 at 96, 64 at 192)."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_launcher", launches)
    q, k, v = (torch.randn(1, 256, 2, headdim, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    block_n = HOPPER_FWD_CONFIGS[(128 if headdim == 96 else 256, False)].hopper_gluon_block_n
    hopper.forward_hopper_plan(q, k, v, out, False, block_n=block_n)(q, k, v, out, lse, 0.1)
    (launch,) = launches
    assert launch["HEAD_SPLIT"] is True and launch["grid"] == (4,)
    rows = [64, block_n, block_n, 64]
    assert [list(d.block_shape) for d in launch["args"][:8]] == [[r, boxes[0]] for r in rows] + [[r, boxes[1]] for r in rows]
    assert all(d.base is t for d, t in zip(launch["args"][:8], (q, k, v, out) * 2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [128, 96, 256])
def test_the_gluon_forward_plan_binds_every_parameter_of_its_kernel(headdim, causal, monkeypatch):
    """launch.DirectLaunch keeps a plan's compiled kernel (and launches it directly from the second
    call on) only where the launch names every parameter after its positional arguments: one left
    to its default (GROUP_SHIFT without causal) would send every call through the JIT. The dense
    Gluon forward's launch, made and launched on the CPU, the launcher recorded."""
    from kernels import flash_attn_hopper as hopper

    launches = _RecordedLaunches()
    monkeypatch.setattr(hopper, "_fwd_launcher", launches)
    q, k, v = (torch.randn(1, 256, 2, headdim, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    config = hopper_fwd_config(headdim, causal)
    hopper.forward_hopper_plan(q, k, v, out, causal, block_n=config.hopper_gluon_block_n,
                               schedule=config)(q, k, v, out, lse, 0.1)
    (launch,) = launches
    unnamed = set(hopper._flash_fwd_hopper_kernel.arg_names[len(launch["args"]):]) - launch.keys()
    assert not unnamed, f"left to their defaults: {sorted(unnamed)}"


def test_exp2_under_pv_counts_the_softmax_between_the_two_waits(monkeypatch):
    """tools/compile_check_sm90.py's exp2_under_pv on a listing shaped like nvdisasm's: per wait for
    S (`WARPGROUP.DEPBAR.LE gsb0, 0x1`), the exp2 before the next wait for P V (`... 0x0`); the
    fewest over the consumers' loops; 0 where ptxas put the second wait first, or no loop."""
    import importlib.util

    # the module drops TRITON_INTERPRET when imported (it compiles for the GPU target); put it back after
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    path = Path(__file__).resolve().parents[1] / "tools" / "compile_check_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_check_sm90", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def listing(*bodies):
        lines, address = [], 0
        for body in bodies:
            for instruction in ("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", *body, "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "BRA"):
                lines.append(f"        /*{address:04x}*/                   {instruction}")
                address += 16
        return "\n".join(["  .text.kernel:", *lines])

    softmax = ("FMNMX R1, R2, R3 ;", *("MUFU.EX2 R4, R5 ;",) * 3, "FADD R6, R4, R7 ;")
    assert module.exp2_under_pv(listing(softmax, softmax)) == 3
    assert module.exp2_under_pv(listing(softmax, softmax[:2])) == 1  # the fewest of the two consumers
    assert module.exp2_under_pv(listing(("FMNMX R1, R2, R3 ;",))) == 0  # the softmax after P V's wait
    assert module.exp2_under_pv("no loop") == 0


def test_loop_spills_counts_local_memory_traffic_in_each_innermost_wgmma_loop(monkeypatch):
    """tools/compile_check_sm90.py's loop_spills on a listing shaped like nvdisasm's: the STL and LDL
    inside each innermost loop that issues HGMMA, in address order; a loop without HGMMA, spills
    outside any loop, and the branches back from after the last EXIT (ptxas's out-of-line mbarrier
    retries) do not count."""
    import importlib.util

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    path = Path(__file__).resolve().parents[1] / "tools" / "compile_check_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_check_sm90", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    program = [
        ("", "STL [R1], R2"),  # a prologue's spill: once, not a step's
        (".L_x_0", "HGMMA.64x64x16.F32 R24, gdesc[UR4], R24"),  # the first consumer's step loop
        ("", "LDL R3, [R1]"),
        ("", "STL [R1+0x4], R3"),
        ("", "@P0 BRA `(.L_x_0)"),
        (".L_x_1", "LDL R5, [R1+0x8]"),  # a loop without a matmul (a loader's)
        ("", "@P1 BRA `(.L_x_1)"),
        (".L_x_2", "HGMMA.64x64x16.F32 R24, gdesc[UR4], R24"),  # the second consumer's, clean
        ("", "@P0 BRA `(.L_x_2)"),
        ("", "EXIT"),
        (".L_x_3", "LDL R6, [R1]"),  # an out-of-line retry back into the first loop
        ("", "BRA `(.L_x_0)"),
    ]
    lines = []
    for address, (label, instruction) in enumerate(program):
        if label:
            lines.append(f"{label}:")
        lines.append(f"        /*{address * 16:04x}*/                   {instruction} ;")
    listing = "\n".join(["  .text.kernel:", *lines])
    assert module.loop_spills(listing) == [2, 0]
    assert module.loop_spills("no loop") == []
