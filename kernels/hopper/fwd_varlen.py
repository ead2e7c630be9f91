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

from .fwd import (
    _fwd_block_matmuls,
    _fwd_first_block,
    _fwd_last_block,
    _fwd_program,
    _fwd_rescale,
    _fwd_shared_buffers,
    _held_p,
    _load_q_kv,
    _online_softmax,
    _pin_buffer,
    _pin_softmax,
    _store_output,
    _turn_barriers,
)
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
def _varlen_load_partition(args, CAUSAL: gl.constexpr, PART: gl.constexpr):
    """_load_partition over one sequence's rows of the packed (total, heads * head dim) views."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0,
     col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0, stride_o, qk_scale,
     turn_bar, pin_buf) = args
    _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, col0, kv_row0,
               kv_col0, 0, n_blocks)


@gluon.jit
def _varlen_softmax_partition(args, CAUSAL: gl.constexpr, PART: gl.constexpr, PINGPONG: gl.constexpr,
                              PIN_SOFTMAX: gl.constexpr, Q_IN_REGS: gl.constexpr):
    """_softmax_partition for one sequence of a packed batch: rows [start_m + PART * 64, + 64) of
    the sequence, over its n_blocks key blocks (at least one: a program whose rows see no key runs
    one fully masked block and writes zeros with logsumexp +inf, as the reference does). The rows
    of a query tile past the sequence's end are the next sequence's: their results are not
    written (a masked store where the tile crosses the end, TMA where it does not)."""
    (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_row, kv_row0,
     col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0, stride_o, qk_scale,
     turn_bar, pin_buf) = args
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = q_desc[0].block_type.shape[0]
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_buf = _at(q_smem, PART)

    first_row = start_m + PART * ROWS  # this part's first query row in its sequence
    offs_m = first_row + gl.arange(0, ROWS, layout=row_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i, l_i, acc, s_init, s, q_op = _fwd_first_block(q_buf, k_smem, q_bar, k_bar, empty_bar, turn_bar, s_layout,
                                                      PART, PINGPONG, None, Q_IN_REGS)
    p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, mask_from, seqlen_k, shift,
                                              BLOCK_N, CAUSAL)
    EARLY_P: gl.constexpr = q_bar.type.shape[0] == 3  # three consumers (_held_p)
    p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
    for i in range(1, n_blocks):
        s, acc_tok, p_op, prev = _fwd_block_matmuls(i, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, p,
                                                    acc, s_init, PART, PINGPONG)
        p, alpha, l_i, m_i = _varlen_softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, i, mask_from, seqlen_k,
                                                  shift, BLOCK_N, CAUSAL)
        _pin_softmax(l_i, pin_buf, PART, PIN_SOFTMAX)
        acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar)
        p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
    acc = _fwd_last_block(n_blocks, p, acc, v_smem, v_bar, empty_bar)

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
                                    Out, LSE, CuSeqQ, CuSeqK, num_heads, stride_lse_h, stride_lse_b, stride_o,
                                    qk_scale, kv_group, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                                    CAUSAL: gl.constexpr, HEAD_SPLIT: gl.constexpr = False,
                                    CONSUMERS: gl.constexpr = 2, PINGPONG: gl.constexpr = False,
                                    PIN_SOFTMAX: gl.constexpr = False, GROUP_SHIFT: gl.constexpr = 0,
                                    Q_IN_REGS: gl.constexpr = False):
    """The Gluon forward over packed sequences (flash_attn_varlen_func): program (query block,
    sequence x head); sequence b's queries are rows CuSeqQ[b]:CuSeqQ[b + 1] of the (total_q,
    heads * head dim) views, its keys rows CuSeqK[b]:CuSeqK[b + 1]; row i of sequence b, head h
    has its logsumexp at LSE[h * stride_lse_h + b * stride_lse_b + CuSeqQ[b] + i] ((heads,
    total_q): (total_q, 0); a dense call's (batch, heads, seqlen_q): (seqlen_q, (heads - 1) *
    seqlen_q)). Causal is bottom-right aligned per sequence. A program past its sequence's last
    query block does nothing. CONSUMERS, PINGPONG, PIN_SOFTMAX, Q_IN_REGS and GROUP_SHIFT (the causal programs'
    launch order over groups of sequence x head rows, `_fwd_program`) as the dense kernel's."""
    q_desc, k_desc, v_desc, o_desc = _descriptor_sections(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc,
                                                          v_tail_desc, o_tail_desc, HEAD_SPLIT)  # as the dense kernel's
    ROWS: gl.constexpr = q_desc[0].block_type.shape[0]
    HEAD_DIM: gl.constexpr = _head_dim(q_desc)
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    pid_m, _, b, h = _fwd_program(num_heads, CAUSAL, GROUP_SHIFT)
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
        lse_row0 = h.to(gl.int64) * stride_lse_h + b.to(gl.int64) * stride_lse_b + q_start
        q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar = _fwd_shared_buffers(q_desc, k_desc, v_desc, STAGES,
                                                                                     V_STAGES, CONSUMERS)
        args = (q_desc, k_desc, v_desc, o_desc, Out, LSE, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar,
                q_row, kv_row0, col0, kv_col0, n_blocks, mask_from, start_m, seqlen_q, seqlen_k, shift, lse_row0,
                stride_o, qk_scale, _turn_barriers(q_bar, CONSUMERS, PINGPONG),
                _pin_buffer(q_bar, CONSUMERS, ROWS, PIN_SOFTMAX))
        if CONSUMERS == 3:  # registers as the dense kernel's
            gl.warp_specialize([
                (_varlen_softmax_partition, (args, CAUSAL, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS)),
                (_varlen_softmax_partition, (args, CAUSAL, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS)),
                (_varlen_softmax_partition, (args, CAUSAL, 2, PINGPONG, PIN_SOFTMAX, Q_IN_REGS)),
                (_varlen_load_partition, (args, CAUSAL, 0)),
            ], [4, 4, 1], [160, 160, 24])
        else:
            gl.warp_specialize([
                (_varlen_softmax_partition, (args, CAUSAL, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS)),
                (_varlen_softmax_partition, (args, CAUSAL, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS)),
                (_varlen_load_partition, (args, CAUSAL, 0)),
            ], [4, 1], [240, 24])

