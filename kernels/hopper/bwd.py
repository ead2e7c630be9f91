"""FA2's backward dK/dV kernel (Algorithm 2 lines 5-18, with line 15's dQ or without) on Hopper,
in Gluon with FlashAttention-3's layout, and the steps its variant over packed variable lengths
(bwd_varlen.py) shares with it.

A loader warp streams Q_i and dO_i tiles (with L_i and D_i, as FA3's producer brings them); two
consumer warpgroups own 64 keys each of a 128-key block and overlap the softmax with the next
matmul of the same query step. The kernel can add dQ too, as FA3 does: the consumers exchange
dS^T through shared memory and dQ_i = dS K_j over all 128 keys goes to the accumulator by TMA
reduce-adds of 64 x 64 tiles (and a 64 x 32 one at head dim 96), which a dQ writer warp issues as the
consumers hand the tiles over (FA3's and FA4's scheme) (5 matmuls instead of the Triton backward's 7;
with element-wise atomics instead it was 1.2-1.5x slower: docs/performance.md, "Gluon dK/dV with
dQ fused"). At 128 each consumer computes half of dQ_i's columns every step; at 64 and 96 the
consumers take turns, each computing every other step's whole dQ_i (_dq_in_turns). The dQ tiles go
to the accumulator in the consumers' register order (shared.DQ_TILE_BASES), which dq_cast.py puts
back in rows. Head dim 96 runs as two head-dim sections (64 + 32, shared._head_sections), as the
forward does: every tile, matmul and accumulator with a head-dim side is a tuple of them.

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

from ..features import _scores
from .dropout import _dropout_keep, _rng_args
from .shared import (
    DQ_REGISTER_BOX,
    DQ_REGISTER_TILE,
    DQ_TAIL_REGISTER_TILE,
    _allocate_sections,
    _at,
    _head_dim,
    _head_sections,
    _load_sections,
    _tma_reduce_add,
    _wgmma_layout,
    _zero_sections,
)

_DQ_TILE_COLS = 64
DQ_COLS: gl.constexpr = gl.constexpr(_DQ_TILE_COLS)  # the columns of a consumer's dQ tile (DQ_REGISTER_TILE's)
# named barriers 14 and 15: consumer 0's or 1's dQ tile is in shared memory for the writer warp
# (_dq_full; ids above those Triton's warp specialisation takes)
DQ_FULL_BARRIER: gl.constexpr = gl.constexpr(14)


@gluon.constexpr_function
def _dq_in_turns(head_dim):
    """Whether the fused dQ's consumers take turns by query step, each computing every other step's
    whole dQ_i (head dims 64 and 96: one tile, or a 64- and a 32-column one), rather than each
    computing its half of every step's columns (head dim 128)."""
    return head_dim != 2 * _DQ_TILE_COLS


@gluon.constexpr_function
def _dq_fuses(head_dim):
    """Whether the kernel can add dQ at this head dim: one or two 64-column tiles, or 64 + 32."""
    return head_dim in (_DQ_TILE_COLS, 2 * _DQ_TILE_COLS, _DQ_TILE_COLS + _DQ_TILE_COLS // 2)


@gluon.constexpr_function
def _dq_first_col(head_dim, half):
    """The first of dQ_i's columns a consumer computes (0 when it computes them all, in turns)."""
    return 0 if _dq_in_turns(head_dim) else half * _DQ_TILE_COLS


@gluon.jit
def _dq_tile_buffer(dq_smem, HALF: gl.constexpr):
    """This consumer's float32 dQ tiles (a tuple, one per dQ section: the [2, 64, 64] ring of
    dq_smem[0] and at head dim 96 the [2, 64, 32] one of dq_smem[1]) reinterpreted in register order
    (DQ_REGISTER_TILE, DQ_TAIL_REGISTER_TILE: the store writes each thread's registers side by side)."""
    buf = dq_smem[0].index(HALF)
    first = buf._reinterpret(gl.float32, [buf.shape[0], buf.shape[1]], DQ_REGISTER_TILE)
    if len(dq_smem) == 1:
        return (first,)
    else:
        tail = dq_smem[1].index(HALF)
        return (first, tail._reinterpret(gl.float32, [tail.shape[0], tail.shape[1]], DQ_TAIL_REGISTER_TILE))


@gluon.constexpr_function
def _ring_head_dim(ring):
    """The head dim of a ring of shared-memory tiles (a tuple of head-dim sections, [n, rows, width] each)."""
    return sum(int(gl._unwrap_if_constexpr(tiles.type.shape[2])) for tiles in ring)


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
def _bwd_descriptors(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc, k_tail_desc,
                     v_tail_desc, do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc, HEAD_SPLIT: gl.constexpr):
    """The dK/dV kernels' descriptors, each as its tuple of head-dim sections (shared._head_sections;
    dQ's: with HEAD_SPLIT, the 64 x 64 and 64 x 32 register-order tiles' boxes)."""
    return (_head_sections(q_desc, q_tail_desc, HEAD_SPLIT), _head_sections(k_desc, k_tail_desc, HEAD_SPLIT),
            _head_sections(v_desc, v_tail_desc, HEAD_SPLIT), _head_sections(do_desc, do_tail_desc, HEAD_SPLIT),
            _head_sections(dk_desc, dk_tail_desc, HEAD_SPLIT), _head_sections(dv_desc, dv_tail_desc, HEAD_SPLIT),
            _head_sections(dq_desc, dq_tail_desc, HEAD_SPLIT))


@gluon.jit
def _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr):
    """The dK/dV kernel's shared memory: K_j and V_j as two 64-key halves (loaded once: kv_bar), a
    ring of STAGES Q_i and dO_i tiles (q_bar, do_bar: a TMA load has landed; empty_bar: a stage is
    free) and, with FUSED_DQ, the dQ exchange's buffers and mbarriers (ds_smem, dq_smem, ds_bar,
    dq_free, done_bar; without it, stand-ins of the right kinds). Descriptors and tiles with a head-dim side
    are tuples of head-dim sections (shared._head_sections)."""
    dtype: gl.constexpr = q_desc[0].dtype
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    k_smem = _allocate_sections(k_desc, 2)
    v_smem = _allocate_sections(v_desc, 2)
    q_smem = _allocate_sections(q_desc, STAGES)
    do_smem = _allocate_sections(do_desc, STAGES)
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
        # each consumer's float32 dQ tiles for the writer warp's reduce-adds, in the consumer's
        # register order (reinterpreted by _dq_tile_buffer)
        ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, BLOCK_M], q_desc[0].layout)
        gl.static_assert(BLOCK_M * DQ_COLS == DQ_REGISTER_BOX[0] * DQ_REGISTER_BOX[1])
        gl.static_assert(_dq_fuses(HEAD_DIM))
        first = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_desc[0].layout)
        if len(dq_desc) == 1:
            dq_smem = (first,)
        else:
            dq_smem = (first, gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS // 2], dq_desc[1].layout))
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for parity in gl.static_range(2):
            mbarrier.init(ds_bar.index(parity), count=2)  # both consumers' dS^T are in place
            mbarrier.init(dq_free.index(parity), count=1)  # the dQ writer has read consumer `parity`'s tile
        mbarrier.init(done_bar, count=2)
    else:  # the fused path's buffers and barriers are not used: stand-ins of the right kinds
        ds_smem, dq_smem, ds_bar, dq_free, done_bar = q_smem[0], q_smem, q_bar, q_bar, kv_bar
    return (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar, dq_free,
            done_bar)


@gluon.jit
def _bwd_load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row0, start_n, col0):
    """FA2 Alg. 2 line 6: K_j and V_j from row kv_row0 + start_n as two 64-key halves, once, on kv_bar."""
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    if len(k_desc) == 1:
        mbarrier.expect(kv_bar, 2 * k_desc[0].block_type.nbytes + 2 * v_desc[0].block_type.nbytes)
    else:
        mbarrier.expect(kv_bar, 2 * (k_desc[0].block_type.nbytes + k_desc[1].block_type.nbytes
                                     + v_desc[0].block_type.nbytes + v_desc[1].block_type.nbytes))
    for half in gl.static_range(2):
        kv_row = kv_row0 + start_n + half * ROWS
        _load_sections(k_desc, kv_row, col0, kv_bar, _at(k_smem, half))
        _load_sections(v_desc, kv_row, col0, kv_bar, _at(v_smem, half))


@gluon.jit
def _bwd_load_tiles(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar,
                    q_row0, kv_row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_desc, delta_desc, lse_smem,
                    delta_smem, lse_row0):
    """FA2 Alg. 2 line 6 (K_j, V_j from row kv_row0 + start_n, as two 64-key halves, once) and line
    9's loads of Q_i and dO_i (rows from q_row0, _bwd_step_coords' steps), each query step into the
    ring stage both consumers have released. L_i and D_i (rows lse_row0.. of their (batch x heads,
    seqlen) views) travel with Q_i and dO_i, on the same mbarriers, as FlashAttention-3's producer
    brings them: the consumers read them from shared memory instead of waiting on global loads at
    every step (docs/performance.md, "The backward's step")."""
    _bwd_load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_row0, start_n, col0)
    _bwd_load_query_steps(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty_bar, q_row0, first_m, q_col0,
                          n_steps, kv_group, lse_desc, delta_desc, lse_smem, delta_smem, lse_row0)


@gluon.jit
def _bwd_load_query_steps(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty_bar, q_row0, first_m, q_col0,
                          n_steps, kv_group, lse_desc, delta_desc, lse_smem, delta_smem, lse_row0):
    """Line 9's loads of _bwd_load_tiles: Q_i with L_i on q_bar, dO_i with D_i on do_bar, each
    query step into the ring stage both consumers have released (empty_bar)."""
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    for step in range(n_steps * kv_group):
        stage = step % STAGES
        m, q_col, lse_row, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, 0, kv_group, BLOCK_M,
                                                HEAD_DIM)
        # a fresh mbarrier counts as having completed the phase before its first
        mbarrier.wait(empty_bar.index(stage), ((step // STAGES) & 1) ^ 1)
        _load_tile_and_stats(q_desc, q_row0 + m, q_col, _at(q_smem, stage), lse_desc, [lse_row, m],
                             lse_smem.index(stage), q_bar.index(stage))
        _load_tile_and_stats(do_desc, q_row0 + m, q_col, _at(do_smem, stage), delta_desc, [lse_row, m],
                             delta_smem.index(stage), do_bar.index(stage))


@gluon.jit
def _load_tile_and_stats(desc, row, col, tiles, stats_desc, stats_coord, stats_buf, bar):
    """One TMA load of a query step's tile (a tuple of head-dim sections, from (row, col) on) into
    `tiles` and of its [1, BLOCK_M] row of L or D into `stats_buf`, all completing `bar`'s phase."""
    if len(desc) == 1:
        mbarrier.expect(bar, desc[0].block_type.nbytes + stats_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, desc[0].block_type.nbytes + desc[1].block_type.nbytes + stats_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(stats_desc, stats_coord, bar, stats_buf)
    _load_sections(desc, row, col, bar, tiles)


@gluon.jit
def _chained_matmul(a, b, init):
    """sum over head-dim sections of a[s] b[s]^T (a, b: tuples of [rows, section] shared tiles),
    one asynchronous wgmma per section chained on the first, which overwrites `init`."""
    tok = warpgroup_mma(a[0], b[0].permute((1, 0)), init, use_acc=False, is_async=True)
    if len(a) == 2:
        tok = warpgroup_mma(a[1], b[1].permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init):
    """Line 10: S^T = K_j Q_i^T (unscaled) and line 13: dP^T = V_j dO_i^T, each issued once its
    tile has landed (one wgmma per head-dim section, chained); both left in flight."""
    mbarrier.wait(q_bar.index(stage), phase)
    s_tok = _chained_matmul(k_buf, q_buf, s_init)
    mbarrier.wait(do_bar.index(stage), phase)
    dp_tok = _chained_matmul(v_buf, do_buf, s_init)
    return s_tok, dp_tok


@gluon.jit
def _section_matmuls(a_op, b, acc):
    """acc[s] += a_op b[s] for each head-dim section s (b and acc: tuples), issued asynchronously,
    `a_op` a register-held A operand of the first section's accumulator layout: the tokens."""
    first = warpgroup_mma(a_op, b[0], acc[0], is_async=True)
    if len(acc) == 1:
        return (first,)
    else:
        tail_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc[1].type.layout, k_width=2)
        return (first, warpgroup_mma(gl.convert_layout(a_op, tail_layout), b[1], acc[1], is_async=True))


@gluon.jit
def _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv, drop=None):
    """Line 12: dV_j += P^T dO_i; line 14: dS^T = P^T * (dP^T - D_i), under the dV matmul (delta:
    D_i as a [1, BLOCK_M] row). With dropout, `drop` = (keep-mask, 1 / (1 - p)): p_op holds the
    kept P^T scaled, and dP^T (of the dropped P) is the kept entries' scaled, FA2's dropout
    backward. Returns the dV matmuls in flight and dS^T in the inputs' dtype."""
    dv_tok = _section_matmuls(p_op, do_buf, dv)
    dp = warpgroup_mma_wait(len(dv), deps=[dp_tok])
    if drop is not None:
        dp = gl.where(drop[0], dp * drop[1], 0.0)
    return dv_tok, (p * (dp - delta)).to(do_buf[0].dtype)


@gluon.jit
def _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout: gl.constexpr, drop=None):
    """_bwd_dv_ds (`drop` its), then line 16: dK_j += dS^T Q_i (the softmax scale is applied once at
    the end). Returns the dV and dK matmuls in flight, dS^T and its A operand."""
    dv_tok, ds = _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv, drop)
    ds_op = gl.convert_layout(ds, op_layout)
    dk_tok = _section_matmuls(ds_op, q_buf, dk)
    return dv_tok, dk_tok, ds, ds_op


@gluon.jit
def _bwd_wait_dkdv(dv_tok, dk_tok, p_op, ds_op):
    """The dV and dK matmuls waited for (all wgmmas in flight): dV_j, dK_j (tuples) and the operands."""
    if len(dv_tok) == 1:
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok[0], dk_tok[0], p_op, ds_op])
        return (dv,), (dk,), p_op, ds_op
    else:
        dv, dv_tail, dk, dk_tail, p_op, ds_op = warpgroup_mma_wait(
            0, deps=[dv_tok[0], dv_tok[1], dk_tok[0], dk_tok[1], p_op, ds_op])
        return (dv, dv_tail), (dk, dk_tail), p_op, ds_op


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
def _bwd_add_dq(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, tile, HALF: gl.constexpr):
    """Line 15 (FA3's scheme), once both consumers' dS^T are in place: dQ_i[:, this consumer's
    columns] = dS K_j[:, columns] over both halves' keys (all columns in turns, _dq_in_turns),
    handed to the dQ writer warp (_bwd_stage_dq; `tile` counts this consumer's earlier tiles)."""
    dq_tok = _bwd_issue_dq(ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF)
    dq = _bwd_wait_dq(0, dq_tok)
    _bwd_stage_dq(dq_buf, dq, dq_free, tile, HALF)


@gluon.jit
def _bwd_issue_dq(ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF: gl.constexpr):
    """Once both consumers' dS^T are in place, the matmuls dS K_j[:, this consumer's columns] over
    both halves' keys, one per dQ section (`dq_init`: their zero accumulators), in flight."""
    FIRST_COL: gl.constexpr = _dq_first_col(_ring_head_dim(k_smem), HALF)
    mbarrier.wait(ds_bar.index(parity), (step // 2) & 1)
    ds_first = ds_smem.index(2 * parity).permute((1, 0))
    ds_second = ds_smem.index(2 * parity + 1).permute((1, 0))
    dq_tok = warpgroup_mma(ds_first, k_smem[0].index(0).slice(FIRST_COL, DQ_COLS, dim=1), dq_init[0],
                           use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds_second, k_smem[0].index(1).slice(FIRST_COL, DQ_COLS, dim=1), dq_tok, is_async=True)
    if len(dq_init) == 1:
        return (dq_tok,)
    else:  # head dim 96, in turns: the 32-column section too
        tail_tok = warpgroup_mma(ds_first, k_smem[1].index(0), dq_init[1], use_acc=False, is_async=True)
        return (dq_tok, warpgroup_mma(ds_second, k_smem[1].index(1), tail_tok, is_async=True))


@gluon.jit
def _bwd_wait_dq(pendings: gl.constexpr, dq_tok):
    """The dQ matmuls waited for, leaving `pendings` later wgmma groups in flight: the tiles (a tuple)."""
    if len(dq_tok) == 1:
        return (warpgroup_mma_wait(pendings, deps=[dq_tok[0]]),)
    else:
        dq, dq_tail = warpgroup_mma_wait(pendings, deps=[dq_tok[0], dq_tok[1]])
        return (dq, dq_tail)


@gluon.jit
def _dq_full(half, ARRIVE: gl.constexpr, WARPS: gl.constexpr):
    """Named barrier DQ_FULL_BARRIER + half (FA3's and FA4's dQFull NamedBarrier, which Gluon does
    not wrap; PTX through inline assembly, one element a thread): consumer `half`'s 128 threads
    arrive (ARRIVE, bar.arrive: no wait) once their dQ tile is in shared memory, and the dQ writer
    warp's 32 wait there (bar.sync) for them; 160 threads complete a phase. WARPS: the caller's."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ids = gl.full([32 * WARPS], 0, gl.int32, layout=layout) + (DQ_FULL_BARRIER + half)
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 160;\n\tmov.b32 $0, $1;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 160;\n\tmov.b32 $0, $1;", "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _bwd_stage_dq(dq_buf, dq, dq_free, tile, HALF: gl.constexpr):
    """This consumer's dQ_i columns (`dq` and `dq_buf` tuples, one per dQ section; the consumer's
    `tile`-th), unscaled (the cast applies the softmax scale once: dq_cast.py, as FA3's and FA4's
    dQ postprocess do), into its shared-memory tile as its registers lie, each thread's in turn
    (DQ_REGISTER_TILE: no bank conflicts on the store), once the dQ writer warp has read the
    previous one (dq_free); then every thread arrives at the tile's named barrier and goes on
    without waiting (_dq_full), and the writer adds the tile into the accumulator
    (_bwd_dq_writer). FA3's and FA4's consumers hand dQ over so; issuing the reduce-add
    themselves, ours synchronised the warpgroup (bar.sync) on every tile."""
    mbarrier.wait(dq_free.index(HALF), (tile & 1) ^ 1)  # a fresh mbarrier's previous phase counts as done
    for section in gl.static_range(len(dq)):
        dq_buf[section].store(dq[section])
    fence_async_shared()
    _dq_full(HALF, True, 4)


@gluon.jit
def _bwd_dq_writer(dq_desc, dq_smem, dq_free, q_row0, first_m, q_col0, n_steps, kv_group, num_heads,
                   HEAD_DIM: gl.constexpr):
    """The dQ writer warp (FA3's and FA4's, on their producer warpgroup's second warp): each
    step's dQ tiles, as the consumers hand them over (_bwd_stage_dq: both consumers' column
    halves at head dim 128, else the tile of the consumer whose turn the step is), added into the
    float32 accumulator behind dq_desc (rows from q_row0, _bwd_step_coords' steps) by one TMA
    reduce-add a section, each released (dq_free) once the reduce-add has read it. The
    accumulator holds, per 64-row block of the (batch x seqlen, heads x head dim) view, its
    columns as 64-row, 32-column register-order tiles in the view's order (a 64-column tile is two
    of them: its highest offset bit is column 32), so the tile of columns c.. starts at float
    64 * (block * columns + c) (dq_cast.dq_from_accumulator puts them back; the varlen kernel's
    q_row0 is its sequence's padded row: dq_cast.varlen_dq_accumulator)."""
    BLOCK_M: gl.constexpr = dq_smem[0].type.shape[1]
    # the tile's first row in the boxes' view (rows of DQ_REGISTER_BOX[1] floats), counting tiles of
    # UNIT columns: 64 where the head dim is one section, 32 at 96 (heads start at multiples of 96)
    UNIT: gl.constexpr = DQ_COLS if len(dq_smem) == 1 else DQ_COLS // 2
    BOX_ROWS: gl.constexpr = BLOCK_M * UNIT // DQ_REGISTER_BOX[1]  # box rows a 64 x UNIT tile spans
    for step in range(n_steps * kv_group):
        m, q_col, _, _ = _bwd_step_coords(step, n_steps, first_m, q_col0, 0, 0, kv_group, BLOCK_M, HEAD_DIM)
        block_tile = (q_row0 + m) // BLOCK_M * (num_heads * (HEAD_DIM // UNIT)) + q_col // UNIT
        if _dq_in_turns(HEAD_DIM):
            _bwd_write_dq_tile(dq_desc, dq_smem, dq_free, step % 2, block_tile * BOX_ROWS, BOX_ROWS, UNIT)
        else:
            for half in gl.static_range(2):
                first = (block_tile + half * DQ_COLS // UNIT) * BOX_ROWS
                _bwd_write_dq_tile(dq_desc, dq_smem, dq_free, half, first, BOX_ROWS, UNIT)
    tma.store_wait(pendings=0)


@gluon.jit
def _bwd_write_dq_tile(dq_desc, dq_smem, dq_free, half, first_row, BOX_ROWS: gl.constexpr, UNIT: gl.constexpr):
    """_bwd_dq_writer's one tile: once consumer `half` has staged it (_dq_full), one TMA reduce-add
    a dQ section from box row `first_row` on, and the buffer released once they have read it."""
    _dq_full(half, False, 1)
    _tma_reduce_add(dq_desc[0], [first_row, 0], _register_box(dq_smem[0].index(half), dq_desc[0]))
    if len(dq_smem) == 2:
        _tma_reduce_add(dq_desc[1], [first_row + DQ_COLS // UNIT * BOX_ROWS, 0],
                        _register_box(dq_smem[1].index(half), dq_desc[1]))
    tma.store_wait(pendings=0)
    mbarrier.arrive(dq_free.index(half), count=1)


@gluon.jit
def _register_box(buf, desc):
    """A register-order dQ tile `buf` as the TMA box of `desc` (the same floats, row-major)."""
    ROWS: gl.constexpr = desc.block_type.shape[0]
    COLS: gl.constexpr = desc.block_type.shape[1]
    return buf._reinterpret(gl.float32, [ROWS, COLS], desc.layout)


@gluon.jit
def _bwd_load_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                        FUSED_DQ: gl.constexpr, DQ_FIRST: gl.constexpr, HALF: gl.constexpr):
    """One warp: _bwd_load_tiles for the program's key block and the query steps that see it."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, row0,
     start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2,
     window_left, window_right, full_lo, full_hi, num_heads, rng) = args
    _bwd_load_tiles(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar,
                    row0, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, LSE, Delta, lse_smem, delta_smem,
                    lse_row0)


@gluon.jit
def _bwd_dq_writer_partition(args):
    """One warp: _bwd_dq_writer for the program's key block and the query steps that see it."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, row0,
     start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2,
     window_left, window_right, full_lo, full_hi, num_heads, rng) = args
    _bwd_dq_writer(dq_desc, dq_smem, dq_free, row0, first_m, q_col0, n_steps, kv_group, num_heads, _head_dim(q_desc))


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
def _bwd_dkdv_step(args, ctx, step, dk, dv, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                   ALIBI: gl.constexpr, FUSED_DQ: gl.constexpr, DQ_FIRST: gl.constexpr, HALF: gl.constexpr,
                   DIAGONAL: gl.constexpr, DROPOUT: gl.constexpr):
    """One query step of _bwd_dkdv_partition's loop (FA2 Alg. 2 lines 8-16 for Q_i, dO_i): `ctx` the
    partition's per-program values, the constexprs its own. DIAGONAL (causal without a window):
    the step's rows cross the key block's diagonal, so P^T is masked. L_i and D_i come from the
    stage's shared memory (the loader's, with Q_i and dO_i); D_i is read once P^T is made, so its
    registers are not held through the softmax. DROPOUT: the forward's keep-mask redrawn
    (hopper/dropout.py) for the step's q head (`_bwd_dv_ds`). Returns dK_j and dV_j (tuples of
    head-dim sections)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, row0,
     start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2,
     window_left, window_right, full_lo, full_hi, num_heads, rng) = args
    k_buf, v_buf, offs_n, offs_m_base, s_init, dq_init, dq_buf = ctx
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    STAGES: gl.constexpr = q_smem[0].type.shape[0]
    MODS: gl.constexpr = WINDOW | SOFTCAP | ALIBI
    dtype: gl.constexpr = q_desc[0].dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk[0].type.layout, k_width=2)
    stage = step % STAGES
    phase = (step // STAGES) & 1
    m, q_col, bh, group = _bwd_step_coords(step, n_steps, first_m, q_col0, lse_row0, seqlen, kv_group, BLOCK_M,
                                           HEAD_DIM)
    offs_m = m + offs_m_base
    q_buf = _at(q_smem, stage)
    do_buf = _at(do_smem, stage)
    # line 10: S^T = K_j Q_i^T (unscaled); line 13: dP^T = V_j dO_i^T; both in flight
    s_tok, dp_tok = _bwd_score_matmuls(k_buf, v_buf, q_buf, do_buf, q_bar, do_bar, stage, phase, s_init)
    # L_i (natural log -> log2) as a [1, BLOCK_M] row of the transposed tiles, landed with Q_i (the
    # score matmuls waited for it)
    lse = lse_smem.index(stage).load(s_layout) * 1.4426950408889634
    # line 11: P^T = exp(S^T - L) in the log2 domain, under the dP^T matmul
    s = warpgroup_mma_wait(len(k_buf), deps=[s_tok])
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
    elif CAUSAL and DIAGONAL:  # a query step that crosses the diagonal of this block
        p = gl.where(offs_n[:, None] <= offs_m[None, :], p, 0.0)
    if DROPOUT:  # the kept entries of P^T, scaled, for dV; dP^T's in _bwd_dv_ds (keys are the rows here)
        seed, rng_offset, _, dropout_p = rng
        keep = _dropout_keep(seed, rng_offset, bh, offs_m[None, :], offs_n[:, None], dropout_p)
        drop = (keep, 1.0 / (1.0 - dropout_p))
        p_op = gl.convert_layout(gl.where(keep, p * drop[1], 0.0).to(dtype), op_layout)
    else:
        drop = None
        p_op = gl.convert_layout(p.to(dtype), op_layout)
    if SOFTCAP:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2 joins P^T now: t is not kept for dS
        p = p * (1.0 - t * t)
    delta = delta_smem.index(stage).load(s_layout)  # D_i once P^T is made
    if FUSED_DQ and DQ_FIRST:
        gl.static_assert(not _dq_in_turns(HEAD_DIM), "in turns, dQ's matmul goes after dK's")
        # lines 12 and 14 as below, dS^T to the other consumer before its A operand is made
        dv_tok, ds = _bwd_dv_ds(p, p_op, dp_tok, delta, do_buf, dv, drop)
        parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
        ds_op = gl.convert_layout(ds, op_layout)
        # line 15 (this consumer's columns of dQ_i), then line 16: dK_j += dS^T Q_i; dQ is
        # staged for the writer warp while the dK matmul runs
        dq_tok = _bwd_issue_dq(ds_smem, k_smem, ds_bar, dq_init, parity, step, HALF)
        dk_tok = _section_matmuls(ds_op, q_buf, dk)
        dq = _bwd_wait_dq(len(dk), dq_tok)  # dV's and dQ's matmuls have finished
        _bwd_stage_dq(dq_buf, dq, dq_free, step, HALF)
        dv, dk, p_op, ds_op = _bwd_wait_dkdv(dv_tok, dk_tok, p_op, ds_op)
        mbarrier.arrive(empty_bar.index(stage), count=1)  # this warpgroup is done with Q_i, dO_i
    else:
        # line 12: dV_j += P^T dO_i; line 14: dS^T under the dV matmul; line 16: dK_j += dS^T Q_i
        dv_tok, dk_tok, ds, ds_op = _bwd_dv_ds_dk(p, p_op, dp_tok, delta, q_buf, do_buf, dv, dk, op_layout, drop)
        if FUSED_DQ:  # dS^T to the other consumer: line 15 needs both halves' keys
            parity = _bwd_share_ds(ds_smem, ds_bar, ds, step, HALF)
        dv, dk, p_op, ds_op = _bwd_wait_dkdv(dv_tok, dk_tok, p_op, ds_op)
        mbarrier.arrive(empty_bar.index(stage), count=1)  # this warpgroup is done with Q_i, dO_i
        if FUSED_DQ:  # line 15: this consumer's columns of dQ_i
            _bwd_add_dq_in_its_turn(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, HALF)
    return dk, dv


@gluon.jit
def _bwd_add_dq_in_its_turn(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, HALF: gl.constexpr):
    """_bwd_add_dq at every step, or in turns (_dq_in_turns) at the steps of this consumer's parity.
    The other consumer may then run a step ahead, but not two: it writes a step's dS^T buffer again
    only after it has waited for this consumer's dS^T of the step between, which this consumer
    shares after its dQ matmul has read the buffer."""
    if _dq_in_turns(_ring_head_dim(k_smem)):
        if step % 2 == HALF:
            _bwd_add_dq(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, step // 2, HALF)
    else:
        _bwd_add_dq(ds_smem, k_smem, ds_bar, dq_buf, dq_free, dq_init, parity, step, step, HALF)


@gluon.jit
def _bwd_dkdv_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                        FUSED_DQ: gl.constexpr, DQ_FIRST: gl.constexpr, HALF: gl.constexpr, DROPOUT: gl.constexpr):
    """One consumer warpgroup: FA2 Alg. 2 lines 7-18 for keys [HALF * 64, HALF * 64 + 64) of the
    block, key-major (the matmuls of lines 10-14 and 16 have these keys as M; K_j and V_j are
    shared-memory operands). Per query step the softmax of S^T runs under the dP^T matmul and dS^T under the dV
    matmul. With GQA/MQA the steps run over every q head of the kv head's group, so dK_j and dV_j
    sum over them in registers.
    FUSED_DQ (line 15, FA3's scheme): both consumers put dS^T in shared memory and wait for each
    other (mbarrier ds_bar); each then computes columns [HALF * 64, HALF * 64 + 64) of
    dQ_i = dS K_j over all 128 keys (head dims 64 and 96: all of them at the steps of parity HALF)
    and hands them to the dQ writer warp, which adds them into the float32 accumulator behind
    dq_desc with TMA reduce-adds (the sum's order varies between runs).
    DQ_FIRST (FA3's order): the dQ matmul is issued before dK's, and dQ is staged for the writer
    while the dK matmul runs; else after dK and dV have finished.
    WINDOW, SOFTCAP, ALIBI: the forward's score modifications (_scores_log2, recomputed here on the
    transposed tile; the softcap's derivative 1 - tanh^2 scales dS), the window's query steps
    outside [full_lo, full_hi] masked. DROPOUT: the forward's dropout (_bwd_dkdv_step)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem, do_smem,
     ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free, done_bar, row0,
     start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale, qk_scale, softcap_log2,
     window_left, window_right, full_lo, full_hi, num_heads, rng) = args
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_buf = _at(k_smem, HALF)
    v_buf = _at(v_smem, HALF)

    kv_row = row0 + start_n + HALF * ROWS  # this half's first key row in the descriptors
    offs_n = start_n + HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    offs_m_base = gl.arange(0, BLOCK_M, layout=col_layout)
    # line 7: dK_j = dV_j = 0
    dk = _zero_sections(ROWS, k_smem)
    dv = _zero_sections(ROWS, k_smem)
    s_init = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    if FUSED_DQ:
        dq_init = _zero_sections(BLOCK_M, dq_smem)  # one per dQ section
        dq_buf = _dq_tile_buffer(dq_smem, HALF)
    else:  # stand-ins of the right kind (unused)
        dq_init, dq_buf = (s_init,), k_buf
    mbarrier.wait(kv_bar, 0)
    ctx = (k_buf, v_buf, offs_n, offs_m_base, s_init, dq_init, dq_buf)
    if CAUSAL and not WINDOW:
        # each q head's first 2 * ROWS query rows cross the block's diagonal (n_steps >= 2 here): they
        # run in a loop of their own, and the other steps' code has no mask
        DIAGONAL_STEPS: gl.constexpr = 2 * ROWS // BLOCK_M
        for group in range(kv_group):
            for i in range(DIAGONAL_STEPS):
                dk, dv = _bwd_dkdv_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        FUSED_DQ, DQ_FIRST, HALF, True, DROPOUT)
            for i in range(DIAGONAL_STEPS, n_steps):
                dk, dv = _bwd_dkdv_step(args, ctx, group * n_steps + i, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI,
                                        FUSED_DQ, DQ_FIRST, HALF, False, DROPOUT)
    else:
        for step in range(n_steps * kv_group):
            dk, dv = _bwd_dkdv_step(args, ctx, step, dk, dv, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST,
                                    HALF, False, DROPOUT)

    if FUSED_DQ:  # the other consumer's last dQ matmul reads this half of K: wait for it
        mbarrier.arrive(done_bar, count=1)
        mbarrier.wait(done_bar, 0)
    # line 18: write dK_j, dV_j, staged through this half's K and V buffers
    for section in gl.static_range(len(dk)):
        k_buf[section].store((dk[section] * softmax_scale).to(k_buf[section].dtype))
        v_buf[section].store(dv[section].to(v_buf[section].dtype))
    fence_async_shared()
    for section in gl.static_range(len(dk)):
        col = col0 + section * dk_desc[0].block_type.shape[1]
        tma.async_copy_shared_to_global(dk_desc[section], [kv_row, col], k_buf[section])
        tma.async_copy_shared_to_global(dv_desc[section], [kv_row, col], v_buf[section])
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
def _flash_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc,
                                  k_tail_desc, v_tail_desc, do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc,
                                  LSE, Delta, num_heads, seqlen, softmax_scale, qk_scale, kv_group, window_left,
                                  window_right, softcap_log2, Alibi, stride_alibi_b, RngSeed, dropout_p,
                                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr,
                                  DQ_FIRST: gl.constexpr, WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
                                  ALIBI: gl.constexpr = False, HEAD_SPLIT: gl.constexpr = False,
                                  DROPOUT: gl.constexpr = False):
    """One program per (batch, kv head, key block) owns dK_j and dV_j (FA2 Alg. 2, Section 3.2's
    parallelism over key blocks; placed by flash_attn_hopper.bwd_grid and _bwd_program), partitioned as
    FA3's backward: a loader warp and two consumer warpgroups of 64 keys each that share every Q_i and
    dO_i tile, and with FUSED_DQ a dQ writer warp (_bwd_dq_writer). The descriptors view (batch * seqlen,
    heads * head dim); num_heads counts q heads, kv_group of them share a kv head. Without FUSED_DQ,
    dq_desc is unused and dQ is the dQ kernel's (backward._flash_bwd_dq_kernel); with it, dq_desc is a
    float32 accumulator's with [16, 256] boxes, each a 64 x 64 tile in register order (_bwd_dq_writer).
    WINDOW, SOFTCAP, ALIBI: as the forward's (with FUSED_DQ only: the dQ kernel has none of them). LSE and
    Delta: descriptors of their (batch x heads, seqlen) float32 views, [1, BLOCK_M] tiles; DQ_FIRST:
    _bwd_dkdv_partition's. HEAD_SPLIT (head dim 96): the head dim is two sections, the *_tail_desc
    descriptors' 32 columns after the others' 64 (with dQ fused, dQ's with [8, 256] boxes, 64 x 32 tiles);
    without it the tail arguments are not read."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc) = _bwd_descriptors(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, q_tail_desc, k_tail_desc, v_tail_desc,
        do_tail_desc, dk_tail_desc, dv_tail_desc, dq_tail_desc, HEAD_SPLIT)
    BLOCK_M: gl.constexpr = q_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = k_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
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

    (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, empty_bar, ds_smem, dq_smem, ds_bar, dq_free,
     done_bar) = _bwd_shared_buffers(q_desc, k_desc, v_desc, do_desc, dq_desc, STAGES, FUSED_DQ)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], LSE.layout)  # L_i and D_i per ring stage
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], Delta.layout)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, Delta, Alibi, q_smem, k_smem, v_smem,
            do_smem, ds_smem, dq_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, empty_bar, ds_bar, dq_free,
            done_bar, row0, start_n, first_m, col0, q_col0, n_steps, kv_group, lse_row0, seqlen, softmax_scale,
            qk_scale, softcap_log2, window_left, window_right, full_lo, full_hi, num_heads,
            _rng_args(RngSeed, 0, dropout_p, DROPOUT))
    # The run-time values travel as one tuple, the constexprs beside it in tuples written in the
    # call (a tuple assigned to a name holds run-time values: the flags would be, and with the
    # fused branch left in the non-fused kernel Triton 3.6's lowering fails, an assertion in
    # ConvertTritonGPUToLLVM). The two consumers are one function, HALF apart; with FUSED_DQ a
    # warp of its own writes dQ (_bwd_dq_writer_partition).
    if FUSED_DQ:
        gl.warp_specialize([
            (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 0, DROPOUT)),
            (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 1, DROPOUT)),
            (_bwd_load_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 0)),
            (_bwd_dq_writer_partition, (args,)),
        ], [4, 1, 1], [240, 24, 24])
    else:
        gl.warp_specialize([
            (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 0, DROPOUT)),
            (_bwd_dkdv_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 1, DROPOUT)),
            (_bwd_load_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, FUSED_DQ, DQ_FIRST, 0)),
        ], [4, 1], [240, 24])
