"""The backward for calls with flash-attn's features (GQA/MQA, sliding windows, softcap, ALiBi,
dropout, packed variable lengths): a dK/dV kernel and a dQ kernel over backward_steps.py's inner
loops, whose feature flags are constexprs (kernels/features.py, kernels/dropout.py).

GQA/MQA: one dK/dV program per (key block, batch x kv head) loops over the q heads of its
group, adding each head's share into the same on-chip dK/dV accumulators. Nothing is
materialised (no repeated K/V, no float32 buffer per q head, no reduction pass), K and V are
read once per group, and every dK/dV element is still written by one program in a fixed
order, so the backward stays atomic-free and bit-identical between runs (deterministic or not).
The dQ program of q head h reads kv head h // kv_group. (On Hopper, a call that is not asked to
be deterministic takes the Gluon dK/dV kernel with dQ fused instead where dispatch.bwd_dkdv_path
sends it, dropout where the config's hopper_gluon_dropout asks; its dQ reduce-adds may round
differently run to run: kernels/backward.py.)

Sliding windows: the query blocks a key block's program visits and the key blocks a query
block's program visits are bounded by the window (blocks outside are skipped, not masked).
Packed variable lengths: as the forward, grids span the longest sequence and programs past a
sequence's end visit nothing and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backward_steps import _bwd_dkdv_inner, _bwd_dq_inner, _bwd_preprocess_launcher
from .checks import Features
from .common import (
    LOG2E,
    _batch_head,
    _key_range,
    _load_tile,
    _query_block_start,
    _store_tile,
    cdiv,
    ensure_descriptor_allocator,
    last_dim_contiguous,
    strides,
)
from .configs import BwdConfig, default_bwd_config, padded_headdim, takes_feature_tiles
from .dispatch import bwd_uses_tma
from .dropout import _rng_state
from .features import _seq_bounds, _window_key_blocks, _window_query_blocks, feature_args
from .forward import varlen_strides
from .launch import CachedLauncher


@triton.jit
def _flash_bwd_dkdv_features_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    kv_group, window_left, window_right, softcap_log2, dropout_p, Alibi, stride_alibi_b,
    CuSeqQ, CuSeqK, RngSeed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, QUERY_MAJOR: tl.constexpr,
    TMA: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
):
    """One program per (key block, batch x kv head) owns dK_j and dV_j (FA2 Alg. 2 lines 5-18)
    and loops over the kv_group q heads that read them. Causal calls arrive as a window with
    right side 0 (WINDOW)."""
    start_n = tl.program_id(0) * BLOCK_N
    b, kv_h = _batch_head(tl.program_id(1), num_heads // kv_group)
    if VARLEN:  # LSE and Delta are (heads, total_q); seqlen_q/k arrive as the totals
        q_start, len_q = _seq_bounds(CuSeqQ, b)
        k_start, len_k = _seq_bounds(CuSeqK, b)
        Q += q_start * stride_qs
        DO += q_start * stride_dos
        K += k_start * stride_ks
        V += k_start * stride_vs
        DK += k_start * stride_dks
        DV += k_start * stride_dvs
        lse_base = q_start
        lse_head = seqlen_q
        seqlen_q = len_q
        seqlen_k = len_k
    else:  # (batch, heads, seqlen_q)
        lse_head = seqlen_q
        lse_base = b * num_heads * seqlen_q
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    DK += b * stride_dkb + kv_h * stride_dkh
    DV += b * stride_dvb + kv_h * stride_dvh

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    # line 6: load K_j, V_j; line 7: dK_j = dV_j = 0 (keys past seqlen_k: rows never stored)
    k = _load_tile(K + offs_n[:, None] * stride_ks + offs_d[None, :], n_ok, d_ok, not EVEN_N, not EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vs + offs_d[None, :], n_ok, d_ok, not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # the query blocks that see these keys: masked at the window's edges, unmasked between
    if WINDOW:
        lo, full_lo, full, end = _window_query_blocks(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                      BLOCK_M, BLOCK_N)
    else:
        lo = 0
        full_lo = 0
        full = seqlen_q
        end = seqlen_q
    if VARLEN:  # a program past its sequence's last key block visits nothing
        end = tl.where(start_n < seqlen_k, end, 0)
        full = tl.minimum(full, end)
        if WINDOW:
            full_lo = tl.minimum(full_lo, end)
    if DROPOUT:
        seed, rng_offset = _rng_state(RngSeed)
    else:
        seed = 0
        rng_offset = 0
    if VARLEN:  # an empty sequence visits no query block: its descriptors (no zero-row ones) are never read
        q_rows = tl.maximum(seqlen_q, 1)
    else:
        q_rows = seqlen_q
    for g in range(kv_group):
        h = kv_h * kv_group + g
        bh = b * num_heads + h
        Qh = Q + b * stride_qb + h * stride_qh
        DOh = DO + b * stride_dob + h * stride_doh
        LSEh = LSE + lse_base + h * lse_head
        Deltah = Delta + lse_base + h * lse_head
        if ALIBI:
            alibi_log2 = tl.load(Alibi + b * stride_alibi_b + h) * LOG2E
        else:
            alibi_log2 = 0.0
        if TMA:
            Qh = tl.make_tensor_descriptor(Qh, shape=[q_rows, HEAD_DIM], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
            DOh = tl.make_tensor_descriptor(DOh, shape=[q_rows, HEAD_DIM], strides=[stride_dos, 1],
                                            block_shape=[BLOCK_M, BLOCK_D])
        if WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, DK, stride_qs, stride_dos, 0, offs_n,
                                     offs_d, lo, full_lo, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                                     window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                     rng_offset, bh, HEAD_DIM, BLOCK_M, EVEN_M, True, EVEN_D, QUERY_MAJOR, TMA, 0,
                                     WINDOW, SOFTCAP, ALIBI, DROPOUT)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, DK, stride_qs, stride_dos, 0, offs_n,
                                 offs_d, full_lo, full, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                                 window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                 rng_offset, bh, HEAD_DIM, BLOCK_M, EVEN_M, False, EVEN_D, QUERY_MAJOR, TMA, 0,
                                 WINDOW, SOFTCAP, ALIBI, DROPOUT)
        if WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, DK, stride_qs, stride_dos, 0, offs_n,
                                     offs_d, full, end, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                                     window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                     rng_offset, bh, HEAD_DIM, BLOCK_M, EVEN_M, True, EVEN_D, QUERY_MAJOR, TMA, 0,
                                     WINDOW, SOFTCAP, ALIBI, DROPOUT)
    # line 18: write dK_j (scaled once: S = scale * Q K^T) and dV_j
    _store_tile(DK + offs_n[:, None] * stride_dks + offs_d[None, :],
                (dk * softmax_scale).to(DK.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)
    _store_tile(DV + offs_n[:, None] * stride_dvs + offs_d[None, :],
                dv.to(DV.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)


@triton.jit
def _flash_bwd_dq_features_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    kv_group, window_left, window_right, softcap_log2, dropout_p, Alibi, stride_alibi_b,
    CuSeqQ, CuSeqK, RngSeed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """One program per (query block, batch x head) owns dQ_i (FA2 Alg. 2 line 15), reading kv
    head h // kv_group, over the key blocks the forward visited."""
    start_m = _query_block_start(CAUSAL, BLOCK_M)
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    kv_h = h // kv_group
    if VARLEN:
        q_start, len_q = _seq_bounds(CuSeqQ, b)
        k_start, len_k = _seq_bounds(CuSeqK, b)
        Q += q_start * stride_qs
        DO += q_start * stride_dos
        DQ += q_start * stride_dqs
        K += k_start * stride_ks
        V += k_start * stride_vs
        LSE += h * seqlen_q + q_start
        Delta += h * seqlen_q + q_start
        seqlen_q = len_q
        seqlen_k = len_k
    else:
        LSE += pid_bh.to(tl.int64) * seqlen_q
        Delta += pid_bh.to(tl.int64) * seqlen_q
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok, not EVEN_M, not EVEN_D)
    do = _load_tile(DO + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok, d_ok, not EVEN_M, not EVEN_D)
    lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TMA:
        if VARLEN:  # an empty sequence visits no key block: its descriptors (no zero-row ones) are never read
            kv_rows = tl.maximum(seqlen_k, 1)
        else:
            kv_rows = seqlen_k
        K = tl.make_tensor_descriptor(K, shape=[kv_rows, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[kv_rows, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    if ALIBI:
        alibi_log2 = tl.load(Alibi + b * stride_alibi_b + h) * LOG2E
    else:
        alibi_log2 = 0.0
    if DROPOUT:
        seed, rng_offset = _rng_state(RngSeed)
    else:
        seed = 0
        rng_offset = 0

    if WINDOW:
        lo, full_lo, full, end = _window_key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                    BLOCK_M, BLOCK_N)
    else:
        full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, False)
        lo = 0
        full_lo = 0
    if VARLEN:
        end = tl.where(start_m < seqlen_q, end, 0)
        full = tl.minimum(full, end)
        if WINDOW:
            full_lo = tl.minimum(full_lo, end)
    if WINDOW:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d, lo, full_lo,
                           seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_log2, alibi_log2,
                           dropout_p, seed, rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA,
                           WINDOW, SOFTCAP, ALIBI, DROPOUT)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d, full_lo, full,
                       seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_log2, alibi_log2,
                       dropout_p, seed, rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, False, EVEN_D, TMA,
                       WINDOW, SOFTCAP, ALIBI, DROPOUT)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d, full, end,
                       seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_log2, alibi_log2,
                       dropout_p, seed, rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA,
                       WINDOW, SOFTCAP, ALIBI, DROPOUT)
    _store_tile(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :],
                (dq * softmax_scale).to(DQ.dtype.element_ty), m_ok, d_ok, not EVEN_M, not EVEN_D)


_bwd_dkdv_features_launcher = CachedLauncher(_flash_bwd_dkdv_features_kernel)
_bwd_dq_features_launcher = CachedLauncher(_flash_bwd_dq_features_kernel)


def flash_attn_backward_features(do, q, k, v, out, lse, softmax_scale: float, causal: bool,
                                 config: BwdConfig | None, features: Features):
    """flash_attn_backward for calls with features or GQA/MQA: (dq, dk, dv) in the inputs' dtype,
    atomic-free (bit-identical between runs): what a deterministic feature backward runs."""
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    heads, headdim = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if features.varlen:
        batch = features.cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]  # token totals; the kernels read each sequence's
        rows, keys, stride_of = features.max_seqlen_q, features.max_seqlen_k, varlen_strides
        # D = rowsum(dO * O) row by row: the packed tensors as one sequence of all tokens
        pre_batch = 1
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        rows, keys, stride_of = seqlen_q, seqlen_k, strides
        pre_batch = batch
    if min(seqlen_q, seqlen_k, rows, keys, batch * heads) == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    qk_scale, feature_values, flags = feature_args(q, k, softmax_scale, causal, features)
    # any mask or score modification (causal is a window here), beyond GQA alone, takes the
    # features' table, but a softcap (takes_feature_tiles)
    cfg = config or default_bwd_config(headdim, q.device, masked_features=takes_feature_tiles(flags))
    block_d = padded_headdim(headdim)
    delta = torch.empty_like(lse)
    _bwd_preprocess_launcher[(cdiv(seqlen_q, 64), pre_batch * heads)](
        out, do, delta, delta, *stride_of(out), *stride_of(do), heads, seqlen_q,
        HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_M=64,
    )
    tma = bwd_uses_tma(cfg, q, k, v, do)
    if tma:
        ensure_descriptor_allocator()
    common = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "CAUSAL": causal, "TMA": tma, **flags}
    tensor_strides = (*stride_of(q), *stride_of(k), *stride_of(v), *stride_of(do))
    scalars = (heads, seqlen_q, seqlen_k, softmax_scale, qk_scale, *feature_values)
    _bwd_dkdv_features_launcher[(cdiv(keys, cfg.block_n1), batch * kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *tensor_strides, *stride_of(dk), *stride_of(dv), *scalars,
        BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1,
        EVEN_M=not features.varlen and seqlen_q % cfg.block_m1 == 0,
        EVEN_N=not features.varlen and seqlen_k % cfg.block_n1 == 0,
        QUERY_MAJOR=cfg.query_major, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
    )
    _bwd_dq_features_launcher[(cdiv(rows, cfg.block_m2), batch * heads)](
        q, k, v, do, lse, delta, dq, *tensor_strides, *stride_of(dq), *scalars,
        BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2, EVEN_M=not features.varlen and seqlen_q % cfg.block_m2 == 0,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **common,
    )
    return dq, dk, dv
