"""Split-KV decoding kernels (Flash-Decoding): attention of a few query tokens over a KV cache.

The FlashAttention-2 paper (Dao, 2023, Sec. 3.2 and its discussion of decoding) notes that with
one query token per sequence the only parallelism left is batch x heads, too little to fill a
GPU; FlashAttention-2 splits the KV cache along the sequence across thread blocks and combines
the partial results with their logsumexps. Two kernels do that here:

1. `_fwd_kvcache_split_kernel`: program (split, batch x kv head, query tile) runs FA2's online
   softmax (Alg. 1 lines 8-10, log2 domain) over its split's keys and writes the partial output
   O_s = softmax_s(S) V and its logsumexp L_s in float32 (with one split, the final output in
   the input dtype instead). GQA: the q heads sharing a kv head are packed into the tile's M
   dimension (row r is query token r // GROUP, q head kv_head * GROUP + r % GROUP), so each
   kv head's keys are read once for its whole group.
2. `_fwd_kvcache_combine_kernel`: per output row, L = logsumexp_s(L_s) and
   O = sum_s exp(L_s - L) O_s.

The cache is contiguous (batch_cache, seqlen_cache, kv_heads, headdim), rows picked through
`cache_batch_idx` and each sequence's keys optionally starting at `cache_leftpad[b]`, or paged (num_pages, PAGE_SIZE, kv_heads, headdim) through a block table:
key n of sequence b is row n % PAGE_SIZE of page block_table[b, n // PAGE_SIZE], gathered
row by row, so a key block may span several pages. The launch's splits share each sequence's
key blocks round robin (INTERLEAVE_SPLITS: split s reads blocks s, s + num_splits, ...; else
each split one run of consecutive blocks); a split with no visible key (past a short
sequence's end, or outside its window) writes an empty result (O_s = 0, L_s = -inf) that the
combine weighs by zero.

Conventions as flash-attn's: masks aligned to the end of each sequence's keys (query token i
of seqlen_q sits at key position i + seqlen_k - seqlen_q); score order scale, softcap, ALiBi
(`-slope * |position - key|`), mask; a query row that sees no key outputs zeros with
logsumexp +inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, LOG2E


@triton.jit
def _fwd_kvcache_split_kernel(
    Q, K, V, Out, LSE, SeqlensK, BatchIdx, BlockTable, Slopes, LeftPad,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_osplit, stride_ob, stride_os, stride_oh,
    stride_lsplit, stride_lb, stride_lh,
    stride_btb, stride_slb, table_keys,
    seqlen_q, kv_heads, sm_scale, softcap, window_left, window_right,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_LEFTPAD: tl.constexpr = False, INTERLEAVE_SPLITS: tl.constexpr = False,
    PAGE_LAYOUT: tl.constexpr = 0, SAME_KV_STRIDES: tl.constexpr = False,
):
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    pid_m = tl.program_id(2)
    seqlen_k = tl.load(SeqlensK + batch)

    # the tile's rows: GROUP q heads per query token, all reading this kv head
    rows = seqlen_q * GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_ok = offs_m < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + batch * stride_qb + token[:, None] * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    position = token + seqlen_k - seqlen_q  # the query's own key position (bottom-right alignment)

    # this split's keys: whole key blocks of the sequence's, from `lo` in steps of `step` up to
    # `hi`; a left-padded sequence's keys start at LeftPad[b] (positions keep their cache index:
    # the bottom-right alignment and ALiBi's distances are the same counted from the pad)
    if HAS_LEFTPAD:
        pad = tl.load(LeftPad + batch)
    else:
        pad = 0
    first_block = pad // BLOCK_N * BLOCK_N
    if INTERLEAVE_SPLITS:
        # round robin: a window's blocks are shared by all splits instead of falling to the one
        # or two whose run holds them (kernels.decode.interleave_splits says where it is used)
        step = BLOCK_N * num_splits
        lo = first_block + split * BLOCK_N
        hi = seqlen_k
    else:  # one run of consecutive blocks per split, the blocks shared evenly
        step = BLOCK_N
        per_split = tl.cdiv(tl.cdiv(seqlen_k - first_block, BLOCK_N), num_splits) * BLOCK_N
        lo = first_block + split * per_split
        hi = tl.minimum(lo + per_split, seqlen_k)
    first_position = (pid_m * BLOCK_M) // GROUP + seqlen_k - seqlen_q
    last_position = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows) - 1) // GROUP + seqlen_k - seqlen_q
    if HAS_RIGHT:  # no key past the window's right edge (causal: past the diagonal)
        hi = tl.minimum(hi, last_position + window_right + 1)
    if HAS_LEFT:  # start at the split's first block from the one holding the window's left edge
        edge = tl.maximum(first_position - window_left, 0) // BLOCK_N * BLOCK_N
        lo += tl.cdiv(tl.maximum(edge - lo, 0), step) * step

    if HAS_BATCH_IDX:
        cache_row = tl.load(BatchIdx + batch).to(tl.int64)
    else:
        cache_row = batch.to(tl.int64)
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * stride_slb + head, mask=m_ok, other=0.0)
    K += kv_head * stride_kh
    V += kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # paged: each key row's page number, read one key block ahead so that the
    # block table's latency overlaps the block before instead of preceding every K load; the
    # first read is bounded by the table's width (`table_keys`: its columns x PAGE_SIZE), so it
    # stays inside the sequence's row of the table; a page read past the sequence's end is never
    # dereferenced, its rows masked below. Blocks start at multiples of BLOCK_N, so with
    # PAGE_LAYOUT 1 (a block holds whole pages) each row's column in the block and its offset in
    # its page are the same at every block, worked out once here; with PAGE_LAYOUT 2 (a page holds
    # whole blocks) a block is one run of rows of one page, one table entry; PAGE_LAYOUT 0 works
    # out each row's page and offset at every block.
    page_rows = BlockTable + batch * stride_btb
    offs_b = tl.arange(0, BLOCK_N)
    if PAGE_LAYOUT == 2:
        k_in_block = offs_b * stride_kn
        v_in_block = offs_b * stride_vn
    else:
        k_in_block = (offs_b % PAGE_SIZE) * stride_kn if PAGE_LAYOUT == 1 else offs_b
        v_in_block = (offs_b % PAGE_SIZE) * stride_vn if PAGE_LAYOUT == 1 else offs_b
    if PAGE_SIZE > 0:
        next_page = _page_numbers(page_rows, lo, offs_b, table_keys, PAGE_SIZE, PAGE_LAYOUT)
    else:
        next_page = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start_n in range(lo, hi, step):
        offs_n = start_n + offs_b
        n_ok = offs_n < hi
        if HAS_LEFTPAD:  # the padding before a sequence's first key is neither read nor seen
            n_ok &= offs_n >= pad
        if PAGE_SIZE > 0:
            # the pages read one block ahead (above, or in the previous iteration)
            page = next_page.to(tl.int64)
            next_page = _page_numbers(page_rows, start_n + step, offs_b, hi, PAGE_SIZE, PAGE_LAYOUT)
            if PAGE_LAYOUT == 0:
                k_rows = page * stride_kb + (offs_n % PAGE_SIZE) * stride_kn
                v_rows = page * stride_vb + (offs_n % PAGE_SIZE) * stride_vn
            elif PAGE_LAYOUT == 1:
                k_rows = page * stride_kb + k_in_block
                v_rows = page * stride_vb + v_in_block
            else:  # one page: its base and the block's first row in it, then the rows in order
                k_rows = (page * stride_kb + (start_n % PAGE_SIZE) * stride_kn) + k_in_block
                v_rows = (page * stride_vb + (start_n % PAGE_SIZE) * stride_vn) + v_in_block
        else:
            k_rows = cache_row * stride_kb + offs_n.to(tl.int64) * stride_kn
            v_rows = cache_row * stride_vb + offs_n.to(tl.int64) * stride_vn
        if SAME_KV_STRIDES:  # V's rows at K's offsets: one address computation for both
            v_rows = k_rows
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp2
            s = softcap * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 * LOG2E / softcap)) + 1.0))
        if HAS_ALIBI:
            s -= slope[:, None] * tl.abs(position[:, None] - offs_n[None, :]).to(tl.float32)
        visible = n_ok[None, :]
        if HAS_RIGHT:
            visible &= offs_n[None, :] <= position[:, None] + window_right
        if HAS_LEFT:
            visible &= offs_n[None, :] >= position[:, None] - window_left
        s = tl.where(visible, s * LOG2E, float("-inf"))
        # FA2 Alg. 1 lines 8-10: new running max, rescale by exp(m_old - m_new), no 1/l yet
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays empty
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # FA2 Alg. 1 line 12: one division by l at the end; L = m + log(l) in natural-log units
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    if SPLIT:  # a split's empty part weighs zero in the combine
        lse = tl.where(empty, float("-inf"), lse)
    else:
        lse = tl.where(empty, float("inf"), lse)
    o_ptrs = (Out + split * stride_osplit + batch * stride_ob + token[:, None] * stride_os
              + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + split * stride_lsplit + batch * stride_lb + head * stride_lh + token, lse, mask=m_ok)


@triton.jit
def _page_numbers(page_rows, first, offs_b, limit, PAGE_SIZE: tl.constexpr, PAGE_LAYOUT: tl.constexpr):
    """The page of each key row first + offs_b (a block; `first` a multiple of its length) from the
    sequence's row of the block table, rows from `limit` on reading none (0): per row (PAGE_LAYOUT
    0), per row from the block's first column (1: the block holds whole pages), or one entry for
    the block (2: a page holds whole blocks)."""
    if PAGE_LAYOUT == 2:
        return tl.load(page_rows + first // PAGE_SIZE, mask=first < limit, other=0)
    elif PAGE_LAYOUT == 1:
        return tl.load(page_rows + first // PAGE_SIZE + offs_b // PAGE_SIZE, mask=first + offs_b < limit, other=0)
    else:
        return tl.load(page_rows + (first + offs_b) // PAGE_SIZE, mask=first + offs_b < limit, other=0)


@triton.jit
def _fwd_kvcache_combine_kernel(
    OutAcc, LseAcc, Out, LSE,
    stride_asplit, stride_lsplit,
    num_splits, heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One output row (batch, token, head) per program; OutAcc (splits, batch, seqlen_q, heads,
    HEAD_DIM) and Out are contiguous, LseAcc (splits, batch, heads, seqlen_q) and LSE too."""
    row = tl.program_id(0)  # (batch, token, head) in Out's order
    batch = row // (seqlen_q * heads)
    token = (row // heads) % seqlen_q
    head = row % heads
    lse_row = (batch * heads + head) * seqlen_q + token
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    lse_s = tl.load(LseAcc + offs_s * stride_lsplit + lse_row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.math.exp2((lse_s - m_safe) * LOG2E)  # exp(L_s - max); 0 for empty splits
    total = tl.sum(weight, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o_s = tl.load(OutAcc + offs_s[:, None] * stride_asplit + row * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(weight[:, None] * o_s, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + row * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(LSE + lse_row, tl.where(total == 0.0, float("inf"), m_safe + tl.math.log2(total) * LN2))


@triton.jit
def _rotate_row(Src, Dst, CosRow, SinRow, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                ROTARY_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Dst[:HEAD_DIM] = Src rotated in its first 2 * ROTARY_HALF dims, in float32: pairs
    (2j, 2j + 1) when INTERLEAVED, else (j, j + ROTARY_HALF) (GPT-NeoX); the rest copied."""
    if ROTARY_HALF > 0:
        offs_j = tl.arange(0, BLOCK_HALF)
        j_ok = offs_j < ROTARY_HALF
        if INTERLEAVED:
            first = 2 * offs_j
            second = first + 1
        else:
            first = offs_j
            second = offs_j + ROTARY_HALF
        x1 = tl.load(Src + first, mask=j_ok, other=0.0).to(tl.float32)
        x2 = tl.load(Src + second, mask=j_ok, other=0.0).to(tl.float32)
        c = tl.load(CosRow + offs_j, mask=j_ok, other=0.0).to(tl.float32)
        s = tl.load(SinRow + offs_j, mask=j_ok, other=0.0).to(tl.float32)
        tl.store(Dst + first, (x1 * c - x2 * s).to(Dst.dtype.element_ty), mask=j_ok)
        tl.store(Dst + second, (x1 * s + x2 * c).to(Dst.dtype.element_ty), mask=j_ok)
    offs_d = tl.arange(0, BLOCK_D)
    pass_ok = (offs_d >= 2 * ROTARY_HALF) & (offs_d < HEAD_DIM)
    tl.store(Dst + offs_d, tl.load(Src + offs_d, mask=pass_ok), mask=pass_ok)


@triton.jit
def _kvcache_append_kernel(
    K, V, KCache, VCache, CacheSeqlens, BatchIdx, BlockTable, Cos, Sin,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcn, stride_kch,
    stride_vcb, stride_vcn, stride_vch,
    stride_btb, stride_cos,
    seqlen_new,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
):
    """Program (batch x new token, kv head): the new key, rotated at its position
    cache_seqlens[b] + i (its cache index, left padding or not, as flash-attn does), and the new
    value go into cache slot cache_seqlens[b] + i; nothing else is written."""
    batch = tl.program_id(0) // seqlen_new
    token = tl.program_id(0) % seqlen_new
    kv_head = tl.program_id(1)
    position = tl.load(CacheSeqlens + batch) + token
    if PAGE_SIZE > 0:
        page = tl.load(BlockTable + batch * stride_btb + position // PAGE_SIZE).to(tl.int64)
        k_row = page * stride_kcb + (position % PAGE_SIZE) * stride_kcn
        v_row = page * stride_vcb + (position % PAGE_SIZE) * stride_vcn
    else:
        if HAS_BATCH_IDX:
            cache_row = tl.load(BatchIdx + batch).to(tl.int64)
        else:
            cache_row = batch.to(tl.int64)
        k_row = cache_row * stride_kcb + position.to(tl.int64) * stride_kcn
        v_row = cache_row * stride_vcb + position.to(tl.int64) * stride_vcn
    _rotate_row(K + batch * stride_kb + token * stride_ks + kv_head * stride_kh,
                KCache + k_row + kv_head * stride_kch, Cos + position * stride_cos, Sin + position * stride_cos,
                HEAD_DIM, BLOCK_D, ROTARY_HALF, BLOCK_HALF, INTERLEAVED)
    _rotate_row(V + batch * stride_vb + token * stride_vs + kv_head * stride_vh,
                VCache + v_row + kv_head * stride_vch, Cos, Sin, HEAD_DIM, BLOCK_D, 0, BLOCK_HALF, INTERLEAVED)


@triton.jit
def _rotary_kernel(
    X, Out, Start, Cos, Sin,
    stride_xb, stride_xs, stride_xh,
    stride_ob, stride_os, stride_oh, stride_cos,
    seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, STEP: tl.constexpr,
):
    """Program (batch x token, head): Out = X rotated at position Start[b] + token (STEP) or
    Start[b] (all tokens at one position)."""
    batch = tl.program_id(0) // seqlen
    token = tl.program_id(0) % seqlen
    head = tl.program_id(1)
    position = tl.load(Start + batch)
    if STEP:
        position += token
    _rotate_row(X + batch * stride_xb + token * stride_xs + head * stride_xh,
                Out + batch * stride_ob + token * stride_os + head * stride_oh,
                Cos + position * stride_cos, Sin + position * stride_cos,
                HEAD_DIM, BLOCK_D, ROTARY_HALF, BLOCK_HALF, INTERLEAVED)
