"""FlashAttention-2 in Triton: forward and backward, with flash-attn's Python API.

Provenance: the algorithm is FlashAttention-2 (Dao, 2023, arXiv 2307.08691), Algorithm 1
(forward) and Algorithm 2 (backward); the code's shape follows Triton's fused-attention
tutorial (python/tutorials/06-fused-attention.py): an inner-loop helper per pass, a `MASK`
constexpr separating the off-diagonal (unmasked) blocks from the blocks that need a mask,
and a backward split into a dK/dV pass and a dQ pass so that no atomics are needed.

Differences from flash-attn's CUDA kernels:
* the layout is flash-attn's (batch, seqlen, heads, headdim), read through strides; the last
  dimension must be contiguous (other inputs are made contiguous first);
* head dims that are not powers of two (59, 80, 96, 111, 160, ...) are padded inside the
  kernel to the next power of two with masked loads, not by copying inputs;
* this file's backward recomputes S and dP in a dQ pass (7 matmuls instead of 5) so that dQ is
  written once by one program, bit-identical between runs; TFLOPs/s always use the paper's count
  of 5 (baselines/flops.py). A config with `BwdConfig.fused_dq_min_rows` set instead has the
  dK/dV kernel add dQ into a float32 accumulator (TMA reduce-adds on Hopper, element-wise atomics
  elsewhere) unless `deterministic=True`; on the H200 that measured no faster, so no shipped table
  sets it. The Gluon dK/dV kernel (below) fuses dQ FlashAttention-3's way at head dim 128 unless
  `deterministic=True`, and that is faster;
* dropout, sliding windows, softcapping, ALiBi and GQA/MQA raise NotImplementedError.

On Hopper the forward moves its tiles with TMA tensor descriptors where the block table asks
for it and the inputs are 16-byte aligned (`FwdConfig.tma`, `fwd_memory_path`): 2D descriptors
made on the host for whole-block shapes with medium key loops (1k-8k keys), per-(batch, head)
descriptors made in the kernel (bounded at the true seqlen and head dim) for long ones;
otherwise pointer tiles with masks. Causal programs are launched longest-first. The
head-dim-256 backward lays its dK/dV matmuls out query-major (`BwdConfig.query_major`).
At head dim 128 from 1k keys and 64 from 4k (equal lengths in whole blocks, 16-bit, exact 2D
views), the Hopper forward is not this file's kernel but the Gluon one of flash_attn_hopper.py, with
FlashAttention-3's warp layout (`fwd_memory_path` returns 'gluon-ws'). In the same scope the
head-dim-128 backward from 1k keys computes dK and dV with that file's Gluon kernel
(`bwd_dkdv_path`), which also adds dQ with TMA reduce-adds (`bwd_gluon_fuses_dq`; so dQ's
rounding can differ between runs, as in flash-attn) unless `deterministic=True`, which keeps the
dQ kernel. The preprocessing kernel is this file's in every case. Measurements behind these
choices: reports/h200/perf_notes.md.

Cautions: a query row that sees no key (causal with seqlen_q > seqlen_k) outputs zeros and
has logsumexp +inf, as flash-attn does. Triton's CPU interpreter (TRITON_INTERPRET=1) runs
these kernels on CPU tensors, correctly for fp16 and fp32 but not bf16 (its bf16 dot is
broken), and slowly: keep interpreter shapes small.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import flash_attn_hopper
from kernels.launch import CachedLauncher

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2):   ln(x) = log2(x) * LN2
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


# --------------------------------------------------------------------------------------
# Block-size configurations: data, not code (one line of reason per choice).
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Tensor-descriptor (TMA) loads and stores where the inputs allow them (16-byte aligned),
    # with descriptors made one of two ways, chosen by the keys a program visits on average
    # (all of seqlen_k, half when causal); see fwd_memory_path().
    tma: bool = False
    # In the kernel, per (batch, head), bounded at the true seqlen and head dim (any ragged
    # shape), from this many keys: each program makes its own (a global write and a proxy
    # fence each), a fixed cost that only a long key loop amortises (at head dim 128 they lost
    # 10-25% to pointer tiles at 512-1024 keys and won 5-13% from 2048 up).
    tma_min_keys: int = 2048
    # On the host, 2D over (batch * seqlen, heads * head dim), for key counts in
    # [tma_host_min_keys, tma_host_below_keys) where that view is exact (whole blocks, a
    # power-of-two head dim): no per-program set-up, but four descriptors to encode on the
    # host per launch. tma_host_below_keys = 0: never. At head dim 128 they beat pointer tiles
    # by 6-13% at 1024-4096 keys and lost 2-5% to in-kernel descriptors at 8k-16k; at 512 keys
    # the paper sweep's launches (20-30 us of GPU work) became host-bound, at 0.61-0.75x what
    # the same kernel read when called directly (reports/h200/perf_notes.md, v3).
    tma_host_min_keys: int = 1024
    tma_host_below_keys: int = 0
    # From this many keys, the Gluon forward with FA3's warp layout (kernels/flash_attn_hopper.py:
    # a loader warp, two consumer warpgroups, the softmax under the P V matmul) where its scope
    # holds (hopper_gluon_applies); 0 = never.
    hopper_gluon_min_keys: int = 0


@dataclass(frozen=True)
class BwdConfig:
    block_m1: int  # query rows per step of the dK/dV pass
    block_n1: int  # keys owned by one dK/dV program
    block_m2: int  # query rows owned by one dQ program
    block_n2: int  # keys per step of the dQ pass
    num_warps: int
    num_stages: int
    # the dQ kernel's warps and stages, where they differ from the dK/dV kernel's
    dq_num_warps: int | None = None
    dq_num_stages: int | None = None
    # dK/dV matmuls laid out with the query block as M (S = Q K^T) instead of the key block
    # (S^T = K Q^T): K and V then stay in shared memory as wgmma B operands instead of
    # registers, which is what lets head dim 256 keep both 64x256 accumulators in registers.
    query_major: bool = False
    # Tensor-descriptor (TMA) loads for the tiles each loop step streams (Q and dO in the
    # dK/dV kernel, K and V in the dQ kernel), descriptors made per program and bounded at
    # (seqlen, head dim) like the forward's in-kernel path: no address registers per tile.
    tma: bool = False
    # From this many query rows, dQ added by the dK/dV kernel into a float32 accumulator (TMA
    # reduce-adds; FA2 Alg. 2 line 15 as the paper has it: 5 matmuls, not 7) unless flash_attn_backward
    # is asked to be deterministic. 0 = never: the dQ kernel. 0 in every table: on the H200 the
    # fused backward (its best config per point) ran at 0.90-1.00x the speed of the two-kernel
    # one at head dims 64 and 128, 1k-16k (perf_notes, "v6").
    fused_dq_min_rows: int = 0
    # From this many keys, the dK/dV kernel is the Gluon one with FA3's warp layout
    # (kernels/flash_attn_hopper.py: a loader warp and two consumer warpgroups sharing each Q/dO
    # tile) where its scope holds (hopper_gluon_applies); 0 = never. It takes precedence over
    # fused_dq_min_rows.
    hopper_gluon_min_keys: int = 0
    # Whether that Gluon kernel also adds dQ (FA3's scheme: TMA reduce-adds into a float32
    # accumulator, so the sum's order varies between runs), at head dim 128, unless
    # flash_attn_backward is asked to be deterministic; the dQ kernel then does not run.
    hopper_gluon_fused_dq: bool = False

    @property
    def dq_warps(self) -> int:
        """Warps of the dQ kernel."""
        return self.num_warps if self.dq_num_warps is None else self.dq_num_warps

    @property
    def dq_stages(self) -> int:
        """Pipeline stages of the dQ kernel."""
        return self.num_stages if self.dq_num_stages is None else self.dq_num_stages


# Hopper (sm_90), keyed by (padded head dim, causal). Chosen on the H200 by tools/tune_fa2.py
# (bf16, seqlen 4096, paper shapes): rows in reports/h200/tuning/tune_fa2_seqlen4096_bf16.csv,
# reasoning in reports/h200/perf_notes.md.
HOPPER_FWD_CONFIGS = {
    # small head dims: 4 warps of wgmma on 128x64 tiles; causal prefers 8 warps (more rows
    # in flight to hide the diagonal blocks' mask arithmetic).
    (16, False): FwdConfig(128, 64, 4, 3),
    (16, True): FwdConfig(128, 64, 8, 3),
    (32, False): FwdConfig(128, 64, 4, 3),
    (32, True): FwdConfig(128, 64, 8, 3),
    # head dim 64 from 4096 keys: the Gluon forward (below for 128). Against this kernel, same
    # process, four runs (bf16 and fp16 twice each): 0.97-1.05x at 4k, 1.01-1.05x at 8k (one run
    # per dtype), 1.03-1.10x at 16k; at 2k 0.97-1.04x, slower causal, so not taken there
    # (perf_notes, "v6").
    (64, False): FwdConfig(128, 64, 4, 3, hopper_gluon_min_keys=4096),
    (64, True): FwdConfig(128, 64, 8, 3, hopper_gluon_min_keys=4096),
    # head dim 128: 128x128 tiles with 8 warps halve the K/V re-reads per output row; TMA
    # frees the pointer registers (255 registers + 124 B of spills -> 216, none): +5-13%.
    # From 1024 keys, equal lengths in whole blocks take the Gluon kernel instead: 1.03-1.33x
    # this one at 1k-16k in bf16 and fp16, same process (perf_notes, "v5: a Gluon forward").
    (128, False): FwdConfig(128, 128, 8, 3, tma=True, tma_host_below_keys=8192, hopper_gluon_min_keys=1024),
    # causal: in-kernel descriptors from 4096 visited keys (seqlen 8k, whose longest programs
    # visit all 8192): +3.4% bf16 and +0-4% fp16 over host ones there, same process (v4; since v5
    # that applies to shapes outside the Gluon kernel's scope, and to the ablation's rung 4).
    (128, True): FwdConfig(128, 128, 8, 3, tma=True, tma_host_below_keys=4096, hopper_gluon_min_keys=1024),
    # head dim 256: only 2 stages of 128x64 K/V tiles fit next to Q in shared memory; TMA
    # (host descriptors to 4k keys, in-kernel from 8k) within -1..+2% of pointer tiles up
    # to 4k keys and +2-5% at 16k.
    (256, False): FwdConfig(128, 64, 8, 2, tma=True, tma_host_below_keys=8192),
    (256, True): FwdConfig(128, 64, 8, 2, tma=True, tma_host_below_keys=8192),
}
HOPPER_BWD_CONFIGS = {
    # tutorial 06's shape: narrow query steps against wide key blocks and vice versa.
    16: BwdConfig(32, 128, 128, 32, 4, 3),
    32: BwdConfig(32, 128, 128, 32, 4, 3),
    64: BwdConfig(32, 128, 128, 32, 4, 3),
    # head dim 128: 64-row query steps and 8 warps keep the four dK/dV matmuls on wgmma. From 1024
    # keys the Gluon dK/dV kernel instead, with dQ fused (5 matmuls, not 7): the backward 1.08-1.20x
    # faster at 1k-16k, bf16 and fp16, same process, than the one committed before it (this kernel
    # and the dQ kernel below 2k keys; from 2k the non-fused Gluon kernel and the dQ kernel)
    # (perf_notes, "v6 -> v7"). At 1k, where v7 kept this kernel (forward+backward host-bound when
    # causal), the fused Gluon backward read 1.07-1.12x faster by do_bench in two runs (v7, and v8
    # with cached launches), bwd and fwd_bwd (perf_notes, "v7 -> v8"). At head dim 64 the Gluon
    # kernel without dQ was 0.98-1.18x this kernel's time, so not taken there.
    128: BwdConfig(64, 128, 128, 32, 8, 3, hopper_gluon_min_keys=1024, hopper_gluon_fused_dq=True),
    # head dim 256: query-major dK/dV with 128 query rows per step at 8 warps and 1 stage (the
    # only stage count that fits), dQ 64x32 at 4 warps and 3 stages. Against the v1 key-major 64x64 (4
    # warps): dK/dV kernel 6.58 -> 2.62 ms at seqlen 4k, whole backward 1.7-2.0x
    # (reports/h200/perf_notes.md, v3). Descriptor loads free the address registers that
    # spilled (ptxas: 300 and 568 B -> 0): -2..-8% time at 4k-16k (v4). At head dim 128 the
    # whole backward was 0-8% slower with them (the dQ kernel), at 64 1.5-6% slower (mostly
    # the dK/dV kernel), so those keep pointer loads.
    256: BwdConfig(128, 64, 64, 32, 8, 1, dq_num_warps=4, dq_num_stages=3, query_major=True, tma=True),
}
# Any other CUDA GPU (Ampere, Ada): smaller tiles, fewer stages (less shared memory).
GENERIC_FWD_CONFIG = FwdConfig(64, 64, 4, 2)
GENERIC_BWD_CONFIG = BwdConfig(32, 64, 64, 32, 4, 2)
# Triton's CPU interpreter: small tiles so that tiny test shapes still span several blocks.
# On CPU both TMA paths run: host descriptors for whole-block shapes below 64 keys, in-kernel
# descriptors for the rest.
INTERPRETER_FWD_CONFIG = FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0,
                                   tma_host_below_keys=64)
INTERPRETER_BWD_CONFIG = BwdConfig(16, 32, 32, 16, 4, 1)


def padded_headdim(headdim: int) -> int:
    """Head dim as the kernels tile it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (headdim - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host: triton.cdiv is a constexpr function, about 3 us a call under
    cProfile on the project's CPU machine, not measured on the GPU's host (up to four calls per
    forward+backward; see kernels/launch.py on why host time matters)."""
    return -(-a // b)


@functools.cache
def _is_hopper(device_index: int) -> bool:
    """Whether this CUDA device is sm_90 (asked once per device: the query costs ~7 us of host
    time, which calls of ~0.1 ms feel)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _on_hopper(device: torch.device) -> bool:
    return _is_hopper(torch.cuda.current_device() if device.index is None else device.index)


def default_fwd_config(headdim: int, causal: bool, device: torch.device) -> FwdConfig:
    if device.type != "cuda":
        return INTERPRETER_FWD_CONFIG
    if _on_hopper(device):
        return HOPPER_FWD_CONFIGS[(padded_headdim(headdim), causal)]
    return GENERIC_FWD_CONFIG


def default_bwd_config(headdim: int, device: torch.device) -> BwdConfig:
    if device.type != "cuda":
        return INTERPRETER_BWD_CONFIG
    if _on_hopper(device):
        return HOPPER_BWD_CONFIGS[padded_headdim(headdim)]
    return GENERIC_BWD_CONFIG


# --------------------------------------------------------------------------------------
# Shared jit helpers
# --------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2D tile, masking only the dimensions that can run out of bounds (so the
    masks compile out for block-aligned lengths and power-of-two head dims)."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=rows_ok[:, None] & cols_ok[None, :])
        else:
            tl.store(ptrs, tile, mask=rows_ok[:, None])
    else:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=cols_ok[None, :])
        else:
            tl.store(ptrs, tile)


@triton.jit
def _batch_head(pid_bh, num_heads):
    """(batch, head) of the program whose grid index over batch x heads is `pid_bh`, as int64
    so that offsets past 2^31 elements do not overflow."""
    return (pid_bh // num_heads).to(tl.int64), (pid_bh % num_heads).to(tl.int64)


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) visits, as [0, full) without a
    mask and [full, end) with one. Causal is bottom-right aligned: row i sees key j iff
    j <= i + seqlen_k - seqlen_q. Blocks entirely above the diagonal are never visited."""
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        end = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), seqlen_k)
        full = tl.minimum(tl.maximum(start_m + offset + 1, 0), seqlen_k) // BLOCK_N * BLOCK_N
    else:
        end = seqlen_k
        full = seqlen_k // BLOCK_N * BLOCK_N
    return full, end


@triton.jit
def _finalize(acc, l_i, m_i):
    """FA2 Alg. 1 lines 12-13: O = diag(l)^-1 O once, L = m + log(l) (natural log). A row
    that saw no key has l = 0: it outputs 0 and L = +inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_i)) * LN2)
    return out, lse


@triton.jit
def _query_block_start(CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query row of this program. Causal: the last query block (the most key blocks to
    visit) is launched first, so the long programs start early and short ones fill the tail
    of the last wave (longest-processing-time-first, as flash-attn's CUDA kernels order them)."""
    if CAUSAL:
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    return tl.program_id(0) * BLOCK_M


# --------------------------------------------------------------------------------------
# Forward (FA2 Algorithm 1)
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# Backward (FA2 Algorithm 2)
# --------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    num_heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """FA2 Alg. 2 line 4: D = rowsum(dO * O), one float32 per query row."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seqlen_q + offs_m, tl.sum(o * do, 1),
             mask=offs_m < seqlen_q)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs, offs_n, offs_d,
                    lo, hi, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
                    MASK: tl.constexpr, EVEN_D: tl.constexpr, QUERY_MAJOR: tl.constexpr,
                    TMA: tl.constexpr, FUSED_DQ: tl.constexpr):
    """FA2 Alg. 2 lines 8-16 for one key block over query blocks [lo, hi). Query rows past
    seqlen_q load L = +inf and dO = 0, so they contribute exactly nothing without a mask.
    Key-major (default): every matmul has the key block as M (S^T = K Q^T), K and V are
    register operands. Query-major: S = Q K^T and dP = dO V^T have the query block as M, and
    P and dS are transposed on chip for the dV and dK updates; K and V stay in shared memory.
    With TMA, Q and DO are tensor descriptors bounded at (seqlen_q, HEAD_DIM) (zero fill).
    FUSED_DQ (FA2 Alg. 2 line 15 as the paper has it): dQ_i += scale * dS K_j is added into the
    float32 accumulator DQ here, by a TMA reduce-add of the tile (2: DQ a descriptor bounded at
    (seqlen_q, HEAD_DIM)) or element-wise atomics (1: DQ a pointer); 0: the dQ kernel does it."""
    offs_m_base = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
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
        if QUERY_MAJOR:
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
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, QUERY_MAJOR: tl.constexpr,
    TMA: tl.constexpr, FUSED_DQ: tl.constexpr,
):
    """One program per (key block, batch x head) owns dK_j and dV_j (FA2 Alg. 2 lines 5-18):
    every element is written by exactly one program, so no atomics for them. With FUSED_DQ the
    program also adds its part of every dQ_i into DQ, a float32 accumulator (line 15, atomics:
    the sum's order varies between runs); without, DQ is unused and the dQ kernel follows."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    LSE += pid_bh.to(tl.int64) * seqlen_q
    Delta += pid_bh.to(tl.int64) * seqlen_q
    if FUSED_DQ:
        DQ += b * stride_dqb + h * stride_dqh
    if FUSED_DQ == 2:
        DQ = tl.make_tensor_descriptor(DQ, shape=[seqlen_q, HEAD_DIM], strides=[stride_dqs, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    # line 6: load K_j, V_j; line 7: dK_j = dV_j = 0. Keys past seqlen_k load zeros and
    # only produce rows of dK/dV that are never stored.
    k = _load_tile(K + offs_n[:, None] * stride_ks + offs_d[None, :], n_ok, d_ok,
                   not EVEN_N, not EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vs + offs_d[None, :], n_ok, d_ok,
                   not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if TMA:
        Q = tl.make_tensor_descriptor(Q, shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                      block_shape=[BLOCK_M, BLOCK_D])
        DO = tl.make_tensor_descriptor(DO, shape=[seqlen_q, HEAD_DIM], strides=[stride_dos, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])

    if CAUSAL:
        # query blocks that see some of these keys: row i sees key j iff i >= j - offset
        offset = seqlen_k - seqlen_q
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        full = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - offset, lo), seqlen_q)
        full = tl.cdiv(full, BLOCK_M) * BLOCK_M  # from here on every row sees every key
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs,
                                 offs_n, offs_d, lo, full, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                                 HEAD_DIM, BLOCK_M, EVEN_M, True, EVEN_D, QUERY_MAJOR, TMA, FUSED_DQ)
    else:
        full = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs,
                             offs_n, offs_d, full, seqlen_q, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                             HEAD_DIM, BLOCK_M, EVEN_M, False, EVEN_D, QUERY_MAJOR, TMA, FUSED_DQ)
    # line 18: write dK_j (scaled once: S = scale * Q K^T) and dV_j
    _store_tile(DK + offs_n[:, None] * stride_dks + offs_d[None, :],
                (dk * softmax_scale).to(DK.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)
    _store_tile(DV + offs_n[:, None] * stride_dvs + offs_d[None, :],
                dv.to(DV.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d, lo, hi,
                  seqlen_q, seqlen_k, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  MASK: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """FA2 Alg. 2 lines 10-15 for one query block over key blocks [lo, hi). With TMA, K and V
    are tensor descriptors bounded at (seqlen_k, HEAD_DIM) (zero fill)."""
    offs_n_base = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
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


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
):
    """One program per (query block, batch x head) owns dQ_i: the dQ part of FA2 Alg. 2
    (line 15) as a separate pass, so dQ needs no atomics and the result is deterministic."""
    start_m = _query_block_start(CAUSAL, BLOCK_M)
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    LSE += pid_bh.to(tl.int64) * seqlen_q
    Delta += pid_bh.to(tl.int64) * seqlen_q

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                   not EVEN_M, not EVEN_D)
    do = _load_tile(DO + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok, d_ok,
                    not EVEN_M, not EVEN_D)
    lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TMA:
        K = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])

    full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d,
                       0, full, seqlen_q, seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL,
                       False, EVEN_D, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d,
                       full, end, seqlen_q, seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL,
                       True, EVEN_D, TMA)
    _store_tile(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :],
                (dq * softmax_scale).to(DQ.dtype.element_ty), m_ok, d_ok, not EVEN_M, not EVEN_D)


# --------------------------------------------------------------------------------------
# Launchers: validate, allocate, launch
# --------------------------------------------------------------------------------------
# The launches: after a shape's first call, without Triton's per-call argument binding
# (kernels/launch.py; host time is what short calls wait on).
_fwd_launcher = CachedLauncher(_flash_fwd_kernel)
_bwd_preprocess_launcher = CachedLauncher(_bwd_preprocess_kernel)
_bwd_dkdv_launcher = CachedLauncher(_flash_bwd_dkdv_kernel)
_bwd_dq_launcher = CachedLauncher(_flash_bwd_dq_kernel)


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           softmax_scale: float | None) -> float:
    """Raise TypeError/ValueError naming the argument for anything the kernels cannot take;
    return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, headdim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not _interpreter_enabled():
        raise ValueError(f"q is on {q.device}: the Triton kernels need a CUDA tensor, or set "
                         "TRITON_INTERPRET=1 in the environment before importing `kernels` to "
                         "run them in Triton's CPU interpreter (slow, for tests)")
    batch, _, heads, headdim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if k.shape[3] != headdim:
        raise ValueError(f"k and v must have q's head dim {headdim}, got {k.shape[3]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    if k.shape[2] != heads:
        if k.shape[2] == 0 or heads % k.shape[2] != 0:
            raise ValueError(f"k and v heads ({k.shape[2]}) must divide q heads ({heads})")
        raise NotImplementedError(f"GQA/MQA (k/v heads {k.shape[2]} != q heads {heads}) is "
                                  "not implemented yet")
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return float(softmax_scale)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride()[:3]


def flash_attn_forward(q, k, v, softmax_scale: float, causal: bool,
                       config: FwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass on validated inputs. Returns (out, lse): out like q, lse (batch, heads,
    seqlen_q) float32 natural-log logsumexp. `config` overrides the block-size table."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
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
        if q.is_cuda and _on_hopper(q.device):
            flash_attn_hopper.flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale, causal)
            return out, lse
        # a Hopper config passed for another device: the Gluon kernel is compiled for sm_90 only
        cfg = dataclasses.replace(cfg, hopper_gluon_min_keys=0)
        path = fwd_memory_path(cfg, q, k, v, out, causal)
    if path == "tma-host":
        args = tuple(_flat_descriptor(t, rows) for t, rows in
                     ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n), (out, cfg.block_m)))
    else:
        args = (q, k, v, out)
        if path == "tma-kernel":
            _ensure_descriptor_allocator()
    grid = (_cdiv(seqlen_q, cfg.block_m), batch * heads)
    _fwd_launcher[grid](
        *args, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        heads, seqlen_q, seqlen_k, softmax_scale * LOG2E.value,
        HEAD_DIM=headdim, BLOCK_D=padded_headdim(headdim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, EVEN_M=seqlen_q % cfg.block_m == 0, TMA=FWD_MEMORY_PATHS.index(path),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


FWD_MEMORY_PATHS = ("pointer", "tma-kernel", "tma-host")  # the kernel's TMA constexpr: 0, 1, 2
HOPPER_GLUON_PATH = "gluon-ws"  # kernels/flash_attn_hopper.py instead of _flash_fwd_kernel


def fwd_memory_path(config: FwdConfig, q, k, v, out, causal: bool) -> str:
    """How the forward runs for these (batch, seqlen, heads, headdim) tensors: 'gluon-ws' (the
    Gluon kernel of flash_attn_hopper.py, from hopper_gluon_min_keys keys where its scope holds),
    or _flash_fwd_kernel with 'tma-host' (2D descriptors made here), 'tma-kernel' (per-head
    descriptors made by each program) or 'pointer' (pointer tiles), by FwdConfig's rules."""
    if (config.hopper_gluon_min_keys and k.shape[1] >= config.hopper_gluon_min_keys
            and hopper_gluon_applies(q, k, v, out)):
        return HOPPER_GLUON_PATH
    if not config.tma or not tma_compatible(q, k, v, out):
        return "pointer"
    keys = k.shape[1] // 2 if causal else k.shape[1]
    if (config.tma_host_min_keys <= keys < config.tma_host_below_keys
            and _flat_view_is_exact(q, k, v, out, config)):
        return "tma-host"
    return "tma-kernel" if keys >= config.tma_min_keys else "pointer"


def _flat_view_is_exact(q, k, v, out, config: FwdConfig) -> bool:
    """Whether a (batch * seqlen, heads * headdim) 2D descriptor reads and writes exactly a
    (batch, head)'s tiles: whole blocks (no tile runs into the next batch's rows), a head dim
    with no padding columns (no tile runs into the next head's), heads side by side in a row
    and batches back to back."""
    headdim = q.shape[3]
    if (headdim != padded_headdim(headdim) or q.shape[1] % config.block_m or k.shape[1] % config.block_n
            or q.shape[0] * max(q.shape[1], k.shape[1]) >= 2**31):
        return False
    return all(t.stride(2) == headdim and t.stride(0) == t.shape[1] * t.stride(1) for t in (q, k, v, out))


def hopper_gluon_applies(q, k, v, out) -> bool:
    """The Gluon kernels' scope (kernels/flash_attn_hopper.py): query and key lengths equal and
    whole blocks, head dim 64 or 128, fp16 or bf16, and each tensor an exact 2D view for its
    descriptors (as the host-descriptor path needs, for the Gluon kernels' 128-row blocks).
    `out` is the forward's output, or dO for the backward's dK/dV kernel."""
    hopper = flash_attn_hopper
    batch, seqlen, heads, headdim = q.shape
    if not (q.shape == k.shape == v.shape == out.shape and headdim in hopper.HEAD_DIMS
            and seqlen % hopper.BLOCK_M == 0 and batch * heads <= 65535  # the grid's y limit
            and all(t.dtype == q.dtype for t in (k, v, out)) and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    # rows that do not overlap (no broadcast K or V with stride 0): one descriptor row each
    if any(t.stride(1) < heads * headdim for t in (q, k, v, out)):
        return False
    return tma_compatible(q, k, v, out) and _flat_view_is_exact(q, k, v, out, FwdConfig(hopper.BLOCK_M, hopper.BLOCK_N, 4, 1))


def _flat_descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    batch, seqlen, heads, headdim = t.shape
    return TensorDescriptor(t, [batch * seqlen, heads * headdim], [t.stride(1), 1], [block_rows, headdim])


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors (either kind, see fwd_memory_path) can describe these (batch,
    seqlen, heads, headdim) tensors: the copy engine needs 16-byte aligned addresses and row
    strides, so the base pointer and every stride but the last (which must be 1) in bytes are
    multiples of 16. Otherwise the forward uses pointer tiles (same results)."""
    for t in tensors:
        size = t.element_size()
        strides = t.stride()
        if strides[-1] != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in strides[:-1]):
            return False
    return True


def _torch_scratch(size: int, alignment: int, stream):
    """Global scratch for Triton from torch's caching allocator, aligned as Triton asks (a
    view into a slightly larger buffer, which the view keeps alive)."""
    buffer = torch.empty(size + alignment, dtype=torch.int8, device="cpu" if _interpreter_enabled() else "cuda")
    offset = -buffer.data_ptr() % alignment
    return buffer[offset:offset + size]


def _ensure_descriptor_allocator() -> None:
    """Descriptors made inside a kernel (tl.make_tensor_descriptor) live in a global scratch
    buffer that Triton asks the host for at launch. Triton keeps that allocator in a context
    variable (per thread), so this is checked at every TMA launch: torch's allocator is set
    only where none is, and an allocator the caller set is kept."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def flash_attn_backward(do, q, k, v, out, lse, softmax_scale: float, causal: bool,
                        config: BwdConfig | None = None, deterministic: bool = False):
    """Backward pass: returns (dq, dk, dv) in the inputs' dtype. Where the config fuses dQ into
    the dK/dV kernel (`bwd_gluon_fuses_dq` on the Gluon path, `bwd_fuses_dq` on the Triton one), dQ
    is summed by atomics in an order that varies between runs (as flash-attn's own backward does);
    `deterministic=True` takes the dQ kernel instead."""
    do, q, k, v = (_last_dim_contiguous(t) for t in (do, q, k, v))
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if seqlen_q == 0 or seqlen_k == 0 or batch * heads == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg = config or default_bwd_config(headdim, q.device)
    block_d = padded_headdim(headdim)
    delta = torch.empty_like(lse)
    _bwd_preprocess_launcher[(_cdiv(seqlen_q, 64), batch * heads)](
        out, do, delta, *_strides(out), *_strides(do), heads, seqlen_q,
        HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_M=64,
    )
    tma = bwd_uses_tma(cfg, q, k, v, do)
    if tma:
        _ensure_descriptor_allocator()
    common = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "CAUSAL": causal, "TMA": tma}
    if bwd_dkdv_path(cfg, q, k, v, do) == HOPPER_GLUON_PATH and q.is_cuda and _on_hopper(q.device):
        # the Gluon kernel (compiled for sm_90 only), adding dQ itself where the config says so
        dq_acc = (torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                  if bwd_gluon_fuses_dq(cfg, headdim, deterministic) else None)
        flash_attn_hopper.flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, softmax_scale, causal,
                                                          dq_accum=dq_acc)
    else:
        dq_acc = _launch_triton_dkdv(cfg, q, k, v, do, lse, delta, dk, dv, softmax_scale, common,
                                     bwd_fuses_dq(cfg, seqlen_q, deterministic))
    if dq_acc is not None:  # dQ was added into a float32 accumulator
        return dq.copy_(dq_acc), dk, dv
    _bwd_dq_launcher[(_cdiv(seqlen_q, cfg.block_m2), batch * heads)](
        q, k, v, do, lse, delta, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        heads, seqlen_q, seqlen_k, softmax_scale, softmax_scale * LOG2E.value,
        BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2,
        EVEN_M=seqlen_q % cfg.block_m2 == 0, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **common,
    )
    return dq, dk, dv


def _launch_triton_dkdv(cfg: BwdConfig, q, k, v, do, lse, delta, dk, dv, softmax_scale: float, common: dict,
                        fuse_dq: bool) -> torch.Tensor | None:
    """_flash_bwd_dkdv_kernel into dk and dv; with `fuse_dq`, also dQ added into a float32
    accumulator, which is returned (else None)."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    fused_dq = 0
    dq_acc = None
    if fuse_dq:
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        # TMA reduce-adds on Hopper, else element-wise atomics (also in Triton's CPU interpreter,
        # which has no descriptor reduce)
        fused_dq = 2 if q.is_cuda and _on_hopper(q.device) and tma_compatible(dq_acc) else 1
        if fused_dq == 2:
            _ensure_descriptor_allocator()
    acc = dk if dq_acc is None else dq_acc  # DQ is unused by the kernel unless dQ is fused
    _bwd_dkdv_launcher[(_cdiv(seqlen_k, cfg.block_n1), batch * heads)](
        q, k, v, do, lse, delta, dk, dv, acc,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv), *_strides(acc),
        heads, seqlen_q, seqlen_k, softmax_scale, softmax_scale * LOG2E.value,
        BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1,
        EVEN_M=seqlen_q % cfg.block_m1 == 0, EVEN_N=seqlen_k % cfg.block_n1 == 0,
        QUERY_MAJOR=cfg.query_major, FUSED_DQ=fused_dq, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **common,
    )
    return dq_acc


def bwd_fuses_dq(config: BwdConfig, seqlen_q: int, deterministic: bool = False) -> bool:
    """Whether the dK/dV kernel adds dQ into a float32 accumulator (atomics, run-to-run rounding
    differences) instead of the dQ kernel writing it: where the config asks for it from this
    many query rows and the caller does not ask for a deterministic backward."""
    return bool(config.fused_dq_min_rows) and seqlen_q >= config.fused_dq_min_rows and not deterministic


def bwd_dkdv_path(config: BwdConfig, q, k, v, do) -> str:
    """Which kernel computes dK and dV for these tensors by the config's rule: 'gluon-ws'
    (flash_attn_hopper.py: from hopper_gluon_min_keys keys where hopper_gluon_applies holds) or
    'triton' (_flash_bwd_dkdv_kernel). flash_attn_backward takes 'gluon-ws' only on an sm_90
    device."""
    if (config.hopper_gluon_min_keys and k.shape[1] >= config.hopper_gluon_min_keys
            and k.shape[1] % flash_attn_hopper.BWD_BLOCK_N == 0 and hopper_gluon_applies(q, k, v, do)):
        return HOPPER_GLUON_PATH
    return "triton"


def bwd_gluon_fuses_dq(config: BwdConfig, headdim: int, deterministic: bool = False) -> bool:
    """On the 'gluon-ws' path: whether the Gluon kernel adds dQ itself (TMA reduce-adds, the sum's
    order varying between runs) instead of the dQ kernel writing it: where the config asks for it,
    at head dim 128 (its two consumers split dQ's columns), unless a deterministic backward is
    asked for."""
    return config.hopper_gluon_fused_dq and headdim == 128 and not deterministic


def bwd_uses_tma(config: BwdConfig, q, k, v, do) -> bool:
    """Whether the backward streams its loop tiles through tensor descriptors: where the
    config asks for it and the copy engine can address the tensors (tma_compatible)."""
    return bool(config.tma) and tma_compatible(q, k, v, do)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, fwd_config, bwd_config, deterministic=False):
        out, lse = flash_attn_forward(q, k, v, softmax_scale, causal, fwd_config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.bwd_config = softmax_scale, causal, bwd_config
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: do not have autograd allocate and zero one for it per backward
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # an upstream node returned no gradient for out (none is materialised)
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                         ctx.bwd_config, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None


# --------------------------------------------------------------------------------------
# Public API: flash-attn's signatures
# --------------------------------------------------------------------------------------
def _check_unimplemented(dropout_p, window_size, softcap, alibi_slopes):
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented yet")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)}: sliding-window attention "
                                  "is not implemented yet")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented yet")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, fwd_config: FwdConfig | None = None,
                    bwd_config: BwdConfig | None = None):
    """Drop-in for `flash_attn.flash_attn_func`.

    q: (batch, seqlen_q, heads, headdim); k, v: (batch, seqlen_k, heads, headdim); float16,
    bfloat16 (or float32). Returns out (batch, seqlen_q, heads, headdim), or with
    `return_attn_probs=True` the tuple (out, softmax_lse, S_dmask) where softmax_lse is
    (batch, heads, seqlen_q) float32 and S_dmask is None (flash-attn returns its dropout
    pattern there; this kernel has no dropout). `deterministic` matters where the backward fuses
    dQ into the dK/dV kernel: the Hopper table's head-dim-128 backward from 1k keys (the Gluon
    kernel, `bwd_gluon_fuses_dq`), or a `bwd_config` with `fused_dq_min_rows` set. There
    `deterministic=False` adds dQ with atomics, whose rounding differs from run to run as in
    flash-attn, and `deterministic=True` keeps the separate dQ pass (bit-identical gradients).
    `fwd_config`/`bwd_config` override the block-size table (benchmarks use them; results are
    identical up to rounding).
    """
    _check_unimplemented(dropout_p, window_size, softcap, alibi_slopes)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = check_attention_inputs(q, k, v, softmax_scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    out, lse = FlashAttnFunc.apply(q, k, v, scale, causal, fwd_config, bwd_config, deterministic)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_qkvpacked_func`: qkv (batch, seqlen, 3, heads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must be a tensor of shape (batch, seqlen, 3, heads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_kvpacked_func`: kv (batch, seqlen_k, 2, heads, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("kv must be a tensor of shape (batch, seqlen_k, 2, heads, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
