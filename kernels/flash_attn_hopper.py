"""FA2's forward (Algorithm 1) and the backward's dK/dV kernel (Algorithm 2, with or without line
15's dQ) on Hopper, written in Gluon with FlashAttention-3's layout.

Triton 3.6 compiles the forward of `forward.py` to wgmma, but it waits for every matmul at
once and its key loop synchronises all warps at CTA-wide barriers, so the softmax does not run
under a matmul of the same warps (docs/performance.md, "Gluon forward with FlashAttention-3's
warp layout"). Gluon, Triton's lower-level language, lets a kernel say
which warps do what and when a matmul is waited for. This kernel (FA3, Shah et al. 2024):

- **Warp specialisation:** a producer warp issues the TMA loads of Q, K and V; two consumer
  warpgroups own 64 query rows each. They synchronise only through mbarriers (a K/V stage is
  refilled once both consumers have released it), with no CTA-wide barrier in the key loop, so
  one consumer's softmax can run while the other's matmuls do. Nothing orders them (FA3 adds
  named barriers for a strict ping-pong); the overlap is what the warp schedulers make of it.
- **Intra-warpgroup overlap (FA3's Algorithm 2):** for key block j a consumer issues S_j = Q K_j^T,
  then O += P_{j-1} V_{j-1}, and waits for S_j alone (`warpgroup_mma_wait(1)`): the softmax of
  S_j runs under the P V matmul.
- FA2's non-matmul savings are kept: O unnormalised until one final rescale, the softmax scale
  folded into the exponent's FMA, logsumexp stored, the causal mask only on the diagonal block.

Scope (`dispatch.fwd_memory_path` picks this path, "gluon-ws", only where
`dispatch.hopper_gluon_applies` holds, and `forward.flash_attn_forward` only on an sm_90 device): query and key
lengths equal and whole 128-row blocks; head dim 128 (from 1k keys) or 64 (from 4k keys, where
it measured 0.97-1.10x the Triton kernel, faster on average; at 2k causal it was slower); fp16 or bf16; each tensor a
(batch * seqlen, heads * head dim) 2D view with rows that do not overlap. Beyond dense attention
they take GQA/MQA (q head h reads kv head h // group), sliding windows (only the key blocks, or
in the backward the query steps, a window reaches), softcap and ALiBi (constexpr flags; the
backward with dQ fused only, `dispatch.bwd_dkdv_path`). Packed variable
lengths have kernels of their own here, causal or not and with no other feature: a forward
(`_flash_fwd_hopper_varlen_kernel`, `dispatch.hopper_gluon_varlen_applies`) and, at head dim 128,
a dK/dV kernel with dQ fused (`_flash_bwd_dkdv_hopper_varlen_kernel`,
`dispatch.hopper_gluon_varlen_bwd_applies`). Dropout runs on the Triton kernels.

The backward's dK/dV kernel (below the forward) has the same shape: a loader warp streams Q_i and
dO_i tiles, two consumer warpgroups own 64 keys each of a 128-key block and overlap the softmax
with the next matmul of the same query step. At head dim 128 it can add dQ too, as FA3 does: the
consumers exchange dS^T through shared memory, each computes half of dQ_i's columns over all 128
keys and adds them with one TMA reduce-add per step (5 matmuls instead of the Triton backward's 7;
with element-wise atomics instead it was 1.2-1.5x slower: docs/performance.md, "Gluon dK/dV with
dQ fused"). `backward.flash_attn_backward` takes it at head dim 128 from 1k keys in the same scope
(`dispatch.bwd_dkdv_path`), with dQ fused unless asked to be deterministic
(`dispatch.bwd_gluon_fuses_dq`).

Gluon has no CPU interpreter: the CPU tests compile these kernels for sm_90, the GPU tests run them.
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import l2_cache_bytes
from .features import _scores, _tanh
from .launch import CachedLauncher, DirectLaunch, descriptor_template

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per block
STAGES = 3  # K/V blocks in flight (shared memory at head dim 128: Q 32 KiB + 3 x 64 KiB of K and V; half at 64)
HEAD_DIMS = (64, 128)  # the head dims the kernels serve (flash_attn.hopper_gluon_applies)
LOG2E = 1.4426950408889634
# How the forward adds ALiBi's key term under a causal mask (the ALIBI constexpr's value, 1 + the
# index): per element in registers, or by the tensor cores: a 128-key wgmma of depth 16 that each
# S matmul chains on ('matmul-wide'; docs/performance.md, "ALiBi's key term", has the timings).
# Its 4 KiB B tile fits beside K's 3-stage ring at head dim 128 once V's ring holds 2 blocks.
# V_STAGES: V blocks in flight (None: STAGES, or 2 where that tile needs the room); K and V
# stages are released separately, K's once its S matmul has finished, V's once its P~ V has.
ALIBI_COLUMN_TERMS = ("registers", "matmul-wide")
ALIBI_COLUMN_TERM = "matmul-wide"
V_STAGES: int | None = None


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, n_blocks, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr):
    """FA2 Alg. 1 line 9 on unscaled scores S: m_new, P~ = exp2(S * scale - m_new) and
    l = exp2(m_old - m_new) l + rowsum(P~); the causal mask only on the diagonal block (the last
    one), and no mask code at all in the non-causal kernel. Every row sees its own key on the
    diagonal, so m_new is finite."""
    if CAUSAL:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if block == n_blocks - 1:
            visible = (block * BLOCK_N + offs_n)[None, :] <= offs_m[:, None]
            s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.jit
def _softmax_step_alibi(s, m_i, l_i, qk_scale, block_bias, offs_m, offs_n, block, n_blocks, BLOCK_N: gl.constexpr):
    """_softmax_step (causal) on scores whose matmul added ALiBi's key term (`_alibi_query_tile`):
    S * scale holds scale * q.k + slope * log2(e) * (key offset in the block), and `block_bias`
    (slope * log2(e) * (the block's first key - the reference row)) completes the key term in the
    per-row math, so each element costs what the dense step's does."""
    if block == n_blocks - 1:
        visible = (block * BLOCK_N + offs_n)[None, :] <= offs_m[:, None]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale + block_bias)
    p = gl.exp2(s * qk_scale - (m_new - block_bias)[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.jit
def _alibi_key_tile(kx_smem):
    """Fill the [BLOCK_N, 16] B operand of ALiBi's key term: row j (a key offset in the block) holds
    j in columns 0-2, zeros after (j < 256 is exact in bf16 and fp16). Written once per program,
    before the partitions start."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    rows = gl.arange(0, kx_smem.type.shape[0], layout=gl.SliceLayout(1, layout)).to(gl.float32)[:, None]
    cols = gl.arange(0, kx_smem.type.shape[1], layout=gl.SliceLayout(0, layout))[None, :]
    tile = gl.where(cols < 3, rows, 0.0)
    kx_smem.store(tile.to(kx_smem.dtype))
    fence_async_shared()


@gluon.jit
def _alibi_query_tile(alibi_log2, qk_scale, dtype: gl.constexpr, a_layout: gl.constexpr):
    """The [64, 16] A operand of ALiBi's key term, in its register layout: every row holds
    a = slope * log2(e) / scale split into three terms of `dtype` (their sum is a to fp32
    precision) in columns 0-2, zeros after. A times `_alibi_key_tile`'s B adds a * (key offset)
    to each unscaled score, which the scale turns into slope * log2(e) * (key offset)."""
    a = alibi_log2 / qk_scale
    a1 = a.to(dtype).to(gl.float32)
    a2 = (a - a1).to(dtype).to(gl.float32)
    a3 = a - a1 - a2
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, a_layout))[None, :]
    zero = gl.zeros([64, 16], gl.float32, a_layout)
    return (zero + gl.where(cols == 0, a1, gl.where(cols == 1, a2, gl.where(cols == 2, a3, 0.0)))).to(dtype)


@gluon.jit
def _scores_log2(s, qk_scale, mods, rows, cols, CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """kernels/features.py's `_scores` (scores in log2 units with the softcap, then ALiBi's
    `-slope * |i - j|`; and the tanh the softcap's derivative needs), but under a causal mask
    ALiBi split in two. `mods` = (softcap * log2(e), slope * log2(e), the reference row r);
    `rows` and `cols` index the tile's queries and keys (2D, broadcastable). Every visible key
    has j <= i there, so the bias is slope * (j - r) - slope * (i - r): the query term is the
    same for a whole row, so it is left to the caller (the forward leaves it out of the softmax,
    where it cancels, and takes it off the logsumexp; the backward adds it to the logsumexp), and
    the per-element cost is one add."""
    softcap_log2, alibi_log2, ref = mods
    s, t = _scores(s, qk_scale, softcap_log2, alibi_log2, rows, cols, 0, SOFTCAP, ALIBI and not CAUSAL)
    if ALIBI and CAUSAL:
        s = s + alibi_log2 * (cols - ref).to(gl.float32)
    return s, t


@gluon.jit
def _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n, offs_n_f, block, CAUSAL: gl.constexpr,
                       BLOCK_N: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """_softmax_step with a sliding window, softcap or ALiBi. `window` = (left, right, full_lo,
    full_hi): with WINDOW a block outside [full_lo, full_hi) is masked, else causal masks the
    blocks from full_hi (the diagonal one). A row may see no key of a block at a window's edge:
    its max stays -inf until a block where it sees one, so the exponent's reference is 0 while it
    is -inf (P~ = 0, no NaN). Per element this costs the dense step's work plus, with ALiBi, one
    add and the column term's share (from `offs_n_f`, the block's key offsets as floats, which
    the compiler recomputes per block: a thread holds 32 keys of 2 rows, so each operation per
    key costs about half a one per element; docs/performance.md has the counters) and, with a
    softcap, its tanh."""
    cols = block * BLOCK_N + offs_n
    if SOFTCAP:
        softcap_log2, alibi_log2, ref = mods
        s = softcap_log2 * _tanh(s * qk_scale)
        scale = 1.0  # s is in log2 units from here
    elif ALIBI:
        softcap_log2, alibi_log2, ref = mods
        s = s * qk_scale
        scale = 1.0
    else:
        scale = qk_scale  # folded into the exponent's FMA, as the dense step does
    if ALIBI:
        if CAUSAL:  # _scores_log2's split bias: the column term only
            s = s + alibi_log2 * (offs_n_f + (block * BLOCK_N - ref).to(gl.float32))[None, :]
        else:
            s = s - alibi_log2 * gl.abs(offs_m[:, None] - cols[None, :]).to(gl.float32)
    if WINDOW:
        left, right, full_lo, full_hi = window
        if (block < full_lo) | (block >= full_hi):
            diag = offs_m[:, None]
            visible = (cols[None, :] <= diag + right) & (cols[None, :] >= diag - left)
            s = gl.where(visible, s, float("-inf"))
    elif CAUSAL:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if block >= window[3]:  # the diagonal block
            s = gl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    if WINDOW:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = gl.exp2(s * scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.constexpr_function
def _alibi_by_matmul(causal, window, softcap, alibi):
    """Whether the forward adds ALiBi's key term in the S matmul (`_alibi_query_tile`): asked for
    (ALIBI_COLUMN_TERM), causal, without a window or softcap (the bias is linear in the key index
    only where every visible key is at or before the query, and a softcap comes before it)."""
    return int(alibi) >= 2 and bool(causal) and not window and not softcap


@gluon.constexpr_function
def _wgmma_layout(cols):
    """The layout of a wgmma accumulator `cols` wide held by one warpgroup (its 4 warps split the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _fwd_program(num_heads, CAUSAL: gl.constexpr):
    """The program's (query block, batch x head, batch, head); causal runs the last query block (the
    most key blocks) first: the longest programs start early."""
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    return pid_m, pid_bh, pid_bh // num_heads, pid_bh % num_heads


@gluon.jit
def _fwd_shared_buffers(q_desc, k_desc, v_desc, STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """The forward's shared memory: Q_i as two 64-row halves, rings of STAGES K_j and V_STAGES V_j
    blocks, and their mbarriers (q_bar, k_bar, v_bar: a TMA load has landed; empty_bar: a stage is
    free). With rings of one size a key block's K and V share a stage, released once P~ V is done;
    with V's ring shorter (`_split_release`) empty_bar holds K's stages then V's, each released
    once its matmul is done."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    RELEASES: gl.constexpr = STAGES + V_STAGES if V_STAGES != STAGES else STAGES
    empty_bar = gl.allocate_shared_memory(gl.int64, [RELEASES, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(q_bar.index(half), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(stage), count=1)
        if V_STAGES == STAGES:
            mbarrier.init(v_bar.index(stage), count=1)
        mbarrier.init(empty_bar.index(stage), count=2)  # released by both consumer warpgroups
    if V_STAGES != STAGES:
        for stage in gl.static_range(V_STAGES):
            mbarrier.init(v_bar.index(stage), count=1)
            mbarrier.init(empty_bar.index(STAGES + stage), count=2)
    return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar


@gluon.jit
def _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, col0, kv_row0,
               kv_col0, first_block, n_blocks):
    """FA2 Alg. 1 line 4 (Q_i, as two 64-row halves) and line 7 (K_j, V_j of key blocks first_block ..
    first_block + n_blocks - 1 from row kv_row0) as TMA loads, each key block into the ring stage
    both consumers have released (empty_bar counts two; with `_split_release`, K's and V's apart)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    for half in gl.static_range(2):
        mbarrier.expect(q_bar.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + half * q_desc.block_type.shape[0], col0], q_bar.index(half),
                                        q_smem.index(half))
    for i in range(n_blocks):
        stage = i % STAGES
        # a fresh mbarrier counts as having completed the phase before its first, so the first
        # STAGES waits pass at once
        mbarrier.wait(empty_bar.index(stage), ((i // STAGES) & 1) ^ 1)
        row = kv_row0 + (first_block + i) * BLOCK_N
        mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col0], k_bar.index(stage), k_smem.index(stage))
        v_stage = i % V_STAGES
        if _split_release(empty_bar, k_smem):
            mbarrier.wait(empty_bar.index(STAGES + v_stage), ((i // V_STAGES) & 1) ^ 1)
        mbarrier.expect(v_bar.index(v_stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col0], v_bar.index(v_stage), v_smem.index(v_stage))


@gluon.constexpr_function
def _split_release(empty_bar, k_smem):
    """Whether K's and V's stages are released apart (`_fwd_shared_buffers`: V's ring is shorter)."""
    return empty_bar.type.shape[0] > k_smem.type.shape[0]


@gluon.jit
def _s_matmul(q_buf, k_tile, s_init, bias=None):
    """Line 8's S = Q K_j^T (unscaled), issued asynchronously; with `bias` (ALiBi's (A, B) tiles,
    `_alibi_by_matmul`) chained on A B, so S holds ALiBi's key term with no work per element."""
    if bias is None:
        s_tok = warpgroup_mma(q_buf, k_tile.permute((1, 0)), s_init, use_acc=False, is_async=True)
    else:
        s_tok = warpgroup_mma(bias[0], bias[1], s_init, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(q_buf, k_tile.permute((1, 0)), s_tok, is_async=True)
    return s_tok


@gluon.jit
def _fwd_first_block(q_buf, k_smem, q_bar, k_bar, empty_bar, s_layout: gl.constexpr, o_layout: gl.constexpr,
                     HALF: gl.constexpr, bias=None):
    """A consumer's line 5 (O = 0, l = 0, m = -inf) and line 8 for its first key block (S = Q K^T,
    unscaled, waited for, through `_s_matmul`), then K_0's stage released: (m, l, O, the zero
    accumulator every S matmul starts from, S)."""
    ROWS: gl.constexpr = q_buf.type.shape[0]
    HEAD_DIM: gl.constexpr = q_buf.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar.index(HALF), 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma_wait(0, deps=[_s_matmul(q_buf, k_smem.index(0), s_init, bias)])
    if _split_release(empty_bar, k_smem):
        mbarrier.arrive(empty_bar.index(0), count=1)  # K_0 read
    return m_i, l_i, acc, s_init, s


@gluon.jit
def _fwd_block_matmuls(i, q_buf, k_smem, v_smem, k_bar, v_bar, empty_bar, p, acc, s_init, p_layout: gl.constexpr,
                       bias=None):
    """Line 8 for the loop's i-th key block j (`_s_matmul`) and line 10's P~ V for block j - 1, both
    in flight; waits for S_j alone (wgmma groups complete in order), so the caller's line 9 for
    block j runs under P~ V. Returns S_j, P~ V's accumulator and A operand, and the empty barrier
    of block j - 1's V stage (with `_split_release`, K_j's is released here, S_j done)."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    stage = i % STAGES
    prev = (i - 1) % V_STAGES
    mbarrier.wait(k_bar.index(stage), (i // STAGES) & 1)
    s_tok = _s_matmul(q_buf, k_smem.index(stage), s_init, bias)
    mbarrier.wait(v_bar.index(prev), ((i - 1) // V_STAGES) & 1)
    p_op = gl.convert_layout(p.to(q_buf.dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])
    if _split_release(empty_bar, k_smem):
        mbarrier.arrive(empty_bar.index(stage), count=1)  # K_j read
        prev = STAGES + prev
    return s, acc_tok, p_op, prev


@gluon.jit
def _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar, o_row_layout: gl.constexpr):
    """Block j - 1's P~ V waited for and its V stage released (`prev`, the empty barrier
    _fwd_block_matmuls returned: this warpgroup is done with it), then
    line 10's rescale: O = diag(exp(m_old - m_new)) O, before P~_j V_j is added."""
    acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
    mbarrier.arrive(empty_bar.index(prev), count=1)
    return acc * gl.convert_layout(alpha, o_row_layout)[:, None]


@gluon.jit
def _fwd_last_block(n_blocks, p, acc, v_smem, v_bar, empty_bar, p_layout: gl.constexpr):
    """Line 10 for the last key block: O += P~ V, waited for, and its stage released."""
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    V_FIRST: gl.constexpr = empty_bar.type.shape[0] - V_STAGES  # V's first empty barrier: 0 unless released apart
    last = (n_blocks - 1) % V_STAGES
    mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // V_STAGES) & 1)
    p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
    mbarrier.arrive(empty_bar.index(V_FIRST + last), count=1)
    return acc


@gluon.jit
def _load_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                    HALF: gl.constexpr):
    """One warp: _load_q_kv for the program's query block and the key blocks it visits."""
    (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0, col0,
     kv_col0, first_block, n_blocks, pid_bh, seqlen, qk_scale, softcap_log2, alibi_log2, window_left, window_right,
     full_lo, full_hi, kx_smem) = args
    _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, col0, kv_row0,
               kv_col0, first_block, n_blocks)


@gluon.jit
def _softmax_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                       HALF: gl.constexpr):
    """One consumer warpgroup: FA2 Alg. 1 lines 5-15 for query rows [HALF * 64, HALF * 64 + 64)
    of the block, in FA3's Algorithm 2 order, over key blocks first_block .. first_block +
    n_blocks - 1 (_softmax_loop), then lines 12-15."""
    (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0, col0,
     kv_col0, first_block, n_blocks, pid_bh, seqlen, qk_scale, softcap_log2, alibi_log2, window_left, window_right,
     full_lo, full_hi, kx_smem) = args
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    # wgmma accumulators of one warpgroup, and P as the register-held A operand of P V
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_buf = q_smem.index(HALF)
    mods = (softcap_log2, alibi_log2, q_row - kv_row0)  # ALiBi's reference row: the block's first
    window = (window_left, window_right, full_lo, full_hi)

    start_m = (q_row - kv_row0) + HALF * ROWS  # this half's first query row in its sequence
    offs_m = start_m + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs_n_f = offs_n.to(gl.float32)
    acc, l_i, m_i = _softmax_loop(q_buf, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, qk_scale, mods, window,
                                  offs_m, offs_n, offs_n_f, first_block, n_blocks, kx_smem, s_layout, o_layout,
                                  p_layout, o_row_layout, CAUSAL, WINDOW, SOFTCAP, ALIBI, HALF)
    # lines 12-15: O = diag(l)^-1 O once, L = m + log(l) (m is in log2 units), write both
    out = acc / gl.convert_layout(l_i, o_row_layout)[:, None]
    lse2 = m_i + gl.log2(l_i)
    if ALIBI and CAUSAL:  # the query term the softmax left out (_scores_log2)
        lse2 = lse2 - mods[1] * (offs_m - mods[2]).to(gl.float32)
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen + offs_m, lse2 * 0.6931471805599453)
    q_buf.store(out.to(dtype))  # this half's Q buffer stages its O (only this warpgroup read it)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + HALF * ROWS, col0], q_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _softmax_loop(q_buf, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, qk_scale, mods, window, offs_m, offs_n,
                  offs_n_f, first_block, n_blocks, kx_smem, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  p_layout: gl.constexpr, o_row_layout: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, HALF: gl.constexpr):
    """Lines 5-11 of one consumer over its key blocks, the scores through _softmax_step (dense),
    _softmax_step_alibi (ALiBi's key term added by the S matmul) or _softmax_step_mods: the
    unnormalised O, l and m."""
    ALIBI_MMA: gl.constexpr = _alibi_by_matmul(CAUSAL, WINDOW, SOFTCAP, ALIBI)
    MODS: gl.constexpr = WINDOW | SOFTCAP | ALIBI
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    if ALIBI_MMA:  # ALiBi's (A, B) tiles, and its key term's per-block part: slope * log2(e) * (j0 - row0)
        bias = (_alibi_query_tile(mods[1], qk_scale, k_smem.dtype,
                                  gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)),
                kx_smem.permute((1, 0)))
    else:
        bias = None
    # lines 5 and 8 for key block 0, then line 9
    m_i, l_i, acc, s_init, s = _fwd_first_block(q_buf, k_smem, q_bar, k_bar, empty_bar, s_layout, o_layout, HALF,
                                                bias)
    if ALIBI_MMA:
        p, alpha, l_i, m_i = _softmax_step_alibi(s, m_i, l_i, qk_scale, mods[1] * (-mods[2]).to(gl.float32), offs_m,
                                                 offs_n, 0, n_blocks, BLOCK_N)
    elif MODS:
        p, alpha, l_i, m_i = _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n, offs_n_f, first_block,
                                                CAUSAL, BLOCK_N, WINDOW, SOFTCAP, ALIBI)
    else:
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, n_blocks, BLOCK_N, CAUSAL)
    for i in range(1, n_blocks):
        # line 8 for block j and line 10's P~ V for block j - 1; line 9 for block j runs under P~ V
        s, acc_tok, p_op, prev = _fwd_block_matmuls(i, q_buf, k_smem, v_smem, k_bar, v_bar, empty_bar, p, acc, s_init,
                                                    p_layout, bias)
        if ALIBI_MMA:
            p, alpha, l_i, m_i = _softmax_step_alibi(s, m_i, l_i, qk_scale, mods[1] * (i * BLOCK_N - mods[2]).to(gl.float32),
                                                     offs_m, offs_n, i, n_blocks, BLOCK_N)
        elif MODS:
            p, alpha, l_i, m_i = _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n,
                                                    offs_n_f, first_block + i, CAUSAL, BLOCK_N, WINDOW, SOFTCAP, ALIBI)
        else:
            p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, i, n_blocks, BLOCK_N, CAUSAL)
        acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar, o_row_layout)
    acc = _fwd_last_block(n_blocks, p, acc, v_smem, v_bar, empty_bar, p_layout)
    return acc, l_i, m_i


@gluon.jit
def _window_key_blocks(start_m, seqlen, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key blocks the query block [start_m, start_m + BLOCK_M) visits under a window (query and
    key lengths equal): first, count, and [full_lo, full_hi), the blocks every row sees whole
    (kernels/features.py's _window_key_blocks; sides are non-negative, UNBOUNDED for no bound)."""
    first = gl.maximum(start_m - window_left, 0) // BLOCK_N
    end = (gl.minimum(start_m + BLOCK_M + window_right, seqlen) + BLOCK_N - 1) // BLOCK_N
    full_lo = (gl.maximum(start_m + BLOCK_M - 1 - window_left, 0) + BLOCK_N - 1) // BLOCK_N
    full_hi = gl.maximum(gl.minimum(start_m + window_right + 1, seqlen) // BLOCK_N, full_lo)
    return first, end - first, full_lo, full_hi


@gluon.jit
def _flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, num_heads, seqlen, qk_scale,
                             kv_group, window_left, window_right, softcap_log2, Alibi, stride_alibi_b,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr = False,
                             SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False, V_STAGES: gl.constexpr = 0):
    """One program per (query block, batch x head) (FA2 Section 3.2), partitioned into warps as
    FA3 does. The descriptors view (batch * seqlen, heads * head dim); K and V have
    num_heads / kv_group heads (GQA/MQA: q head h reads kv head h // kv_group). CAUSAL reaches the
    partitions at compile time (a constexpr in their argument tuples), so the non-causal kernel has
    no mask code (as a run-time flag it cost the non-causal kernel its speed); so do WINDOW (a
    sliding window: only the key blocks it reaches are loaded), SOFTCAP and ALIBI (slopes of
    shape (heads,) or (batch, heads), batch stride stride_alibi_b)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = 2 * ROWS
    # the causal loop's block count and its one masked (diagonal) block assume square blocks
    gl.static_assert(BLOCK_M == BLOCK_N)
    pid_m, pid_bh, b, h = _fwd_program(num_heads, CAUSAL)
    start_m = pid_m * BLOCK_M
    q_row = b * seqlen + start_m
    kv_row0 = b * seqlen
    col0 = h * HEAD_DIM
    kv_col0 = (h // kv_group) * HEAD_DIM
    full_lo = 0
    full_hi = 0
    if WINDOW:
        first_block, n_blocks, full_lo, full_hi = _window_key_blocks(start_m, seqlen, window_left, window_right,
                                                                     BLOCK_M, BLOCK_N)
    elif CAUSAL:  # key blocks up to the diagonal, the last one masked
        first_block = 0
        n_blocks = (start_m + BLOCK_M) // BLOCK_N
        full_hi = n_blocks - 1
    else:
        first_block = 0
        n_blocks = seqlen // BLOCK_N
    alibi_log2 = 0.0
    if ALIBI:
        alibi_log2 = gl.load(Alibi + b * stride_alibi_b + h) * 1.4426950408889634

    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar = _fwd_shared_buffers(
        q_desc, k_desc, v_desc, STAGES, V_STAGES if V_STAGES else STAGES)
    if _alibi_by_matmul(CAUSAL, WINDOW, SOFTCAP, ALIBI):
        kx_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, 16],
                                            gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
        _alibi_key_tile(kx_smem)
    else:
        kx_smem = q_smem  # not read

    args = (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0,
            col0, kv_col0, first_block, n_blocks, pid_bh, seqlen, qk_scale, softcap_log2, alibi_log2, window_left,
            window_right, full_lo, full_hi, kx_smem)
    # The run-time values travel as one tuple, the constexprs beside it in tuples written in the
    # call (a tuple assigned to a name holds run-time values: the flags would be). The default
    # partition (4 warps) and one worker (4 warps) consume, one function HALF apart; one warp
    # loads. Registers: 240 per consumer thread, 24 for the loader.
    gl.warp_specialize([
        (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 0)),
        (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 1)),
        (_load_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 0)),
    ], [4, 1], [240, 24])


@functools.cache
def _tile_layout(rows: int, headdim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, headdim] tile (computed once per shape and dtype: four
    descriptors per launch would otherwise recompute it)."""
    return gl.NVMMASharedLayout.get_default_for([rows, headdim], gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _row_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A (batch * seqlen, heads * head dim) 2D view of a (batch, seqlen, heads, head dim) tensor,
    `rows` rows per tile (the layout `flash_attn._flat_view_is_exact` checks)."""
    batch, seqlen, heads, headdim = t.shape
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the Hopper forward takes float16 or bfloat16 tensors, got {t.dtype}")
    return TensorDescriptor(t, [batch * seqlen, heads * headdim], [t.stride(1), 1], [rows, headdim],
                            _tile_layout(rows, headdim, t.dtype))


_fwd_launcher = CachedLauncher(_flash_fwd_hopper_kernel)  # kernels/launch.py

# The score modifications and masks the Gluon kernels take (kernels/features.py's constexprs);
# dropout runs on the Triton kernels only (packed variable lengths: the varlen kernel below).
GLUON_FEATURE_FLAGS = ("WINDOW", "SOFTCAP", "ALIBI")


def flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale: float, causal: bool, stages: int = STAGES) -> None:
    """Write O into `out` and the natural-log logsumexp into `lse` (batch, heads, seqlen) for dense
    attention (GQA/MQA included); the caller (forward.flash_attn_forward) has checked the scope
    above. `stages`: K/V blocks in flight (experiments time other counts)."""
    forward_hopper_plan(q, k, v, out, causal, stages)(q, k, v, out, lse, softmax_scale)


def forward_constexprs(causal: bool, head_dim: int, flags: dict | None, stages: int = STAGES) -> dict:
    """The forward kernel's feature constexprs for GLUON_FEATURE_FLAGS `flags`: ALIBI as 1 + the
    index of ALIBI_COLUMN_TERM, and V_STAGES. ALiBi's B tile by matmul (4 KiB) beside 3 K and 3 V
    stages of 32 KiB and Q's 32 KiB passes the 227 KiB limit at head dim 128: V's ring holds 2
    blocks there."""
    flags = {name: bool((flags or {}).get(name)) for name in GLUON_FEATURE_FLAGS}
    if flags["ALIBI"]:
        flags["ALIBI"] = 1 + ALIBI_COLUMN_TERMS.index(ALIBI_COLUMN_TERM)
    by_matmul = _alibi_by_matmul(causal, flags["WINDOW"], flags["SOFTCAP"], flags["ALIBI"])
    return {**flags, "V_STAGES": V_STAGES or (2 if by_matmul and head_dim > 64 else stages)}


def forward_hopper_plan(q, k, v, out, causal: bool, stages: int = STAGES, flags: dict | None = None):
    """The launch for tensors shaped, strided and aligned like these, as a function of (q, k, v,
    out, lse, softmax_scale, features=()): descriptors are copied from ones made (and validated)
    here, and the compiled kernel is launched directly after the first call (launch.DirectLaunch).
    `flags`: the GLUON_FEATURE_FLAGS constexprs of kernels/features.py's `feature_args`; `features`
    then holds its run-time values (qk_scale, window sides, softcap * log2(e), the slopes and their
    batch stride)."""
    batch, seqlen, heads, _ = q.shape
    templates = (_row_descriptor(q, BLOCK_M // 2), _row_descriptor(k, BLOCK_N), _row_descriptor(v, BLOCK_N),
                 _row_descriptor(out, BLOCK_M // 2))
    flags = forward_constexprs(causal, q.shape[-1], flags, stages)
    # 4 warps in the default partition, 4 + 1 in the workers: 9, padded to 12 (registers are
    # reallocated per warpgroup); 168 registers each at launch, moved by setmaxnreg
    # the descriptors' tensors are passed and the launch makes them (launch.DirectLaunch)
    launch = DirectLaunch(sys.modules[__name__], "_fwd_launcher", (seqlen // BLOCK_M, batch * heads),
                          {"STAGES": stages, "CAUSAL": causal, "num_warps": 4, "maxnreg": 168, **flags},
                          descriptors=dict(enumerate(map(descriptor_template, templates))))
    kv_group = heads // k.shape[2]

    def run(q, k, v, out, lse, softmax_scale, features=()):
        qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b = (
            features or (softmax_scale * LOG2E, 0, 0, 0.0, None, 0))
        launch(q, k, v, out, lse, heads, seqlen, qk_scale, kv_group, window_left, window_right, softcap_log2,
               alibi if alibi is not None else lse, stride_alibi_b)

    return run


# --------------------------------------------------------------------------------------
# Forward over packed variable lengths (flash_attn_varlen_func): the same warp layout
# --------------------------------------------------------------------------------------
@gluon.jit
def _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, mask_from, seqlen_k, shift,
                         BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """_softmax_step for one sequence of a packed batch: from block `mask_from` on, keys past the
    sequence's end (and, causal, keys past the row's diagonal, bottom-right aligned: key j is
    visible to query row i when j <= i + shift, shift = seqlen_k - seqlen_q) are masked. A row
    may see no key of a block (or none at all): its max stays -inf and the exponent's reference
    is 0 while it does (P~ = 0, no NaN)."""
    if block >= mask_from:
        cols = block * BLOCK_N + offs_n
        visible = cols[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + shift)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.jit
def _varlen_load_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr):
    """_load_partition over one sequence's rows of the packed (total, heads * head dim) views."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0,
     col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0, stride_o, qk_scale) = args
    _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, col0, kv_row0,
               kv_col0, 0, n_blocks)


@gluon.jit
def _varlen_softmax_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr):
    """_softmax_partition for one sequence of a packed batch: rows [start_m + HALF * 64, + 64) of
    the sequence, over its n_blocks key blocks (at least one: a program whose rows see no key runs
    one fully masked block and writes zeros with logsumexp +inf, as the reference does). The rows
    of a query tile past the sequence's end are the next sequence's: their results are not
    written (a masked store where the tile crosses the end, TMA where it does not)."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0,
     col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0, stride_o, qk_scale) = args
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_buf = q_smem.index(HALF)

    first_row = start_m + HALF * ROWS  # this half's first query row in its sequence
    offs_m = first_row + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i, l_i, acc, s_init, s = _fwd_first_block(q_buf, k_smem, q_bar, k_bar, empty_bar, s_layout, o_layout, HALF)
    p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, mask_from, seqlen_k, shift,
                                              BLOCK_N, CAUSAL)
    for i in range(1, n_blocks):
        s, acc_tok, p_op, prev = _fwd_block_matmuls(i, q_buf, k_smem, v_smem, k_bar, v_bar, empty_bar, p, acc, s_init,
                                                    p_layout)
        p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, i, mask_from, seqlen_k,
                                                  shift, BLOCK_N, CAUSAL)
        acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar, o_row_layout)
    acc = _fwd_last_block(n_blocks, p, acc, v_smem, v_bar, empty_bar, p_layout)

    # lines 12-15; a row that saw no key: O = 0, L = +inf
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, o_row_layout)[:, None]
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(LSE + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
    if first_row + ROWS <= seqlen_q:  # the whole half is this sequence's: one TMA store
        q_buf.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_row + HALF * ROWS, col0], q_buf)
        tma.store_wait(pendings=0)
    else:  # the tile crosses the sequence's end: the rows past it belong to the next sequence
        o_rows = first_row + gl.arange(0, ROWS, layout=o_row_layout)
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = Out + (q_row - start_m + o_rows).to(gl.int64)[:, None] * stride_o + (col0 + o_cols)[None, :]
        gl.store(ptrs, out.to(dtype), mask=(o_rows < seqlen_q)[:, None])


@gluon.jit
def _flash_fwd_hopper_varlen_kernel(q_desc, k_desc, v_desc, o_desc, Out, LSE, CuSeqQ, CuSeqK, num_heads, total_q,
                                    stride_o, qk_scale, kv_group, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """The Gluon forward over packed sequences (flash_attn_varlen_func): program (query block,
    sequence x head); sequence b's queries are rows CuSeqQ[b]:CuSeqQ[b + 1] of the (total_q,
    heads * head dim) views, its keys rows CuSeqK[b]:CuSeqK[b + 1]; LSE is (heads, total_q).
    Causal is bottom-right aligned per sequence. A program past its sequence's last query block
    does nothing."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = 2 * ROWS
    pid_m, pid_bh, b, h = _fwd_program(num_heads, CAUSAL)
    q_start = gl.load(CuSeqQ + b)
    seqlen_q = gl.load(CuSeqQ + b + 1) - q_start
    kv_row0 = gl.load(CuSeqK + b)
    seqlen_k = gl.load(CuSeqK + b + 1) - kv_row0
    start_m = pid_m * BLOCK_M
    if start_m < seqlen_q:
        shift = seqlen_k - seqlen_q
        keys = seqlen_k
        if CAUSAL:  # the keys the block's last row sees (bottom-right), at most the sequence's
            keys = gl.minimum(gl.maximum(start_m + BLOCK_M + shift, 0), seqlen_k)
        n_blocks = gl.maximum((keys + BLOCK_N - 1) // BLOCK_N, 1)  # one masked block if no key is seen
        mask_from = seqlen_k // BLOCK_N  # the sequence's partial last block
        if CAUSAL:  # from the block holding the first row's diagonal
            mask_from = gl.minimum(mask_from, gl.maximum(start_m + shift, 0) // BLOCK_N)
        q_row = q_start + start_m
        col0 = h * HEAD_DIM
        kv_col0 = (h // kv_group) * HEAD_DIM
        lse_row0 = h.to(gl.int64) * total_q + q_start
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar = _fwd_shared_buffers(q_desc, k_desc, v_desc, STAGES,
                                                                                     STAGES)
        args = (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                q_row, kv_row0, col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0,
                stride_o, qk_scale)
        gl.warp_specialize([
            (_varlen_softmax_partition, (args, CAUSAL, 0)),
            (_varlen_softmax_partition, (args, CAUSAL, 1)),
            (_varlen_load_partition, (args, CAUSAL, 0)),
        ], [4, 1], [240, 24])


def _packed_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A (total, heads * head dim) 2D view of a packed (total, heads, head dim) tensor."""
    total, heads, headdim = t.shape
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the Hopper forward takes float16 or bfloat16 tensors, got {t.dtype}")
    return TensorDescriptor(t, [total, heads * headdim], [t.stride(0), 1], [rows, headdim],
                            _tile_layout(rows, headdim, t.dtype))


_fwd_varlen_launcher = CachedLauncher(_flash_fwd_hopper_varlen_kernel)


def flash_attn_varlen_forward_hopper(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                     qk_scale: float, causal: bool, stages: int = STAGES) -> None:
    """Write O into `out` (packed like q) and the natural-log logsumexp into `lse` (heads, total_q)
    for packed sequences (q (total_q, heads, d), k and v (total_k, kv_heads, d), each a
    (total, heads * d) 2D view with rows that do not overlap; d 64 or 128; fp16 or bf16);
    `qk_scale` is the softmax scale times log2(e)."""
    total_q, heads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), batch * heads)
    _fwd_varlen_launcher[grid](
        _packed_descriptor(q, BLOCK_M // 2), _packed_descriptor(k, BLOCK_N), _packed_descriptor(v, BLOCK_N),
        _packed_descriptor(out, BLOCK_M // 2), out, lse, cu_seqlens_q, cu_seqlens_k, heads, total_q, out.stride(0),
        qk_scale, heads // k.shape[1], STAGES=stages, CAUSAL=causal, num_warps=4, maxnreg=168)


# --------------------------------------------------------------------------------------
# Backward: the dK/dV kernel (FA2 Alg. 2 lines 5-18, line 15's dQ optionally) in FA3's layout
# --------------------------------------------------------------------------------------
BWD_BLOCK_M = 64  # query rows per step of the key block's loop
# The dK/dV kernel's schedule (constexprs STATS and DQ_FIRST of _flash_bwd_dkdv_hopper_kernel):
# L_i and D_i loaded with Q_i and dO_i into shared memory; the fused dQ's matmul issued before
# dK's where it measured faster (GQA/MQA, windows, ALiBi: `_dq_first`), None meaning that rule
# and a bool forcing it. Module-level so that an experiment can time the schedules against each other
# (tools/experiments/exp_bwd_schedule.py, docs/performance.md).
BWD_STATS_IN_SHARED = True
BWD_DQ_FIRST: bool | None = None
# The consumer's step: D_i read once P^T is made rather than with L_i (BWD_LATE_DELTA), and under
# a causal mask the steps that cross the key block's diagonal in a loop of their own, so the
# other steps' code has no mask (BWD_SPLIT_DIAGONAL); docs/performance.md has their timings.
BWD_LATE_DELTA = True
BWD_SPLIT_DIAGONAL = True
# The varlen dK/dV kernel: L_i and D_i brought into shared memory by the loader warp
# (VARLEN_BWD_STATS_IN_SHARED), and the steps that need a mask in a loop of their own
# (VARLEN_BWD_SPLIT_MASKED); docs/performance.md has their timings.
VARLEN_BWD_STATS_IN_SHARED = True
VARLEN_BWD_SPLIT_MASKED = False
# With one loop: every step masked (False), or each step masked only where it needs it, told at run
# time as the dense kernel's one loop did (True; ignored where the masked steps run apart): faster
# causal, level otherwise (docs/performance.md).
VARLEN_BWD_MASK_AT_RUN_TIME = True
# The varlen dK/dV kernel's key blocks (varlen_bwd_key_blocks): "longest", every sequence given the
# longest one's, the programs past a shorter sequence's end exiting at once; "packed", sequence b's
# from block (cu_seqlens_k[b] + 128 b) // 128 of one axis over the batch (FA3's padded offsets), at
# most one empty program a sequence; "auto" (varlen_bwd_grid) packed where the longest grid would be
# more than half empty, where it measured faster (level or slower elsewhere: docs/performance.md).
VARLEN_BWD_GRID = "auto"
VARLEN_BWD_GRIDS = ("longest", "packed", "auto")
# "packed": the lanes of a program's scan of cu_seqlens (batch + 1 entries; more sequences take
# "longest"), one a thread of the kernel's four warps: the width the GPU tests ran
VARLEN_BWD_SCAN_BATCH = 128


def varlen_bwd_masking() -> int:
    """The varlen dK/dV kernel's SPLIT_MASKED constexpr from the module's settings: 0 one loop,
    every step masked; 1 the masked steps in a loop of their own; 2 one loop, each step masked
    where it needs it (a run-time check)."""
    if VARLEN_BWD_SPLIT_MASKED:
        return 1
    return 2 if VARLEN_BWD_MASK_AT_RUN_TIME else 0
# The dK/dV kernels' launch order (bwd_grid): (batch, kv head) pairs in sections of at most this
# many, each section's key blocks block-major; "l2" sizes the sections to the L2 cache; 1 runs each
# pair's key blocks in turn. Module-level so that an experiment can time the orders.
BWD_HEAD_SECTION: int | str = "l2"
BWD_BLOCK_N = 128  # keys per program: two consumer warpgroups of 64
BWD_MAX_KEY_BLOCKS = 65535  # key blocks on the grid's second axis (bwd_grid): CUDA's limit there
# The fused dQ's float32 accumulator (the dense dK/dV kernel's; VARLEN_BWD_DQ_ORDER the varlen one's): "rows"
# holds dQ as the (batch x seqlen, heads x head dim) view, each consumer's 64 x 64 tile stored from
# its wgmma registers into a 128-byte-swizzled tile (two-way bank conflicts) and reduce-added by a
# [64, 64] box; "registers" holds each such tile as the consumer's registers lie (FA4's dQaccum
# order): each thread's four-register runs side by side (DQ_TILE_BASES), stored without bank
# conflicts and reduce-added as one contiguous [16, 256] box, and dq_from_accumulator puts the
# tiles back in rows as it casts. docs/performance.md has their timings.
BWD_DQ_ORDER = "registers"
BWD_DQ_ORDERS = ("rows", "registers")
# The varlen dK/dV kernel's accumulator: "rows" the packed (total_q, heads x head dim) view, or
# "registers", each sequence's tiles from a padded row of their own (varlen_dq_accumulator, FA3's
# layout for its dQaccum), cast back by dq_from_varlen_accumulator.
VARLEN_BWD_DQ_ORDER = "registers"
# A 64 x 64 float32 tile in the wgmma accumulator's register order: bit b of an element's offset
# in the tile moves it by DQ_TILE_BASES[b] (row, column); offsets 0-3 are one thread's registers
# 0-3 (columns c, c + 1 of rows r and r + 8), then the lanes, the warps (16 rows each), and the
# thread's higher registers (8 columns on). The wgmma layout's own bases (gl.to_linear_layout of
# _wgmma_layout(64)): registers [0, 1], [8, 0], [0, 8], [0, 16], [0, 32]; lanes [0, 2], [0, 4],
# [1, 0], [2, 0], [4, 0]; warps [16, 0], [32, 0].
DQ_TILE_BASES = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0), (0, 8), (0, 16), (0, 32))
DQ_REGISTER_BOX: gl.constexpr = gl.constexpr((16, 256))  # the tile's 4096 floats as one TMA box
DQ_REGISTER_TILE: gl.constexpr = gl.SharedLinearLayout(offset_bases=[[row, col] for row, col in DQ_TILE_BASES])
# How the register-order accumulator's cast (dq_from_accumulator, dq_from_varlen_accumulator)
# writes dQ: "scattered", each element to its (row, column) from DQ_TILE_BASES; "rows", the tile
# put in rows first (_register_tile_in_rows), each row's columns stored side by side, and in the
# varlen cast also each padded tile read whole, unmasked, by the programs within the sequence
# (docs/performance.md has their timings)
DQ_CAST = "rows"
DQ_CASTS = ("scattered", "rows")
BWD_STAGES = 2  # Q/dO tiles in flight (shared memory at head dim 128: K and V 64 KiB + 2 x 32 KiB; 64 KiB more for the fused dQ's dS^T and dQ tiles)


@gluon.jit
def _dq_tile_buffer(dq_smem, dq_desc, HALF: gl.constexpr):
    """This consumer's float32 dQ tile of the [2, 64, 64] dq_smem: with the descriptor's layout
    (rows), or reinterpreted as DQ_REGISTER_TILE (register order: the store writes each thread's
    registers side by side)."""
    buf = dq_smem.index(HALF)
    if dq_desc.block_type.shape[1] == DQ_REGISTER_BOX[1]:
        buf = buf._reinterpret(gl.float32, [buf.shape[0], buf.shape[1]], DQ_REGISTER_TILE)
    return buf


def bwd_grid(n_blocks: int, pairs: int, kv_group: int, seqlen_q: int, headdim: int, element_size: int,
             device: torch.device, section: int | str | None = None) -> tuple[int, int, int]:
    """The dK/dV kernels' grid (pairs in a section, key blocks, sections) for n_blocks key blocks
    of `pairs` (batch, kv head) pairs (_bwd_program; the varlen kernel's packed grid passes its kv
    heads, every sequence's blocks on the key-block axis: _varlen_packed_program). A section holds the largest divisor of
    `pairs` at most `section` (default BWD_HEAD_SECTION); "l2": at most as many pairs as keep
    their Q, dO and float32 dQ accumulator (kv_group q heads of seqlen_q rows each) within the L2
    cache (common.l2_cache_bytes), the budget FlashAttention-4's backward tile scheduler
    (SingleTileLPTBwdScheduler in flash_attn/cute/tile_scheduler.py) sizes its head sections by;
    it rounds down to a power of two and runs a narrower last section, here the largest divisor
    of the pairs keeps every section whole. The accumulator is counted whether or not the call
    fuses dQ. Refuses more than BWD_MAX_KEY_BLOCKS key blocks, which the
    dispatch keeps off these kernels (dispatch.bwd_dkdv_path, hopper_gluon_varlen_bwd_applies)."""
    if not 0 < n_blocks <= BWD_MAX_KEY_BLOCKS or pairs < 1:
        raise ValueError(f"the dK/dV grid takes 1..{BWD_MAX_KEY_BLOCKS} key blocks and at least one (batch, kv head) "
                         f"pair, got {n_blocks} key blocks and {pairs} pairs")
    section = BWD_HEAD_SECTION if section is None else section
    if section == "l2":
        index = device.index if device.index is not None else torch.cuda.current_device()
        section = max(1, l2_cache_bytes(index) // max(kv_group * seqlen_q * headdim * (2 * element_size + 4), 1))
    if not isinstance(section, int) or section < 1:
        raise ValueError(f"BWD_HEAD_SECTION must be a positive int or 'l2', got {section!r}")
    width = next(w for w in range(min(section, pairs), 0, -1) if pairs % w == 0)
    return width, n_blocks, pairs // width


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """A TMA reduce-add of shared-memory tile `src` into global memory at `coord` of `tensor_desc`
    (cp.reduce.async.bulk.tensor .add; completion as for tma.async_copy_shared_to_global, by
    tma.store_wait). Triton 3.6 lowers `tensor_descriptor.atomic_add` to this op, but its Gluon
    Hopper module does not wrap it; this calls the same builder method."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group, BLOCK_M: gl.constexpr,
                     HEAD_DIM: gl.constexpr):
    """Step `step` of a key block's loop over (q head of its group, query step) (GQA/MQA: the
    kv_group q heads that share this kv head, one after the other): (first query row, the q
    head's first column in the descriptors, the q head's (batch, head) row of LSE and Delta, the
    head's index in its group)."""
    group = step // n_steps
    m = first_m + (step - group * n_steps) * BLOCK_M
    return m, q_col0 + group * HEAD_DIM, lse_row0 + group, group


@gluon.jit
def _bwd_program(num_heads, kv_group, BLOCK_N: gl.constexpr):
    """The program's (batch, kv head, first key) of its place in the grid (pair in its section,
    key block, section of (batch x kv head) pairs; bwd_grid). Programs start in grid order, the
    first axis fastest: a section's block 0 of every pair, then block 1 of every pair, and so on.
    Causal, block 0 has the most query steps, so a section's longest programs start first
    (longest-processing-time first)."""
    kv_heads = num_heads // kv_group
    pair = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
    return pair // kv_heads, pair % kv_heads, gl.program_id(1) * BLOCK_N


@gluon.jit
def _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr):
    """The dK/dV kernel's shared memory: K_j and V_j as two 64-key halves (loaded once: kv_bar), a
    ring of STAGES Q_i and dO_i tiles (q_bar, do_bar: a TMA load has landed; empty_bar: a stage is
    free) and, with FUSED_DQ, the dQ exchange's buffers and mbarriers (ds_smem, dq_smem, ds_bar,
    done_bar; without it, stand-ins of the right kinds)."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(stage), count=1)
        mbarrier.init(do_bar.index(stage), count=1)
        mbarrier.init(empty_bar.index(stage), count=2)  # released by both consumer warpgroups
    if FUSED_DQ:
        # dS^T of both consumers for two steps (the A operands of dQ = dS K, read transposed) and
        # each consumer's float32 dQ tile for its reduce-add: rows of the (batch x seqlen, heads x
        # head dim) view, or in the consumer's register order (DQ_ORDER "registers")
        ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, BLOCK_M], q_desc.layout)
        if dq_desc.block_type.shape[1] == DQ_REGISTER_BOX[1]:  # each tile reinterpreted by _dq_tile_buffer
            gl.static_assert(BLOCK_M * HEAD_DIM // 2 == DQ_REGISTER_BOX[0] * DQ_REGISTER_BOX[1])
        else:
            gl.static_assert(2 * dq_desc.block_type.shape[1] == HEAD_DIM)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for parity in gl.static_range(2):
            mbarrier.init(ds_bar.index(parity), count=2)  # both consumers' dS^T are in place
        mbarrier.init(done_bar, count=2)
    else:  # the fused path's buffers and barriers are not used: stand-ins of the right kinds
        ds_smem, dq_smem, ds_bar, done_bar = q_smem, q_smem, q_bar, kv_bar
    return k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar, done_bar


@gluon.jit
def _bwd_load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row0, start_n, col0):
    """FA2 Alg. 2 line 6: K_j and V_j from row kv_row0 + start_n as two 64-key halves, once, on kv_bar."""
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        kv_row = kv_row0 + start_n + half * ROWS
        tma.async_copy_global_to_shared(k_desc, [kv_row, col0], kv_bar, k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [kv_row, col0], kv_bar, v_smem.index(half))


@gluon.jit
def _bwd_load_tiles(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar,
                    q_row0, kv_row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_desc, delta_desc, lse_smem,
                    delta_smem, lse_row0, STATS: gl.constexpr):
    """FA2 Alg. 2 line 6 (K_j, V_j from row kv_row0 + start_n, as two 64-key halves, once) and line
    9's loads of Q_i and dO_i (rows from q_row0, _bwd_step_coords' steps), each query step into the
    ring stage both consumers have released. With STATS, L_i and D_i (rows lse_row0.. of their
    (batch x heads, seqlen) views) travel with Q_i and dO_i, on the same mbarriers, as
    FlashAttention-3's producer brings them: the consumers read them from shared memory instead of
    waiting on global loads at every step."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    _bwd_load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row0, start_n, col0)
    for step in range(n_steps * kv_group):
        stage = step % STAGES
        m, q_col, lse_row, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, 0, kv_group, BLOCK_M,
                                                HEAD_DIM)
        # a fresh mbarrier counts as having completed the phase before its first
        mbarrier.wait(empty_bar.index(stage), ((step // STAGES) & 1) ^ 1)
        _load_tile_and_stats(q_desc, [q_row0 + m, q_col], q_smem.index(stage), lse_desc, [lse_row, m],
                             lse_smem.index(stage), q_bar.index(stage), STATS)
        _load_tile_and_stats(do_desc, [q_row0 + m, q_col], do_smem.index(stage), delta_desc, [lse_row, m],
                             delta_smem.index(stage), do_bar.index(stage), STATS)


@gluon.jit
def _load_tile_and_stats(desc, coord, buf, stats_desc, stats_coord, stats_buf, bar, STATS: gl.constexpr):
    """One TMA load of a query step's tile into `buf` and, with STATS, of its [1, BLOCK_M] row of L
    or D into `stats_buf`, both completing `bar`'s phase."""
    if STATS:
        mbarrier.expect(bar, desc.block_type.nbytes + stats_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(stats_desc, stats_coord, bar, stats_buf)
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coord, bar, buf)


@gluon.jit
def _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init):
    """Line 10: S^T = K_j Q_i^T (unscaled) and line 13: dP^T = V_j dO_i^T, each issued once its
    tile has landed; both left in flight."""
    mbarrier.wait(q_bar.index(stage), phase)
    s_tok = warpgroup_mma(k_buf, q_buf.permute((1, 0)), s_init, use_acc=False, is_async=True)
    mbarrier.wait(do_bar.index(stage), phase)
    dp_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), s_init, use_acc=False, is_async=True)
    return s_tok, dp_tok


@gluon.jit
def _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv):
    """Line 12: dV_j += P^T dO_i; line 14: dS^T = P^T * (dP^T - D_i), under the dV matmul (delta:
    D_i as a [1, BLOCK_M] row). Returns the dV matmul in flight and dS^T in the inputs' dtype."""
    dv_tok = warpgroup_mma(p_op, do_buf, dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=[dp_tok])
    return dv_tok, (p * (dp - delta)).to(do_buf.dtype)


@gluon.jit
def _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout: gl.constexpr):
    """_bwd_dv_ds, then line 16: dK_j += dS^T Q_i (the softmax scale is applied once at the end).
    Returns the dV and dK matmuls in flight, dS^T and its A operand."""
    dv_tok, ds = _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv)
    ds_op = gl.convert_layout(ds, op_layout)
    dk_tok = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
    return dv_tok, dk_tok, ds, ds_op


@gluon.jit
def _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF: gl.constexpr):
    """The fused dQ's exchange: this consumer's dS^T into the step's buffer pair (two pairs: a
    consumer may be one step ahead), then its arrival on the pair's mbarrier. Returns the pair."""
    parity = step % 2
    ds_smem.index(2 * parity + HALF).store(ds)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's stores, before one thread arrives
    mbarrier.arrive(ds_bar.index(parity), count=1)
    return parity


@gluon.jit
def _bwd_add_dq(dq_desc, q_row0, m, q_col, ds_smem, k_smem, ds_bar, dq_buf, dq_init, parity, step, softmax_scale,
                num_heads, HALF: gl.constexpr):
    """Line 15 (FA3's scheme), once both consumers' dS^T are in place: dQ_i[:, this consumer's
    columns] = dS K_j[:, columns] over both halves' keys, scaled and added into the float32
    accumulator behind dq_desc (rows from q_row0) by one TMA reduce-add."""
    dq_tok = _bwd_issue_dq(dq_desc, ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF)
    dq = warpgroup_mma_wait(0, deps=[dq_tok])
    _bwd_reduce_dq(dq_desc, q_row0, m, q_col, dq_buf, dq, softmax_scale, num_heads, HALF)


@gluon.jit
def _bwd_issue_dq(dq_desc, ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF: gl.constexpr):
    """Once both consumers' dS^T are in place, the matmul dS K_j[:, this consumer's columns] over
    both halves' keys, in flight."""
    DQ_COLS: gl.constexpr = dq_init.shape[1]
    mbarrier.wait(ds_bar.index(parity), (step // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)),
                           k_smem.index(0).slice(HALF * DQ_COLS, DQ_COLS, dim=1), dq_init,
                           use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)),
                         k_smem.index(1).slice(HALF * DQ_COLS, DQ_COLS, dim=1), dq_tok, is_async=True)


@gluon.jit
def _bwd_reduce_dq(dq_desc, q_row0, m, q_col, dq_buf, dq, softmax_scale, num_heads, HALF: gl.constexpr):
    """dQ_i's columns, scaled, added into the float32 accumulator by one TMA reduce-add: as rows
    of the (batch x seqlen, heads x head dim) view at (q_row0 + m, this consumer's columns), or
    (DQ_ORDER "registers") as the consumer's registers lie, each thread's in turn (DQ_REGISTER_TILE:
    no bank conflicts on the store), one contiguous tile of the accumulator per (64-row block of
    the view, 64 columns), tiles in the view's order (dq_from_accumulator puts them back; the
    varlen kernel's q_row0 is its sequence's padded row: varlen_dq_accumulator,
    dq_from_varlen_accumulator)."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    DQ_COLS: gl.constexpr = dq.shape[1]
    tma.store_wait(pendings=0)  # the previous step's reduce-add has read dq_buf
    dq_buf.store(dq * softmax_scale)
    fence_async_shared()
    gl.thread_barrier()
    if dq_desc.block_type.shape[1] == DQ_REGISTER_BOX[1]:
        tile = (q_row0 + m) // BLOCK_M * (2 * num_heads) + q_col // DQ_COLS + HALF  # q_col: the head's first
        _tma_reduce_add(dq_desc, [tile * DQ_REGISTER_BOX[0], 0],
                        dq_buf._reinterpret(gl.float32, [DQ_REGISTER_BOX[0], DQ_REGISTER_BOX[1]], dq_desc.layout))
    else:
        _tma_reduce_add(dq_desc, [q_row0 + m, q_col + HALF * DQ_COLS], dq_buf)


@gluon.jit
def _bwd_load_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                        FUSED_DQ: gl.constexpr, STATS: gl.constexpr, DQ_FIRST: gl.constexpr, HALF: gl.constexpr):
    """One warp: _bwd_load_tiles for the program's key block and the query steps that see it."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0, start_n, first_m,
     col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2, window_left,
     window_right, full_lo, full_hi, num_heads) = args
    _bwd_load_tiles(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar,
                    row0, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, LSE, Delta, lse_smem, delta_smem,
                    lse_row0, STATS)


@gluon.jit
def _bwd_delta_row(Delta, delta_smem, stage, lse_row, seqlen, offs_m, s_layout: gl.constexpr, STATS: gl.constexpr):
    """D_i as a [1, BLOCK_M] row of the transposed tiles: from the stage's shared memory (STATS) or
    from global memory."""
    if STATS:
        return delta_smem.index(stage).load(s_layout)
    else:
        return gl.load(Delta + lse_row.to(gl.int64) * seqlen + offs_m)[None, :]


@gluon.jit
def _bwd_dkdv_step(args, ctx, step, dk, dv, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                   ALIBI: gl.constexpr, FUSED_DQ: gl.constexpr, STATS: gl.constexpr, DQ_FIRST: gl.constexpr,
                   HALF: gl.constexpr, LATE_DELTA: gl.constexpr, DIAGONAL: gl.constexpr):
    """One query step of _bwd_dkdv_partition's loop (FA2 Alg. 2 lines 8-16 for Q_i, dO_i): `ctx` the
    partition's per-program values, the constexprs its own. DIAGONAL (causal): 1 where the step's
    rows cross the key block's diagonal, so P^T is masked, 0 where they do not, 2 where the step
    tells at run time (one loop for all steps). Returns dK_j and dV_j."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0, start_n, first_m,
     col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2, window_left,
     window_right, full_lo, full_hi, num_heads) = args
    k_buf, v_buf, offs_n, offs_m_base, s_init, dq_init, dq_buf = ctx
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    MODS: gl.constexpr = WINDOW | SOFTCAP | ALIBI
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    m, q_col, lse_row, group = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group,
                                                BLOCK_M, HEAD_DIM)
    offs_m = m + offs_m_base
    q_buf = q_smem.index(stage)
    do_buf = do_smem.index(stage)
    # line 10: S^T = K_j Q_i^T (unscaled); line 13: dP^T = V_j dO_i^T; both in flight
    s_tok, dp_tok = _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init)
    # L_i (natural log -> log2) and D_i as [1, BLOCK_M] rows of the transposed tiles
    if STATS:  # landed with Q_i and dO_i (the score matmuls waited for both)
        lse = lse_smem.index(stage).load(s_layout) * 1.4426950408889634
    else:
        lse = gl.load(LSE + lse_row.to(gl.int64) * seqlen + offs_m)[None, :] * 1.4426950408889634
    if not LATE_DELTA:
        delta = _bwd_delta_row(Delta, delta_smem, stage, lse_row, seqlen, offs_m, s_layout, STATS)
    # line 11: P^T = exp(S^T - L) in the log2 domain, under the dP^T matmul
    s = warpgroup_mma_wait(1, deps=[s_tok])
    if MODS:
        alibi_log2 = 0.0
        if ALIBI:  # the slope of this step's q head
            alibi_log2 = gl.load(Alibi + group) * 1.4426950408889634
        s, t = _scores_log2(s, qk_scale, (softcap_log2, alibi_log2, start_n), offs_m[None, :], offs_n[:, None],
                            CAUSAL, SOFTCAP, ALIBI)
        if ALIBI and CAUSAL:  # the query term of the split bias joins the logsumexp
            lse = lse + (alibi_log2 * (offs_m - start_n).to(gl.float32))[None, :]
        p = gl.exp2(s - lse)
    else:
        p = gl.exp2(s * qk_scale - lse)
    if WINDOW:
        if (m < full_lo) | (m > full_hi):  # query steps that do not see every key of the block
            visible = ((offs_m[None, :] >= offs_n[:, None] - window_right)
                       & (offs_m[None, :] <= offs_n[:, None] + window_left))
            p = gl.where(visible, p, 0.0)
    elif CAUSAL and DIAGONAL == 1:  # a query step that crosses the diagonal of this block
        p = gl.where(offs_n[:, None] <= offs_m[None, :], p, 0.0)
    elif CAUSAL and DIAGONAL == 2:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if m - first_m < 2 * k_desc.block_type.shape[0]:  # the query steps that cross the diagonal
            p = gl.where(offs_n[:, None] <= offs_m[None, :], p, 0.0)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    if SOFTCAP:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2 joins P^T now: t is not kept for dS
        p = p * (1.0 - t * t)
    if LATE_DELTA:  # D_i once P^T is made: its registers are not held through the softmax
        delta = _bwd_delta_row(Delta, delta_smem, stage, lse_row, seqlen, offs_m, s_layout, STATS)
    if FUSED_DQ and DQ_FIRST:
        # lines 12 and 14 as below, dS^T to the other consumer before its A operand is made
        dv_tok, ds = _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv)
        parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
        ds_op = gl.convert_layout(ds, op_layout)
        # line 15 (this consumer's columns of dQ_i), then line 16: dK_j += dS^T Q_i; dQ is
        # written and reduce-added while the dK matmul runs
        dq_tok = _bwd_issue_dq(dq_desc, ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF)
        dk_tok = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
        dq = warpgroup_mma_wait(1, deps=[dq_tok])  # dV's and dQ's matmuls have finished
        _bwd_reduce_dq(dq_desc, row0, m, q_col, dq_buf, dq, softmax_scale, num_heads, HALF)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
        mbarrier.arrive(empty_bar.index(stage), count=1)  # this warpgroup is done with Q_i, dO_i
    else:
        # line 12: dV_j += P^T dO_i; line 14: dS^T under the dV matmul; line 16: dK_j += dS^T Q_i
        dv_tok, dk_tok, ds, ds_op = _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout)
        if FUSED_DQ:  # dS^T to the other consumer: line 15 needs both halves' keys
            parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
        mbarrier.arrive(empty_bar.index(stage), count=1)  # this warpgroup is done with Q_i, dO_i
        if FUSED_DQ:  # line 15: this consumer's columns of dQ_i
            _bwd_add_dq(dq_desc, row0, m, q_col, ds_smem, k_smem, ds_bar, dq_buf, dq_init, parity, step,
                        softmax_scale, num_heads, HALF)
    return dk, dv


@gluon.jit
def _bwd_dkdv_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                        FUSED_DQ: gl.constexpr, STATS: gl.constexpr, DQ_FIRST: gl.constexpr, HALF: gl.constexpr,
                        LATE_DELTA: gl.constexpr, SPLIT_DIAGONAL: gl.constexpr):
    """One consumer warpgroup: FA2 Alg. 2 lines 7-18 for keys [HALF * 64, HALF * 64 + 64) of the
    block, key-major (the matmuls of lines 10-14 and 16 have these keys as M; K_j and V_j are
    shared-memory operands). Per query step the softmax of S^T runs under the dP^T matmul and dS^T under the dV
    matmul. With GQA/MQA the steps run over every q head of the kv head's group, so dK_j and dV_j
    sum over them in registers.
    FUSED_DQ (line 15, FA3's scheme): both consumers put dS^T in shared memory and wait for each
    other (mbarrier ds_bar); each then computes columns [HALF * 64, HALF * 64 + 64) of
    dQ_i = dS K_j over all 128 keys and adds them into the float32 accumulator behind dq_desc with
    one TMA reduce-add (the sum's order varies between runs).
    DQ_FIRST (FA3's order): the dQ matmul is issued before dK's, and dQ goes to shared memory and
    its reduce-add while the dK matmul runs; else after dK and dV have finished.
    STATS: L_i and D_i come from shared memory (the loader's, with Q_i and dO_i), else from global
    memory at each step.
    WINDOW, SOFTCAP, ALIBI: the forward's score modifications (_scores_log2, recomputed here on the
    transposed tile; the softcap's derivative 1 - tanh^2 scales dS), the window's query steps
    outside [full_lo, full_hi] masked."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0, start_n, first_m,
     col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2, window_left,
     window_right, full_lo, full_hi, num_heads) = args
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_buf = k_smem.index(HALF)
    v_buf = v_smem.index(HALF)

    kv_row = row0 + start_n + HALF * ROWS  # this half's first key row in the descriptors
    offs_n = start_n + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_m_base = gl.arange(0, BLOCK_M, layout=col_layout)
    # line 7: dK_j = dV_j = 0
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    s_init = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    if FUSED_DQ:
        DQ_COLS: gl.constexpr = HEAD_DIM // 2  # this consumer's columns of dQ
        dq_init = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
        dq_buf = _dq_tile_buffer(dq_smem, dq_desc, HALF)
    else:  # stand-ins of the right kind (unused)
        dq_init, dq_buf = s_init, k_buf
    mbarrier.wait(kv_bar, 0)
    ctx = (k_buf, v_buf, offs_n, offs_m_base, s_init, dq_init, dq_buf)
    if CAUSAL and not WINDOW and SPLIT_DIAGONAL:
        # each q head's first 2 * ROWS query rows cross the block's diagonal (n_steps >= 2 here): they
        # run in a loop of their own, and the other steps' code has no mask
        DIAGONAL_STEPS: gl.constexpr = 2 * ROWS // BLOCK_M
        for group in range(kv_group):
            for i in range(DIAGONAL_STEPS):
                dk, dv = _bwd_dkdv_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        FUSED_DQ, STATS, DQ_FIRST, HALF, LATE_DELTA, 1)
            for i in range(DIAGONAL_STEPS, n_steps):
                dk, dv = _bwd_dkdv_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        FUSED_DQ, STATS, DQ_FIRST, HALF, LATE_DELTA, 0)
    else:
        for step in range(n_steps * kv_group):
            dk, dv = _bwd_dkdv_step(args, ctx, step, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, STATS,
                                    DQ_FIRST, HALF, LATE_DELTA, 2)

    if FUSED_DQ:  # the other consumer's last dQ matmul reads this half of K: wait for it
        mbarrier.arrive(done_bar, count=1)
        mbarrier.wait(done_bar, 0)
    # line 18: write dK_j, dV_j, staged through this half's K and V buffers
    k_buf.store((dk * softmax_scale).to(dtype))
    v_buf.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [kv_row, col0], k_buf)
    tma.async_copy_shared_to_global(dv_desc, [kv_row, col0], v_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _window_query_steps(start_n, seqlen, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query steps that see some key of [start_n, start_n + BLOCK_N) under a window (query and
    key lengths equal; row i sees key j iff j - right <= i <= j + left): the first step's row, the
    count, and the bounds [full_lo, full_hi] of the first rows of steps that see every key."""
    first_m = gl.maximum(start_n - window_right, 0) // BLOCK_M * BLOCK_M
    end = gl.minimum(start_n + BLOCK_N + window_left, seqlen)
    return first_m, (end - first_m + BLOCK_M - 1) // BLOCK_M, start_n + BLOCK_N - 1 - window_right, \
        start_n + window_left - BLOCK_M + 1


@gluon.jit
def _flash_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, num_heads,
                                  seqlen, softmax_scale, qk_scale, kv_group, window_left, window_right, softcap_log2,
                                  Alibi, stride_alibi_b, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                  FUSED_DQ: gl.constexpr, WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                                  ALIBI: gl.constexpr = False, STATS: gl.constexpr = False,
                                  DQ_FIRST: gl.constexpr = False, LATE_DELTA: gl.constexpr = True,
                                  SPLIT_DIAGONAL: gl.constexpr = True):
    """One program per (batch, kv head, key block) owns dK_j and dV_j (FA2 Alg. 2, Section 3.2's
    parallelism over key blocks; placed by bwd_grid and _bwd_program), partitioned as FA3's backward: a loader warp and two consumer
    warpgroups of 64 keys each that share every Q_i and dO_i tile. The descriptors view (batch *
    seqlen, heads * head dim); num_heads counts q heads, kv_group of them share a kv head.
    Without FUSED_DQ, dq_desc is unused and dQ is the dQ kernel's
    (flash_attn._flash_bwd_dq_kernel); with it, dq_desc is a float32 accumulator's, with boxes of
    64 rows by half the head dim (BWD_DQ_ORDER "rows") or [16, 256] boxes, each a 64 x 64 tile in
    register order ("registers", _bwd_reduce_dq). WINDOW, SOFTCAP, ALIBI: as the forward's (with FUSED_DQ only:
    the dQ kernel has none of them). LSE and Delta: (batch, heads, seqlen) float32 pointers, or
    with STATS descriptors of their (batch x heads, seqlen) views, [1, BLOCK_M] tiles; DQ_FIRST:
    _bwd_dkdv_partition's."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = 2 * ROWS
    b, kv_head, start_n = _bwd_program(num_heads, kv_group, BLOCK_N)
    row0 = b * seqlen
    col0 = kv_head * HEAD_DIM
    q_col0 = kv_head * kv_group * HEAD_DIM  # the group's first q head
    lse_row0 = b * num_heads + kv_head * kv_group
    full_lo = 0
    full_hi = 0
    if WINDOW:
        first_m, n_steps, full_lo, full_hi = _window_query_steps(start_n, seqlen, window_left, window_right,
                                                                 BLOCK_M, BLOCK_N)
    else:
        if CAUSAL:  # query rows from the block's first key on see some of its keys
            first_m = start_n
        else:
            first_m = 0
        n_steps = (seqlen - first_m) // BLOCK_M
    Alibi += b * stride_alibi_b + kv_head * kv_group  # the group's slopes (read only with ALIBI)

    (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar,
     done_bar) = _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES, FUSED_DQ)
    if STATS:  # L_i and D_i per ring stage
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], LSE.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], Delta.layout)
    else:  # stand-ins of the right kind
        lse_smem, delta_smem = q_smem, q_smem
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem,
            do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
            start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2,
            window_left, window_right, full_lo, full_hi, num_heads)
    # The run-time values travel as one tuple, the constexprs beside it in tuples written in the
    # call (a tuple assigned to a name holds run-time values: the flags would be, and with the
    # fused branch left in the non-fused kernel Triton 3.6's lowering fails, an assertion in
    # ConvertTritonGPUToLLVM). The two consumers are one function, HALF apart.
    gl.warp_specialize([
        (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, STATS, DQ_FIRST, 0, LATE_DELTA,
                                SPLIT_DIAGONAL)),
        (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, STATS, DQ_FIRST, 1, LATE_DELTA,
                                SPLIT_DIAGONAL)),
        (_bwd_load_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, STATS, DQ_FIRST, 0)),
    ], [4, 1], [240, 24])


@gluon.jit
def _varlen_bwd_load_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr, STATS: gl.constexpr,
                               SPLIT_MASKED: gl.constexpr):
    """_bwd_load_partition over one sequence's rows of the packed views; with STATS also each step's
    L_i and D_i (heads, total_q rows) into the stage's shared memory, +inf and 0 past the sequence's
    end, announced on stats_bar."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, q_start, kv_row0, start_n, first_m, col0,
     q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv, softmax_scale,
     qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    if not STATS:  # L and D stay in global memory (the stats arguments: stand-ins of the right kinds)
        _bwd_load_tiles(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_bar, do_bar,
                        empty_bar, q_start, kv_row0, start_n, first_m, col0, q_col0, n_steps, kv_group, q_desc, q_desc,
                        q_smem, q_smem, 0, False)
    else:
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])  # the loader's one warp
        offs = gl.arange(0, BLOCK_M, layout=row_layout)
        _bwd_load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row0, start_n, col0)
        for step in range(n_steps * kv_group):
            stage = step % STAGES
            m, q_col, head, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, q_col0 // HEAD_DIM, 0, kv_group,
                                                 BLOCK_M, HEAD_DIM)
            rows = m + offs
            stats_row = head.to(gl.int64) * total_q + q_start
            lse = gl.load(LSE + stats_row + rows, mask=rows < seqlen_q, other=float("inf"))  # before the wait
            delta = gl.load(Delta + stats_row + rows, mask=rows < seqlen_q, other=0.0)
            mbarrier.wait(empty_bar.index(stage), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(q_bar.index(stage), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + m, q_col], q_bar.index(stage), q_smem.index(stage))
            mbarrier.expect(do_bar.index(stage), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [q_start + m, q_col], do_bar.index(stage), do_smem.index(stage))
            lse_smem.index(stage).store(lse)
            delta_smem.index(stage).store(delta)
            gl.thread_barrier()  # the warp's stores, before one thread arrives
            mbarrier.arrive(stats_bar.index(stage), count=1)


@gluon.jit
def _varlen_store_rows(desc, Ptr, stride, buf, value, first, row0, col0, limit, layout: gl.constexpr,
                       ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Write a [ROWS, HEAD_DIM] tile whose rows are sequence positions first.. (row0 + first in
    the packed view): by TMA where every row is before `limit`, else only those rows, by a masked
    pointer store (the rows past it belong to the next sequence)."""
    if first + ROWS <= limit:
        buf.store(value)
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row0 + first, col0], buf)
        tma.store_wait(pendings=0)
    else:
        rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        ptrs = Ptr + (row0 + rows).to(gl.int64)[:, None] * stride + (col0 + cols)[None, :]
        gl.store(ptrs, value, mask=(rows < limit)[:, None])


@gluon.jit
def _varlen_bwd_step(args, ctx, step, dk, dv, CAUSAL: gl.constexpr, HALF: gl.constexpr, STATS: gl.constexpr,
                     MASKED: gl.constexpr):
    """One query step of _varlen_bwd_dkdv_partition's loop (_bwd_dkdv_step's, dQ fused); MASKED 1: P^T
    is masked to the sequence's keys and, causal, to each row's visible ones; 2: so where the step
    needs it (the block's keys run past the sequence's end, or, causal, some row of the step does
    not see every key of this half), told at run time; 0: not masked. Returns dK_j, dV_j."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, q_start, kv_row0, start_n, first_m, col0,
     q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv, softmax_scale,
     qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    k_buf, v_buf, offs_n, offs_m_base, keys_ok, s_init, dq_init, dq_buf, first_key, partial_keys = ctx
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    m, q_col, head, group = _bwd_step_coords(step, n_steps, first_m, q_col0, q_col0 // HEAD_DIM, 0, kv_group,
                                             BLOCK_M, HEAD_DIM)
    offs_m = m + offs_m_base
    q_buf = q_smem.index(stage)
    do_buf = do_smem.index(stage)
    s_tok, dp_tok = _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init)
    if STATS:  # the loader's copies of L_i and D_i; D_i read once P^T is made (_bwd_dkdv_step's LATE_DELTA)
        mbarrier.wait(stats_bar.index(stage), phase)
        lse = lse_smem.index(stage).load(offs_m_base.type.layout)[None, :] * 1.4426950408889634
    else:
        stats_row = head.to(gl.int64) * total_q + q_start  # scalar: the pointer tiles are made at each load
        rows_ok = offs_m < seqlen_q
        lse = gl.load(LSE + stats_row + offs_m, mask=rows_ok, other=float("inf"))[None, :] * 1.4426950408889634
        delta = gl.load(Delta + stats_row + offs_m, mask=rows_ok, other=0.0)[None, :]
    s = warpgroup_mma_wait(1, deps=[s_tok])
    p = gl.exp2(s * qk_scale - lse)
    if MASKED == 1:  # keys past the sequence's end and, causal, past a row's diagonal
        if CAUSAL:
            p = gl.where(keys_ok[:, None] & (offs_n[:, None] <= offs_m[None, :] + shift), p, 0.0)
        else:
            p = gl.where(keys_ok[:, None], p, 0.0)
    elif MASKED == 2:  # the same, where the step needs it: row m + shift sees keys up to itself
        if CAUSAL:
            if partial_keys | (m + shift < first_key + ROWS - 1):
                p = gl.where(keys_ok[:, None] & (offs_n[:, None] <= offs_m[None, :] + shift), p, 0.0)
        else:
            if partial_keys:
                p = gl.where(keys_ok[:, None], p, 0.0)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    if STATS:
        delta = delta_smem.index(stage).load(offs_m_base.type.layout)[None, :]
    dv_tok, dk_tok, ds, ds_op = _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout)
    parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
    mbarrier.arrive(empty_bar.index(stage), count=1)
    _bwd_add_dq(dq_desc, dq_row0, m, q_col, ds_smem, k_smem, ds_bar, dq_buf, dq_init, parity, step, softmax_scale,
                num_heads, HALF)
    return dk, dv


@gluon.jit
def _varlen_bwd_dkdv_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr, STATS: gl.constexpr,
                               SPLIT_MASKED: gl.constexpr):
    """_bwd_dkdv_partition (dQ fused) for one sequence of a packed batch: keys [start_n + HALF * 64,
    + 64) of the sequence against its query steps. P^T is masked to the sequence's keys and (causal,
    bottom-right) to each row's visible ones; a query row past the sequence's end reads the
    logsumexp +inf (P = 0), so its dS is 0: in rows order the dQ reduce-add of a tile crossing into
    the next sequence adds zeros there, in register order into the padding after this sequence's
    tiles. dK and dV rows past the sequence's end are not written."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, q_start, kv_row0, start_n, first_m, col0,
     q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv, softmax_scale,
     qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_buf = k_smem.index(HALF)
    v_buf = v_smem.index(HALF)

    first_key = start_n + HALF * ROWS  # this half's first key in its sequence
    offs_n = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_m_base = gl.arange(0, BLOCK_M, layout=col_layout)
    keys_ok = offs_n < seqlen_k
    partial_keys = start_n + 2 * ROWS > seqlen_k
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    s_init = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    DQ_COLS: gl.constexpr = HEAD_DIM // 2  # this consumer's columns of dQ
    dq_init = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
    dq_buf = _dq_tile_buffer(dq_smem, dq_desc, HALF)
    mbarrier.wait(kv_bar, 0)
    ctx = (k_buf, v_buf, offs_n, offs_m_base, keys_ok, s_init, dq_init, dq_buf, first_key, partial_keys)
    # the steps that need a mask come first in each q head's run: all of them in the sequence's last,
    # partial key block; else, causal, those whose rows cross the block's diagonal (bottom-right).
    # They run in a loop of their own, and the other steps' code has no mask (SPLIT_MASKED 1);
    # else one loop, each step masked (0) or each told at run time whether it needs the mask (2)
    if SPLIT_MASKED != 1 or partial_keys:
        masked_steps = n_steps
    elif CAUSAL:
        masked_steps = gl.minimum(gl.maximum(start_n + 2 * ROWS - 1 - shift - first_m + BLOCK_M - 1, 0) // BLOCK_M,
                                  n_steps)
    else:
        masked_steps = 0
    for group in range(kv_group):
        for i in range(masked_steps):
            dk, dv = _varlen_bwd_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, HALF, STATS,
                                      2 if SPLIT_MASKED == 2 else 1)
        for i in range(masked_steps, n_steps):
            dk, dv = _varlen_bwd_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, HALF, STATS, 0)

    mbarrier.arrive(done_bar, count=1)
    mbarrier.wait(done_bar, 0)
    tma.store_wait(pendings=0)
    _varlen_store_rows(dk_desc, DK, stride_dk, k_buf, (dk * softmax_scale).to(dtype), first_key, kv_row0, col0,
                       seqlen_k, acc_layout, ROWS, HEAD_DIM)
    _varlen_store_rows(dv_desc, DV, stride_dv, v_buf, dv.to(dtype), first_key, kv_row0, col0, seqlen_k, acc_layout,
                       ROWS, HEAD_DIM)


@gluon.jit
def _varlen_stats_buffers(STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
    """The varlen dK/dV kernel's ring of L_i and D_i rows (STAGES x BLOCK_M float32 each) and the
    mbarriers its loader arrives on once a stage's rows are stored."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], layout)
    stats_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(stats_bar.index(stage), count=1)
    return lse_smem, delta_smem, stats_bar


@gluon.jit
def _varlen_packed_program(CuSeqQ, CuSeqK, batch, BLOCK_N: gl.constexpr, SCAN: gl.constexpr):
    """The program's (sequence b, kv head, first key, and b's query start, query length, key start
    and key length) where the grid's second axis holds every sequence's key blocks, sequence b's
    from block (CuSeqK[b] + BLOCK_N b) // BLOCK_N (FA3's padded offsets: increasing in b by at
    least b's own blocks, so at most one empty block a sequence; varlen_bwd_key_blocks), the first
    axis and the third the kv heads (bwd_grid's sections of them). One vector load of each
    cu_seqlens (SCAN >= batch + 1 lanes), then b is the count of sequences that start at or before
    the block, less one; that needs CuSeqK[0] == 0 (checks.check_cu_seqlens), which puts block 0 in
    sequence 0."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, SCAN, layout=layout)
    cu_k = gl.load(CuSeqK + offs, mask=offs <= batch, other=0)
    cu_q = gl.load(CuSeqQ + offs, mask=offs <= batch, other=0)
    block = gl.program_id(1)
    first_blocks = gl.where(offs < batch, (cu_k + offs * BLOCK_N) // BLOCK_N, 2147483647)
    started = first_blocks <= block
    b = gl.sum(started.to(gl.int32), axis=0) - 1
    start_n = (block - gl.max(gl.where(started, first_blocks, 0), axis=0)) * BLOCK_N
    q_start = gl.sum(gl.where(offs == b, cu_q, 0), axis=0)
    kv_row0 = gl.sum(gl.where(offs == b, cu_k, 0), axis=0)
    seqlen_q = gl.sum(gl.where(offs == b + 1, cu_q, 0), axis=0) - q_start
    seqlen_k = gl.sum(gl.where(offs == b + 1, cu_k, 0), axis=0) - kv_row0
    kv_head = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
    return b, kv_head, start_n, q_start, seqlen_q, kv_row0, seqlen_k


def varlen_bwd_key_blocks(grid: str, batch: int, total_k: int, max_seqlen_k: int) -> int:
    """The varlen dK/dV grid's key blocks in `grid` (VARLEN_BWD_GRIDS): "longest", the longest
    sequence's; "packed", every sequence's from its padded block (_varlen_packed_program): the
    block after the last sequence's, (total_k + BWD_BLOCK_N batch) // BWD_BLOCK_N."""
    if grid == "longest":
        return triton.cdiv(max_seqlen_k, BWD_BLOCK_N)
    if grid == "packed":
        return (total_k + BWD_BLOCK_N * batch) // BWD_BLOCK_N
    raise ValueError(f"VARLEN_BWD_GRID must be one of {VARLEN_BWD_GRIDS}, got {grid!r}")


def varlen_bwd_grid(batch: int, total_k: int, max_seqlen_k: int, grid: str | None = None) -> str:
    """The varlen dK/dV kernel's key blocks for `batch` sequences of `total_k` keys, the longest
    `max_seqlen_k`, in `grid` (default VARLEN_BWD_GRID): "auto" packed where the longest grid's
    batch x blocks are more than twice the packed axis's; packed only for at most
    VARLEN_BWD_SCAN_BATCH - 1 sequences (a program's scan) and BWD_MAX_KEY_BLOCKS blocks. "More than
    half empty" is counted against the packed axis, which holds up to one empty block a sequence.
    The packed axis runs each section's sequences in turn, each one's blocks in order, so it gives
    up the longest grid's start of every sequence's longest programs first within a section."""
    grid = VARLEN_BWD_GRID if grid is None else grid  # the module's, read at each call (experiments set it)
    if grid not in VARLEN_BWD_GRIDS:
        raise ValueError(f"VARLEN_BWD_GRID must be one of {VARLEN_BWD_GRIDS}, got {grid!r}")
    packed_blocks = varlen_bwd_key_blocks("packed", batch, total_k, max_seqlen_k)
    if grid == "auto":
        longest = batch * varlen_bwd_key_blocks("longest", batch, total_k, max_seqlen_k)
        grid = "packed" if longest > 2 * packed_blocks else "longest"
    if grid == "packed" and (batch + 1 > VARLEN_BWD_SCAN_BATCH or packed_blocks > BWD_MAX_KEY_BLOCKS):
        grid = "longest"  # more sequences than a program scans, or more blocks than the axis holds
    return grid


@gluon.jit
def _flash_bwd_dkdv_hopper_varlen_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE,
                                         Delta, CuSeqQ, CuSeqK, num_heads, total_q, stride_dk, stride_dv,
                                         softmax_scale, qk_scale, kv_group, batch, STAGES: gl.constexpr,
                                         CAUSAL: gl.constexpr, STATS: gl.constexpr, SPLIT_MASKED: gl.constexpr,
                                         SCAN: gl.constexpr):
    """The Gluon dK/dV kernel with dQ fused over packed sequences: program (sequence, kv head, key
    block), placed by bwd_grid and, with SCAN 0, _bwd_program ((sequence, kv head) pairs), else
    _varlen_packed_program (kv heads; every sequence's key blocks on the second axis); sequence b's
    queries are rows CuSeqQ[b]:CuSeqQ[b + 1] of the packed views (LSE and Delta (heads, total_q)),
    its keys rows CuSeqK[b]:CuSeqK[b + 1]; causal bottom-right per sequence. A program past its
    sequence's last key block does nothing. STATS: the loader warp
    brings each step's L_i and D_i into shared memory by plain loads (by TMA, as the dense kernel
    does, a causal packed batch hit an illegal instruction on the H200: docs/performance.md), else
    the consumers read them from global memory. SPLIT_MASKED: _varlen_bwd_dkdv_partition's. SCAN:
    0, the grid gives every sequence the longest one's key blocks; else the key blocks of the
    `batch` sequences lie on one axis (SCAN lanes >= batch + 1)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = 2 * ROWS
    if SCAN:
        b, kv_head, start_n, q_start, seqlen_q, kv_row0, seqlen_k = _varlen_packed_program(
            CuSeqQ, CuSeqK, batch, BLOCK_N, SCAN)
    else:
        b, kv_head, start_n = _bwd_program(num_heads, kv_group, BLOCK_N)
        q_start = gl.load(CuSeqQ + b)
        seqlen_q = gl.load(CuSeqQ + b + 1) - q_start
        kv_row0 = gl.load(CuSeqK + b)
        seqlen_k = gl.load(CuSeqK + b + 1) - kv_row0
    if start_n < seqlen_k:
        shift = seqlen_k - seqlen_q
        if CAUSAL:  # rows i with i + shift >= start_n see some key of the block
            first_m = gl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        else:
            first_m = 0
        n_steps = (gl.maximum(seqlen_q - first_m, 0) + BLOCK_M - 1) // BLOCK_M
        col0 = kv_head * HEAD_DIM
        q_col0 = kv_head * kv_group * HEAD_DIM
        (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar,
         done_bar) = _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES, True)
        lse_smem, delta_smem, stats_bar = _varlen_stats_buffers(STAGES, BLOCK_M)
        if dq_desc.block_type.shape[1] == DQ_REGISTER_BOX[1]:
            # dQ tiles in register order: sequence b's rows from the accumulator's padded row
            # (CuSeqQ[b] + 64 b) // 64 * 64, whole 64-row tiles apart from the next sequence's
            # (FA3's padded offsets for its dQaccum; varlen_dq_accumulator sizes the accumulator)
            dq_row0 = (q_start + b * BLOCK_M) // BLOCK_M * BLOCK_M
        else:
            dq_row0 = q_start
        args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem,
                do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, q_start, kv_row0,
                start_n, first_m, col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk,
                stride_dv, softmax_scale, qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads)
        gl.warp_specialize([
            (_varlen_bwd_dkdv_partition, (args, CAUSAL, 0, STATS, SPLIT_MASKED)),
            (_varlen_bwd_dkdv_partition, (args, CAUSAL, 1, STATS, SPLIT_MASKED)),
            (_varlen_bwd_load_partition, (args, CAUSAL, 0, STATS, SPLIT_MASKED)),
        ], [4, 1], [240, 24])


@functools.cache
def _stats_layout() -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [1, BWD_BLOCK_M] float32 row of L or D (unswizzled)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _dq_first(fused: bool, kv_group: int, flags: dict) -> bool:
    """Whether the fused dQ's matmul goes before dK's (BWD_DQ_FIRST): by default with GQA/MQA, a
    window or ALiBi, where it measured faster; dense MHA measured level or slower
    (docs/performance.md)."""
    if not fused:
        return False
    if BWD_DQ_FIRST is not None:
        return BWD_DQ_FIRST
    return kv_group > 1 or flags["WINDOW"] or flags["ALIBI"]


def _stats_template(rows: int, seqlen: int) -> TensorDescriptor:
    """A descriptor template (descriptor_like gives it its tensor) of the (batch x heads, seqlen)
    view of a contiguous (batch, heads, seqlen) float32 L or D, one BWD_BLOCK_M-query row per tile."""
    template = object.__new__(TensorDescriptor)
    template.__dict__.update(base=None, shape=[rows, seqlen], strides=[seqlen, 1], block_shape=[1, BWD_BLOCK_M],
                             layout=_stats_layout(), padding="zero")
    return template


@functools.cache
def _fp32_tile_layout_unswizzled() -> gl.NVMMASharedLayout:
    """The shared-memory layout of the register-order dQ tile's [16, 256] TMA box: row-major."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def _fp32_tile_layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a float32 [rows, cols] tile (the fused dQ's reduce-adds)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32)


_bwd_dkdv_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_kernel)  # kernels/launch.py


def flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, softmax_scale: float, causal: bool,
                                    dq_accum: torch.Tensor | None = None, stages: int | None = None) -> None:
    """Write dK and dV (FA2 Alg. 2) given the forward's logsumexp `lse` and D = rowsum(dO * O) in
    `delta` (both (batch, heads, seqlen) float32); with `dq_accum` (a zeroed float32 tensor shaped
    like q, head dim 128), also add dQ into it, in BWD_DQ_ORDER's order (dq_from_accumulator
    reads it). The caller (backward.flash_attn_backward) has checked the scope
    (dispatch.hopper_gluon_applies)."""
    plan = backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, causal, stages)
    plan(q, k, v, do, lse, delta, dk, dv, dq_accum, softmax_scale)


@triton.jit
def _register_tile_rows_cols(offs):
    """The (row, column) in its 64 x 64 block of each offset of a register-order tile:
    DQ_TILE_BASES, bit by bit: rows 8 (bit 1), 1, 2, 4 (bits 4-6), 16, 32 (bits 7-8); columns 1
    (bit 0), 2, 4 (bits 2-3), 8, 16, 32 (bits 9-11)."""
    row = ((offs >> 1) & 1) * 8 + ((offs >> 4) & 7) + ((offs >> 7) & 3) * 16
    col = (offs & 1) + ((offs >> 2) & 3) * 2 + ((offs >> 9) & 7) * 8
    return row, col


@triton.jit
def _register_tile_in_rows(acc):
    """A register-order tile's 4096 floats (DQ_TILE_BASES) as its [64, 64] block in rows: the
    offsets' bit groups, from the highest (columns 32-8, rows 32-16, rows 4-1, columns 4-2, row 8,
    column 1), as dimensions, permuted to the block's (rows 32-16, row 8, rows 4-1, columns 32-8,
    columns 4-2, column 1), so that each row's columns are side by side for the stores."""
    return tl.reshape(tl.permute(tl.reshape(acc, (8, 4, 8, 4, 2, 2)), (1, 4, 2, 0, 3, 5)), (64, 64))


@triton.jit
def _dq_rows_from_register_tiles_kernel(DQAccum, DQ, col_tiles):
    """_dq_from_register_tiles_kernel with the tile put in rows before the cast and store
    (_register_tile_in_rows): each row's 64 columns stored side by side (DQ_CAST "rows")."""
    tile = tl.program_id(0)
    acc = _register_tile_in_rows(tl.load(DQAccum + tile.to(tl.int64) * 4096 + tl.arange(0, 4096)))
    block_row, block_col = tile // col_tiles, tile % col_tiles
    rows, cols = tl.arange(0, 64)[:, None], tl.arange(0, 64)[None, :]
    dst = (block_row.to(tl.int64) * 64 + rows) * (col_tiles * 64) + block_col * 64 + cols
    tl.store(DQ + dst, acc.to(DQ.dtype.element_ty))


@triton.jit
def _dq_from_register_tiles_kernel(DQAccum, DQ, col_tiles):
    """One 64 x 64 tile of the fused dQ's accumulator in register order (DQ_TILE_BASES; tiles in
    the order of the (batch x seqlen, heads x head dim) view's 64 x 64 blocks, `col_tiles` to a
    row of blocks) cast into its block of DQ, that view of a contiguous tensor."""
    tile = tl.program_id(0)
    offs = tl.arange(0, 4096)
    acc = tl.load(DQAccum + tile.to(tl.int64) * 4096 + offs)
    row, col = _register_tile_rows_cols(offs)
    block_row, block_col = tile // col_tiles, tile % col_tiles
    dst = (block_row.to(tl.int64) * 64 + row) * (col_tiles * 64) + block_col * 64 + col
    tl.store(DQ + dst, acc.to(DQ.dtype.element_ty))


_dq_from_register_tiles_launcher = CachedLauncher(_dq_from_register_tiles_kernel)
_dq_rows_from_register_tiles_launcher = CachedLauncher(_dq_rows_from_register_tiles_kernel)


def _dq_cast() -> str:
    """DQ_CAST, read at each call (experiments set it)."""
    if DQ_CAST not in DQ_CASTS:
        raise ValueError(f"DQ_CAST must be one of {DQ_CASTS}, got {DQ_CAST!r}")
    return DQ_CAST


def dq_from_accumulator(dq_accum: torch.Tensor, dtype: torch.dtype, order: str) -> torch.Tensor:
    """dQ in `dtype`, shaped like the fused dQ's float32 accumulator `dq_accum`, from that
    accumulator in `order` (BWD_DQ_ORDERS: "rows" as it is, "registers" DQ_TILE_BASES' tiles)."""
    if order == "rows":
        return dq_accum.to(dtype)
    if order != "registers":
        raise ValueError(f"order must be one of {BWD_DQ_ORDERS}, got {order!r}")
    columns = dq_accum.shape[-2] * dq_accum.shape[-1]  # heads x head dim
    if not dq_accum.is_contiguous() or columns % 64 or dq_accum.numel() % (64 * columns):
        raise ValueError("the register-order accumulator is a contiguous (..., heads, head dim) float32 tensor "
                         f"of whole 64 x 64 blocks; got shape {tuple(dq_accum.shape)}")
    dq = torch.empty(dq_accum.shape, device=dq_accum.device, dtype=dtype)
    launcher = _dq_rows_from_register_tiles_launcher if _dq_cast() == "rows" else _dq_from_register_tiles_launcher
    launcher[(dq_accum.numel() // 4096,)](dq_accum, dq, columns // 64)
    return dq


def _register_order_descriptor(dq_accum: torch.Tensor) -> TensorDescriptor:
    """The descriptor of a register-order dQ accumulator (contiguous, whole 4096-float tiles, dense
    or varlen): its floats as rows of DQ_REGISTER_BOX[1], one [16, 256] box per 64 x 64 tile."""
    return TensorDescriptor(dq_accum, [dq_accum.numel() // DQ_REGISTER_BOX[1], DQ_REGISTER_BOX[1]],
                            [DQ_REGISTER_BOX[1], 1], list(DQ_REGISTER_BOX), _fp32_tile_layout_unswizzled())


def backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, causal: bool, stages: int | None = None,
                              flags: dict | None = None):
    """The dK/dV launch for tensors shaped, strided and aligned like these, as a function of (q, k,
    v, do, lse, delta, dk, dv, dq_accum, softmax_scale, features=()) (see forward_hopper_plan;
    `features` = (qk_scale, window sides, softcap * log2(e), slopes, their batch stride) from
    kernels/features.py's feature_args; with `flags` or GQA/MQA, dQ must be fused: the dQ kernel
    has neither). The function's `dq_order` is the accumulator's order (BWD_DQ_ORDER when made):
    dq_from_accumulator's argument."""
    batch, seqlen, heads, headdim = q.shape
    kv_heads = k.shape[2]
    rows = BWD_BLOCK_N // 2
    stages = BWD_STAGES if stages is None else stages  # the module's, read at each plan (experiments set it)
    fused = dq_accum is not None
    if fused and headdim != 128:
        raise ValueError(f"the fused dQ splits head dim 128 between the two consumers, got {headdim}")
    flags = {name: bool((flags or {}).get(name)) for name in GLUON_FEATURE_FLAGS}
    if (any(flags.values()) or kv_heads != heads) and not fused:
        raise ValueError("the Gluon backward takes features and GQA/MQA with dQ fused only")
    templates = (_row_descriptor(q, BWD_BLOCK_M), _row_descriptor(k, rows), _row_descriptor(v, rows),
                 _row_descriptor(do, BWD_BLOCK_M), _row_descriptor(dk, rows), _row_descriptor(dv, rows))
    dq_template = None
    dq_order = BWD_DQ_ORDER  # the module's, read at each plan (experiments set it)
    if dq_order not in BWD_DQ_ORDERS:
        raise ValueError(f"BWD_DQ_ORDER must be one of {BWD_DQ_ORDERS}, got {dq_order!r}")
    if fused and dq_order == "registers":  # contiguous like q (backward.py makes it so): whole 4096-float tiles
        dq_template = _register_order_descriptor(dq_accum)
    elif fused:
        dq_template = TensorDescriptor(dq_accum, [batch * seqlen, heads * headdim], [dq_accum.stride(1), 1],
                                       [BWD_BLOCK_M, headdim // 2], _fp32_tile_layout(BWD_BLOCK_M, headdim // 2))
    stats = BWD_STATS_IN_SHARED  # seqlen is a multiple of BWD_BLOCK_N: the rows of L and D are aligned
    kv_group = heads // kv_heads
    # the descriptors' tensors are passed and the launch makes them (launch.DirectLaunch): Q, K, V, dO,
    # dK, dV, then dQ's accumulator (without the fused dQ, unused: dK's again), then L and D with STATS
    descriptors = dict(enumerate(map(descriptor_template, templates)))
    descriptors[6] = descriptor_template(dq_template) if fused else descriptors[4]
    if stats:
        descriptors[7] = descriptors[8] = _stats_template(batch * heads, seqlen)
    grid = bwd_grid(seqlen // BWD_BLOCK_N, batch * kv_heads, kv_group, seqlen, headdim, q.element_size(), q.device)
    launch = DirectLaunch(sys.modules[__name__], "_bwd_dkdv_launcher", grid,
                          {"STAGES": stages, "CAUSAL": causal, "FUSED_DQ": fused, "num_warps": 4, "maxnreg": 168,
                           "STATS": stats, "DQ_FIRST": _dq_first(fused, kv_group, flags), "LATE_DELTA": BWD_LATE_DELTA,
                           "SPLIT_DIAGONAL": BWD_SPLIT_DIAGONAL, **flags},
                          descriptors=descriptors)

    def run(q, k, v, do, lse, delta, dk, dv, dq_accum, softmax_scale, features=()):
        qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b = (
            features or (softmax_scale * LOG2E, 0, 0, 0.0, None, 0))
        if stats and (not lse.is_contiguous() or lse.data_ptr() % 16):  # another caller's L: a contiguous, aligned copy
            lse = lse.clone(memory_format=torch.contiguous_format)
        launch(q, k, v, do, dk, dv, dk if dq_accum is None else dq_accum, lse, delta, heads, seqlen, softmax_scale,
               qk_scale, kv_group, window_left, window_right, softcap_log2, alibi if alibi is not None else lse,
               stride_alibi_b)

    run.dq_order = dq_order if fused else "rows"
    return run


_bwd_dkdv_varlen_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_varlen_kernel)


def _varlen_dq_accumulator_rows(total_q: int, batch: int) -> int:
    """Rows of the register-order varlen accumulator: total_q + 64 batch, rounded up to whole tiles
    (sequence b's last tile ends by (cu_seqlens_q[b + 1] + 64 b) // 64 * 64 + 64)."""
    return triton.cdiv(total_q + batch * BWD_BLOCK_M, BWD_BLOCK_M) * BWD_BLOCK_M


def _check_varlen_dq_accumulator(dq_accum: torch.Tensor, shape, batch: int, order: str) -> None:
    """A varlen accumulator as varlen_dq_accumulator makes it for packed `shape` and `batch`
    sequences in `order`, else a ValueError naming what differs (a TMA reduce-add past its end
    would be dropped silently)."""
    total_q, heads, headdim = shape
    if order not in BWD_DQ_ORDERS:
        raise ValueError(f"order must be one of {BWD_DQ_ORDERS}, got {order!r}")
    rows = total_q if order == "rows" else _varlen_dq_accumulator_rows(total_q, batch)
    if (dq_accum.dtype != torch.float32 or not dq_accum.is_contiguous()
            or tuple(dq_accum.shape) != (rows, heads, headdim)):
        raise ValueError(f"dq_accum must be a contiguous float32 ({rows}, {heads}, {headdim}) tensor for {batch} "
                         f"sequences of {total_q} tokens in {order!r} order (varlen_dq_accumulator), got "
                         f"{dq_accum.dtype} {tuple(dq_accum.shape)}")


def varlen_dq_accumulator(q: torch.Tensor, batch: int, order: str) -> torch.Tensor:
    """The varlen dK/dV kernel's float32 dQ accumulator (uninitialised) for packed q (total_q,
    heads, head dim) of `batch` sequences: in "rows" shaped like q; in "registers" (rows, heads,
    head dim) with room for each sequence's 64-row tiles from its padded row
    (cu_seqlens_q[b] + 64 b) // 64 * 64, FA3's padded offset, so that no tile holds two sequences:
    rows = total_q + 64 batch, rounded up to whole tiles."""
    if order not in BWD_DQ_ORDERS:
        raise ValueError(f"order must be one of {BWD_DQ_ORDERS}, got {order!r}")
    if order == "rows":
        return torch.empty(q.shape, device=q.device, dtype=torch.float32)
    total_q, heads, headdim = q.shape
    rows = _varlen_dq_accumulator_rows(total_q, batch)
    return torch.empty((rows, heads, headdim), device=q.device, dtype=torch.float32)


@triton.jit
def _dq_from_padded_register_tiles_kernel(DQAccum, DQ, CuSeqQ, col_tiles):
    """One 64 x 64 tile (query block j of sequence b, column block c: the program's place) of the
    varlen accumulator in register order (varlen_dq_accumulator's padded rows, DQ_TILE_BASES'
    tiles) cast into sequence b's rows of DQ, a contiguous
    (total_q, heads, head dim) tensor; rows past the sequence's end are neither read nor written."""
    j, b, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CuSeqQ + b)
    seqlen = tl.load(CuSeqQ + b + 1) - q_start
    offs = tl.arange(0, 4096)
    row, col = _register_tile_rows_cols(offs)
    keep = j * 64 + row < seqlen
    tile = ((q_start + b * 64) // 64 + j).to(tl.int64) * col_tiles + c
    acc = tl.load(DQAccum + tile * 4096 + offs, mask=keep)
    dst = (q_start + j * 64 + row).to(tl.int64) * (col_tiles * 64) + c * 64 + col
    tl.store(DQ + dst, acc.to(DQ.dtype.element_ty), mask=keep)


_dq_from_padded_register_tiles_launcher = CachedLauncher(_dq_from_padded_register_tiles_kernel)


@triton.jit
def _dq_rows_from_padded_register_tiles_kernel(DQAccum, DQ, CuSeqQ, col_tiles):
    """_dq_from_padded_register_tiles_kernel with the tile put in rows before the cast and store
    (_register_tile_in_rows; DQ_CAST "rows"): a program past its sequence's tiles does nothing,
    the others read their whole padded tile (within the accumulator: varlen_dq_accumulator) and
    store only the sequence's rows, each row's columns side by side."""
    j, b, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CuSeqQ + b)
    seqlen = tl.load(CuSeqQ + b + 1) - q_start
    if j * 64 < seqlen:
        tile = ((q_start + b * 64) // 64 + j).to(tl.int64) * col_tiles + c
        acc = _register_tile_in_rows(tl.load(DQAccum + tile * 4096 + tl.arange(0, 4096)))
        rows, cols = tl.arange(0, 64)[:, None], tl.arange(0, 64)[None, :]
        dst = (q_start + j * 64 + rows).to(tl.int64) * (col_tiles * 64) + c * 64 + cols
        tl.store(DQ + dst, acc.to(DQ.dtype.element_ty), mask=j * 64 + rows < seqlen)


_dq_rows_from_padded_register_tiles_launcher = CachedLauncher(_dq_rows_from_padded_register_tiles_kernel)


def dq_from_varlen_accumulator(dq_accum: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                               shape: tuple[int, int, int], dtype: torch.dtype, order: str) -> torch.Tensor:
    """dQ in `dtype` and packed `shape` (total_q, heads, head dim) from the varlen accumulator
    `dq_accum` in `order` (varlen_dq_accumulator's)."""
    batch = cu_seqlens_q.shape[0] - 1
    _check_varlen_dq_accumulator(dq_accum, shape, batch, order)
    if order == "rows":
        return dq_accum.to(dtype)
    total_q, heads, headdim = shape
    dq = torch.empty(shape, device=dq_accum.device, dtype=dtype)
    if total_q and not (batch and max_seqlen_q):  # the cast would leave dq's rows unwritten
        raise ValueError(f"{total_q} packed tokens need at least one sequence and max_seqlen_q >= 1, got "
                         f"{batch} sequences and max_seqlen_q={max_seqlen_q}")
    if total_q:
        # query blocks on the axis CUDA does not limit to 65535; the batch within it (the varlen
        # kernels' dispatch keeps batch x heads so), the column tiles too (2 x heads at head dim 128)
        grid = (triton.cdiv(max_seqlen_q, BWD_BLOCK_M), batch, heads * headdim // 64)
        launcher = (_dq_rows_from_padded_register_tiles_launcher if _dq_cast() == "rows"
                    else _dq_from_padded_register_tiles_launcher)
        launcher[grid](dq_accum, dq, cu_seqlens_q, heads * headdim // 64)
    return dq


def flash_attn_varlen_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, dq_accum, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_k: int, softmax_scale: float, causal: bool,
                                           stages: int | None = None, dq_order: str | None = None) -> None:
    """dK and dV of packed sequences (q, do (total_q, heads, 128), k, v, dk, dv (total_k, kv_heads,
    128), as flash_attn_varlen_forward_hopper takes them), and dQ added into `dq_accum` (a zeroed
    float32 accumulator from varlen_dq_accumulator in `dq_order`, default VARLEN_BWD_DQ_ORDER);
    `lse` and `delta` (heads, total_q) float32."""
    stages = BWD_STAGES if stages is None else stages
    dq_order = VARLEN_BWD_DQ_ORDER if dq_order is None else dq_order
    total_q, heads, headdim = q.shape
    rows = BWD_BLOCK_N // 2
    batch = cu_seqlens_q.shape[0] - 1
    _check_varlen_dq_accumulator(dq_accum, q.shape, batch, dq_order)
    if dq_order == "registers":  # whole 4096-float tiles, one TMA box each
        dq_desc = _register_order_descriptor(dq_accum)
    else:
        dq_desc = TensorDescriptor(dq_accum, [total_q, heads * headdim], [dq_accum.stride(0), 1],
                                   [BWD_BLOCK_M, headdim // 2], _fp32_tile_layout(BWD_BLOCK_M, headdim // 2))
    kv_heads = k.shape[1]
    key_grid = varlen_bwd_grid(batch, k.shape[0], max_seqlen_k)
    key_blocks = varlen_bwd_key_blocks(key_grid, batch, k.shape[0], max_seqlen_k)
    scan = 0 if key_grid == "longest" else VARLEN_BWD_SCAN_BATCH
    # sections of (sequence, kv head) pairs, or of kv heads over every sequence's blocks ("packed");
    # the mean length sizes them
    pairs = batch * kv_heads if key_grid == "longest" else kv_heads
    grid = bwd_grid(key_blocks, pairs, heads // kv_heads, max(total_q // max(batch, 1), 1), headdim,
                    q.element_size(), q.device)
    _bwd_dkdv_varlen_launcher[grid](
        _packed_descriptor(q, BWD_BLOCK_M), _packed_descriptor(k, rows), _packed_descriptor(v, rows),
        _packed_descriptor(do, BWD_BLOCK_M), _packed_descriptor(dk, rows), _packed_descriptor(dv, rows), dq_desc,
        dk, dv, lse, delta, cu_seqlens_q, cu_seqlens_k, heads, total_q, dk.stride(0), dv.stride(0),
        softmax_scale, softmax_scale * LOG2E, heads // kv_heads, batch, STAGES=stages, CAUSAL=causal,
        STATS=VARLEN_BWD_STATS_IN_SHARED, SPLIT_MASKED=varlen_bwd_masking(), SCAN=scan, num_warps=4, maxnreg=168)


# The entry points as defined here: forward.py and backward.py run their plans while the module's
# public names still hold these, and call the public names when a test or experiment replaced them.
GENUINE_ENTRY_POINTS = (flash_attn_forward_hopper, flash_attn_backward_dkdv_hopper)
