"""The pieces of the Triton backward (FA2 Algorithm 2) that the dense kernels (backward.py) and the
feature kernels (backward_features.py: windows, softcap, ALiBi, dropout, GQA, packed lengths)
share: the preprocessing kernel (D = rowsum(dO * O), Alg. 2 line 4), and the dK/dV and dQ loops
over one key block's query blocks (lines 8-16) and one query block's key blocks (lines 10-15)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, _batch_head, _load_tile
from .dropout import _dropout_keep
from .features import _in_window, _scores
from .launch import CachedLauncher


@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Delta, DQAccum,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    num_heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr = False,
):
    """FA2 Alg. 2 line 4: D = rowsum(dO * O), one float32 per query row. With ZERO_DQ, also
    line 3's dQ = 0 for the same rows of DQAccum, the fused dQ's float32 accumulator (fresh and
    contiguous, (batch, seqlen, heads, head dim)): one launch fewer than a separate memset;
    ZERO_DQ 2: every row of the program's block, past seqlen_q too (the varlen accumulator in
    register order, whose padded rows the grid covers whole: hopper/dq_cast.py's varlen_dq_accumulator)."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    # offsets in int64: a packed batch is one sequence here, whose rows x strides pass 2^31 from
    # total_q x heads x head dim = 2^31 on (as does batch x stride in a long dense batch)
    b64, rows64 = b.to(tl.int64), offs_m.to(tl.int64)[:, None]
    o = tl.load(Out + b64 * stride_ob + h * stride_oh + rows64 * stride_os + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b64 * stride_dob + h * stride_doh + rows64 * stride_dos + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seqlen_q + offs_m, tl.sum(o * do, 1),
             mask=offs_m < seqlen_q)
    if ZERO_DQ:
        row = (b64 * seqlen_q + offs_m) * num_heads + h
        if ZERO_DQ == 2:  # every row: the columns' bound alone, broadcast over the rows
            mask = (offs_d < HEAD_DIM)[None, :]
        tl.store(DQAccum + row[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=mask)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs, offs_n, offs_d,
                    lo, hi, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                    window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed, rng_offset, bh,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
                    MASK: tl.constexpr, EVEN_D: tl.constexpr, QUERY_MAJOR: tl.constexpr,
                    TMA: tl.constexpr, FUSED_DQ: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                    ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """FA2 Alg. 2 lines 8-16 for one key block over query blocks [lo, hi). Query rows past
    seqlen_q load L = +inf and dO = 0, so they contribute exactly nothing without a mask.
    Key-major (default): every matmul has the key block as M (S^T = K Q^T), K and V are
    register operands. Query-major: S = Q K^T and dP = dO V^T have the query block as M, and
    P and dS are transposed on chip for the dV and dK updates; K and V stay in shared memory.
    With TMA, Q and DO are tensor descriptors bounded at (seqlen_q, HEAD_DIM) (zero fill).
    FUSED_DQ (FA2 Alg. 2 line 15 as the paper has it): dQ_i += scale * dS K_j is added into the
    float32 accumulator DQ here, by a TMA reduce-add of the tile (2: DQ a descriptor bounded at
    (seqlen_q, HEAD_DIM)) or element-wise atomics (1: DQ a pointer); 0: the dQ kernel does it.
    WINDOW (MASK: the window's mask instead of the causal one), SOFTCAP, ALIBI, DROPOUT: the
    features (_bwd_features_probs, _bwd_features_ds); off, the dense steps compile as without them."""
    offs_m_base = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    FEATURES: tl.constexpr = WINDOW or SOFTCAP or ALIBI or DROPOUT
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base
        m_ok = offs_m < seqlen_q
        if TMA:
            if QUERY_MAJOR:
                q = Q.load([start_m, 0])
            else:
                qT = Q.load([start_m, 0]).T
            do = DO.load([start_m, 0])
        else:
            if QUERY_MAJOR:
                q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                               not EVEN_M, not EVEN_D)
            else:
                qT = _load_tile(Q + offs_d[:, None] + offs_m[None, :] * stride_qs, d_ok, m_ok,
                                not EVEN_D, not EVEN_M)
            do = _load_tile(DO + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok, d_ok,
                            not EVEN_M, not EVEN_D)
        if EVEN_M:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(Delta + offs_m)
        else:
            lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
        if FEATURES:
            if QUERY_MAJOR:  # tiles (query, key): S = Q K^T
                p, t, keep = _bwd_features_probs(tl.dot(q, tl.trans(k)), lse[:, None] * LOG2E, offs_m[:, None],
                                               offs_n[None, :], seqlen_q, seqlen_k, qk_scale, window_left,
                                               window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                               rng_offset, bh, MASK, SOFTCAP, ALIBI, DROPOUT)
                dv = tl.dot(tl.trans(_bwd_dropped(p, keep, dropout_p, DROPOUT).to(do.dtype)), do, dv)
                ds = _bwd_features_ds(p, t, keep, tl.dot(do, tl.trans(v)), delta[:, None], dropout_p, SOFTCAP,
                                      DROPOUT)
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
            else:  # tiles (key, query): S^T = K Q^T, the helpers called with the axes' roles swapped
                pT, tT, keepT = _bwd_features_probs(tl.dot(k, qT), lse[None, :] * LOG2E, offs_m[None, :],
                                                 offs_n[:, None], seqlen_q, seqlen_k, qk_scale, window_left,
                                                 window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                                 rng_offset, bh, MASK, SOFTCAP, ALIBI, DROPOUT)
                dv = tl.dot(_bwd_dropped(pT, keepT, dropout_p, DROPOUT).to(do.dtype), do, dv)
                dsT = _bwd_features_ds(pT, tT, keepT, tl.dot(v, tl.trans(do)), delta[None, :], dropout_p,
                                       SOFTCAP, DROPOUT)
                dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
        elif QUERY_MAJOR:
            # lines 10-11: recompute S = Q K^T and P = exp(S - L) (log2 domain)
            p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None] * LOG2E)
            if MASK:
                p = tl.where(offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q), p, 0.0)
            # line 12: dV += P^T dO
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
            # lines 13-14: dP = dO V^T, dS = P * (dP - D)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            # line 16: dK += dS^T Q (the softmax scale is applied once at the end)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
            if FUSED_DQ:  # line 15: dQ_i += scale * dS K_j
                _bwd_add_dq(DQ, tl.dot(ds.to(k.dtype), k) * softmax_scale, start_m, offs_m, offs_d, m_ok,
                            d_ok, stride_dqs, EVEN_M, EVEN_D, FUSED_DQ)
        else:
            # lines 10-11: recompute S^T = K Q^T and P^T = exp(S^T - L) (log2 domain)
            pT = tl.math.exp2(tl.dot(k, qT) * qk_scale - lse[None, :] * LOG2E)
            if MASK:
                pT = tl.where(offs_n[:, None] <= offs_m[None, :] + (seqlen_k - seqlen_q), pT, 0.0)
            # line 12: dV += P^T dO
            dv = tl.dot(pT.to(do.dtype), do, dv)
            # lines 13-14: dP^T = V dO^T, dS^T = P^T * (dP^T - D)
            dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
            # line 16: dK += dS^T Q (the softmax scale is applied once at the end)
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
            if FUSED_DQ:  # line 15: dQ_i += scale * dS K_j
                _bwd_add_dq(DQ, tl.dot(tl.trans(dsT.to(k.dtype)), k) * softmax_scale, start_m, offs_m, offs_d,
                            m_ok, d_ok, stride_dqs, EVEN_M, EVEN_D, FUSED_DQ)
    return dk, dv


@triton.jit
def _bwd_features_probs(s, lse2, rows, cols, seqlen_q, seqlen_k, qk_scale, window_left, window_right, softcap_log2,
                        alibi_log2, dropout_p, seed, rng_offset, bh, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                        ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """FA2 Alg. 2 lines 10-11 with the features: P = exp(S' - L) from raw dots `s`, S' the
    softcapped, ALiBi-biased scores (log2 units; lse2 = L * log2(e)), masked by the window where
    MASK. Returns (P, the softcap's tanh, dropout's keep-mask), the last two placeholders where
    their feature is off. `rows`/`cols` index the tile's queries/keys (2D, either orientation)."""
    s, t = _scores(s, qk_scale, softcap_log2, alibi_log2, rows, cols, seqlen_k - seqlen_q, SOFTCAP, ALIBI)
    p = tl.math.exp2(s - lse2)
    if MASK:
        p = tl.where(_in_window(rows, cols, seqlen_k - seqlen_q, window_left, window_right), p, 0.0)
    if DROPOUT:
        keep = _dropout_keep(seed, rng_offset, bh, rows, cols, dropout_p)
    else:
        keep = t
    return p, t, keep


@triton.jit
def _bwd_dropped(p, keep, dropout_p, DROPOUT: tl.constexpr):
    """P after dropout, Z * P / (1 - p) with Z the keep-mask: what dV = P^T dO sums (line 12)."""
    if DROPOUT:
        p = tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)
    return p


@triton.jit
def _bwd_features_ds(p, t, keep, dp, delta, dropout_p, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr):
    """Lines 13-14 with the features: dS = P * (dP - D), dP taken back through dropout
    (Z dP / (1 - p)) and dS through the softcap (times 1 - tanh^2). D = rowsum(dO * O) holds
    with dropout as without: O is the dropped P times V."""
    if DROPOUT:
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _bwd_add_dq(DQ, dq, start_m, offs_m, offs_d, m_ok, d_ok, stride_dqs, EVEN_M: tl.constexpr,
                EVEN_D: tl.constexpr, FUSED_DQ: tl.constexpr):
    """Add one program's share of dQ_i into the float32 accumulator that every key block adds
    to: one TMA reduce-add of the tile (FUSED_DQ 2, rows past seqlen_q dropped by the
    descriptor's bounds) or element-wise atomics (1)."""
    if FUSED_DQ == 2:
        DQ.atomic_add([start_m, 0], dq)
    else:
        ptrs = DQ + offs_m[:, None] * stride_dqs + offs_d[None, :]
        if EVEN_M and EVEN_D:
            tl.atomic_add(ptrs, dq, sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, mask=m_ok[:, None] & d_ok[None, :], sem="relaxed")



@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d, lo, hi,
                  seqlen_q, seqlen_k, qk_scale,
                  window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed, rng_offset, bh,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  MASK: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """FA2 Alg. 2 lines 10-15 for one query block over key blocks [lo, hi). With TMA, K and V
    are tensor descriptors bounded at (seqlen_k, HEAD_DIM) (zero fill). `lse` is in log2 units.
    WINDOW, SOFTCAP, ALIBI, DROPOUT as in _bwd_dkdv_inner."""
    offs_n_base = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    FEATURES: tl.constexpr = WINDOW or SOFTCAP or ALIBI or DROPOUT
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        n_ok = offs_n < seqlen_k
        if TMA:
            kT = K.load([start_n, 0]).T
            vT = V.load([start_n, 0]).T
        else:
            kT = _load_tile(K + offs_d[:, None] + offs_n[None, :] * stride_ks, d_ok, n_ok,
                            not EVEN_D, MASK)
            vT = _load_tile(V + offs_d[:, None] + offs_n[None, :] * stride_vs, d_ok, n_ok,
                            not EVEN_D, MASK)
        if FEATURES:
            p, t, keep = _bwd_features_probs(tl.dot(q, kT), lse[:, None], offs_m[:, None], offs_n[None, :],
                                             seqlen_q, seqlen_k, qk_scale, window_left, window_right,
                                             softcap_log2, alibi_log2, dropout_p, seed, rng_offset, bh,
                                             MASK and WINDOW, SOFTCAP, ALIBI, DROPOUT)
            if MASK:  # keys past seqlen_k (zeros) could overflow P under ALiBi: inf * 0 in dS K is NaN
                p = tl.where(n_ok[None, :], p, 0.0)
            ds = _bwd_features_ds(p, t, keep, tl.dot(do, vT), delta[:, None], dropout_p, SOFTCAP, DROPOUT)
        else:
            # lines 10-11: P = exp(S - L)
            p = tl.math.exp2(tl.dot(q, kT) * qk_scale - lse[:, None])
            if MASK:
                visible = n_ok[None, :]
                if CAUSAL:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
                p = tl.where(visible, p, 0.0)
            # lines 13-14: dP = dO V^T, dS = P * (dP - D)
            ds = p * (tl.dot(do, vT) - delta[:, None])
        # line 15: dQ += dS K
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq




_bwd_preprocess_launcher = CachedLauncher(_bwd_preprocess_kernel)
