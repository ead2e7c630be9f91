"""FA2's forward (Algorithm 1) over packed variable lengths (flash_attn_varlen_func) on Hopper, in
Gluon: fwd.py's warp layout, loads, matmuls and softmax steps, with each sequence's rows and keys
found from cu_seqlens, the keys past a sequence's end and (causal, bottom-right aligned) past a
row's diagonal masked from the first block that needs it, and the rows of a query tile past the
sequence's end left unwritten. Dense calls off the dense kernel's grid run it too, each batch row
a packed sequence (dispatch.GluonPath.PACKED).

The host side is kernels/flash_attn_hopper.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .fwd import (
    _fwd_block_matmuls,
    _fwd_blocks,
    _fwd_first_block,
    _fwd_last_block,
    _fwd_rescale,
    _fwd_shared_buffers,
    _held_p,
    _load_q_kv,
    _online_softmax,
    _pin_softmax,
    _store_output,
    _turn_barriers,
)
from .fwd_tiles import _fwd_program, _q_slot, _round_tile, _rounds
from .shared import _at, _descriptor_sections, _head_dim, _wgmma_layout


@gluon.jit
def _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, mask_from, seqlen_k, shift,
                         BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """_softmax_step for one sequence of a packed batch: from block `mask_from` on, keys past the
    sequence's end (and, causal, keys past the row's diagonal, bottom-right aligned: key j is
    visible to query row i when j <= i + shift, shift = seqlen_k - seqlen_q) are masked. A row
    may see no key of a block (or none at all)."""
    if block >= mask_from:
        cols = block * BLOCK_N + offs_n
        visible = cols[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + shift)
        s = gl.where(visible, s, float("-inf"))
    return _online_softmax(s, m_i, l_i, qk_scale, True)


@gluon.jit
def _varlen_tile(tile, num_m, num_heads, CuSeqQ, CuSeqK, kv_group, stride_lse_h, stride_lse_b, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, GROUP_SHIFT: gl.constexpr):
    """What a tile (query block, sequence x head) covers (fwd_tiles.py `_fwd_program` over num_m blocks a row),
    which the loader and every consumer work out alike: (its first query row in the sequence, the
    sequence's query and key lengths, shift = seqlen_k - seqlen_q (causal is bottom-right aligned),
    its key blocks (at least one: a tile whose rows see no key runs one fully masked block), the
    first block with a mask (the sequence's partial last block, or causal, the one holding the first
    row's diagonal), its rows in Q's and K's packed views, Q's and K's first columns and its
    logsumexp's first row). A tile from the sequence's last query block on has no rows: start_m >= seqlen_q."""
    pid_m, _, b, h = _fwd_program(tile, num_m, num_heads, CAUSAL, GROUP_SHIFT)
    q_start = gl.load(CuSeqQ + b)
    seqlen_q = gl.load(CuSeqQ + b + 1) - q_start
    kv_row0 = gl.load(CuSeqK + b)
    seqlen_k = gl.load(CuSeqK + b + 1) - kv_row0
    start_m = pid_m * BLOCK_M
    shift = seqlen_k - seqlen_q
    keys = seqlen_k
    if CAUSAL:  # the keys the block's last row sees (bottom-right), at most the sequence's
        keys = gl.minimum(gl.maximum(start_m + BLOCK_M + shift, 0), seqlen_k)
    n_blocks = gl.maximum((keys + BLOCK_N - 1) // BLOCK_N, 1)  # one masked block if no key is seen
    mask_from = seqlen_k // BLOCK_N  # the sequence's partial last block
    if CAUSAL:  # from the block holding the first row's diagonal
        mask_from = gl.minimum(mask_from, gl.maximum(start_m + shift, 0) // BLOCK_N)
    lse_row0 = h.to(gl.int64) * stride_lse_h + b.to(gl.int64) * stride_lse_b + q_start
    return (start_m, seqlen_q, seqlen_k, shift, n_blocks, mask_from, q_start + start_m, kv_row0, h * HEAD_DIM,
            (h // kv_group) * HEAD_DIM, lse_row0)


@gluon.jit
def _varlen_load_partition(args, CAUSAL: gl.constexpr, GROUP_SHIFT: gl.constexpr, Q_BUFFERS: gl.constexpr,
                           PERSISTENT: gl.constexpr):
    """_load_partition over the program's tiles of the packed (total, heads * head dim) views."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free, CuSeqQ,
     CuSeqK, num_tiles, num_m, num_heads, stride_lse_h, stride_lse_b, stride_o, qk_scale, kv_group, turn_bar) = args
    BLOCK_M: gl.constexpr = q_smem[0].type.shape[0] // Q_BUFFERS * q_desc[0].block_type.shape[0]
    it = 0
    local = 0
    rounds_end, rounds_step = _rounds(num_tiles, PERSISTENT)
    for first in range(0, rounds_end, rounds_step):  # a round of tiles, one a program
        tile = _round_tile(first)
        if tile < num_tiles:
            (start_m, seqlen_q, seqlen_k, shift, n_blocks, mask_from, q_row, kv_row0, col0, kv_col0,
             lse_row0) = _varlen_tile(tile, num_m, num_heads, CuSeqQ, CuSeqK, kv_group, stride_lse_h, stride_lse_b,
                                      _head_dim(q_desc), BLOCK_M, k_desc[0].block_type.shape[0], CAUSAL, GROUP_SHIFT)
            if start_m < seqlen_q:
                _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free, q_row,
                           col0, kv_row0, kv_col0, 0, n_blocks, it, local, Q_BUFFERS)
                it += n_blocks
                local += 1


@gluon.jit
def _varlen_softmax_partition(args, CAUSAL: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr,
                              PIN_SOFTMAX: gl.constexpr, Q_IN_REGS: gl.constexpr, GROUP_SHIFT: gl.constexpr,
                              Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr):
    """_softmax_partition for the program's tiles of a packed batch: rows [start_m + PART * 64, + 64)
    of the tile's sequence, over its n_blocks key blocks (a tile whose rows see no key runs one fully
    masked block and writes zeros with logsumexp +inf, as the reference does). The rows of a query
    tile past the sequence's end are the next sequence's: their results are not written (a masked
    store where the tile crosses the end, TMA where it does not)."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free, CuSeqQ,
     CuSeqK, num_tiles, num_m, num_heads, stride_lse_h, stride_lse_b, stride_o, qk_scale, kv_group, turn_bar) = args
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = q_desc[0].block_type.shape[0]
    CONSUMERS: gl.constexpr = q_smem[0].type.shape[0] // Q_BUFFERS
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    EARLY_P: gl.constexpr = CONSUMERS == 3  # (_held_p)
    it = 0
    local = 0
    rounds_end, rounds_step = _rounds(num_tiles, PERSISTENT)
    for first in range(0, rounds_end, rounds_step):  # a round of tiles, one a program
        tile = _round_tile(first)
        if tile < num_tiles:
            (start_m, seqlen_q, seqlen_k, shift, n_blocks, mask_from, q_row, kv_row0, col0, kv_col0,
             lse_row0) = _varlen_tile(tile, num_m, num_heads, CuSeqQ, CuSeqK, kv_group, stride_lse_h, stride_lse_b,
                                      _head_dim(q_desc), CONSUMERS * ROWS, BLOCK_N, CAUSAL, GROUP_SHIFT)
            if start_m < seqlen_q:
                slot, q_phase = _q_slot(local, Q_BUFFERS)
                buffer = slot * CONSUMERS + PART
                q_buf = _at(q_smem, buffer)
                first_row = start_m + PART * ROWS  # this part's first query row in its sequence
                offs_m = first_row + gl.arange(0, ROWS, layout=row_layout)
                m_i, l_i, acc, s_init, s, q_op = _fwd_first_block(q_buf, q_bar.index(buffer), q_phase, k_smem, k_bar,
                                                                  empty_bar, turn_bar, it, s_layout, PART, PINGPONG, None,
                                                                  Q_IN_REGS)
                p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, mask_from, seqlen_k,
                                                          shift, BLOCK_N, CAUSAL)
                p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
                if EARLY_P:  # three consumers: one loop, the mask behind a run-time branch (fwd._fwd_blocks)
                    for i in range(1, n_blocks):
                        s, acc_tok, p_op, prev = _fwd_block_matmuls(it + i, q_op, k_smem, v_smem, k_bar, v_bar,
                                                                    empty_bar, turn_bar, p, acc, s_init, PART, PINGPONG)
                        p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, i, mask_from,
                                                                  seqlen_k, shift, BLOCK_N, CAUSAL)
                        l_i = _pin_softmax(l_i, PIN_SOFTMAX)
                        acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar)
                        p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
                else:  # the blocks every row sees whole, then the masked ones (rows may be empty only when
                    # mask_from is 0, and then the first loop is empty)
                    unmasked_end = gl.maximum(gl.minimum(mask_from, n_blocks), 1)
                    mask = (offs_m, offs_n, seqlen_k, shift)
                    p, acc, m_i, l_i = _fwd_blocks(1, unmasked_end, it, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar,
                                                   turn_bar, p, acc, s_init, m_i, l_i, qk_scale, mask, PART, PINGPONG,
                                                   PIN_SOFTMAX, False, False)
                    p, acc, m_i, l_i = _fwd_blocks(unmasked_end, n_blocks, it, q_op, k_smem, v_smem, k_bar, v_bar,
                                                   empty_bar, turn_bar, p, acc, s_init, m_i, l_i, qk_scale, mask, PART,
                                                   PINGPONG, PIN_SOFTMAX, True, CAUSAL)
                acc = _fwd_last_block(it + n_blocks, p, acc, v_smem, v_bar, empty_bar)

                # lines 12-15; a row that saw no key: O = 0, L = +inf
                empty = l_i == 0.0
                l_safe = gl.where(empty, 1.0, l_i)
                lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
                gl.store(LSE + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)
                if first_row + ROWS <= seqlen_q:  # the whole part is this sequence's: one TMA store a section
                    _store_output(acc, l_safe, q_buf, o_desc, q_row + PART * ROWS, col0)
                else:  # the tile crosses the sequence's end: the rows past it belong to the next sequence
                    _store_rows_within(acc[0], l_safe, Out, q_row - start_m, first_row, seqlen_q, stride_o, col0)
                    if len(acc) == 2:
                        _store_rows_within(acc[1], l_safe, Out, q_row - start_m, first_row, seqlen_q, stride_o,
                                           col0 + acc[0].type.shape[1])
                mbarrier.arrive(q_free.index(buffer), count=1)
                it += n_blocks
                local += 1


@gluon.jit
def _store_rows_within(acc, l_i, Out, seq_row0, first_row, seqlen_q, stride_o, col):
    """O = diag(l)^-1 O of one head-dim section, stored by pointers from column `col` on, only the
    rows before the sequence's end (its query row `first_row` on; the sequence's first row is
    row `seq_row0` of Out)."""
    o_layout: gl.constexpr = acc.type.layout
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = first_row + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (seq_row0 + o_rows).to(gl.int64)[:, None] * stride_o + (col + o_cols)[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(o_rows < seqlen_q)[:, None])


@gluon.jit
def _flash_fwd_hopper_varlen_kernel(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc,
                                    Out, LSE, CuSeqQ, CuSeqK, num_heads, num_rows, num_m, stride_lse_h, stride_lse_b,
                                    stride_o, qk_scale, kv_group, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                                    CAUSAL: gl.constexpr, HEAD_SPLIT: gl.constexpr = False,
                                    CONSUMERS: gl.constexpr = 2, PINGPONG: gl.constexpr = False,
                                    PIN_SOFTMAX: gl.constexpr = False, GROUP_SHIFT: gl.constexpr = 0,
                                    Q_IN_REGS: gl.constexpr = False, Q_BUFFERS: gl.constexpr = 1,
                                    PERSISTENT: gl.constexpr = False):
    """The Gluon forward over packed sequences (flash_attn_varlen_func): tiles (query block of
    num_m a row, sequence x head of num_rows), one a program or several in turn (as the dense kernel's);
    sequence b's queries are rows CuSeqQ[b]:CuSeqQ[b + 1] of the (total_q, heads * head dim)
    views, its keys rows CuSeqK[b]:CuSeqK[b + 1]; row i of sequence b, head h has its logsumexp at
    LSE[h * stride_lse_h + b * stride_lse_b + CuSeqQ[b] + i] ((heads, total_q): (total_q, 0); a
    dense call's (batch, heads, seqlen_q): (seqlen_q, (heads - 1) * seqlen_q)). Causal is
    bottom-right aligned per sequence. A tile past its sequence's last query block is skipped.
    CONSUMERS, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, Q_BUFFERS, PERSISTENT and GROUP_SHIFT (the causal
    tiles' order over groups of sequence x head rows, `_fwd_program`) as the dense kernel's."""
    q_desc, k_desc, v_desc, o_desc = _descriptor_sections(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc,
                                                          v_tail_desc, o_tail_desc, HEAD_SPLIT)  # as the dense kernel's
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free = _fwd_shared_buffers(q_desc, k_desc, v_desc, STAGES,
                                                                                         V_STAGES, CONSUMERS, Q_BUFFERS)
    args = (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free,
            CuSeqQ, CuSeqK, num_m * num_rows, num_m, num_heads, stride_lse_h, stride_lse_b, stride_o, qk_scale,
            kv_group, _turn_barriers(q_bar, CONSUMERS, PINGPONG))
    if CONSUMERS == 3:  # registers as the dense kernel's
        gl.warp_specialize([
            (_varlen_softmax_partition, (args, CAUSAL, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_varlen_softmax_partition, (args, CAUSAL, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_varlen_softmax_partition, (args, CAUSAL, 2, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_varlen_load_partition, (args, CAUSAL, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_varlen_softmax_partition, (args, CAUSAL, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_varlen_softmax_partition, (args, CAUSAL, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_varlen_load_partition, (args, CAUSAL, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
        ], [4, 1], [240, 24])
