"""FA2's backward dK/dV kernel with dQ fused (Algorithm 2 lines 5-18) at head dims 192 and 256, on
Hopper in Gluon, built from bwd.py's steps where they fit.

At these head dims, dK_j and dV_j of bwd.py's 64 keys a warpgroup would take 192 or 256 float32
registers a thread before S, dP or dQ hold any: more than a consumer has. So here both consumer
warpgroups share one block of 64 keys and split the work by role, as FA3 splits its wide-head
backward between warpgroups (hopper/flash_bwd_launch_template.h runs 192 on three). The head dim
is two sections, the first 128 columns and the rest (64 at 192, 128 at 256:
flash_attn_hopper.wide_bwd_sections):

- the **S warpgroup** computes S^T = K_j Q_i^T and P^T (line 10-11, the causal mask where the
  step crosses the diagonal), hands P^T over through shared memory, and owns the first section of
  dK_j and dV_j (lines 12 and 16: P^T from its registers, dS^T from shared memory);
- the **dP warpgroup** computes dP^T = V_j dO_i^T (line 13) and, with the other's P^T, forms
  dS^T = P^T * (dP^T - D_i) in float32 (line 14) and hands it back, then owns the second section
  of dK_j and dV_j, reading P^T and dS^T from shared memory, and computes dQ_i = dS K_j (line 15)
  as 64 x 64 register-order tiles: all of them at 192; at 256 (DQ_BY_SECTION) those of its own
  section, the S warpgroup those of the first, so that each does ten twentieths of the step's
  matmul work (else the dP warpgroup's twelve would set the pace).

So the dP warpgroup, whose chain of matmuls is the longer, waits in a step for P^T, which the S
warpgroup forms while dP^T is computed (and for the previous step's dS^T to have been read), not
for the other's arithmetic on its own result (with dP^T - D_i handed over and dS^T formed by the
S warpgroup it was level or slower at every shape measured: docs/performance.md, "The Gluon
backward at head dim 192").

dQ goes to the float32 accumulator: at 192 staged in shared memory for a dQ writer warp that
issues their TMA reduce-adds, as in bwd.py: once dV's and dK's matmuls have finished too, or
(DQ_FIRST) with its matmuls issued before theirs and its tiles staged while they run, as FA3 and
FA4 write dQ out under the matmuls after it. At 256 the staging tiles do not fit beside the
others (DQ_ATOMIC): each warpgroup adds its tiles from its registers, one 16-byte reduction per
four registers, as FA3 adds dQ at that head dim ("atomicAdd" on a sliced dQ GEMM).

Per query step at 192 the S warpgroup does 3 + 2 + 2 and the dP warpgroup 3 + 1 + 1 + 3 fifteenths of
the step's matmul work (each of the five matmuls is three). A pair of buffers carries P^T (float32
in the warpgroup's register order, for dS^T; the inputs' dtype, for dV's matmul) and one dS^T
(the inputs' dtype) between them, each with an mbarrier that says it is full and one that says it
has been read (dS^T by both warpgroups). K_j and V_j (64 keys, loaded once) and a ring of 2 Q_i and dO_i
tiles stream as in bwd.py; shared memory holds about 226 KiB at both head dims.

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
    _dq_tile_offsets,
    _head_dim,
    _load_sections,
    _tma_reduce_add,
    _wgmma_layout,
)


@gluon.jit
def _wide_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES: gl.constexpr, DQ_ATOMIC: gl.constexpr):
    """The kernel's shared memory: K_j and V_j (one block, each a tuple of head-dim sections), the
    ring of STAGES Q_i and dO_i tiles and their L_i and D_i rows, the exchange's buffers (P^T in
    float32, register order, for dS^T, and in the inputs' dtype for dV's matmul, a pair; dS^T) and
    the dP warpgroup's float32 dQ tiles; then the mbarriers: kv_bar, q_bar, do_bar, empty_bar as
    in bwd.py, p_bar / ds_bar (the P^T pair / dS^T buffer is full), p_free / ds_free (read; dS^T
    by both warpgroups), dq_free (the dQ writer warp's reduce-adds
    have read the dQ tiles), done_bar (both warpgroups are past their last matmul on K).
    DQ_ATOMIC: no dQ tiles (dQ goes from registers, _wide_add_dq)."""
    dtype: gl.constexpr = q_desc[0].dtype
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    k_smem = _allocate_sections(k_desc, 1)
    v_smem = _allocate_sections(v_desc, 1)
    q_smem = _allocate_sections(q_desc, STAGES)
    do_smem = _allocate_sections(do_desc, STAGES)
    p_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], DQ_REGISTER_TILE),
              gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], q_desc[0].layout))
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], q_desc[0].layout)
    gl.static_assert(BLOCK_M * DQ_COLS == DQ_REGISTER_BOX[0] * DQ_REGISTER_BOX[1])
    if DQ_ATOMIC:
        dq_smem = ds_smem  # not read
    else:
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
    for i in gl.static_range(6):  # ds_free and done_bar: both consumer warpgroups arrive
        mbarrier.init(xbar.index(i), count=2 if i == 3 or i == 5 else 1)
    return (k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar,
            xbar.index(0), xbar.index(1), xbar.index(2), xbar.index(3), xbar.index(4), xbar.index(5))


@gluon.jit
def _wide_load_partition(args, CAUSAL: gl.constexpr):
    """One warp: K_j and V_j once (FA2 Alg. 2 line 6), then bwd.py's query steps (line 9's Q_i,
    dO_i with L_i, D_i)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
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
def _wide_s_step(args, ctx, step, dk, dv, DQAccum, DIAGONAL: gl.constexpr, DQ_BY_SECTION: gl.constexpr):
    """The S warpgroup's query step (lines 10-12 and 16 for Q_i, dO_i, P^T handed to the dP
    warpgroup and dS^T from it; DIAGONAL: the step's rows cross the block's diagonal, so P^T is
    masked; DQ_BY_SECTION: line 15 for the first section's dQ_i columns too, added into DQAccum
    from registers): returns dK_j, dV_j of the first head-dim section."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, offs_n, offs_m_base, s_init, dq_init = ctx
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
    # P^T to the dP warpgroup (which forms dS^T), once it has read the previous step's
    mbarrier.wait(p_free, (step & 1) ^ 1)  # a fresh mbarrier counts as having completed the phase before its first
    p_smem[0].store(p)
    p_smem[1].store(p.to(dtype))
    fence_async_shared()  # the second is read by a wgmma
    gl.thread_barrier()  # the whole warpgroup's stores, before one thread says so
    mbarrier.arrive(p_bar, count=1)
    p_op = gl.convert_layout(p.to(dtype), op_layout)
    # line 12 for the first section: dV_j += P^T dO_i, in flight while dS^T is awaited
    mbarrier.wait(do_bar.index(stage), phase)
    dv_tok = warpgroup_mma(p_op, do_buf[0], dv, is_async=True)
    # line 16 for the first section: dK_j += dS^T Q_i, dS^T from the dP warpgroup's shared memory
    mbarrier.wait(ds_bar, step & 1)
    dk_tok = warpgroup_mma(ds_smem, q_buf[0], dk, is_async=True)
    if DQ_BY_SECTION:
        # line 15 for the first section's columns
        ds_t = ds_smem.permute((1, 0))
        dv, dk, p_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op])
        dq0_tok = warpgroup_mma(ds_t, k_buf[0].slice(0, DQ_COLS, dim=1), dq_init, use_acc=False, is_async=True)
        dq1_tok = warpgroup_mma(ds_t, k_buf[0].slice(DQ_COLS, DQ_COLS, dim=1), dq_init, use_acc=False,
                                is_async=True)
        dq0, dq1 = warpgroup_mma_wait(0, deps=[dq0_tok, dq1_tok])
        mbarrier.arrive(ds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
        _wide_add_dq(args, DQAccum, step, (dq0, dq1), 0)
    else:
        dv, dk, p_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op])
        mbarrier.arrive(ds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
    return dk, dv


@gluon.jit
def _wide_s_partition(args, DQAccum, CAUSAL: gl.constexpr, DQ_BY_SECTION: gl.constexpr):
    """The S warpgroup (see the module's docstring): dK_j and dV_j's first head-dim section over
    every query step that sees the block, written once the dP warpgroup is past K (line 18)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
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
    if DQ_BY_SECTION:
        dq_init = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
    else:
        dq_init = s_init  # not read
    ctx = (k_buf, offs_n, offs_m_base, s_init, dq_init)
    mbarrier.wait(kv_bar, 0)
    for group in range(kv_group):
        if CAUSAL:  # a block as tall as a query step: each q head's first step crosses the diagonal
            dk, dv = _wide_s_step(args, ctx, group * n_steps, dk, dv, DQAccum, True, DQ_BY_SECTION)
            for i in range(1, n_steps):
                dk, dv = _wide_s_step(args, ctx, group * n_steps + i, dk, dv, DQAccum, False, DQ_BY_SECTION)
        else:
            for i in range(n_steps):
                dk, dv = _wide_s_step(args, ctx, group * n_steps + i, dk, dv, DQAccum, False, DQ_BY_SECTION)
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
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, v_buf, s_init, dq_init = ctx
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    stage = step % STAGES
    mbarrier.wait(do_bar.index(stage), (step // STAGES) & 1)
    return _chained_matmul(v_buf, _at(do_smem, stage), s_init)


@gluon.jit
def _wide_dp_step(args, ctx, step, dk, dv, DQAccum, DQ_FIRST: gl.constexpr, DQ_ATOMIC: gl.constexpr,
                  DQ_BY_SECTION: gl.constexpr):
    """The dP warpgroup's query step: line 13 (dP^T, `_wide_dp_issue`) and, with the S warpgroup's
    P^T, line 14 (dS^T, handed back through shared memory), then lines 12 and 16 for the second
    head-dim section (P^T and dS^T from shared memory) and 15 (every dQ_i column, or with
    DQ_BY_SECTION the second section's), in the order `_wide_dp_partition`'s DQ_FIRST says; dQ_i
    staged for the writer warp, or (DQ_ATOMIC) added into DQAccum from registers (`_wide_add_dq`).
    Returns dK_j, dV_j of the second section."""
    dp_tok = _wide_dp_issue(args, ctx, step)
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    k_buf, v_buf, s_init, dq_init = ctx
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    dtype: gl.constexpr = q_desc[0].dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    q_buf = _at(q_smem, stage)
    do_buf = _at(do_smem, stage)
    delta = delta_smem.index(stage).load(s_layout)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])  # the only matmul in flight
    # line 14: dS^T = P^T * (dP^T - D_i), with the S warpgroup's P^T (float32)
    mbarrier.wait(p_bar, step & 1)
    ds = (p_smem[0].load(s_layout) * (dp - delta)).to(dtype)
    # dS^T to the S warpgroup (line 16's first section) and to the dQ matmuls, once both warpgroups
    # have read the previous step's
    mbarrier.wait(ds_free, (step & 1) ^ 1)  # a fresh mbarrier counts as having completed the phase before its first
    ds_smem.store(ds)
    fence_async_shared()  # read by wgmmas
    gl.thread_barrier()
    mbarrier.arrive(ds_bar, count=1)
    # line 12 and 16 for the second section (P^T and dS^T from shared memory), line 15 (dQ_i = dS K_j,
    # 64 columns a tile)
    mbarrier.wait(q_bar.index(stage), phase)
    if not DQ_FIRST:
        dv_tok = warpgroup_mma(p_smem[1], do_buf[1], dv, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, q_buf[1], dk, is_async=True)
    ds_t = ds_smem.permute((1, 0))
    if DQ_BY_SECTION:  # the second section's columns (the S warpgroup adds the first's)
        dq_toks = (warpgroup_mma(ds_t, k_buf[1].slice(0, DQ_COLS, dim=1), dq_init, use_acc=False, is_async=True),
                   warpgroup_mma(ds_t, k_buf[1].slice(DQ_COLS, DQ_COLS, dim=1), dq_init, use_acc=False,
                                 is_async=True))
        FIRST_TILE: gl.constexpr = k_buf[0].type.shape[1] // DQ_COLS
    else:
        dq_toks = (warpgroup_mma(ds_t, k_buf[0].slice(0, DQ_COLS, dim=1), dq_init, use_acc=False, is_async=True),
                   warpgroup_mma(ds_t, k_buf[0].slice(DQ_COLS, DQ_COLS, dim=1), dq_init, use_acc=False,
                                 is_async=True),
                   warpgroup_mma(ds_t, k_buf[1], dq_init, use_acc=False, is_async=True))
        FIRST_TILE: gl.constexpr = 0
    if DQ_FIRST:
        # lines 12 and 16 after 15: dQ_i is staged for the writer warp (which reduce-adds it), or
        # added, while they run
        dv_tok = warpgroup_mma(p_smem[1], do_buf[1], dv, is_async=True)
        dk_tok = warpgroup_mma(ds_smem, q_buf[1], dk, is_async=True)
        # a commit group per wgmma, completed in order: the 2 left in flight are dV's and dK's
        dq = warpgroup_mma_wait(2, deps=dq_toks)
        _wide_write_dq(args, DQAccum, step, dq, FIRST_TILE, DQ_ATOMIC)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(p_free, count=1)  # both P^T buffers: the second's last reader is dV's matmul
        mbarrier.arrive(ds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
    else:
        done = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok) + dq_toks)
        dv = done[0]
        dk = done[1]
        dq = done[2:]
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(ds_free, count=1)
        mbarrier.arrive(empty_bar.index(stage), count=1)
        _wide_write_dq(args, DQAccum, step, dq, FIRST_TILE, DQ_ATOMIC)
    return dk, dv


@gluon.jit
def _wide_write_dq(args, DQAccum, step, dq, FIRST_TILE: gl.constexpr, DQ_ATOMIC: gl.constexpr):
    """dQ_i's tiles `dq` of query step `step` (64 x 64 each, unscaled; the step's tiles from
    FIRST_TILE on) to the float32 accumulator: added from registers (DQ_ATOMIC, `_wide_add_dq`), or
    staged for the writer warp (`_wide_stage_dq`, every tile of the step)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    if DQ_ATOMIC:
        _wide_add_dq(args, DQAccum, step, dq, FIRST_TILE)
    else:
        _wide_stage_dq(dq_smem, dq, dq_free, step)


@gluon.jit
def _wide_add_dq(args, DQAccum, step, dq, FIRST_TILE: gl.constexpr):
    """dQ_i's tiles `dq` of query step `step` (64 x 64 each, unscaled; tiles FIRST_TILE on of the
    step's row of tiles) added into the float32 accumulator DQAccum straight from registers, without
    shared memory or the writer warp: in the accumulator's register order (DQ_TILE_BASES) a thread's
    registers 4r to 4r + 3 lie side by side, so each run is one 16-byte `red.global.add.v4.f32` (FA3
    adds dQ so at head dim 256, float4 atomicAdd). The tiles are the writer's
    (_wide_dq_writer_partition): 4096 floats each, the step's 64-row block and q head's columns."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    BLOCK_M: gl.constexpr = dq[0].shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    TILES: gl.constexpr = HEAD_DIM // DQ_COLS
    layout: gl.constexpr = dq[0].type.layout
    m, q_col, _, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group, BLOCK_M, HEAD_DIM)
    tile = (row0 + m) // BLOCK_M * (num_heads * TILES) + q_col // DQ_COLS + FIRST_TILE
    row_offs, col_offs = _dq_tile_offsets(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)),
                                          gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, layout)))
    offs = row_offs[:, None] + col_offs[None, :]
    for i in gl.static_range(len(dq)):
        # addresses as integers, the values' bits as int32: the assembly's operands are all integers
        addrs = (DQAccum + (tile + i).to(gl.int64) * (BLOCK_M * DQ_COLS) + offs).to(gl.int64, bitcast=True)
        gl.inline_asm_elementwise(
            "red.global.add.v4.f32 [$4], {$8, $9, $10, $11};\n\t"
            "mov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\tmov.b32 $2, 0;\n\tmov.b32 $3, 0;",
            "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [addrs, dq[i].to(gl.int32, bitcast=True)], dtype=gl.int32,
            is_pure=False, pack=4)


@gluon.jit
def _wide_stage_dq(dq_smem, dq, dq_free, step):
    """The dP warpgroup's dQ_i tiles of query step `step` (all the step's 64 x 64, unscaled: bwd._bwd_stage_dq)
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
def _wide_dq_writer_partition(args, DQ_ATOMIC: gl.constexpr):
    """One warp, the dQ writer (bwd._bwd_dq_writer's role; idle with DQ_ATOMIC, where the
    warpgroups add dQ themselves): each query step's dQ_i tiles,
    once the dP warpgroup has staged them (_wide_stage_dq), added into the float32 accumulator
    (rows from row0 + m of the (batch x seqlen, heads x head dim) view, columns from the step's q
    head; bwd._bwd_dq_writer's layout, a tile per 64-row block and 64 columns) by one TMA
    reduce-add each, then released (dq_free) once the reduce-adds have read them."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
     softmax_scale, qk_scale, num_heads) = args
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    TILES: gl.constexpr = HEAD_DIM // DQ_COLS
    if not DQ_ATOMIC:
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
def _wide_dp_partition(args, DQAccum, CAUSAL: gl.constexpr, DQ_FIRST: gl.constexpr, DQ_ATOMIC: gl.constexpr,
                       DQ_BY_SECTION: gl.constexpr):
    """The dP warpgroup (see the module's docstring): dK_j and dV_j's second head-dim section and
    dQ (DQ_BY_SECTION: the second section's columns) over every query step that sees the block;
    the sections written once both warpgroups are past K (line 18). DQ_FIRST: each step's dQ_i
    matmuls (line 15) are issued before dV's and dK's (lines 12 and 16) and waited for alone, and
    dQ_i is staged for the writer warp, which reduce-adds it (DQ_ATOMIC: added from registers)
    while those two run (as FA3 and FA4 write dQ out under the matmuls after it); else all are
    waited for together and dQ_i follows."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
     p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar, ds_bar,
     p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen,
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
        dk, dv = _wide_dp_step(args, ctx, step, dk, dv, DQAccum, DQ_FIRST, DQ_ATOMIC, DQ_BY_SECTION)
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
                                       DQAccum, dropout_p, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                       DQ_FIRST: gl.constexpr, DQ_ATOMIC: gl.constexpr, DQ_BY_SECTION: gl.constexpr):
    """One program per (batch, kv head, 64-key block) owns dK_j and dV_j and adds dQ (FA2 Alg. 2;
    placed by flash_attn_hopper.bwd_grid and bwd._bwd_program): a loader warp, the S warpgroup,
    the dP warpgroup and a dQ writer warp (the module's docstring). The arguments are bwd.py's
    dense kernel's, the head dim two sections (HEAD_SPLIT) and dQ fused, but for DQAccum
    (dropout's seed in bwd.py's: the dQ accumulator's pointer, which DQ_ATOMIC's adds take); the
    feature arguments (window, softcap, ALiBi, dropout) and dq_tail_desc are not read: this kernel
    has none of the features. DQ_FIRST: the dP warpgroup's order (_wide_dp_partition); DQ_ATOMIC:
    dQ added from the warpgroups' registers (_wide_add_dq), the writer warp idle; DQ_BY_SECTION:
    each warpgroup computes dQ's columns of its own head-dim section (flash_attn_hopper.py chooses
    both by head dim: wide_bwd_constexprs)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc) = _bwd_descriptors(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc, k_tail_desc, v_tail_desc,
        do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc, True)
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    gl.static_assert(BLOCK_M == BLOCK_N, "the causal mask takes each q head's first step as the diagonal one")
    gl.static_assert(DQ_ATOMIC or not DQ_BY_SECTION, "the writer warp takes one warpgroup's staged dQ tiles")
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
    (k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar,
     ds_bar, p_free, ds_free, dq_free, done_bar) = _wide_shared_buffers(
        q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES, DQ_ATOMIC)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], LSE.layout)  # L_i and D_i per ring stage
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], Delta.layout)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, k_smem, v_smem, q_smem, do_smem,
            p_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, p_bar,
            ds_bar, p_free, ds_free, dq_free, done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0,
            seqlen, softmax_scale, qk_scale, num_heads)
    gl.warp_specialize([
        (_wide_s_partition, (args, DQAccum, CAUSAL, DQ_BY_SECTION)),
        (_wide_dp_partition, (args, DQAccum, CAUSAL, DQ_FIRST, DQ_ATOMIC, DQ_BY_SECTION)),
        (_wide_load_partition, (args, CAUSAL)),
        (_wide_dq_writer_partition, (args, DQ_ATOMIC)),
    ], [4, 1, 1], [240, 24, 24])
