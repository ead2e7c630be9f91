"""The FA1 -> FA2 ablation ladder: rungs 0-3 of one Triton kernel family, forward only.

Each rung adds one technique of the FlashAttention-2 paper (Dao, 2023, arXiv 2307.08691,
Section 3) to the one before; the rest of the code, the tile's area, the warps and the
pipelining depth (num_stages) are shared, so the difference between two neighbouring rungs is
the technique (a constexpr flag, the grid and loop order, or the tile's sides):

  rung 0  FA1 (Dao et al., 2022, Algorithm 1): one program per (batch, head); outer loop over
          K/V blocks (line 5), inner loop over Q blocks (line 7); O, l and m live in HBM and
          are read and written at every inner step (lines 8 and 13, fp32 running buffers); O
          renormalised by 1/l_new at every step (line 12); exp with the softmax scale applied
          separately (line 9); m and l stored for the backward; causal: fully masked blocks
          skipped (`skip_masked_blocks=False` computes them too), the mask applied to every
          other block.
  rung 1  + fewer non-matmul FLOPs (FA2 Section 3.1, Algorithm 1 lines 8-10 and 12-13), flag
          FEWER_NONMATMUL: O kept unnormalised and rescaled only by exp(m_old - m_new); one
          1/l per row at the end; logsumexp stored instead of m and l; exp2 with log2(e)
          folded into the scale; the causal mask only on blocks that cross the diagonal.
          Same grid, loop order, tiles, warps and stages as rung 0.
  rung 2  + parallelism over the sequence (FA2 Section 3.2, Algorithm 1 line 3 as the grid):
          a second kernel whose grid is (query blocks, batch x heads), loops swapped: each
          program owns one Q block and keeps O, l, m on chip for its whole life. Same tiles,
          warps and stages, so warps still split the keys.
  rung 3  + split-Q warp partitioning (FA2 Section 3.3): the same kernel as rung 2 with the
          tile's sides swapped (same area, warps and stages), for which the compiler assigns
          warps to query rows. This is FA2.
Rung 4 (the production kernel, kernels/forward.py) is outside this file and changes several
things at once (ablations/ladder.py).

How the warp split is chosen (the design decision). Rungs 0-3 are compiled to mma.sync
(Triton's MMA v2, the A100's instruction, as in the paper) by setting DISABLE_MMA_V3=1 while
Triton compiles them (`_mma_sync_only`; the variable is read by the AccelerateMatmul pass and is
part of the compile cache key, `triton._C.libtriton.get_cache_invalidating_env_vars`).
Triton 3.6 then picks the warp layout of an attention loop's two chained dots
(lib/Dialect/TritonGPU/Transforms/AccelerateMatmul.cpp, `warpsPerTileV2`): the dot rewritten
first, which is P@V (the pass runs bottom-up), gets warpsPerCTA = [num_warps, 1] if its
output is at least as tall as wide, else [1, num_warps], and S = Q K^T copies it. So with
BLOCK_M < BLOCK_D the warps split the columns of S (the keys: FA1's split-K), the softmax
row statistics are reduced across warps through shared memory, and P crosses warps through
shared memory before P@V (each warp then owns a slice of O's columns); with BLOCK_M >=
BLOCK_D the warps split the query rows (split-Q) and nothing crosses warps. This was checked
by compiling for sm_90 (TTGIR `#ttg.nvidia_mma<{versionMajor = 2, warpsPerCTA = ...}>`,
docs/performance.md, the ablation ladder) and is asserted by the launcher (`warp_split`).
The two splits cannot share one tile shape, so rung 3 keeps rung 2's tile area, warps and
stages and swaps the tile's sides (BLOCK_M x BLOCK_N = 64 x 128 -> 128 x 64 at head dim 128);
kernels/ladder_warp_split.py measures the splits at one tile, in Gluon. Triton's split-K
exchanges P (BLOCK_M x BLOCK_N fp16) where FA1's CUDA kernel summed partial O (warps x
BLOCK_M x D fp32), so it communicates less than FA1 did: the split-Q gain measured here
understates what removing FA1's own exchange gains. Split-K written in this Triton family as
a batched 3D dot with cross-warp sums was rejected: it ran 7x slower than split-Q on the H200,
a cost that is not FA1's (the Gluon pair writes FA1's exchange with explicit layouts).

Differences and cautions:
* forward only: the backward ladder is kernels/ladder_backward.py; gradients of these rungs
  come from the FA2 backward with `logsumexp_from_stats(stats)`;
* rungs 0-1 write each Q block's output in its dtype at the last K/V block that block sees
  (as FA1's CUDA kernel does with its fp32 `o_tmp` buffer), so neither needs a pass over O
  after the loop; their first K/V block starts from line 2's initial O, l, m without reading;
* split-Q needs BLOCK_M >= BLOCK_D, so at head dim 256 rung 3 would need a 256 x 256 fp32
  accumulator: rung 3 is defined for head dims <= 128 and says so; head dim 16 is padded to
  32 so that rungs 0-2 can split the keys;
* layout (batch, seqlen, heads, headdim) through strides, any lengths, causal aligned to the
  bottom right; a query row that sees no key outputs zeros (logsumexp +inf);
* Triton's interpreter (TRITON_INTERPRET=1) runs the math of every rung on CPU (fp16/fp32);
  warps do not exist there, so the warp split is a GPU-only property.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_qkv, softmax_scale_or_default
from .common import (
    LOG2E,
    _batch_head,
    _finalize,
    _key_range,
    _load_tile,
    _store_tile,
    last_dim_contiguous,
    strides,
)
from .configs import FwdConfig

# --------------------------------------------------------------------------------------
# The rungs' techniques and tile configurations: data
# --------------------------------------------------------------------------------------
SPLIT_K, SPLIT_Q = "split-K", "split-Q"


@dataclass(frozen=True)
class RungTechniques:
    fewer_nonmatmul: bool  # FA2 Section 3.1
    seq_parallel: bool  # FA2 Section 3.2
    warp_split: str  # SPLIT_K (FA1) or SPLIT_Q (FA2 Section 3.3)


LADDER = (
    RungTechniques(fewer_nonmatmul=False, seq_parallel=False, warp_split=SPLIT_K),
    RungTechniques(fewer_nonmatmul=True, seq_parallel=False, warp_split=SPLIT_K),
    RungTechniques(fewer_nonmatmul=True, seq_parallel=True, warp_split=SPLIT_K),
    RungTechniques(fewer_nonmatmul=True, seq_parallel=True, warp_split=SPLIT_Q),
)

# Hopper (sm_90) with mma.sync, keyed by (rung, padded head dim). Neighbouring rungs differ in
# their technique only: rungs 0-2 share one tile, warps and stages; rung 3 swaps rung 2's sides
# (same BLOCK_M x BLOCK_N, warps and stages) so that BLOCK_M >= BLOCK_D. Pipelining depth is
# not a paper technique, so num_stages is one value per head dim for all four rungs; what more
# stages give rung 3 is a line of its own (the block-size-tuning study, ablations/parts.py).
# Measurements behind each line: docs/performance.md (the ablation ladder).
HOPPER_LADDER_CONFIGS = {
    **{(rung, 32): FwdConfig(16, 128, 4, 2) for rung in (0, 1, 2)},  # BLOCK_M 16 < 32
    (3, 32): FwdConfig(128, 16, 4, 2),
    **{(rung, 64): FwdConfig(32, 128, 4, 2) for rung in (0, 1, 2)},  # BLOCK_M 32 < 64
    (3, 64): FwdConfig(128, 32, 4, 2),
    # one stage: with two, rungs 0-1 spill (K_j, V_j kept for the inner loop plus the prefetched Q_i)
    **{(rung, 128): FwdConfig(64, 128, 4, 1) for rung in (0, 1, 2)},
    (3, 128): FwdConfig(128, 64, 4, 1),
    # head dim 256: 8 warps keep the 64 x 256 accumulator in registers; no split-Q tile fits
    **{(rung, 256): FwdConfig(64, 64, 8, 1) for rung in (0, 1, 2)},
}
# Triton's CPU interpreter: tiny tiles so that test shapes span several blocks both ways.
INTERPRETER_LADDER_CONFIGS = {0: FwdConfig(16, 32, 4, 1), 1: FwdConfig(16, 32, 4, 1),
                              2: FwdConfig(16, 32, 4, 1), 3: FwdConfig(32, 16, 4, 1)}


def check_ladder_inputs(q, k, v, softmax_scale) -> float:
    """The ladder's argument checks (flash-attn layout, one dtype and device, as many K/V heads
    as query heads); returns the softmax scale (1/sqrt(headdim) when None)."""
    check_qkv(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"the ladder needs as many k/v heads as q heads ({q.shape[2]}), got {k.shape[2]}")
    return softmax_scale_or_default(softmax_scale, q.shape[3])


def ladder_block_d(headdim: int) -> int:
    """Head dim as the ladder tiles it: the next power of two, at least 32 (so that a 16-row
    block can be narrower than it, which split-K needs)."""
    return max(32, triton.next_power_of_2(headdim))


def warp_split(block_m: int, block_d: int) -> str:
    """The warp split Triton 3.6 gives an attention loop compiled to mma.sync: P@V's output
    (block_m x block_d) decides, [num_warps, 1] when block_m >= block_d (module docstring)."""
    return SPLIT_Q if block_m >= block_d else SPLIT_K


def default_ladder_config(rung: int, headdim: int, device: torch.device) -> FwdConfig:
    if device.type != "cuda":
        return INTERPRETER_LADDER_CONFIGS[rung]
    block_d = ladder_block_d(headdim)
    if (rung, block_d) not in HOPPER_LADDER_CONFIGS:
        raise NotImplementedError(
            f"rung {rung} has no tile for head dim {headdim}: split-Q needs BLOCK_M >= {block_d}, "
            f"whose {block_d} x {block_d} fp32 accumulator does not fit in registers with mma.sync")
    return HOPPER_LADDER_CONFIGS[(rung, block_d)]


# --------------------------------------------------------------------------------------
# Shared jit helpers: one (Q block, K/V block) step of each algorithm
# --------------------------------------------------------------------------------------
@triton.jit
def _load_kv(K, V, offs_n, offs_d, seqlen_k, stride_kn, stride_vn,
             HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, CHECK_N: tl.constexpr):
    """K_j^T (BLOCK_D, BLOCK_N) and V_j (BLOCK_N, BLOCK_D), masking keys past seqlen_k
    only when CHECK_N."""
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    kT = _load_tile(K + offs_d[:, None] + offs_n[None, :] * stride_kn, d_ok, n_ok,
                    CHECK_ROWS=not EVEN_D, CHECK_COLS=CHECK_N)
    v = _load_tile(V + offs_n[:, None] * stride_vn + offs_d[None, :], n_ok, d_ok,
                   CHECK_ROWS=CHECK_N, CHECK_COLS=not EVEN_D)
    return kT, v


@triton.jit
def _attend_block(acc, l_i, m_i, q, kT, v, offs_m, offs_n, seqlen_q, seqlen_k, sm_scale,
                  CAUSAL: tl.constexpr, MASK: tl.constexpr, FEWER_NONMATMUL: tl.constexpr):
    """Fold K/V block j into the running (O, l, m) of query block i.

    FEWER_NONMATMUL=False: FA1 Alg. 1 lines 9-12, O normalised, m and l in natural log.
    FEWER_NONMATMUL=True: FA2 Alg. 1 lines 8-10, O unnormalised, m in the log2 domain.
    MASK: apply the key-length and causal mask (bottom right: row i sees key j iff
    j <= i + seqlen_k - seqlen_q); a row that has seen no key keeps m = -inf, l = 0, O = 0.
    """
    if FEWER_NONMATMUL:
        # FA2 line 8: S = Q K^T in the log2 domain, scale * log2(e) folded into one multiply
        s = tl.dot(q, kT) * (sm_scale * LOG2E)
    else:
        # FA1 line 9: S = tau Q K^T
        s = tl.dot(q, kT) * sm_scale
    if MASK:
        visible = (offs_n < seqlen_k)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
        s = tl.where(visible, s, float("-inf"))

    if FEWER_NONMATMUL:
        # FA2 line 9: m_new = max(m, rowmax(S)), P~ = exp2(S - m_new), l = e^(m - m_new) l + rowsum(P~)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:  # subtract 0, not -inf, in rows that have seen no key (no NaN)
            m_new_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_sub = m_new
        p = tl.math.exp2(s - m_new_sub[:, None])
        alpha = tl.math.exp2(m_i - m_new_sub)
        l_new = l_i * alpha + tl.sum(p, 1)
        # FA2 line 10: O = diag(e^(m - m_new)) O + P~ V, no 1/l
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        # FA1 line 10: m~ = rowmax(S), P~ = exp(S - m~), l~ = rowsum(P~)
        m_blk = tl.max(s, 1)
        if MASK:
            m_blk_sub = tl.where(m_blk == float("-inf"), 0.0, m_blk)
        else:
            m_blk_sub = m_blk
        p = tl.exp(s - m_blk_sub[:, None])
        l_blk = tl.sum(p, 1)
        # FA1 line 11: m_new = max(m, m~), l_new = e^(m - m_new) l + e^(m~ - m_new) l~
        m_new = tl.maximum(m_i, m_blk)
        if MASK:
            m_new_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_sub = m_new
        alpha = tl.exp(m_i - m_new_sub)
        beta = tl.exp(m_blk - m_new_sub)
        l_new = alpha * l_i + beta * l_blk
        # FA1 line 12: O = diag(l_new)^-1 (diag(l) e^(m - m_new) O + e^(m~ - m_new) P~ V)
        if MASK:
            inv_l = 1.0 / tl.where(l_new == 0.0, 1.0, l_new)
        else:
            inv_l = 1.0 / l_new
        pv = tl.dot(p.to(v.dtype), v)
        acc = (acc * (alpha * l_i)[:, None] + pv * beta[:, None]) * inv_l[:, None]
    return acc, l_new, m_new


# --------------------------------------------------------------------------------------
# Rungs 0-1: FA1's loop order, one program per (batch, head)
# --------------------------------------------------------------------------------------
@triton.jit
def _last_key_block(start_m, seqlen_k, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr):
    """Start of the last K/V block that query block [start_m, start_m + BLOCK_M) sees."""
    if CAUSAL:
        last_key = tl.minimum(start_m + BLOCK_M - 1 + offset, seqlen_k - 1)
    else:
        last_key = seqlen_k - 1
    return last_key // BLOCK_N * BLOCK_N


@triton.jit
def _kv_outer_step(O_run, M_run, L_run, Q, Out, LSE, stride_qs, stride_os,
                   start_m, start_n, kT, v, offs_m_base, offs_n, offs_d, seqlen_q, seqlen_k,
                   sm_scale, last_n,
                   HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
                   MASK: tl.constexpr, EVEN_M: tl.constexpr, FEWER_NONMATMUL: tl.constexpr):
    """FA1 Alg. 1 lines 8-13 for query block i = [start_m, start_m + BLOCK_M) and the K/V
    block in `kT`, `v` (loaded once per outer step, line 6)."""
    offs_m = start_m + offs_m_base
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    # line 8: load Q_i, O_i, l_i, m_i from HBM; on the first K/V block they still hold line
    # 2's initial values (O = 0, l = 0, m = -inf), which the masked loads produce unread
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                   CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
    seen = start_n > 0
    acc_ptrs = O_run + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=(m_ok & seen)[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.load(M_run + offs_m, mask=m_ok & seen, other=float("-inf"))
    l_i = tl.load(L_run + offs_m, mask=m_ok & seen, other=0.0)
    # lines 9-12
    acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, kT, v, offs_m, offs_n, seqlen_q, seqlen_k, sm_scale,
                                  CAUSAL=CAUSAL, MASK=MASK, FEWER_NONMATMUL=FEWER_NONMATMUL)
    # line 13: write O_i, l_i, m_i to HBM; at the last K/V block this Q block sees, O_i is
    # final and goes to Out in the inputs' dtype
    if start_n == last_n:
        out_ptrs = Out + offs_m[:, None] * stride_os + offs_d[None, :]
        if FEWER_NONMATMUL:
            out, lse = _finalize(acc, l_i, m_i)  # FA2 lines 12-13: the only 1/l
            _store_tile(out_ptrs, out.to(Out.dtype.element_ty), m_ok, d_ok,
                        CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
            tl.store(LSE + offs_m, lse, mask=m_ok)
        else:
            _store_tile(out_ptrs, acc.to(Out.dtype.element_ty), m_ok, d_ok,
                        CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
            tl.store(M_run + offs_m, m_i, mask=m_ok)  # FA1 keeps m and l for the backward
            tl.store(L_run + offs_m, l_i, mask=m_ok)
    else:
        tl.store(acc_ptrs, acc, mask=m_ok[:, None] & d_ok[None, :])
        tl.store(M_run + offs_m, m_i, mask=m_ok)
        tl.store(L_run + offs_m, l_i, mask=m_ok)


@triton.jit
def _ladder_kv_outer_kernel(
    Q, K, V, Out, LSE, O_run, M_run, L_run,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads, seqlen_q, seqlen_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    FEWER_NONMATMUL: tl.constexpr, SKIP_MASKED_BLOCKS: tl.constexpr,
):
    """FA1 Alg. 1: one program per (batch, head) walks all of its K/V and Q blocks.
    O_run (fp32), M_run, L_run hold each query row's running O, m, l between outer steps;
    with FEWER_NONMATMUL=False, M_run and L_run end as FA1's stored statistics, with True
    the logsumexp goes to LSE. SKIP_MASKED_BLOCKS=False (causal only) computes the blocks
    above the diagonal too, with the mask, as a kernel without block skipping would; they
    leave O, l, m unchanged, and every Q block is written at the last K/V block."""
    pid_bh = tl.program_id(0)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    Out += b * stride_ob + h * stride_oh
    row0 = pid_bh.to(tl.int64) * seqlen_q
    O_run += row0 * HEAD_DIM
    M_run += row0
    L_run += row0
    LSE += row0

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offset = seqlen_k - seqlen_q  # causal: row i sees key j iff j <= i + offset
    end_m = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    # Query blocks whose every row sees no key (causal, seqlen_q > seqlen_k) are never
    # visited below: write their zeros (and m = -inf, l = 0, or L = +inf) here.
    if CAUSAL:
        for start_m in range(0, tl.maximum(-offset, 0) // BLOCK_M * BLOCK_M, BLOCK_M):
            offs_m = start_m + offs_m_base
            _store_tile(Out + offs_m[:, None] * stride_os + offs_d[None, :],
                        tl.zeros([BLOCK_M, BLOCK_D], dtype=Out.dtype.element_ty),
                        offs_m < seqlen_q, offs_d < HEAD_DIM, CHECK_ROWS=False, CHECK_COLS=not EVEN_D)
            if FEWER_NONMATMUL:
                tl.store(LSE + offs_m, tl.full([BLOCK_M], float("inf"), tl.float32))
            else:
                tl.store(M_run + offs_m, tl.full([BLOCK_M], float("-inf"), tl.float32))
                tl.store(L_run + offs_m, tl.zeros([BLOCK_M], dtype=tl.float32))

    # line 5: for each K/V block j (outer loop)
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + offs_n_base
        # line 6: load K_j, V_j on chip, kept for the whole inner loop
        kT, v = _load_kv(K, V, offs_n, offs_d, seqlen_k, stride_ks, stride_vs,
                         HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, CHECK_N=not EVEN_N)
        # line 7: for each Q block i (inner loop): [lo, mid) need a mask, [mid, end_m) do not
        if CAUSAL:
            if SKIP_MASKED_BLOCKS:  # skip the Q blocks that see none of K/V block j
                lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
            else:  # only the leading Q blocks that see no key at all (written above)
                lo = tl.maximum(-offset, 0) // BLOCK_M * BLOCK_M
            if FEWER_NONMATMUL:  # only blocks crossing the diagonal pay for the mask
                mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
                mid = tl.minimum(tl.maximum(mid, lo), end_m)
            else:  # FA1: the mask is applied to every computed block
                mid = end_m
        else:
            lo = 0
            mid = 0
        if not EVEN_N:  # the last K/V block runs past seqlen_k: every row needs the key mask
            mid = tl.where(start_n + BLOCK_N > seqlen_k, end_m, mid)
        for start_m in range(lo, mid, BLOCK_M):
            last_n = _last_key_block(start_m, seqlen_k, offset, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     CAUSAL=CAUSAL and SKIP_MASKED_BLOCKS)
            _kv_outer_step(O_run, M_run, L_run, Q, Out, LSE, stride_qs, stride_os,
                           start_m, start_n, kT, v, offs_m_base, offs_n, offs_d,
                           seqlen_q, seqlen_k, sm_scale, last_n,
                           HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, CAUSAL=CAUSAL, MASK=True, EVEN_M=EVEN_M,
                           FEWER_NONMATMUL=FEWER_NONMATMUL)
        for start_m in range(mid, end_m, BLOCK_M):
            last_n = _last_key_block(start_m, seqlen_k, offset, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     CAUSAL=CAUSAL and SKIP_MASKED_BLOCKS)
            _kv_outer_step(O_run, M_run, L_run, Q, Out, LSE, stride_qs, stride_os,
                           start_m, start_n, kT, v, offs_m_base, offs_n, offs_d,
                           seqlen_q, seqlen_k, sm_scale, last_n,
                           HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, CAUSAL=CAUSAL, MASK=False, EVEN_M=EVEN_M,
                           FEWER_NONMATMUL=FEWER_NONMATMUL)


@triton.jit
def _cta_barrier(token):
    """One CTA barrier (bar.sync 0) that the compiler keeps: tl.debug_barrier's are merged when
    nothing touches memory between them. Not available in Triton's interpreter."""
    tl.inline_asm_elementwise("mov.b32 $0, $1;\n\tbar.sync 0;", "=r,r", [token], dtype=tl.int32, is_pure=False,
                              pack=1)


# --------------------------------------------------------------------------------------
# Rungs 2-3: FA2's loop order, one program per (query block, batch x head)
# --------------------------------------------------------------------------------------
@triton.jit
def _ladder_q_outer_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    num_heads, seqlen_q, seqlen_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EXTRA_BARRIERS: tl.constexpr = 0,
):
    """FA2 Alg. 1 with FA2 Section 3.2's grid: the program owns Q block i (line 3) and keeps
    O, l, m on chip across all K/V blocks; the warp split comes from BLOCK_M (rung 2 vs 3).
    EXTRA_BARRIERS adds that many CTA barriers to every K/V step and changes nothing else (the
    shared-memory-versus-synchronisation variant, ablations/parts.py); the rungs use 0."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    Out += b * stride_ob + h * stride_oh
    LSE += pid_bh.to(tl.int64) * seqlen_q

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    # line 4: load Q_i; lines 2-3: O = 0, l = 0, m = -inf, on chip
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                   CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # lines 5-11: K/V blocks without a mask, then those crossing the diagonal or seqlen_k
    full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    for start_n in range(0, full, BLOCK_N):
        offs_n = start_n + offs_n_base
        kT, v = _load_kv(K, V, offs_n, offs_d, seqlen_k, stride_ks, stride_vs,
                         HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, CHECK_N=False)
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, kT, v, offs_m, offs_n, seqlen_q, seqlen_k, sm_scale,
                                      CAUSAL=CAUSAL, MASK=False, FEWER_NONMATMUL=True)
        for _ in tl.static_range(EXTRA_BARRIERS):
            _cta_barrier(start_n)
    for start_n in range(full, end, BLOCK_N):
        offs_n = start_n + offs_n_base
        kT, v = _load_kv(K, V, offs_n, offs_d, seqlen_k, stride_ks, stride_vs,
                         HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, CHECK_N=True)
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, kT, v, offs_m, offs_n, seqlen_q, seqlen_k, sm_scale,
                                      CAUSAL=CAUSAL, MASK=True, FEWER_NONMATMUL=True)
        for _ in tl.static_range(EXTRA_BARRIERS):
            _cta_barrier(start_n)

    # lines 12-15: one 1/l, L = m + log(l), write O_i and L_i
    out, lse = _finalize(acc, l_i, m_i)
    _store_tile(Out + offs_m[:, None] * stride_os + offs_d[None, :], out.to(Out.dtype.element_ty),
                m_ok, d_ok, CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
    tl.store(LSE + offs_m, lse, mask=m_ok)


# --------------------------------------------------------------------------------------
# Launcher and public functions
# --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _mma_sync_only():
    """Compile the kernels launched inside with mma.sync (MMA v2) instead of wgmma, as on the
    A100. DISABLE_MMA_V3 is read when Triton compiles and is part of its cache key; launching
    an already compiled kernel does not read it. Not thread-safe (it is the process env)."""
    previous = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = previous


@dataclass(frozen=True)
class LadderLaunch:
    """One kernel launch of a rung, as `plan_ladder_forward` prepared it (the probe and the
    counters read the compiled kernel that `run` returns)."""

    kernel: triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # constexprs, num_warps, num_stages

    def run(self):
        with _mma_sync_only():
            return self.kernel[self.grid](*self.args, **self.meta)


def plan_ladder_forward(q, k, v, softmax_scale: float | None = None, causal: bool = False, *,
                        rung: int, config: FwdConfig | None = None, skip_masked_blocks: bool = True,
                        extra_barriers: int = 0):
    """Validate, allocate and prepare rung `rung`'s launch without running it: returns
    (out, stats, launch), launch None when there is nothing to compute (see ladder_forward)."""
    if not isinstance(rung, int) or isinstance(rung, bool) or not 0 <= rung < len(LADDER):
        raise ValueError(f"rung must be an int in 0..{len(LADDER) - 1}, got {rung!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(skip_masked_blocks, bool):
        raise TypeError(f"skip_masked_blocks must be a bool, got {type(skip_masked_blocks).__name__}")
    if not skip_masked_blocks and LADDER[rung].seq_parallel:
        raise ValueError(f"skip_masked_blocks=False needs FA1's loop order (rungs 0-1), got rung {rung}")
    if not isinstance(extra_barriers, int) or isinstance(extra_barriers, bool) or extra_barriers < 0:
        raise ValueError(f"extra_barriers must be an int >= 0, got {extra_barriers!r}")
    if extra_barriers and not LADDER[rung].seq_parallel:
        raise ValueError(f"extra_barriers needs FA2's loop order (rungs 2-3), got rung {rung}")
    sm_scale = check_ladder_inputs(q, k, v, softmax_scale)
    technique = LADDER[rung]
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    block_d = ladder_block_d(headdim)
    cfg = config or default_ladder_config(rung, headdim, q.device)
    if q.device.type == "cuda" and warp_split(cfg.block_m, block_d) != technique.warp_split:
        raise ValueError(
            f"config {cfg} gives rung {rung} the {warp_split(cfg.block_m, block_d)} warp split at head "
            f"dim {headdim} (BLOCK_D {block_d}); rung {rung} needs {technique.warp_split}: block_m "
            f"{'>=' if technique.warp_split == SPLIT_Q else '<'} {block_d}")

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    stat_shape = (batch, heads, seqlen_q)
    n_stats = 1 if technique.fewer_nonmatmul else 2
    stats = tuple(torch.empty(stat_shape, device=q.device, dtype=torch.float32) for _ in range(n_stats))
    if out.numel() == 0:
        return out, stats, None
    if seqlen_k == 0:  # no key at all: every row is empty
        out.zero_()
        if technique.fewer_nonmatmul:
            stats[0].fill_(float("inf"))
        else:
            stats[0].fill_(float("-inf"))
            stats[1].zero_()
        return out, stats, None

    all_strides = (*strides(q), *strides(k), *strides(v), *strides(out))
    meta = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "CAUSAL": causal, "EVEN_M": seqlen_q % cfg.block_m == 0,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if technique.seq_parallel:
        launch = LadderLaunch(_ladder_q_outer_kernel, (triton.cdiv(seqlen_q, cfg.block_m), batch * heads),
                              (q, k, v, out, stats[0], *all_strides, heads, seqlen_q, seqlen_k, sm_scale),
                              {**meta, "EXTRA_BARRIERS": extra_barriers})
    else:
        # FA1's running O in HBM (fp32); m and l are the stats (rung 0) or scratch (rung 1)
        o_run = torch.empty((batch, heads, seqlen_q, headdim), device=q.device, dtype=torch.float32)
        if technique.fewer_nonmatmul:
            m_run, l_run = (torch.empty(stat_shape, device=q.device, dtype=torch.float32) for _ in range(2))
            lse = stats[0]
        else:
            (m_run, l_run), lse = stats, stats[0]  # rung 0 stores no logsumexp: LSE is never written
        launch = LadderLaunch(
            _ladder_kv_outer_kernel, (batch * heads,),
            (q, k, v, out, lse, o_run, m_run, l_run, *all_strides, heads, seqlen_q, seqlen_k, sm_scale),
            {**meta, "EVEN_N": seqlen_k % cfg.block_n == 0, "FEWER_NONMATMUL": technique.fewer_nonmatmul,
             "SKIP_MASKED_BLOCKS": skip_masked_blocks})
    return out, stats, launch


def ladder_forward(q, k, v, softmax_scale: float | None = None, causal: bool = False, *, rung: int,
                   config: FwdConfig | None = None, skip_masked_blocks: bool = True,
                   extra_barriers: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Forward pass of ladder rung `rung` (0-3) on q (batch, seqlen_q, heads, headdim), k and v
    (batch, seqlen_k, heads, headdim), fp16/bf16/fp32.

    Returns (out, stats): out like q; stats are what the rung stores for the backward, each
    (batch, heads, seqlen_q) float32: (m, l) for rung 0 (FA1), (logsumexp,) for rungs 1-3.
    `logsumexp_from_stats(stats)` turns either into the L of the FA2 backward. `config`
    overrides the tile table; on a GPU it must give the rung's warp split (`warp_split`).
    `skip_masked_blocks=False` (rungs 0-1, causal) computes the fully masked blocks too: the
    ladder's FA1 without causal block skipping; `extra_barriers` (rungs 2-3) adds CTA barriers to
    every K/V step and nothing else."""
    out, stats, launch = plan_ladder_forward(q, k, v, softmax_scale, causal, rung=rung, config=config,
                                             skip_masked_blocks=skip_masked_blocks, extra_barriers=extra_barriers)
    if launch is not None:
        launch.run()
    return out, stats


def logsumexp_from_stats(stats: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The logsumexp L (batch, heads, seqlen_q) that the FA2 backward takes, from a rung's
    stored statistics: (L,) as is, FA1's (m, l) as m + log(l) (+inf where l = 0)."""
    if len(stats) == 1:
        return stats[0]
    m, l = stats
    return torch.where(l == 0, torch.full_like(m, float("inf")), m + torch.log(l))
