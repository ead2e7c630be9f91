"""The Gluon dK/dV kernel with dQ fused over packed variable lengths (flash_attn_varlen_func's
backward), built from bwd.py's steps: program (sequence, kv head, key block), causal bottom-right
per sequence, P^T masked to the sequence's keys and each row's visible ones where a step needs it.

The host side (descriptors, grid, launch) is kernels/flash_attn_hopper.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from .bwd import (
    _bwd_add_dq_in_its_turn,
    _bwd_descriptors,
    _bwd_dq_writer,
    _bwd_dv_ds_dk,
    _bwd_load_kv,
    _bwd_program,
    _bwd_score_matmuls,
    _bwd_share_ds,
    _bwd_shared_buffers,
    _bwd_step_coords,
    _bwd_wait_dkdv,
    _dq_tile_buffer,
)
from .shared import _at, _expect_sections, _head_dim, _load_sections, _wgmma_layout, _zero_sections


@gluon.jit
def _varlen_bwd_load_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr):
    """bwd._bwd_load_partition over one sequence's rows of the packed views, with each step's L_i
    and D_i (heads, total_q rows) stored into the stage's shared memory by plain loads, +inf and 0
    past the sequence's end, announced on stats_bar (by TMA, as the dense kernel brings them, a
    causal packed batch hit an illegal instruction on the H200: docs/performance.md)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, q_start, kv_row0, start_n,
     first_m, col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv,
     softmax_scale, qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
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
        _expect_sections(q_bar.index(stage), q_desc)
        _load_sections(q_desc, q_start + m, q_col, q_bar.index(stage), _at(q_smem, stage))
        _expect_sections(do_bar.index(stage), do_desc)
        _load_sections(do_desc, q_start + m, q_col, do_bar.index(stage), _at(do_smem, stage))
        lse_smem.index(stage).store(lse)
        delta_smem.index(stage).store(delta)
        gl.thread_barrier()  # the warp's stores, before one thread arrives
        mbarrier.arrive(stats_bar.index(stage), count=1)


@gluon.jit
def _varlen_bwd_dq_writer_partition(args):
    """One warp: bwd._bwd_dq_writer for the program's key block over its sequence's query steps,
    from the sequence's padded row of the dQ accumulator."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, q_start, kv_row0, start_n, first_m,
     col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv, softmax_scale,
     qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    _bwd_dq_writer(dq_desc, dq_smem, dq_free, dq_row0, first_m, q_col0, n_steps, kv_group, num_heads, _head_dim(q_desc))


@gluon.jit
def _varlen_store_rows(desc, Ptr, stride, buf, value, first, row0, col0, limit):
    """Write a [ROWS, width] tile (`value`, `buf` and `desc` one head-dim section's) whose rows are
    sequence positions first.. (row0 + first in the packed view), from column col0 on: by TMA where
    every row is before `limit` (issued, not waited for: the caller waits once for all its tiles),
    else only those rows, by a masked pointer store (the rows past it belong to the next sequence)."""
    ROWS: gl.constexpr = value.shape[0]
    WIDTH: gl.constexpr = value.shape[1]
    layout: gl.constexpr = value.type.layout
    if first + ROWS <= limit:
        buf.store(value)
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [row0 + first, col0], buf)
    else:
        rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        ptrs = Ptr + (row0 + rows).to(gl.int64)[:, None] * stride + (col0 + cols)[None, :]
        gl.store(ptrs, value, mask=(rows < limit)[:, None])


@gluon.jit
def _varlen_bwd_step(args, ctx, step, dk, dv, CAUSAL: gl.constexpr, HALF: gl.constexpr):
    """One query step of _varlen_bwd_dkdv_partition's loop (bwd._bwd_dkdv_step's, dQ fused): P^T is
    masked to the sequence's keys and, causal, to each row's visible ones where the step needs it
    (the block's keys run past the sequence's end, or, causal, some row of the step does not see
    every key of this half), told at run time: one loop for all steps, faster causal than masking
    every step and level otherwise, and level with the masked steps in a loop of their own
    (docs/performance.md). The diagonal's test takes one offset a key row against the step's
    column indices, made where it runs, so that no index vector lives through the loop (held
    there, the consumers' loops spilled and filled registers every step: `loop_spills` of
    tools/compile_check_sm90.py). Returns dK_j, dV_j."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, q_start, kv_row0, start_n,
     first_m, col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv,
     softmax_scale, qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    k_buf, v_buf, keys_ok, s_init, dq_init, dq_buf, first_key, partial_keys = ctx
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    dtype: gl.constexpr = q_desc[0].dtype
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk[0].type.layout, k_width=2)
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    m, q_col, _, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, q_col0 // HEAD_DIM, 0, kv_group, BLOCK_M,
                                      HEAD_DIM)
    q_buf = _at(q_smem, stage)
    do_buf = _at(do_smem, stage)
    s_tok, dp_tok = _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init)
    # the loader's copies of L_i and D_i; D_i read once P^T is made (as bwd._bwd_dkdv_step does)
    mbarrier.wait(stats_bar.index(stage), phase)
    lse = lse_smem.index(stage).load(col_layout)[None, :] * 1.4426950408889634
    s = warpgroup_mma_wait(len(k_buf), deps=[s_tok])
    p = gl.exp2(s * qk_scale - lse)
    # keys past the sequence's end and, causal, past a row's diagonal, where the step needs it: row
    # m + shift sees keys up to itself
    if CAUSAL:
        if m + shift < first_key + ROWS - 1:  # rows that miss some key of this half
            # key n, query column c of the step: visible iff n - (m + shift) <= c
            last = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) + (first_key - m - shift)
            p = gl.where(last[:, None] <= gl.arange(0, BLOCK_M, layout=col_layout)[None, :], p, 0.0)
        if partial_keys:
            p = gl.where(keys_ok[:, None], p, 0.0)
    else:
        if partial_keys:
            p = gl.where(keys_ok[:, None], p, 0.0)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    delta = delta_smem.index(stage).load(col_layout)[None, :]
    dv_tok, dk_tok, ds, ds_op = _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout)
    parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
    dv, dk, p_op, ds_op = _bwd_wait_dkdv(dv_tok, dk_tok, p_op, ds_op)
    mbarrier.arrive(empty_bar.index(stage), count=1)
    _bwd_add_dq_in_its_turn(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, HALF)
    return dk, dv


@gluon.jit
def _varlen_bwd_dkdv_partition(args, CAUSAL: gl.constexpr, HALF: gl.constexpr):
    """bwd._bwd_dkdv_partition (dQ fused) for one sequence of a packed batch: keys [start_n + HALF *
    64, + 64) of the sequence against its query steps. P^T is masked to the sequence's keys and
    (causal, bottom-right) to each row's visible ones; a query row past the sequence's end reads
    the logsumexp +inf (P = 0), so its dS is 0: the dQ reduce-add of a tile crossing the
    sequence's end adds zeros into the padding after this sequence's tiles. dK and dV rows past the
    sequence's end are not written."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, q_start, kv_row0, start_n,
     first_m, col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q, stride_dk, stride_dv,
     softmax_scale, qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads) = args
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    k_buf = _at(k_smem, HALF)
    v_buf = _at(v_smem, HALF)

    first_key = start_n + HALF * ROWS  # this half's first key in its sequence
    keys_ok = first_key + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) < seqlen_k
    partial_keys = start_n + 2 * ROWS > seqlen_k
    dk = _zero_sections(ROWS, k_smem)
    dv = _zero_sections(ROWS, k_smem)
    s_init = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    dq_init = _zero_sections(BLOCK_M, dq_smem)  # one per dQ section
    dq_buf = _dq_tile_buffer(dq_smem, HALF)
    mbarrier.wait(kv_bar, 0)
    ctx = (k_buf, v_buf, keys_ok, s_init, dq_init, dq_buf, first_key, partial_keys)
    for group in range(kv_group):
        for i in range(n_steps):
            dk, dv = _varlen_bwd_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, HALF)

    mbarrier.arrive(done_bar, count=1)
    mbarrier.wait(done_bar, 0)
    for section in gl.static_range(len(dk)):
        col = col0 + section * dk_desc[0].block_type.shape[1]
        _varlen_store_rows(dk_desc[section], DK, stride_dk, k_buf[section],
                           (dk[section] * softmax_scale).to(k_buf[section].dtype), first_key, kv_row0, col, seqlen_k)
        _varlen_store_rows(dv_desc[section], DV, stride_dv, v_buf[section], dv[section].to(v_buf[section].dtype),
                           first_key, kv_row0, col, seqlen_k)
    tma.store_wait(pendings=0)  # once for every tile's store: each leaves through a buffer of its own


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
    least b's own blocks, so at most one empty block a sequence; flash_attn_hopper.varlen_bwd_key_blocks), the first
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


@gluon.jit
def _flash_bwd_dkdv_hopper_varlen_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc,
                                         k_tail_desc, v_tail_desc, do_tail_desc, dk_tail_desc, dv_tail_desc,
                                         dq_tail_desc, DK, DV, LSE, Delta, CuSeqQ, CuSeqK, num_heads, total_q,
                                         stride_dk, stride_dv, softmax_scale, qk_scale, kv_group, batch,
                                         STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCAN: gl.constexpr,
                                         HEAD_SPLIT: gl.constexpr = False):
    """The Gluon dK/dV kernel with dQ fused over packed sequences: program (sequence, kv head, key
    block), placed by flash_attn_hopper.bwd_grid and, with SCAN 0, _bwd_program ((sequence, kv
    head) pairs), else _varlen_packed_program (kv heads; every sequence's key blocks on the second
    axis); sequence b's queries are rows CuSeqQ[b]:CuSeqQ[b + 1] of the packed views (LSE and Delta
    (heads, total_q)), its keys rows CuSeqK[b]:CuSeqK[b + 1]; causal bottom-right per sequence. A
    program past its sequence's last key block does nothing. The loader warp brings each step's
    L_i and D_i into shared memory (_varlen_bwd_load_partition). SCAN: 0, the grid gives every
    sequence the longest one's key blocks; else the key blocks of the `batch` sequences lie on one
    axis (SCAN lanes >= batch + 1). HEAD_SPLIT: the dense kernel's (head dim 96 as 64 + 32)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc) = _bwd_descriptors(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc, k_tail_desc, v_tail_desc,
        do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc, HEAD_SPLIT)
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
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
        (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar, dq_free,
         done_bar) = _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES, True)
        lse_smem, delta_smem, stats_bar = _varlen_stats_buffers(STAGES, BLOCK_M)
        # dQ tiles in register order: sequence b's rows from the accumulator's padded row
        # (CuSeqQ[b] + 64 b) // 64 * 64, whole 64-row tiles apart from the next sequence's (FA3's
        # padded offsets for its dQaccum; dq_cast.varlen_dq_accumulator sizes the accumulator)
        dq_row0 = (q_start + b * BLOCK_M) // BLOCK_M * BLOCK_M
        args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, DK, DV, LSE, Delta, q_smem, k_smem, v_smem,
                do_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, q_start,
                kv_row0, start_n, first_m, col0, q_col0, n_steps, kv_group, seqlen_q, seqlen_k, shift, total_q,
                stride_dk, stride_dv, softmax_scale, qk_scale, lse_smem, delta_smem, stats_bar, dq_row0, num_heads)
        gl.warp_specialize([
            (_varlen_bwd_dkdv_partition, (args, CAUSAL, 0)),
            (_varlen_bwd_dkdv_partition, (args, CAUSAL, 1)),
            (_varlen_bwd_load_partition, (args, CAUSAL, 0)),
            (_varlen_bwd_dq_writer_partition, (args,)),
        ], [4, 1, 1], [240, 24, 24])


