"""The FlashAttention-2 forward in Triton (FA2 Algorithm 1) and its launcher.

The code's shape follows Triton's fused-attention tutorial (python/tutorials/06-fused-attention.py):
an inner-loop helper, a `MASK` constexpr separating the off-diagonal (unmasked) key blocks from
the blocks that need a mask. The layout is flash-attn's (batch, seqlen, heads, headdim), read
through strides; head dims that are not powers of two are padded inside the kernel with masked
loads. On Hopper the tiles move with TMA descriptors where dispatch.fwd_memory_path says so.
A query row that sees no key outputs zeros and has logsumexp +inf, as flash-attn does.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import dispatch
from .checks import DENSE, Features, require_implemented
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
from .dispatch import FWD_MEMORY_PATHS, HOPPER_GLUON_PATH, flat_descriptor, fwd_memory_path
from .launch import CachedLauncher


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, lo, hi,
               seqlen_q, seqlen_k, qk_scale, kv_row0, col0,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               MASK: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """FA2 Alg. 1 lines 6-10 over key blocks [lo, hi). With TMA, K and V are tensor
    descriptors and this (batch, head)'s keys start at (kv_row0, col0): per-(batch, head)
    descriptors (TMA 1) are bounded at (seqlen_k, HEAD_DIM) and zero-fill past the ends; the
    host's 2D ones (TMA 2) are used only for whole blocks and unpadded head dims, so no tile
    reaches past this (batch, head)."""
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
            # only blocks that cross the diagonal or the end of the keys pay for a mask
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: subtract 0, not -inf (no NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            # line 9: P~ = exp(S - m_new), l = exp(m_old - m_new) l + rowsum(P~)
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
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


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
    """One program per (query block, batch x head): FA2's thread-block parallelism over the
    sequence (Section 3.2). O, l and m stay on chip for the program's whole life.
    TMA (FWD_MEMORY_PATHS): 0 = pointer tiles; 1 = Hopper's tensor memory accelerator with
    descriptors made here per (batch, head), bounded at the true seqlen and head dim; 2 = TMA
    with descriptors made on the host over (batch * seqlen, heads * head dim), addressed at
    this (batch, head)'s first row and column (the launcher checks that view is exact)."""
    start_m = _query_block_start(CAUSAL, BLOCK_M)
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    if TMA != 2:
        Q += b * stride_qb + h * stride_qh
        K += b * stride_kb + h * stride_kh
        V += b * stride_vb + h * stride_vh
        Out += b * stride_ob + h * stride_oh
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
    else:
        q_row0 = 0
        kv_row0 = 0
        col0 = 0
    if TMA == 1:
        Q = tl.make_tensor_descriptor(Q, shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                      block_shape=[BLOCK_M, BLOCK_D])
        K = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
    if TMA:
        q = Q.load([q_row0 + start_m, col0])
    else:
        q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                       not EVEN_M, not EVEN_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # lines 6-11: key blocks left of the diagonal unmasked, then the ones that need a mask
    full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_d,
                               0, full, seqlen_q, seqlen_k, qk_scale, kv_row0, col0,
                               HEAD_DIM, BLOCK_N, CAUSAL, False, EVEN_D, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_ks, stride_vs, offs_m, offs_d,
                               full, end, seqlen_q, seqlen_k, qk_scale, kv_row0, col0,
                               HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA)

    # lines 12-13: one final rescale O = diag(l)^-1 O, L = m + log(l)
    acc, lse = _finalize(acc, l_i, m_i)
    # lines 14-15: write O_i and L_i
    if TMA == 2:
        Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
    elif TMA:
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




# After a shape's first call, launched without Triton's per-call argument binding
# (kernels/launch.py; host time is what short calls wait on).
_fwd_launcher = CachedLauncher(_flash_fwd_kernel)


def flash_attn_forward(q, k, v, softmax_scale: float, causal: bool, config: FwdConfig | None = None,
                       features: Features = DENSE) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass on validated inputs (checks.check_call). Returns (out, lse): out like q, lse
    (batch, heads, seqlen_q) float32 natural-log logsumexp. `config` overrides the block-size table."""
    require_implemented(q, k, features)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seqlen_q), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:  # no key at all: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    cfg = config or default_fwd_config(headdim, causal, q.device)
    path = fwd_memory_path(cfg, q, k, v, out, causal)
    if path == HOPPER_GLUON_PATH:
        if on_hopper(q.device):
            try:
                dispatch.flash_attn_hopper.flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale, causal)
                return out, lse
            except dispatch.GLUON_BUILD_ERRORS as exc:
                dispatch.disable_gluon(exc)
        # a Hopper config passed for another device (the Gluon kernel is compiled for sm_90 only),
        # or a Triton whose Gluon cannot build it
        cfg = dataclasses.replace(cfg, hopper_gluon_min_keys=0)
        path = fwd_memory_path(cfg, q, k, v, out, causal)
    if path == "tma-host":
        args = tuple(flat_descriptor(t, rows) for t, rows in
                     ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, cfg.block_m)))
    else:
        args = (q, k, v, out)
        if path == "tma-kernel":
            ensure_descriptor_allocator()
    grid = (cdiv(seqlen_q, cfg.block_m), batch * heads)
    _fwd_launcher[grid](
        *args, lse,
        *strides(q), *strides(k), *strides(v), *strides(out),
        heads, seqlen_q, seqlen_k, softmax_scale * LOG2E.value,
        HEAD_DIM=headdim, BLOCK_D=padded_headdim(headdim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, EVEN_M=seqlen_q % cfg.block_m == 0, TMA=FWD_MEMORY_PATHS.index(path),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
