"""The FlashAttention-2 forward in Triton (FA2 Algorithm 1) and its launcher.

The code's shape follows Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py):
an inner-loop helper, a `MASK` constexpr separating the off-diagonal (unmasked) key blocks from
the blocks that need a mask. The layout is flash-attn's (batch, seqlen, heads, headdim), read
through strides; head dims that are not powers of two are padded inside the kernel with masked
loads. On Hopper the tiles move with TMA descriptors where dispatch.fwd_memory_path says so.
A query row that sees no key outputs zeros and has logsumexp +inf, as flash-attn does.

Two entry points share one program (`_fwd_program`): `_flash_fwd_kernel` for dense attention,
whose launch passes nothing for the features, and `_flash_fwd_features_kernel` for GQA/MQA,
sliding windows, softcap, ALiBi, dropout and packed variable lengths, each a constexpr flag, so
the dense program compiles as if the features did not exist.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import triton
import triton.language as tl

from . import dispatch
from .checks import DENSE, Features
from .common import (
    LOG2E,
    _batch_head,
    _finalize,
    _key_range,
    _load_tile,
    _query_block_start,
    _store_tile,
    cdiv,
    ensure_descriptor_allocator,
    last_dim_contiguous,
    strides,
)
from .configs import FwdConfig, default_fwd_config, on_hopper, padded_headdim
from .dispatch import (
    FWD_MEMORY_PATHS,
    GluonPath,
    flat_descriptor,
    fwd_memory_path,
)
from .dropout import _dropout_keep, _rng_state
from .features import _in_window, _scores, _seq_bounds, _window_key_blocks, feature_args
from .launch import CachedLauncher, DirectLaunch, PlanCache, descriptor_like, descriptor_template
from .row_chunks import GRID_ROWS, forward_in_chunks, row_spans, spans_of


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, lo, hi,
               seqlen_q, seqlen_k, qk_scale, kv_row0, col0,
               window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed, rng_offset, pid_bh,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               MASK: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """FA2 Alg. 1 lines 6-10 over key blocks [lo, hi). With TMA, K and V are tensor
    descriptors and this (batch, head)'s keys start at (kv_row0, col0): per-(batch, head)
    descriptors (TMA 1) are bounded at (seqlen_k, HEAD_DIM) and zero-fill past the ends; the
    host's 2D ones (TMA 2) are used only for whole blocks and unpadded head dims, so no tile
    reaches past this (batch, head). WINDOW, SOFTCAP, ALIBI, DROPOUT: kernels/features.py and
    kernels/dropout.py (all off on the dense path, which then compiles as without them)."""
    offs_n_base = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        n_ok = offs_n < seqlen_k
        # line 7: load K_j^T (BLOCK_D, BLOCK_N) and V_j (BLOCK_N, BLOCK_D)
        if TMA:
            kT = K.load([kv_row0 + start_n, col0]).T
            v = V.load([kv_row0 + start_n, col0])
        else:
            kT = _load_tile(K + offs_d[:, None] + offs_n[None, :] * stride_kn, d_ok, n_ok,
                            not EVEN_D, MASK)
            v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :], n_ok, d_ok,
                           MASK, not EVEN_D)
        # line 8: S = Q K^T, kept unscaled; the softmax scale * log2(e) is folded into the
        # exponent below (one FMA per score instead of a multiply and a subtract)
        s = tl.dot(q, kT)
        if MASK:
            # only blocks that cross the diagonal, the window's edges or the end of the keys pay for a mask
            visible = n_ok[None, :]
            if WINDOW:
                visible = visible & _in_window(offs_m[:, None], offs_n[None, :], seqlen_k - seqlen_q,
                                               window_left, window_right)
            elif CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
            if SOFTCAP or ALIBI:
                s, _ = _scores(s, qk_scale, softcap_log2, alibi_log2, offs_m[:, None], offs_n[None, :],
                               seqlen_k - seqlen_q, SOFTCAP, ALIBI)
                s = tl.where(visible, s, float("-inf"))
            else:
                s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: subtract 0, not -inf (no NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            # line 9: P~ = exp(S - m_new), l = exp(m_old - m_new) l + rowsum(P~)
            p = tl.math.exp2(s - m_sub[:, None])
        elif SOFTCAP or ALIBI:
            s, _ = _scores(s, qk_scale, softcap_log2, alibi_log2, offs_m[:, None], offs_n[None, :],
                           seqlen_k - seqlen_q, SOFTCAP, ALIBI)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_new
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_sub = m_new
            # line 9, as above, with S scaled inside the exponent's FMA (qk_scale > 0, so
            # max(S) * qk_scale is the scaled row max)
            p = tl.math.exp2(s * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        # line 10: O = diag(exp(m_old - m_new)) O + P~ V  -- unnormalised, no 1/l here
        acc = acc * alpha[:, None]
        if DROPOUT:  # l (and so the logsumexp) sums the kept and the dropped; O only the kept
            p = tl.where(_dropout_keep(seed, rng_offset, pid_bh, offs_m[:, None], offs_n[None, :], dropout_p),
                         p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_program(
    Q, K, V, Out, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads, seqlen_q, seqlen_k, qk_scale,
    kv_group, window_left, window_right, softcap_log2, dropout_p, Alibi, stride_alibi_b,
    CuSeqQ, CuSeqK, RngSeed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """One program per (query block, batch x head): FA2's thread-block parallelism over the
    sequence (Section 3.2). O, l and m stay on chip for the program's whole life.
    TMA (FWD_MEMORY_PATHS): 0 = pointer tiles; 1 = Hopper's tensor memory accelerator with
    descriptors made here per (batch, head), bounded at the true seqlen and head dim; 2 = TMA
    with descriptors made on the host over (batch * seqlen, heads * head dim), addressed at
    this (batch, head)'s first row and column (the launcher checks that view is exact).
    GQA/MQA: q head h reads kv head h // kv_group. VARLEN: "batch" is the sequence index of
    packed tensors (batch strides 0), seqlen_q/k arrive as the total token counts and become
    the sequence's lengths; the grid spans the longest sequence and programs past a sequence's
    end visit no key and store nothing; TMA 1 then describes K and V only."""
    start_m = _query_block_start(CAUSAL, BLOCK_M)
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    kv_h = h // kv_group
    if VARLEN:
        q_start, len_q = _seq_bounds(CuSeqQ, b)
        k_start, len_k = _seq_bounds(CuSeqK, b)
        Q += q_start * stride_qs
        Out += q_start * stride_os
        K += k_start * stride_ks
        V += k_start * stride_vs
        LSE += h * seqlen_q + q_start  # (heads, total_q)
        seqlen_q = len_q
        seqlen_k = len_k
    if TMA != 2:
        Q += b * stride_qb + h * stride_qh
        K += b * stride_kb + kv_h * stride_kh
        V += b * stride_vb + kv_h * stride_vh
        Out += b * stride_ob + h * stride_oh
    if not VARLEN:
        LSE += pid_bh.to(tl.int64) * seqlen_q

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM

    # line 4: load Q_i; line 5: O = 0, l = 0, m = -inf
    if TMA == 2:  # where this (batch, head) starts in the host descriptors' 2D view
        q_row0 = (b * seqlen_q).to(tl.int32)
        kv_row0 = (b * seqlen_k).to(tl.int32)
        col0 = (h * HEAD_DIM).to(tl.int32)
        kv_col0 = (kv_h * HEAD_DIM).to(tl.int32)
    else:
        q_row0 = 0
        kv_row0 = 0
        col0 = 0
        kv_col0 = 0
    if TMA == 1:
        if VARLEN:  # K and V only (Q and O by pointers: a sequence may be empty); no zero-row descriptor
            kv_rows = tl.maximum(seqlen_k, 1)
        else:
            Q = tl.make_tensor_descriptor(Q, shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                          block_shape=[BLOCK_M, BLOCK_D])
            kv_rows = seqlen_k
        K = tl.make_tensor_descriptor(K, shape=[kv_rows, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[kv_rows, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    if TMA and not VARLEN:
        q = Q.load([q_row0 + start_m, col0])
    else:
        q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                       not EVEN_M, not EVEN_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if ALIBI:
        alibi_log2 = tl.load(Alibi + b * stride_alibi_b + h) * LOG2E
    else:
        alibi_log2 = 0.0
    if DROPOUT:
        seed, rng_offset = _rng_state(RngSeed)
    else:
        seed = 0
        rng_offset = 0

    # lines 6-11: key blocks left of the diagonal unmasked, then the ones that need a mask; a
    # window adds masked blocks at its left edge and skips the blocks outside it
    if WINDOW:
        lo, full_lo, full, end = _window_key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                    BLOCK_M, BLOCK_N)
    else:
        full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        lo = 0
        full_lo = 0
    if VARLEN:  # a program past its sequence's last query block visits nothing
        end = tl.where(start_m < seqlen_q, end, 0)
        full = tl.minimum(full, end)
        if WINDOW:
            full_lo = tl.minimum(full_lo, end)
    if WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_d,
                                   lo, full_lo, seqlen_q, seqlen_k, qk_scale, kv_row0, kv_col0,
                                   window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                                   rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA,
                                   WINDOW, SOFTCAP, ALIBI, DROPOUT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_d,
                               full_lo, full, seqlen_q, seqlen_k, qk_scale, kv_row0, kv_col0,
                               window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                               rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, False, EVEN_D, TMA,
                               WINDOW, SOFTCAP, ALIBI, DROPOUT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_d,
                               full, end, seqlen_q, seqlen_k, qk_scale, kv_row0, kv_col0,
                               window_left, window_right, softcap_log2, alibi_log2, dropout_p, seed,
                               rng_offset, pid_bh, HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA,
                               WINDOW, SOFTCAP, ALIBI, DROPOUT)

    # lines 12-13: one final rescale O = diag(l)^-1 O, L = m + log(l)
    if DROPOUT:  # the kept entries are scaled by 1 / (1 - p)
        acc = acc * (1.0 / (1.0 - dropout_p))
    acc, lse = _finalize(acc, l_i, m_i)
    # lines 14-15: write O_i and L_i
    if TMA == 2:
        Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
    elif TMA and not VARLEN:
        out_desc = tl.make_tensor_descriptor(Out, shape=[seqlen_q, HEAD_DIM], strides=[stride_os, 1],
                                             block_shape=[BLOCK_M, BLOCK_D])
        out_desc.store([start_m, 0], acc.to(Out.dtype.element_ty))  # clipped at the bounds
    else:
        _store_tile(Out + offs_m[:, None] * stride_os + offs_d[None, :], acc.to(Out.dtype.element_ty),
                    m_ok, d_ok, not EVEN_M, not EVEN_D)
    if EVEN_M:
        tl.store(LSE + offs_m, lse)
    else:
        tl.store(LSE + offs_m, lse, mask=m_ok)


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
):
    """Dense attention (as many kv heads as q heads, causal or not): _fwd_program with every
    feature off, launched with no argument for them (host time is what short calls wait on)."""
    _fwd_program(Q, K, V, Out, LSE, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                 num_heads, seqlen_q, seqlen_k, qk_scale,
                 1, 0, 0, 0.0, 0.0, None, 0, None, None, None,
                 HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, EVEN_M, TMA,
                 False, False, False, False, False)


@triton.jit
def _flash_fwd_features_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads, seqlen_q, seqlen_k, qk_scale,
    kv_group, window_left, window_right, softcap_log2, dropout_p, Alibi, stride_alibi_b,
    CuSeqQ, CuSeqK, RngSeed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """GQA/MQA, sliding windows, softcap, ALiBi, dropout and packed variable lengths
    (kernels/features.py's `feature_args`): _fwd_program with those arguments."""
    _fwd_program(Q, K, V, Out, LSE, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                 num_heads, seqlen_q, seqlen_k, qk_scale,
                 kv_group, window_left, window_right, softcap_log2, dropout_p, Alibi, stride_alibi_b,
                 CuSeqQ, CuSeqK, RngSeed,
                 HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, EVEN_M, TMA,
                 WINDOW, SOFTCAP, ALIBI, DROPOUT, VARLEN)


# After a shape's first call, launched without Triton's per-call argument binding
# (kernels/launch.py; host time is what short calls wait on).
_fwd_launcher = CachedLauncher(_flash_fwd_kernel)
_fwd_features_launcher = CachedLauncher(_flash_fwd_features_kernel)


def flash_attn_forward(q, k, v, softmax_scale: float, causal: bool, config: FwdConfig | None = None,
                       features: Features = DENSE) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass on validated inputs (checks.check_call). Returns (out, lse): out like q, lse
    (batch, heads, seqlen_q) float32 natural-log logsumexp ((heads, total_q) for packed variable
    lengths). `config` overrides the block-size table. Calls with any feature, or fewer kv heads
    than q heads, run _flash_fwd_features_kernel, or on Hopper the Gluon kernel where
    dispatch.fwd_memory_path sends them (no dropout; packed variable lengths with no other feature
    take the Gluon varlen kernel).

    Dense calls run a per-shape plan (`_dense_plan`): which kernel and memory path, the grid, the
    constexprs and descriptor templates are decided once per (shapes, strides, dtype, alignment,
    config, device), so a repeated shape costs the host two allocations and one direct launch.
    More (batch x head) rows than a grid axis takes run in chunks of batch rows (row_chunks.py)."""
    if features is not DENSE or k.shape[-2] != q.shape[-2]:
        spans = spans_of(q, features)
        if spans:
            return forward_in_chunks(flash_attn_forward, spans, q, k, v, softmax_scale, causal, config, features)
        return _forward_features(q, k, v, softmax_scale, causal, config, features)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    batch, seqlen_q, heads, headdim = q.shape
    if batch * heads > GRID_ROWS:
        return forward_in_chunks(flash_attn_forward, row_spans(batch, heads), q, k, v, softmax_scale, causal, config,
                                 features)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seqlen_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no key at all: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    # the config passed (None: the table's, which head dim, causal and device fix, as they fix
    # whether the device is Hopper), so a repeated call hashes no config and asks no table
    device = q.device
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, device, causal, config,
           q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, dispatch.gluon_unavailable)
    plan = _PLANS.get(key) or _PLANS.put(key, _dense_plan(q, k, v, out, causal,
                                                          config or default_fwd_config(headdim, causal, device)))
    try:
        plan(q, k, v, out, lse, softmax_scale)
    except dispatch.GLUON_BUILD_ERRORS as exc:
        if not getattr(plan, "gluon", False):
            raise
        dispatch.disable_gluon(exc)  # a Triton whose Gluon cannot build it: the Triton kernel from now on
        _PLANS.clear()
        return flash_attn_forward(q, k, v, softmax_scale, causal, config)
    return out, lse


_PLANS = PlanCache()


def _dense_plan(q, k, v, out, causal: bool, cfg: FwdConfig):
    """The dense forward for tensors like these, as a function of (q, k, v, out, lse, softmax_scale)."""
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    path = fwd_memory_path(cfg, q, k, v, out, causal)
    if path in (GluonPath.DENSE, GluonPath.PACKED):
        if on_hopper(q.device):
            hopper = dispatch.flash_attn_hopper
            rows = dispatch.fwd_gluon_rows(cfg, causal=causal, keys=seqlen_k)
            gluon_runs = []  # made by the first call (where the kernel compiles, or fails to)

            def run_gluon(q, k, v, out, lse, softmax_scale):
                if not gluon_runs:
                    gluon_runs.append(hopper.forward_hopper_plan(q, k, v, out, causal, block_n=cfg.hopper_gluon_block_n,
                                                                 block_m=rows, schedule=cfg))
                gluon_runs[0](q, k, v, out, lse, softmax_scale)

            def run_gluon_packed(q, k, v, out, lse, softmax_scale):
                forward_packed(q, k, v, out, lse, softmax_scale * LOG2E.value, causal, cfg, rows)

            run = run_gluon if path == GluonPath.DENSE else run_gluon_packed
            run.gluon = True
            return run
        # a Hopper config passed for another device: the Gluon kernel is compiled for sm_90 only
        cfg = dataclasses.replace(cfg, hopper_gluon_min_keys=0)
        path = fwd_memory_path(cfg, q, k, v, out, causal)
    constexprs = {"HEAD_DIM": headdim, "BLOCK_D": padded_headdim(headdim), "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, "CAUSAL": causal, "EVEN_M": seqlen_q % cfg.block_m == 0,
                  "TMA": FWD_MEMORY_PATHS.index(path), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    launch = DirectLaunch(sys.modules[__name__], "_fwd_launcher", (cdiv(seqlen_q, cfg.block_m), batch * heads),
                          constexprs)
    ints = (*strides(q), *strides(k), *strides(v), *strides(out), heads, seqlen_q, seqlen_k)
    if path == "tma-host":
        q_t, k_t, v_t, o_t = (descriptor_template(flat_descriptor(t, rows)) for t, rows in
                              ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, cfg.block_m)))

        def run_host_descriptors(q, k, v, out, lse, softmax_scale):
            launch(descriptor_like(q_t, q), descriptor_like(k_t, k), descriptor_like(v_t, v),
                   descriptor_like(o_t, out), lse, *ints, softmax_scale * LOG2E.value)

        return run_host_descriptors

    def run(q, k, v, out, lse, softmax_scale):
        if path == "tma-kernel":
            ensure_descriptor_allocator()
        launch(q, k, v, out, lse, *ints, softmax_scale * LOG2E.value)

    return run


def forward_packed(q, k, v, out, lse, qk_scale: float, causal: bool, cfg: FwdConfig, block_m: int) -> None:
    """A dense call on the Gluon varlen forward (dispatch.GluonPath.PACKED): the batch
    rows of q, k, v and out as packed sequences of seqlen_q queries and seqlen_k keys each, the
    logsumexp written straight into the dense (batch, heads, seqlen_q) `lse`; `block_m` query rows a
    program (dispatch.fwd_gluon_rows), the rest of the kernel's tiles as `cfg` says."""
    packed = dispatch.packed_features(q, k)
    varlen_forward_gluon(*(dispatch.packed_view(t) for t in (q, k, v, out)), lse, packed.cu_seqlens_q,
                         packed.cu_seqlens_k, q.shape[1], k.shape[1], qk_scale, causal, cfg, block_m)


def varlen_forward_gluon(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                         qk_scale: float, causal: bool, cfg: FwdConfig, block_m: int) -> None:
    """The Gluon varlen forward (flash_attn_hopper.flash_attn_varlen_forward_hopper's arguments, the
    config's key block and schedule) through a per-shape plan (varlen_forward_hopper_plan), keyed by
    what its launch depends on: shapes, strides, dtypes, every pointer's 16-byte alignment (Triton
    specialises on it), the batch and longest lengths, causal, the tiles and the schedule."""
    hopper = dispatch.flash_attn_hopper
    batch = cu_seqlens_q.shape[0] - 1
    key = ("gluon-varlen", q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), lse.shape,
           lse.stride(), q.dtype, q.device, batch, max_seqlen_q, max_seqlen_k, causal, cfg.hopper_gluon_block_n,
           block_m, tuple(hopper.forward_schedule(cfg).values()), cfg.hopper_gluon_head_section,
           cfg.hopper_gluon_persistent_below_keys, *(t.data_ptr() % 16 for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)))
    plan = _PLANS.get(key) or _PLANS.put(key, hopper.varlen_forward_hopper_plan(
        q, k, v, out, lse, batch, max_seqlen_q, max_seqlen_k, causal, cfg.hopper_gluon_block_n, block_m, cfg))
    plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, qk_scale)


def _forward_features_gluon(q, k, v, out, lse, causal: bool, features: Features, qk_scale: float,
                            feature_values: tuple, cfg: FwdConfig, block_m: int) -> None:
    """The Gluon forward (kernels/flash_attn_hopper.py) for a call with GQA/MQA, a window, softcap
    or ALiBi, through a per-shape plan keyed like the dense one's
    plus the feature flags, the config's Gluon tiles and `block_m` (dispatch.fwd_gluon_rows)."""
    hopper = dispatch.flash_attn_hopper
    flags = dispatch.gluon_feature_flags(features, causal)
    key = ("gluon", q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal,
           tuple(flags.values()), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, cfg.hopper_gluon_block_n,
           block_m, tuple(hopper.forward_schedule(cfg).values()), cfg.hopper_gluon_head_section,
           cfg.hopper_gluon_persistent_below_keys)
    plan = _PLANS.get(key) or _PLANS.put(key, hopper.forward_hopper_plan(
        q, k, v, out, causal, flags=flags, block_n=cfg.hopper_gluon_block_n, block_m=block_m,
        schedule=cfg))
    _, window_left, window_right, softcap_log2, _, alibi, stride_alibi_b, _, _, _ = feature_values
    plan(q, k, v, out, lse, qk_scale, (qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b))


def _memory_path_args(path: str, cfg: FwdConfig, q, k, v, out) -> tuple:
    """The kernel's first four arguments on this memory path: tensors, or host-made descriptors
    (as flash_attn_forward's dense path makes them inline)."""
    if path == "tma-host":
        return tuple(flat_descriptor(t, rows) for t, rows in
                     ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, cfg.block_m)))
    if path == "tma-kernel":
        ensure_descriptor_allocator()
    return q, k, v, out


def varlen_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, sequence and head strides of a packed (total, heads, headdim) tensor: the kernels
    find each sequence from cu_seqlens, so the batch stride is 0."""
    return 0, t.stride(0), t.stride(1)


def _forward_features(q, k, v, softmax_scale: float, causal: bool, config: FwdConfig | None,
                      features: Features) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_forward for calls with features (kernels/features.py) or GQA/MQA."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    heads, headdim = q.shape[-2], q.shape[-1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if features.varlen:
        batch = features.cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]  # token totals; the kernel reads each sequence's
        rows, keys, stride_of = features.max_seqlen_q, features.max_seqlen_k, varlen_strides
        lse = torch.empty((heads, seqlen_q), device=q.device, dtype=torch.float32)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        rows, keys, stride_of = seqlen_q, seqlen_k, strides
        lse = torch.empty((batch, heads, seqlen_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0 or keys == 0:  # no key at all: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    cfg = config or default_fwd_config(headdim, causal, q.device)
    path = fwd_memory_path(cfg, q, k, v, out, causal, features)
    qk_scale, feature_values, flags = feature_args(q, k, softmax_scale, causal, features)
    if path in (GluonPath.DENSE, GluonPath.PACKED):
        if on_hopper(q.device):
            # `rows` stays the Triton fallback's grid
            gluon_rows = dispatch.fwd_gluon_rows(cfg, features, causal,
                                                 features.max_seqlen_k if features.varlen else seqlen_k)
            try:
                if features.varlen:
                    varlen_forward_gluon(q, k, v, out, lse, features.cu_seqlens_q, features.cu_seqlens_k,
                                         features.max_seqlen_q, features.max_seqlen_k, qk_scale, causal, cfg,
                                         gluon_rows)
                elif path == GluonPath.PACKED:
                    forward_packed(q, k, v, out, lse, qk_scale, causal, cfg, gluon_rows)
                else:
                    _forward_features_gluon(q, k, v, out, lse, causal, features, qk_scale, feature_values, cfg,
                                            gluon_rows)
                return out, lse
            except dispatch.GLUON_BUILD_ERRORS as exc:
                dispatch.disable_gluon(exc)  # a Triton whose Gluon cannot build it: the Triton kernel from now on
                _PLANS.clear()
        cfg = dataclasses.replace(cfg, hopper_gluon_min_keys=0)  # the Gluon kernel is compiled for sm_90 only
        path = fwd_memory_path(cfg, q, k, v, out, causal, features)
    _fwd_features_launcher[(cdiv(rows, cfg.block_m), batch * heads)](
        *_memory_path_args(path, cfg, q, k, v, out), lse,
        *stride_of(q), *stride_of(k), *stride_of(v), *stride_of(out),
        heads, seqlen_q, seqlen_k, qk_scale, *feature_values,
        HEAD_DIM=headdim, BLOCK_D=padded_headdim(headdim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, EVEN_M=not features.varlen and seqlen_q % cfg.block_m == 0,
        TMA=FWD_MEMORY_PATHS.index(path), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    return out, lse
