"""The backward ladder: FA1's backward -> FA2's backward, one technique per rung (rungs 0-3).

The FlashAttention-2 paper (Dao, 2023, arXiv 2307.08691) says each of its three techniques
applies to the backward pass too (Sections 3.1.2, 3.2 and 3.3). These rungs are one Triton
kernel whose constexpr flags and grid add them one at a time, on the same tile area, warps
and stages, compiled to mma.sync as the forward ladder is (kernels/fa_ladder.py):

  rung 0  FA1's backward (Dao et al., 2022, Algorithm 4): one program per (batch, head); outer
          loop over K/V blocks j (line 6), inner loop over Q blocks i (line 9); P rebuilt from
          FA1's stored m and l as diag(l)^-1 exp(tau S - m) (line 13); D_i = rowsum(dO_i * O_i)
          recomputed at every (i, j) step (line 19); dQ_i read from HBM, updated and written
          back at every step (line 21); the causal mask on every computed block.
  rung 1  + fewer non-matmul FLOPs (FA2 Sec. 3.1.2 and Algorithm 2): P = exp2(S log2(e) tau -
          L log2(e)) from the logsumexp alone (Alg. 2 line 11, no divide), D = rowsum(dO * O)
          once per row by a preprocessing kernel (Alg. 2 line 4); the causal mask only on
          blocks that cross the diagonal. Same grid and loops as rung 0.
  rung 2  + parallelism over the sequence (FA2 Sec. 3.2): grid (K/V blocks, batch x heads), one
          program per K/V block (Alg. 2 line 5 as the grid); dQ accumulated across programs
          with atomic adds (Alg. 2 line 15: "atomic adds ... to update dQ"). Same tiles.
  rung 3  + warp partitioning (FA2 Sec. 3.3): the tile's sides swapped (same area, warps and
          stages) so that the compiler gives the warps the program's own K/V rows; dV and dK
          then need no exchange between warps, and dQ's partial sums over the keys still do
          ("still requires some synchronization").

Rung 4, the production backward (kernels/backward.py, with its Gluon kernel on Hopper), is
outside this file. How the warp split follows the tile: the dot that decides is dK += dS^T Q
(BLOCK_N x BLOCK_D, the last of the chained dots; kernels/fa_ladder.py's docstring gives
Triton's rule), so warps split the program's key rows iff BLOCK_N >= BLOCK_D
(`bwd_warp_split`, checked against the compiled TTGIR by the GPU tests).

Differences and cautions: dQ is accumulated in float32 (a zeroed buffer like q) and cast to
the inputs' dtype after the kernel, in every rung; the scale tau is applied to dQ at each step
and to dK once at the end, in every rung; at head dim 256 rung 3 has no tile (it would need
BLOCK_N >= 256 with two 256 x 256 fp32 accumulators); inputs in flash-attn's layout
(batch, seqlen, heads, headdim), causal aligned to the bottom right, any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import LOG2E, _batch_head, _load_tile, _store_tile, last_dim_contiguous, strides
from .fa_ladder import (
    SPLIT_K,
    SPLIT_Q,
    _mma_sync_only,
    check_ladder_inputs,
    ladder_block_d,
    ladder_forward,
    warp_split,
)


@dataclass(frozen=True)
class BwdRungTechniques:
    fewer_nonmatmul: bool  # FA2 Sec. 3.1.2
    kv_parallel: bool  # FA2 Sec. 3.2
    warp_split: str  # SPLIT_K: warps across the query columns of S^T; SPLIT_Q: across the key rows (Sec. 3.3)


BWD_LADDER = (
    BwdRungTechniques(fewer_nonmatmul=False, kv_parallel=False, warp_split=SPLIT_K),
    BwdRungTechniques(fewer_nonmatmul=True, kv_parallel=False, warp_split=SPLIT_K),
    BwdRungTechniques(fewer_nonmatmul=True, kv_parallel=True, warp_split=SPLIT_K),
    BwdRungTechniques(fewer_nonmatmul=True, kv_parallel=True, warp_split=SPLIT_Q),
)


@dataclass(frozen=True)
class LadderBwdConfig:
    block_m: int  # query rows per inner step
    block_n: int  # key rows per program (rungs 2-3) or per outer step (rungs 0-1)
    num_warps: int
    num_stages: int


# Hopper (sm_90) with mma.sync, keyed by (rung, padded head dim). Rungs 0-2 share one tile,
# rung 3 swaps its sides; warps and stages are one value per head dim.
HOPPER_BWD_LADDER_CONFIGS = {
    **{(rung, 32): LadderBwdConfig(64, 16, 4, 1) for rung in (0, 1, 2)},  # BLOCK_N 16 < 32
    (3, 32): LadderBwdConfig(16, 64, 4, 1),
    **{(rung, 64): LadderBwdConfig(64, 32, 4, 1) for rung in (0, 1, 2)},  # BLOCK_N 32 < 64
    (3, 64): LadderBwdConfig(32, 64, 4, 1),
    # 8 warps: rung 3's two 128 x 128 fp32 accumulators (dK, dV) in 256 threads' registers; it
    # spills 300 bytes (ptxas for sm_90), at 64 x 128 it spilled 2256
    **{(rung, 128): LadderBwdConfig(128, 32, 8, 1) for rung in (0, 1, 2)},
    (3, 128): LadderBwdConfig(32, 128, 8, 1),
    **{(rung, 256): LadderBwdConfig(64, 32, 8, 1) for rung in (0, 1, 2)},
}
# Triton's CPU interpreter: tiny tiles so that test shapes span several blocks both ways.
INTERPRETER_BWD_LADDER_CONFIGS = {0: LadderBwdConfig(32, 16, 4, 1), 1: LadderBwdConfig(32, 16, 4, 1),
                                  2: LadderBwdConfig(32, 16, 4, 1), 3: LadderBwdConfig(16, 32, 4, 1)}
PREPROCESS_BLOCK_M = 64


def bwd_warp_split(block_n: int, block_d: int) -> str:
    """The warp split Triton 3.6 gives the ladder's backward on mma.sync: the forward's rule
    (fa_ladder.warp_split) on dK's output (block_n x block_d), so warps own key rows (SPLIT_Q's
    counterpart) when block_n >= block_d."""
    return warp_split(block_n, block_d)


def default_bwd_ladder_config(rung: int, headdim: int, device: torch.device) -> LadderBwdConfig:
    if device.type != "cuda":
        return INTERPRETER_BWD_LADDER_CONFIGS[rung]
    block_d = ladder_block_d(headdim)
    if (rung, block_d) not in HOPPER_BWD_LADDER_CONFIGS:
        raise NotImplementedError(
            f"backward rung {rung} has no tile for head dim {headdim}: its warp split needs BLOCK_N >= "
            f"{block_d}, whose two {block_d} x {block_d} fp32 accumulators do not fit in registers")
    return HOPPER_BWD_LADDER_CONFIGS[(rung, block_d)]


# --------------------------------------------------------------------------------------
# One (K/V block j, Q block i) step, and one K/V block's walk over the Q blocks
# --------------------------------------------------------------------------------------
@triton.jit
def _bwd_step(dk, dv, k, v, Q, DO, Out, DQ, Stat1, Stat2, start_m, offs_m_base, offs_n, offs_d,
              stride_qs, stride_dos, stride_os, stride_dqs, seqlen_q, seqlen_k, sm_scale,
              HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, CAUSAL: tl.constexpr,
              MASK: tl.constexpr, FEWER_NONMATMUL: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """FA1 Alg. 4 lines 10-22 (FEWER_NONMATMUL=False) or FA2 Alg. 2 lines 7-16 (True) for
    query block [start_m, start_m + BLOCK_M); returns the updated dK_j, dV_j (fp32, unscaled
    dK). Stat1, Stat2: FA1's m and l, or FA2's logsumexp L and D."""
    offs_m = start_m + offs_m_base
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    # FA1 line 10 / FA2 line 8: load Q_i, dO_i (and FA1's O_i, m_i, l_i; FA2's L_i, D_i)
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                   CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
    do = _load_tile(DO + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok, d_ok,
                    CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
    # S^T = K_j Q_i^T (BLOCK_N, BLOCK_M): FA1 line 11 / FA2 line 9
    sT = tl.dot(k, tl.trans(q))
    if FEWER_NONMATMUL:
        # FA2 line 11: P = exp(S - L), one exp2 with log2(e) folded into the scale, no divide
        lse = tl.load(Stat1 + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(Stat2 + offs_m, mask=m_ok, other=0.0)
        pT = tl.math.exp2(sT * (sm_scale * LOG2E) - (lse * LOG2E)[None, :])
    else:
        # FA1 line 13: P = diag(l)^-1 exp(tau S - m); a row that sees no key has l = 0
        m_i = tl.load(Stat1 + offs_m, mask=m_ok, other=0.0)
        l_i = tl.load(Stat2 + offs_m, mask=m_ok, other=1.0)
        m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = tl.where(l_i == 0.0, 0.0, 1.0 / l_i)
        pT = tl.exp(sT * sm_scale - m_i[None, :]) * inv_l[None, :]
        # FA1 line 19: D_i = rowsum(dO_i * O_i), recomputed at every (i, j) step
        o = _load_tile(Out + offs_m[:, None] * stride_os + offs_d[None, :], m_ok, d_ok,
                       CHECK_ROWS=not EVEN_M, CHECK_COLS=not EVEN_D)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if MASK:  # key length and causal (bottom right: row i sees key j iff j <= i + seqlen_k - seqlen_q)
        visible = (offs_n < seqlen_k)[:, None]
        if CAUSAL:
            visible = visible & (offs_n[:, None] <= offs_m[None, :] + (seqlen_k - seqlen_q))
        pT = tl.where(visible, pT, 0.0)
    # FA1 line 16 / FA2 line 12: dV_j += P^T dO_i
    dv = tl.dot(pT.to(do.dtype), do, dv)
    # FA1 line 17 / FA2 line 13: dP^T = V_j dO_i^T
    dpT = tl.dot(v, tl.trans(do))
    # FA1 line 20 / FA2 line 14: dS = P * (dP - D_i)
    dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
    # FA1 line 21 / FA2 line 15: dQ_i += tau dS K_j, in HBM (read-modify-write, or atomics
    # when several programs add to the same rows)
    dq = tl.dot(tl.trans(dsT), k) * sm_scale
    dq_ptrs = DQ + offs_m[:, None] * stride_dqs + offs_d[None, :]
    dq_ok = m_ok[:, None] & d_ok[None, :]
    if DQ_ATOMIC:
        tl.atomic_add(dq_ptrs, dq, mask=dq_ok)
    else:
        tl.store(dq_ptrs, tl.load(dq_ptrs, mask=dq_ok, other=0.0) + dq, mask=dq_ok)
    # FA1 line 22 / FA2 line 16: dK_j += dS^T Q_i (tau applied once, after the loop)
    dk = tl.dot(dsT, q, dk)
    return dk, dv


@triton.jit
def _bwd_kv_block(start_n, K, V, Q, DO, Out, DQ, DK, DV, Stat1, Stat2,
                  stride_ks, stride_vs, stride_qs, stride_dos, stride_os, stride_dqs, stride_dks, stride_dvs,
                  seqlen_q, seqlen_k, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                  FEWER_NONMATMUL: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """K/V block j = [start_n, start_n + BLOCK_N): FA1 Alg. 4 lines 7-24 / FA2 Alg. 2 lines 6-18."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    # load K_j, V_j on chip; dK_j = dV_j = 0 (FA1 lines 7-8, FA2 lines 6-7)
    k = _load_tile(K + offs_n[:, None] * stride_ks + offs_d[None, :], n_ok, d_ok,
                   CHECK_ROWS=not EVEN_N, CHECK_COLS=not EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vs + offs_d[None, :], n_ok, d_ok,
                   CHECK_ROWS=not EVEN_N, CHECK_COLS=not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Q blocks: [lo, mid) need a mask, [mid, end_m) do not; blocks above the diagonal are skipped
    offset = seqlen_k - seqlen_q
    end_m = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        if FEWER_NONMATMUL:  # only blocks crossing the diagonal pay for the mask
            mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M
            mid = tl.minimum(tl.maximum(mid, lo), end_m)
        else:  # FA1: the mask on every computed block
            mid = end_m
    else:
        lo = 0
        mid = 0
    if not EVEN_N:  # the last K/V block runs past seqlen_k: every row needs the key mask
        mid = tl.where(start_n + BLOCK_N > seqlen_k, end_m, mid)
    for start_m in range(lo, mid, BLOCK_M):
        dk, dv = _bwd_step(dk, dv, k, v, Q, DO, Out, DQ, Stat1, Stat2, start_m, offs_m_base, offs_n, offs_d,
                           stride_qs, stride_dos, stride_os, stride_dqs, seqlen_q, seqlen_k, sm_scale,
                           HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, EVEN_M=EVEN_M, CAUSAL=CAUSAL, MASK=True,
                           FEWER_NONMATMUL=FEWER_NONMATMUL, DQ_ATOMIC=DQ_ATOMIC)
    for start_m in range(mid, end_m, BLOCK_M):
        dk, dv = _bwd_step(dk, dv, k, v, Q, DO, Out, DQ, Stat1, Stat2, start_m, offs_m_base, offs_n, offs_d,
                           stride_qs, stride_dos, stride_os, stride_dqs, seqlen_q, seqlen_k, sm_scale,
                           HEAD_DIM=HEAD_DIM, EVEN_D=EVEN_D, EVEN_M=EVEN_M, CAUSAL=CAUSAL, MASK=False,
                           FEWER_NONMATMUL=FEWER_NONMATMUL, DQ_ATOMIC=DQ_ATOMIC)
    # write dK_j (times tau), dV_j to HBM (FA1 line 24, FA2 line 18)
    _store_tile(DK + offs_n[:, None] * stride_dks + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                n_ok, d_ok, CHECK_ROWS=not EVEN_N, CHECK_COLS=not EVEN_D)
    _store_tile(DV + offs_n[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
                n_ok, d_ok, CHECK_ROWS=not EVEN_N, CHECK_COLS=not EVEN_D)


@triton.jit
def _ladder_bwd_kernel(
    Q, K, V, Out, DO, DQ, DK, DV, Stat1, Stat2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    num_heads, seqlen_q, seqlen_k, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    FEWER_NONMATMUL: tl.constexpr, KV_PARALLEL: tl.constexpr,
):
    """KV_PARALLEL=False: FA1's grid, one program per (batch, head) walking every K/V block;
    True: FA2 Sec. 3.2's grid (K/V blocks, batch x heads), dQ added with atomics."""
    pid_bh = tl.program_id(1) if KV_PARALLEL else tl.program_id(0)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    Out += b * stride_ob + h * stride_oh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    Stat1 += pid_bh.to(tl.int64) * seqlen_q
    Stat2 += pid_bh.to(tl.int64) * seqlen_q
    if KV_PARALLEL:
        _bwd_kv_block(tl.program_id(0) * BLOCK_N, K, V, Q, DO, Out, DQ, DK, DV, Stat1, Stat2,
                      stride_ks, stride_vs, stride_qs, stride_dos, stride_os, stride_dqs, stride_dks, stride_dvs,
                      seqlen_q, seqlen_k, sm_scale, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
                      BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
                      FEWER_NONMATMUL=FEWER_NONMATMUL, DQ_ATOMIC=True)
    else:
        # FA1 line 6: for each K/V block j (outer loop, inside the one program)
        for start_n in range(0, seqlen_k, BLOCK_N):
            _bwd_kv_block(start_n, K, V, Q, DO, Out, DQ, DK, DV, Stat1, Stat2,
                          stride_ks, stride_vs, stride_qs, stride_dos, stride_os, stride_dqs, stride_dks, stride_dvs,
                          seqlen_q, seqlen_k, sm_scale, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
                          BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
                          FEWER_NONMATMUL=FEWER_NONMATMUL, DQ_ATOMIC=False)


@triton.jit
def _ladder_bwd_preprocess_kernel(Out, DO, Delta, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                                  num_heads, seqlen_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                  BLOCK_M: tl.constexpr):
    """FA2 Alg. 2 line 4: D = rowsum(dO * O), once per query row (rungs 1-3)."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    o = _load_tile(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], m_ok, d_ok,
                   CHECK_ROWS=True, CHECK_COLS=True)
    do = _load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok,
                    d_ok, CHECK_ROWS=True, CHECK_COLS=True)
    tl.store(Delta + pid_bh.to(tl.int64) * seqlen_q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
             mask=m_ok)


# --------------------------------------------------------------------------------------
# Launcher and public functions
# --------------------------------------------------------------------------------------
def _check_rung(rung) -> None:
    if not isinstance(rung, int) or isinstance(rung, bool) or not 0 <= rung < len(BWD_LADDER):
        raise ValueError(f"rung must be an int in 0..{len(BWD_LADDER) - 1}, got {rung!r}")


def plan_ladder_backward(do, q, k, v, out, stats, softmax_scale: float | None = None, causal: bool = False, *,
                         rung: int, config: LadderBwdConfig | None = None):
    """Validate, allocate and prepare backward rung `rung`: returns (dq_acc, dk, dv, launches),
    launches the list of (kernel, grid, args, meta) to run in order (see ladder_backward)."""
    _check_rung(rung)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sm_scale = check_ladder_inputs(q, k, v, softmax_scale)
    technique = BWD_LADDER[rung]
    for name, t in (("do", do), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"{name} must be a tensor like q {tuple(q.shape)} {q.dtype}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    batch, seqlen_q, heads, headdim = q.shape
    stat_shape = (batch, heads, seqlen_q)
    wanted = 1 if technique.fewer_nonmatmul else 2
    if (not isinstance(stats, tuple) or len(stats) != wanted
            or any(s.shape != stat_shape or s.dtype != torch.float32 for s in stats)):
        raise ValueError(f"stats must be a tuple of {wanted} float32 tensors {stat_shape} (rung {rung}: "
                         f"{'(logsumexp,)' if wanted == 1 else 'FA1 m and l'}), the forward ladder's stats")
    do, q, k, v, out = (last_dim_contiguous(t) for t in (do, q, k, v, out))
    seqlen_k = k.shape[1]
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if seqlen_q == 0 or seqlen_k == 0 or batch * heads == 0:
        return dq_acc, dk.zero_(), dv.zero_(), []
    cfg = config or default_bwd_ladder_config(rung, headdim, q.device)
    block_d = ladder_block_d(headdim)
    if q.device.type == "cuda" and bwd_warp_split(cfg.block_n, block_d) != technique.warp_split:
        raise ValueError(f"config {cfg} gives backward rung {rung} the {bwd_warp_split(cfg.block_n, block_d)} warp "
                         f"split at head dim {headdim}; it needs {technique.warp_split}: block_n "
                         f"{'>=' if technique.warp_split == SPLIT_Q else '<'} {block_d}")
    launches = []
    if technique.fewer_nonmatmul:
        lse = stats[0].contiguous()
        delta = torch.empty_like(lse)
        launches.append((_ladder_bwd_preprocess_kernel, (triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M), batch * heads),
                         (out, do, delta, *strides(out), *strides(do), heads, seqlen_q),
                         {"HEAD_DIM": headdim, "BLOCK_D": block_d, "BLOCK_M": PREPROCESS_BLOCK_M}))
        stat1, stat2 = lse, delta
    else:
        stat1, stat2 = (s.contiguous() for s in stats)
    grid = (triton.cdiv(seqlen_k, cfg.block_n), batch * heads) if technique.kv_parallel else (batch * heads,)
    args = (q, k, v, out, do, dq_acc, dk, dv, stat1, stat2,
            *strides(q), *strides(k), *strides(v), *strides(out), *strides(do), *strides(dq_acc), *strides(dk),
            *strides(dv), heads, seqlen_q, seqlen_k, sm_scale)
    meta = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "CAUSAL": causal, "EVEN_M": seqlen_q % cfg.block_m == 0, "EVEN_N": seqlen_k % cfg.block_n == 0,
            "FEWER_NONMATMUL": technique.fewer_nonmatmul, "KV_PARALLEL": technique.kv_parallel,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    launches.append((_ladder_bwd_kernel, grid, args, meta))
    return dq_acc, dk, dv, launches


def ladder_backward(do, q, k, v, out, stats, softmax_scale: float | None = None, causal: bool = False, *,
                    rung: int, config: LadderBwdConfig | None = None):
    """Backward rung `rung` (0-3): (dq, dk, dv) in q's dtype, from dO, the inputs, the output and
    the statistics the forward ladder stored (`stats`: FA1's (m, l) for rung 0, (logsumexp,) for
    rungs 1-3; `kernels.fa_ladder.ladder_forward` returns both kinds). Compiled to mma.sync."""
    dq_acc, dk, dv, launches = plan_ladder_backward(do, q, k, v, out, stats, softmax_scale, causal, rung=rung,
                                                    config=config)
    with _mma_sync_only():
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
    return dq_acc.to(q.dtype), dk, dv


class _LadderAttention(torch.autograd.Function):
    """Forward: the forward ladder's rung 0 (FA1's m and l) for backward rung 0, rung 1 (the
    logsumexp) for the others; backward: backward rung `rung`. Only the backward is the
    object of study (mode 'bwd' times it alone)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, rung):
        out, stats = ladder_forward(q, k, v, softmax_scale, causal, rung=0 if rung == 0 else 1)
        ctx.save_for_backward(q, k, v, out, *stats)
        ctx.causal, ctx.softmax_scale, ctx.rung = causal, softmax_scale, rung
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, *stats = ctx.saved_tensors
        dq, dk, dv = ladder_backward(do, q, k, v, out, tuple(stats), ctx.softmax_scale, ctx.causal, rung=ctx.rung)
        return dq, dk, dv, None, None, None


def ladder_attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, *, rung: int):
    """Attention with autograd whose backward is backward rung `rung` (0-3)."""
    _check_rung(rung)
    return _LadderAttention.apply(q, k, v, causal, softmax_scale, rung)
