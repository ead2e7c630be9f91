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
(batch * seqlen, heads * head dim) 2D view with rows that do not overlap.

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

from .launch import CachedLauncher, DirectLaunch, descriptor_like

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per block
STAGES = 3  # K/V blocks in flight (shared memory at head dim 128: Q 32 KiB + 3 x 64 KiB of K and V; half at 64)
HEAD_DIMS = (64, 128)  # the head dims the kernels serve (flash_attn.hopper_gluon_applies)
LOG2E = 1.4426950408889634


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
def _load_partition(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                    q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL: gl.constexpr):
    """One warp: FA2 Alg. 1 line 4 (Q_i, as two 64-row halves) and line 7 (K_j, V_j) as TMA loads,
    each key block into the ring stage both consumers have released (empty_bar counts two)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    for half in gl.static_range(2):
        mbarrier.expect(q_bar.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + half * q_desc.block_type.shape[0], col0], q_bar.index(half),
                                        q_smem.index(half))
    for block in range(n_blocks):
        stage = block % STAGES
        # a fresh mbarrier counts as having completed the phase before its first, so the first
        # STAGES waits pass at once
        mbarrier.wait(empty_bar.index(stage), ((block // STAGES) & 1) ^ 1)
        row = kv_row0 + block * BLOCK_N
        mbarrier.expect(k_bar.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col0], k_bar.index(stage), k_smem.index(stage))
        mbarrier.expect(v_bar.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col0], v_bar.index(stage), v_smem.index(stage))


@gluon.jit
def _softmax_partition(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                       q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL: gl.constexpr,
                       HALF: gl.constexpr):
    """One consumer warpgroup: FA2 Alg. 1 lines 5-15 for query rows [HALF * 64, HALF * 64 + 64)
    of the block, in FA3's Algorithm 2 order."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    # wgmma accumulators of one warpgroup (its 4 warps split the 64 rows), and P as the
    # register-held A operand of P V
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_buf = q_smem.index(HALF)

    # line 5: O = 0, l = 0, m = -inf
    start_m = (q_row - kv_row0) + HALF * ROWS  # this half's first query row in its sequence
    offs_m = start_m + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # key block 0: line 8 (S = Q K^T, unscaled) and line 9
    mbarrier.wait(q_bar.index(HALF), 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, n_blocks, BLOCK_N, CAUSAL)
    for block in range(1, n_blocks):
        stage = block % STAGES
        prev = (block - 1) % STAGES
        # line 8 for block j and line 10's P~ V for block j - 1, both in flight
        mbarrier.wait(k_bar.index(stage), (block // STAGES) & 1)
        s_tok = warpgroup_mma(q_buf, k_smem.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((block - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # S_j done (wgmma groups complete in order); line 9 for block j runs under P~ V
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, n_blocks, BLOCK_N,
                                           CAUSAL)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
        mbarrier.arrive(empty_bar.index(prev), count=1)  # this warpgroup is done with block j - 1
        # line 10's rescale: O = diag(exp(m_old - m_new)) O, before P~_j V_j is added
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
    # line 10 for the last block
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
    mbarrier.arrive(empty_bar.index(last), count=1)

    # lines 12-15: O = diag(l)^-1 O once, L = m + log(l) (m is in log2 units), write both
    out = acc / gl.convert_layout(l_i, o_row_layout)[:, None]
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen + offs_m, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    q_buf.store(out.to(dtype))  # this half's Q buffer stages its O (only this warpgroup read it)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + HALF * ROWS, col0], q_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _softmax_partition_first_half(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar,
                                  empty_bar, q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL: gl.constexpr):
    _softmax_partition(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                       q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL, 0)


@gluon.jit
def _softmax_partition_second_half(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar,
                                   empty_bar, q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL: gl.constexpr):
    _softmax_partition(q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                       q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL, 1)


@gluon.jit
def _flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, num_heads, seqlen, qk_scale,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One program per (query block, batch x head) (FA2 Section 3.2), partitioned into warps as
    FA3 does. The descriptors view (batch * seqlen, heads * head dim). CAUSAL reaches the
    partitions at compile time (a constexpr in their argument tuples), so the non-causal kernel has
    no mask code (as a run-time flag it cost the non-causal kernel its speed)."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = 2 * ROWS
    # the causal loop's block count and its one masked (diagonal) block assume square blocks
    gl.static_assert(BLOCK_M == BLOCK_N)
    if CAUSAL:  # the last query block (the most key blocks) first: longest programs start early
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_m = pid_m * BLOCK_M
    q_row = b * seqlen + start_m
    kv_row0 = b * seqlen
    col0 = h * HEAD_DIM
    if CAUSAL:  # key blocks up to the diagonal
        n_blocks = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_blocks = seqlen // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(q_bar.index(half), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(stage), count=1)
        mbarrier.init(v_bar.index(stage), count=1)
        mbarrier.init(empty_bar.index(stage), count=2)  # released by both consumer warpgroups

    args = (q_desc, k_desc, v_desc, o_desc, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
            q_row, kv_row0, col0, n_blocks, pid_bh, seqlen, qk_scale, CAUSAL)
    # the default partition (4 warps) and one worker (4 warps) consume, one warp loads;
    # registers: 240 per consumer thread, 24 for the loader
    gl.warp_specialize([
        (_softmax_partition_first_half, args),
        (_softmax_partition_second_half, args),
        (_load_partition, args),
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


def flash_attn_forward_hopper(q, k, v, out, lse, softmax_scale: float, causal: bool, stages: int = STAGES) -> None:
    """Write O into `out` and the natural-log logsumexp into `lse` (batch, heads, seqlen); the
    caller (forward.flash_attn_forward) has checked the scope above. `stages`: K/V blocks in
    flight (experiments time other counts)."""
    forward_hopper_plan(q, k, v, out, causal, stages)(q, k, v, out, lse, softmax_scale)


def forward_hopper_plan(q, k, v, out, causal: bool, stages: int = STAGES):
    """The launch for tensors shaped, strided and aligned like these, as a function of (q, k, v,
    out, lse, softmax_scale): descriptors are copied from ones made (and validated) here, and the
    compiled kernel is launched directly after the first call (launch.DirectLaunch)."""
    batch, seqlen, heads, _ = q.shape
    templates = (_row_descriptor(q, BLOCK_M // 2), _row_descriptor(k, BLOCK_N), _row_descriptor(v, BLOCK_N),
                 _row_descriptor(out, BLOCK_M // 2))
    # 4 warps in the default partition, 4 + 1 in the workers: 9, padded to 12 (registers are
    # reallocated per warpgroup); 168 registers each at launch, moved by setmaxnreg
    launch = DirectLaunch(sys.modules[__name__], "_fwd_launcher", (seqlen // BLOCK_M, batch * heads),
                          {"STAGES": stages, "CAUSAL": causal, "num_warps": 4, "maxnreg": 168})
    q_t, k_t, v_t, o_t = templates

    def run(q, k, v, out, lse, softmax_scale):
        launch(descriptor_like(q_t, q), descriptor_like(k_t, k), descriptor_like(v_t, v), descriptor_like(o_t, out),
               lse, heads, seqlen, softmax_scale * LOG2E)

    return run


# --------------------------------------------------------------------------------------
# Backward: the dK/dV kernel (FA2 Alg. 2 lines 5-18, line 15's dQ optionally) in FA3's layout
# --------------------------------------------------------------------------------------
BWD_BLOCK_M = 64  # query rows per step of the key block's loop
BWD_BLOCK_N = 128  # keys per program: two consumer warpgroups of 64
BWD_STAGES = 2  # Q/dO tiles in flight (shared memory at head dim 128: K and V 64 KiB + 2 x 32 KiB; 64 KiB more for the fused dQ's dS^T and dQ tiles)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """A TMA reduce-add of shared-memory tile `src` into global memory at `coord` of `tensor_desc`
    (cp.reduce.async.bulk.tensor .add; completion as for tma.async_copy_shared_to_global, by
    tma.store_wait). Triton 3.6 lowers `tensor_descriptor.atomic_add` to this op, but its Gluon
    Hopper module does not wrap it; this calls the same builder method."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bwd_load_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale,
                        CAUSAL: gl.constexpr):
    """One warp: FA2 Alg. 2 line 6 (K_j, V_j, as two 64-key halves, once) and line 9's loads of
    Q_i and dO_i, each query step into the ring stage both consumers have released."""
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        kv_row = row0 + start_n + half * ROWS
        tma.async_copy_global_to_shared(k_desc, [kv_row, col0], kv_bar, k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [kv_row, col0], kv_bar, v_smem.index(half))
    for step in range(n_steps):
        stage = step % STAGES
        # a fresh mbarrier counts as having completed the phase before its first
        mbarrier.wait(empty_bar.index(stage), ((step // STAGES) & 1) ^ 1)
        row = row0 + first_m + step * BLOCK_M
        mbarrier.expect(q_bar.index(stage), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col0], q_bar.index(stage), q_smem.index(stage))
        mbarrier.expect(do_bar.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, col0], do_bar.index(stage), do_smem.index(stage))


@gluon.jit
def _bwd_dkdv_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale,
                        CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup: FA2 Alg. 2 lines 7-18 for keys [HALF * 64, HALF * 64 + 64) of the
    block, key-major (the matmuls of lines 10-14 and 16 have these keys as M; K_j and V_j are
    shared-memory operands). Per query step the softmax of S^T runs under the dP^T matmul and dS^T under the dV
    matmul.
    FUSED_DQ (line 15, FA3's scheme): both consumers put dS^T in shared memory and wait for each
    other (mbarrier ds_bar); each then computes columns [HALF * 64, HALF * 64 + 64) of
    dQ_i = dS K_j over all 128 keys and adds them into the float32 accumulator behind dq_desc with
    one TMA reduce-add (the sum's order varies between runs)."""
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_buf = k_smem.index(HALF)
    v_buf = v_smem.index(HALF)

    kv_row = row0 + start_n + HALF * ROWS  # this half's first key row in the descriptors
    offs_n = start_n + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_m_base = gl.arange(0, BLOCK_M, layout=col_layout)
    LSE += pid_bh.to(gl.int64) * seqlen
    Delta += pid_bh.to(gl.int64) * seqlen
    # line 7: dK_j = dV_j = 0
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    s_init = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    if FUSED_DQ:
        DQ_COLS: gl.constexpr = dq_desc.block_type.shape[1]  # this consumer's columns of dQ
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        dq_init = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
        dq_buf = dq_smem.index(HALF)
    mbarrier.wait(kv_bar, 0)
    for step in range(n_steps):
        stage = step % STAGES
        phase = (step // STAGES) & 1
        offs_m = first_m + step * BLOCK_M + offs_m_base
        q_buf = q_smem.index(stage)
        do_buf = do_smem.index(stage)
        # line 10: S^T = K_j Q_i^T (unscaled); line 13: dP^T = V_j dO_i^T; both in flight
        mbarrier.wait(q_bar.index(stage), phase)
        s_tok = warpgroup_mma(k_buf, q_buf.permute((1, 0)), s_init, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(stage), phase)
        dp_tok = warpgroup_mma(v_buf, do_buf.permute((1, 0)), s_init, use_acc=False, is_async=True)
        lse = gl.load(LSE + offs_m) * 1.4426950408889634  # natural log -> log2 (LOG2E)
        delta = gl.load(Delta + offs_m)
        # line 11: P^T = exp(S^T - L) in the log2 domain, under the dP^T matmul
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p = gl.exp2(s * qk_scale - lse[None, :])
        if CAUSAL:  # noqa: SIM102 -- a compile-time branch around a run-time one
            if step * BLOCK_M < 2 * ROWS:  # the query steps that cross the diagonal of this block
                p = gl.where(offs_n[:, None] <= offs_m[None, :], p, 0.0)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        # line 12: dV_j += P^T dO_i
        dv_tok = warpgroup_mma(p_op, do_buf, dv, is_async=True)
        # line 14: dS^T = P^T * (dP^T - D_i), under the dV matmul
        dp = warpgroup_mma_wait(1, deps=[dp_tok])
        ds = (p * (dp - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        # line 16: dK_j += dS^T Q_i (the softmax scale is applied once at the end)
        dk_tok = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
        if FUSED_DQ:
            # dS^T into this step's buffer pair (two pairs: a consumer may be one step ahead)
            parity = step % 2
            ds_smem.index(2 * parity + HALF).store(ds)
            fence_async_shared()
            gl.thread_barrier()  # the whole warpgroup's stores, before one thread arrives
            mbarrier.arrive(ds_bar.index(parity), count=1)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
        mbarrier.arrive(empty_bar.index(stage), count=1)  # this warpgroup is done with Q_i, dO_i
        if FUSED_DQ:
            # line 15: dQ_i[:, this consumer's columns] = dS K_j[:, columns], over both halves' keys
            mbarrier.wait(ds_bar.index(parity), (step // 2) & 1)
            dq_tok = warpgroup_mma(ds_smem.index(2 * parity).permute((1, 0)),
                                   k_smem.index(0).slice(HALF * DQ_COLS, DQ_COLS, dim=1), dq_init,
                                   use_acc=False, is_async=True)
            dq_tok = warpgroup_mma(ds_smem.index(2 * parity + 1).permute((1, 0)),
                                   k_smem.index(1).slice(HALF * DQ_COLS, DQ_COLS, dim=1), dq_tok, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            tma.store_wait(pendings=0)  # the previous step's reduce-add has read dq_buf
            dq_buf.store(dq * softmax_scale)
            fence_async_shared()
            gl.thread_barrier()
            _tma_reduce_add(dq_desc, [row0 + first_m + step * BLOCK_M, col0 + HALF * DQ_COLS], dq_buf)

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


# The consumers' entry points, one per (dQ fused or not, half of the key block). FUSED_DQ is passed
# on as a literal: a flag that came through gl.warp_specialize's arguments is a run-time value in
# the partitions, and with the fused branch left in the non-fused kernel Triton 3.6's lowering
# fails (an assertion in ConvertTritonGPUToLLVM).


@gluon.jit
def _bwd_dkdv_partition_first_half(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                                   v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                                   start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL: gl.constexpr):
    _bwd_dkdv_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL, False, 0)


@gluon.jit
def _bwd_dkdv_partition_second_half(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                                    v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                                    start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL: gl.constexpr):
    _bwd_dkdv_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL, False, 1)


@gluon.jit
def _bwd_fused_partition_first_half(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                                    v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                                    start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL: gl.constexpr):
    _bwd_dkdv_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL, True, 0)


@gluon.jit
def _bwd_fused_partition_second_half(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                                     v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                                     start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL: gl.constexpr):
    _bwd_dkdv_partition(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem,
                        v_smem, do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0,
                        start_n, first_m, col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL, True, 1)


@gluon.jit
def _flash_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, num_heads,
                                  seqlen, softmax_scale, qk_scale, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                  FUSED_DQ: gl.constexpr):
    """One program per (key block, batch x head) owns dK_j and dV_j (FA2 Alg. 2, Section 3.2's
    parallelism over key blocks), partitioned as FA3's backward: a loader warp and two consumer
    warpgroups of 64 keys each that share every Q_i and dO_i tile. The descriptors view (batch *
    seqlen, heads * head dim). Without FUSED_DQ, dq_desc is unused and dQ is the dQ kernel's
    (flash_attn._flash_bwd_dq_kernel); with it, dq_desc is a float32 accumulator's, with tiles of
    64 rows by half the head dim."""
    dtype: gl.constexpr = q_desc.dtype
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    ROWS: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = 2 * ROWS
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    start_n = gl.program_id(0) * BLOCK_N  # causal: program 0 has the most query steps and starts first
    row0 = b * seqlen
    col0 = h * HEAD_DIM
    if CAUSAL:  # query rows from the block's first key on see some of its keys
        first_m = start_n
    else:
        first_m = 0
    n_steps = (seqlen - first_m) // BLOCK_M

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
        gl.static_assert(2 * dq_desc.block_type.shape[1] == HEAD_DIM)
        # dS^T of both consumers for two steps (the A operands of dQ = dS K, read transposed) and
        # each consumer's float32 dQ tile for its reduce-add
        ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, BLOCK_M], q_desc.layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for parity in gl.static_range(2):
            mbarrier.init(ds_bar.index(parity), count=2)  # both consumers' dS^T are in place
        mbarrier.init(done_bar, count=2)
        args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem, v_smem,
                do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, done_bar, row0, start_n, first_m,
                col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL)
        gl.warp_specialize([
            (_bwd_fused_partition_first_half, args),
            (_bwd_fused_partition_second_half, args),
            (_bwd_load_partition, args),
        ], [4, 1], [240, 24])
    else:  # the fused path's buffers and barriers are not used: stand-ins of the right kinds
        args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, q_smem, k_smem, v_smem,
                do_smem, q_smem, q_smem, kv_bar, q_bar, do_bar, empty_bar, q_bar, kv_bar, row0, start_n, first_m,
                col0, n_steps, pid_bh, seqlen, softmax_scale, qk_scale, CAUSAL)
        gl.warp_specialize([
            (_bwd_dkdv_partition_first_half, args),
            (_bwd_dkdv_partition_second_half, args),
            (_bwd_load_partition, args),
        ], [4, 1], [240, 24])


@functools.cache
def _fp32_tile_layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a float32 [rows, cols] tile (the fused dQ's reduce-adds)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32)


_bwd_dkdv_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_kernel)  # kernels/launch.py


def flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, softmax_scale: float, causal: bool,
                                    dq_accum: torch.Tensor | None = None, stages: int = BWD_STAGES) -> None:
    """Write dK and dV (FA2 Alg. 2) given the forward's logsumexp `lse` and D = rowsum(dO * O) in
    `delta` (both (batch, heads, seqlen) float32); with `dq_accum` (a zeroed float32 tensor shaped
    like q, head dim 128), also add dQ into it. The caller (backward.flash_attn_backward) has
    checked the scope (dispatch.hopper_gluon_applies)."""
    plan = backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, causal, stages)
    plan(q, k, v, do, lse, delta, dk, dv, dq_accum, softmax_scale)


def backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, causal: bool, stages: int = BWD_STAGES):
    """The dK/dV launch for tensors shaped, strided and aligned like these, as a function of (q, k,
    v, do, lse, delta, dk, dv, dq_accum, softmax_scale) (see forward_hopper_plan)."""
    batch, seqlen, heads, headdim = q.shape
    rows = BWD_BLOCK_N // 2
    fused = dq_accum is not None
    if fused and headdim != 128:
        raise ValueError(f"the fused dQ splits head dim 128 between the two consumers, got {headdim}")
    templates = (_row_descriptor(q, BWD_BLOCK_M), _row_descriptor(k, rows), _row_descriptor(v, rows),
                 _row_descriptor(do, BWD_BLOCK_M), _row_descriptor(dk, rows), _row_descriptor(dv, rows))
    dq_template = None
    if fused:
        dq_template = TensorDescriptor(dq_accum, [batch * seqlen, heads * headdim], [dq_accum.stride(1), 1],
                                       [BWD_BLOCK_M, headdim // 2], _fp32_tile_layout(BWD_BLOCK_M, headdim // 2))
    launch = DirectLaunch(sys.modules[__name__], "_bwd_dkdv_launcher", (seqlen // BWD_BLOCK_N, batch * heads),
                          {"STAGES": stages, "CAUSAL": causal, "FUSED_DQ": fused, "num_warps": 4, "maxnreg": 168})
    q_t, k_t, v_t, do_t, dk_t, dv_t = templates

    def run(q, k, v, do, lse, delta, dk, dv, dq_accum, softmax_scale):
        dk_desc = descriptor_like(dk_t, dk)
        dq_desc = dk_desc if dq_accum is None else descriptor_like(dq_template, dq_accum)  # unused unless fused
        launch(descriptor_like(q_t, q), descriptor_like(k_t, k), descriptor_like(v_t, v), descriptor_like(do_t, do),
               dk_desc, descriptor_like(dv_t, dv), dq_desc, lse, delta, heads, seqlen, softmax_scale,
               softmax_scale * LOG2E)

    return run


# The entry points as defined here: forward.py and backward.py run their plans while the module's
# public names still hold these, and call the public names when a test or experiment replaced them.
GENUINE_ENTRY_POINTS = (flash_attn_forward_hopper, flash_attn_backward_dkdv_hopper)
