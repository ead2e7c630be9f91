"""FA2's backward dK/dV kernel with dQ fused (Algorithm 2 lines 5-18) at head dim 192, on Hopper
in Gluon, built from bwd.py's steps where they fit.

At head dim 192, dK_j and dV_j of bwd.py's 64 keys a warpgroup would take 192 float32 registers
a thread before S, dP or dQ hold any: more than a consumer has. So here both consumer
warpgroups share one block of 64 keys and split the work by role, as FA3 splits its wide-head
backward between warpgroups (hopper/flash_bwd_launch_template.h runs 192 on three):

- the **S warpgroup** computes S^T = K_j Q_i^T and P^T (line 10-11, the causal mask where the
  step crosses the diagonal), reads the other's dP^T - D_i from shared memory and forms
  dS^T = P^T * (dP^T - D_i) in float32 (line 14), and owns the head dim's first section (128
  columns) of dK_j and dV_j (lines 12 and 16, P^T and dS^T from its registers);
- the **dP warpgroup** computes dP^T = V_j dO_i^T (line 13) and hands dP^T - D_i over, then
  owns the second section (64 columns) of dK_j and dV_j and all of dQ_i = dS K_j (line 15),
  reading P^T and dS^T from shared memory; dQ goes to the float32 accumulator as three 64 x 64
  register-order tiles, staged for a dQ writer warp that issues their TMA reduce-adds, as in
  bwd.py: once dV's and dK's matmuls have finished too, or (DQ_FIRST) with its matmuls issued
  before theirs and its tiles staged while they run, as FA3 and FA4 write dQ out under the
  matmuls after it.

Per query step the S warpgroup does 3 + 2 + 2 and the dP warpgroup 3 + 1 + 1 + 3 fifteenths of
the step's matmul work (each of the five matmuls is three). One buffer each carries dP^T - D_i (float32, the warpgroup's register order)
and P^T, dS^T (the inputs' dtype) between them, each with an mbarrier that says it is full and
one that says it has been read. K_j and V_j (64 keys, loaded once) and a ring of 2 Q_i and dO_i
tiles stream as in bwd.py; shared memory holds 225 KiB.

The host side (descriptors, grid, plans) is kernels/flash_attn_hopper.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .bwd import (
    DQ_COLS,
    _bwd_descriptors,
    _bwd_load_query_steps,
    _bwd_program,
    _bwd_step_coords,
    _chained_matmul,
    _dq_full,
    _register_box,
)
from .shared import (
    DQ_REGISTER_BOX,
    DQ_REGISTER_TILE,
    _allocate_sections,
    _at,
    _head_dim,
    _load_sections,
    _tma_reduce_add,
    _wgmma_layout,
)


@gluon.jit
def _wide_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES: gl.constexpr):
    """The kernel's shared memory: K_j and V_j (one block, each a tuple of head-dim sections), the
    ring of STAGES Q_i and dO_i tiles and their L_i and D_i rows, the exchange's buffers (dP^T -
    D_i in register order, P^T, dS^T) and the dP warpgroup's three float32 dQ tiles; then the
    mbarriers: kv_bar, q_bar, do_bar, empty_bar as in bwd.py, dp_bar / pds_bar (the dP^T - D_i
    buffer / the P^T and dS^T buffers are full) and dp_free / pds_free (read), dq_free (the dQ
    writer warp's reduce-adds have read the dQ tiles), done_bar (both warpgroups are past their
    last matmul on K)."""
    dtype: gl.constexpr = q_desc[0].dtype
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    k_smem = _allocate_sections(k_desc, 1)
    v_smem = _allocate_sections(v_desc, 1)
    q_smem = _allocate_sections(q_desc, STAGES)
    do_smem = _allocate_sections(do_desc, STAGES)
    dpmd_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], DQ_REGISTER_TILE)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], q_desc[0].layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], q_desc[0].layout)
    gl.static_assert(BLOCK_M * DQ_COLS == DQ_REGISTER_BOX[0] * DQ_REGISTER_BOX[1])
    dq_smem = gl.allocate_shared_memory(gl.float32, [_head_dim(q_desc) // DQ_COLS, BLOCK_M, DQ_COLS],
                                        dq_desc[0].layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(stage), count=1)
        mbarrier.init(do_bar.index(stage), count=1)
        mbarrier.init(empty_bar.index(stage), count=2)  # released by both consumer warpgroups
    for i in gl.static_range(5):
        mbarrier.init(xbar.index(i), count=1)
    mbarrier.init(xbar.index(5), count=2)
    return (k_smem, v_smem, q_smem, do_smem, dpmd_smem, p_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar,
            xbar.index(0), xbar.index(1), xbar.index(2), xbar.index(3), xbar.index(4), xbar.index(5))


@gluon.jit
def _wide_load_partition(args, CAUSAL: gl.constexpr):
    """One warp: K_j and V_j once (FA2 Alg. 2 line 6), then bwd.py's query steps (line 9's Q_i,
    dO_i with L_i, D_i)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    if len(k_desc) == 1:
        mbarrier.expect(kv_bar, k_desc[0].block_type.nbytes + v_desc[0].block_type.nbytes)
    else:
        mbarrier.expect(kv_bar, k_desc[0].block_type.nbytes + k_desc[1].block_type.nbytes
                        + v_desc[0].block_type.nbytes + v_desc[1].block_type.nbytes)
    _load_sections(k_desc, row0 + start_n, col0, kv_bar, _at(k_smem, 0))
    _load_sections(v_desc, row0 + start_n, col0, kv_bar, _at(v_smem, 0))
    _bwd_load_query_steps(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty_bar, row0, first_m, q_col0,
                          n_steps, kv_group, LSE, Delta, lse_smem, delta_smem, lse_row0)


@gluon.jit
def _wide_s_step(args, ctx, step, dk, dv, DIAGONAL: gl.constexpr):
    """The S warpgroup's query step (lines 10-12, 14, 16 for Q_i, dO_i; DIAGONAL: the step's rows
    cross the block's diagonal, so P^T is masked): returns dK_j, dV_j of the first head-dim section."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, offs_n, offs_m_base, s_init = ctx
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    dtype: gl.constexpr = q_desc[0].dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    m, _, _, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group, BLOCK_M,
                                  _head_dim(q_desc))
    q_buf = _at(q_smem, stage)
    do_buf = _at(do_smem, stage)
    # line 10: S^T = K_j Q_i^T (unscaled), one wgmma per head-dim section
    mbarrier.wait(q_bar.index(stage), phase)
    s_tok = _chained_matmul(k_buf, q_buf, s_init)
    lse = lse_smem.index(stage).load(s_layout) * 1.4426950408889634
    s = warpgroup_mma_wait(0, deps=[s_tok])
    # line 11: P^T = exp(S^T - L) in the log2 domain
    p = gl.exp2(s * qk_scale - lse)
    if DIAGONAL:
        p = gl.where(offs_n[:, None] <= (m + offs_m_base)[None, :], p, 0.0)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    # line 12 for the first section: dV_j += P^T dO_i, in flight while dP^T - D_i is awaited
    mbarrier.wait(do_bar.index(stage), phase)
    dv_tok = warpgroup_mma(p_op, do_buf[0], dv, is_async=True)
    # line 14: dS^T = P^T * (dP^T - D_i), with the dP warpgroup's dP^T - D_i
    mbarrier.wait(dp_bar, step & 1)
    dpmd = dpmd_smem.load(s_layout)
    gl.thread_barrier()  # the whole warpgroup's loads, before one thread frees the buffer
    mbarrier.arrive(dp_free, count=1)
    ds = (p * dpmd).to(dtype)
    ds_op = gl.convert_layout(ds, op_layout)
    # line 16 for the first section: dK_j += dS^T Q_i
    dk_tok = warpgroup_mma(ds_op, q_buf[0], dk, is_async=True)
    # P^T and dS^T to the dP warpgroup, once it has read the previous step's
    mbarrier.wait(pds_free, (step & 1) ^ 1)  # a fresh mbarrier counts as having completed the phase before its first
    p_smem.store(p.to(dtype))
    ds_smem.store(ds)
    fence_async_shared()  # read by its wgmmas
    gl.thread_barrier()
    mbarrier.arrive(pds_bar, count=1)
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
    mbarrier.arrive(empty_bar.index(stage), count=1)
    return dk, dv


@gluon.jit
def _wide_s_partition(args, CAUSAL: gl.constexpr):
    """The S warpgroup (see the module's docstring): dK_j and dV_j's first head-dim section over
    every query step that sees the block, written once the dP warpgroup is past K (line 18)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    WIDTH: gl.constexpr = k_desc[0].block_type.shape[1]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    k_buf = _at(k_smem, 0)
    v_buf = _at(v_smem, 0)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m_base = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    # line 7: dK_j = dV_j = 0 (the first section's)
    dk = gl.zeros([BLOCK_N, WIDTH], gl.float32, layout=_wgmma_layout(WIDTH))
    dv = gl.zeros([BLOCK_N, WIDTH], gl.float32, layout=_wgmma_layout(WIDTH))
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    ctx = (k_buf, offs_n, offs_m_base, s_init)
    mbarrier.wait(kv_bar, 0)
    for group in range(kv_group):
        if CAUSAL:  # a block as tall as a query step: each q head's first step crosses the diagonal
            dk, dv = _wide_s_step(args, ctx, group * n_steps, dk, dv, True)
            for i in range(1, n_steps):
                dk, dv = _wide_s_step(args, ctx, group * n_steps + i, dk, dv, False)
        else:
            for i in range(n_steps):
                dk, dv = _wide_s_step(args, ctx, group * n_steps + i, dk, dv, False)
    mbarrier.arrive(done_bar, count=1)
    mbarrier.wait(done_bar, 0)  # the dP warpgroup's last dQ matmul has read K
    # line 18: the first section of dK_j, dV_j, staged through its K and V tiles
    k_buf[0].store((dk * softmax_scale).to(k_buf[0].dtype))
    v_buf[0].store(dv.to(v_buf[0].dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc[0], [row0 + start_n, col0], k_buf[0])
    tma.async_copy_shared_to_global(dv_desc[0], [row0 + start_n, col0], v_buf[0])
    tma.store_wait(pendings=0)


@gluon.jit
def _wide_dp_issue(args, ctx, step):
    """Line 13 for query step `step`: dP^T = V_j dO_i^T issued once dO_i has landed (one wgmma per
    head-dim section, chained), left in flight."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, v_buf, s_init, dq_init = ctx
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    stage = step % STAGES
    mbarrier.wait(do_bar.index(stage), (step // STAGES) & 1)
    return _chained_matmul(v_buf, _at(do_smem, stage), s_init)


@gluon.jit
def _wide_dp_step(args, ctx, step, dk, dv, DQ_FIRST: gl.constexpr):
    """The dP warpgroup's query step: line 13 (dP^T, `_wide_dp_issue`), then lines 12 and 16 for the
    second head-dim section and 15, in the order `_wide_dp_partition`'s DQ_FIRST says. Returns dK_j,
    dV_j of the second section."""
    dp_tok = _wide_dp_issue(args, ctx, step)
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, v_buf, s_init, dq_init = ctx
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    q_buf = _at(q_smem, stage)
    do_buf = _at(do_smem, stage)
    delta = delta_smem.index(stage).load(s_layout)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])  # the only matmul in flight
    # dP^T - D_i to the S warpgroup, once it has read the previous step's
    mbarrier.wait(dp_free, (step & 1) ^ 1)
    dpmd_smem.store(dp - delta)
    gl.thread_barrier()
    mbarrier.arrive(dp_bar, count=1)
    # once P^T and dS^T are in place: line 12 and 16 for the second section, line 15 (dQ_i = dS K_j,
    # 64 columns a tile)
    mbarrier.wait(q_bar.index(stage), phase)
    mbarrier.wait(pds_bar, step & 1)
    if not DQ_FIRST:
        dv_tok = warpgroup_mma(p_smem, do_buf[1], dv, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, q_buf[1], dk, is_async=True)
    ds_t = ds_smem.permute((1, 0))
    dq0_tok = warpgroup_mma(ds_t, k_buf[0].slice(0, DQ_COLS, dim=1), dq_init, use_acc=False, is_async=True)
    dq1_tok = warpgroup_mma(ds_t, k_buf[0].slice(DQ_COLS, DQ_COLS, dim=1), dq_init, use_acc=False, is_async=True)
    dq2_tok = warpgroup_mma(ds_t, k_buf[1], dq_init, use_acc=False, is_async=True)
    if DQ_FIRST:
        # lines 12 and 16 after 15: dQ_i is staged for the writer warp (which reduce-adds it) while they run
        dv_tok = warpgroup_mma(p_smem, do_buf[1], dv, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, q_buf[1], dk, is_async=True)
        # a commit group per wgmma, completed in order: the 2 left in flight are dV's and dK's
        dq0, dq1, dq2 = warpgroup_mma_wait(2, deps=[dq0_tok, dq1_tok, dq2_tok])
        _wide_stage_dq(dq_smem, (dq0, dq1, dq2), dq_free, step)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(pds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
    else:
        dv, dk, dq0, dq1, dq2 = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq0_tok, dq1_tok, dq2_tok])
        mbarrier.arrive(pds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
        _wide_stage_dq(dq_smem, (dq0, dq1, dq2), dq_free, step)
    return dk, dv


@gluon.jit
def _wide_stage_dq(dq_smem, dq, dq_free, step):
    """The dP warpgroup's dQ_i tiles of query step `step` (three 64 x 64, unscaled: bwd._bwd_stage_dq)
    into shared memory in register order once the dQ writer warp has read the previous step's
    (dq_free), then every thread arrives at named barrier DQ_FULL_BARRIER and goes on
    (bwd._dq_full; _wide_dq_writer_partition adds them)."""
    BLOCK_M: gl.constexpr = dq[0].shape[0]
    mbarrier.wait(dq_free, (step & 1) ^ 1)  # a fresh mbarrier's previous phase counts as done
    for i in gl.static_range(len(dq)):
        buf = dq_smem.index(i)
        buf._reinterpret(gl.float32, [BLOCK_M, DQ_COLS], DQ_REGISTER_TILE).store(dq[i])
    fence_async_shared()
    _dq_full(0, True, 4)


@gluon.jit
def _wide_dq_writer_partition(args):
    """One warp, the dQ writer (bwd._bwd_dq_writer's role): each query step's three dQ_i tiles,
    once the dP warpgroup has staged them (_wide_stage_dq), added into the float32 accumulator
    (rows from row0 + m of the (batch x seqlen, heads x head dim) view, columns from the step's q
    head; bwd._bwd_dq_writer's layout, a tile per 64-row block and 64 columns) by one TMA
    reduce-add each, then released (dq_free) once the reduce-adds have read them."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    TILES: gl.constexpr = HEAD_DIM // DQ_COLS
    for step in range(n_steps * kv_group):
        m, q_col, _, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group, BLOCK_M,
                                          HEAD_DIM)
        tile = (row0 + m) // BLOCK_M * (num_heads * TILES) + q_col // DQ_COLS
        _dq_full(0, False, 1)
        for i in gl.static_range(TILES):
            box = _register_box(dq_smem.index(i), dq_desc[0])
            _tma_reduce_add(dq_desc[0], [(tile + i) * DQ_REGISTER_BOX[0], 0], box)
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_free, count=1)


@gluon.jit
def _wide_dp_partition(args, CAUSAL: gl.constexpr, DQ_FIRST: gl.constexpr):
    """The dP warpgroup (see the module's docstring): dK_j and dV_j's second head-dim section and
    dQ over every query step that sees the block; the sections written once both warpgroups are
    past K (line 18). DQ_FIRST: each step's dQ_i matmuls (line 15) are issued before dV's and dK's
    (lines 12 and 16) and waited for alone, and dQ_i is staged for the writer warp, which
    reduce-adds it while those two run (as FA3 and FA4 write dQ out under the matmuls after it);
    else all five are waited for together and dQ_i follows."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar, pds_bar,
     dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    TAIL: gl.constexpr = k_desc[1].block_type.shape[1]
    k_buf = _at(k_smem, 0)
    v_buf = _at(v_smem, 0)
    dk = gl.zeros([BLOCK_N, TAIL], gl.float32, layout=_wgmma_layout(TAIL))
    dv = gl.zeros([BLOCK_N, TAIL], gl.float32, layout=_wgmma_layout(TAIL))
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=_wgmma_layout(BLOCK_M))
    dq_init = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
    ctx = (k_buf, v_buf, s_init, dq_init)
    mbarrier.wait(kv_bar, 0)
    for step in range(n_steps * kv_group):
        dk, dv = _wide_dp_step(args, ctx, step, dk, dv, DQ_FIRST)
    mbarrier.arrive(done_bar, count=1)
    mbarrier.wait(done_bar, 0)
    k_buf[1].store((dk * softmax_scale).to(k_buf[1].dtype))
    v_buf[1].store(dv.to(v_buf[1].dtype))
    fence_async_shared()
    col = col0 + k_desc[0].block_type.shape[1]
    tma.async_copy_shared_to_global(dk_desc[1], [row0 + start_n, col], k_buf[1])
    tma.async_copy_shared_to_global(dv_desc[1], [row0 + start_n, col], v_buf[1])
    tma.store_wait(pendings=0)


@gluon.jit
def _flash_bwd_dkdv_hopper_wide_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc,
                                       k_tail_desc, v_tail_desc, do_tail_desc, dk_tail_desc, dv_tail_desc,
                                       dq_tail_desc, LSE, Delta, num_heads, seqlen, softmax_scale, qk_scale,
                                       kv_group, window_left, window_right, softcap_log2, Alibi, stride_alibi_b,
                                       RngSeed, dropout_p, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                       DQ_FIRST: gl.constexpr):
    """One program per (batch, kv head, 64-key block) owns dK_j and dV_j and adds dQ (FA2 Alg. 2;
    placed by flash_attn_hopper.bwd_grid and bwd._bwd_program): a loader warp, the S warpgroup,
    the dP warpgroup and a dQ writer warp (the module's docstring). The arguments are bwd.py's dense kernel's, the
    head dim two sections (HEAD_SPLIT) and dQ fused; the feature arguments (window, softcap,
    ALiBi, dropout) and dq_tail_desc are not read: this kernel has none of the features. DQ_FIRST:
    the dP warpgroup's order (_wide_dp_partition)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc) = _bwd_descriptors(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc, k_tail_desc, v_tail_desc,
        do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc, True)
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    gl.static_assert(BLOCK_M == BLOCK_N, "the causal mask takes each q head's first step as the diagonal one")
    b, kv_head, start_n = _bwd_program(num_heads, kv_group, BLOCK_N)
    row0 = b * seqlen
    col0 = kv_head * HEAD_DIM
    q_col0 = kv_head * kv_group * HEAD_DIM  # the group's first q head
    lse_row0 = b * num_heads + kv_head * kv_group
    if CAUSAL:  # query rows from the block's first key on see some of its keys
        first_m = start_n
    else:
        first_m = 0
    n_steps = (seqlen - first_m) // BLOCK_M
    (k_smem, v_smem, q_smem, do_smem, dpmd_smem, p_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar,
     pds_bar, dp_free, pds_free, dq_free, done_bar) = _wide_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], LSE.layout)  # L_i and D_i per ring stage
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], Delta.layout)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
            dpmd_smem, p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, dp_bar,
            pds_bar, dp_free, pds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0,
            seqlen, softmax_scale, qk_scale, num_heads)
    gl.warp_specialize([
        (_wide_s_partition, (args, CAUSAL)),
        (_wide_dp_partition, (args, CAUSAL, DQ_FIRST)),
        (_wide_load_partition, (args, CAUSAL)),
        (_wide_dq_writer_partition, (args,)),
    ], [4, 1, 1], [240, 24, 24])
