"""FA2's forward (Algorithm 1) on Hopper, written in Gluon with FlashAttention-3's layout: the dense
kernel (GQA/MQA, sliding windows, softcap, ALiBi as constexpr flags) and the loads, matmuls
and softmax steps fwd_varlen.py's kernel over packed variable lengths is built from.

Triton 3.6 compiles the forward of `forward.py` to wgmma, but it waits for every matmul at
once and its key loop synchronises all warps at CTA-wide barriers, so the softmax does not run
under a matmul of the same warps (docs/performance.md, "Gluon forward with FlashAttention-3's
warp layout"). Gluon, Triton's lower-level language, lets a kernel say which warps do what and
when a matmul is waited for. These kernels (FA3, Shah et al. 2024):

- **Warp specialisation:** a producer warp issues the TMA loads of Q, K and V; two or three
  consumer warpgroups (CONSUMERS; FwdConfig.hopper_gluon_block_m: 128 or 192 query rows, FA3's
  choice at head dims 64 and 96 being 192) own 64 query rows each. They synchronise only through
  mbarriers (a K/V stage is refilled once every consumer has released it), with no CTA-wide
  barrier in the key loop, so one consumer's softmax can run while the others' matmuls do. At
  head dims up to 128 the table has them issue their matmuls in turns (FwdConfig.hopper_gluon_pingpong:
  a ring of mbarriers where FA3 and FA4 use named barriers, `_await_turn`); above, nothing orders
  them and the overlap is what the warp schedulers make of it.
- **Intra-warpgroup overlap (FA3's Algorithm 2):** for key block j a consumer issues S_j = Q K_j^T,
  then O += P_{j-1} V_{j-1}, and waits for S_j (`warpgroup_mma_wait(1)`; with two head-dim
  sections that also takes P V's first): the softmax of S_j runs under (the rest of) the P V matmul.
- **Tiles in a loop:** a program runs (query block, batch x head) tiles in rounds over a flat grid,
  its K/V rings and mbarrier phases running on from one tile to the next: one program a tile (the
  loop compiled away: PERSISTENT off, fwd_tiles.py `_rounds`), or one an SM on a persistent grid
  (FwdConfig.hopper_gluon_persistent_below_keys), where the loader warp loads the next tile's first
  K block and, in a second Q buffer where one fits, its Q while the consumers finish the tile before.
- FA2's non-matmul savings are kept: O unnormalised until one final rescale, the softmax scale
  folded into the exponent's FMA, logsumexp stored, the causal mask only on the diagonal blocks.
- **Every head dim FA3's table has, unpadded:** register tiles are powers of two, so head dims 96
  and 192 run as two head-dim sections (64 + 32, 128 + 64), each its own TMA box, S matmul and O
  accumulator (`_head_sections`); the host sizes the key block and the K/V rings to shared memory
  (flash_attn_hopper.forward_stages: 64-key blocks at 192 and 256).

The host side (descriptors, plans, launches) is kernels/flash_attn_hopper.py.
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

from ..features import _tanh
from .fwd_tiles import _dense_tile, _q_slot, _round_tile, _rounds
from .shared import (
    _allocate_sections,
    _at,
    _descriptor_sections,
    _expect_sections,
    _head_dim,
    _load_sections,
    _wgmma_layout,
    _zero_sections,
)


@gluon.jit
def _online_softmax(s, m_i, l_i, scale, EMPTY_ROWS: gl.constexpr):
    """FA2 Alg. 1 line 9 on masked scores S (-inf where a key is not seen): m_new = max(m_old,
    rowmax(S) * scale), P~ = exp2(S * scale - m_new) and l = exp2(m_old - m_new) l + rowsum(P~),
    the scale folded into the exponent's FMA. With EMPTY_ROWS a row may see no key of the block
    (or none yet): its max stays -inf, and the exponent's reference is 0 while it does (P~ = 0, no
    NaN); without, every row has seen a key by then (its own, on the diagonal)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    if EMPTY_ROWS:
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = gl.exp2(s * scale - m_ref[:, None])
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@gluon.jit
def _causal_mask(s, cols, offs_m):
    """S with the keys past each row's diagonal (key index > query index) at -inf."""
    return gl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, block, diagonal, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr):
    """_online_softmax on unscaled scores S, the causal mask only on the diagonal blocks (from block
    `diagonal` on: the last BLOCK_M / BLOCK_N), and no mask code at all in the non-causal kernel.
    Every row has seen a key by the time it meets a masked one (key 0 is in the first block)."""
    if CAUSAL:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if block >= diagonal:
            s = _causal_mask(s, block * BLOCK_N + offs_n, offs_m)
    return _online_softmax(s, m_i, l_i, qk_scale, False)


@gluon.jit
def _block_mask(s, block, mask, BLOCK_N: gl.constexpr, KEYS: gl.constexpr, CAUSAL: gl.constexpr):
    """S of key block `block` with the keys a row does not see at -inf. `mask` = (the rows' query
    indices, the block's key offsets, the key length, shift): with KEYS the keys from the key length
    on (without KEYS the key length is not read); with CAUSAL the keys past a row's diagonal,
    bottom-right aligned (key j is seen by query row i when j <= i + shift, shift = seqlen_k -
    seqlen_q: 0 in the dense kernel)."""
    offs_m, offs_n, seqlen_k, shift = mask
    # one bound a row on the offsets within the block (one compare an element, nothing a step could
    # hoist out of its loop as a whole tile): a row sees the keys before it
    first_key = block * BLOCK_N
    if CAUSAL:
        end = offs_m + (shift + 1)
        if KEYS:
            end = gl.minimum(end, seqlen_k)
        s = gl.where(offs_n[None, :] < (end - first_key)[:, None], s, float("-inf"))
    elif KEYS:
        s = gl.where(offs_n[None, :] < seqlen_k - first_key, s, float("-inf"))
    return s


@gluon.jit
def _fwd_blocks(lo, hi, it, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, p, acc, s_init, m_i, l_i,
                qk_scale, mask, PART: gl.constexpr, PINGPONG: gl.constexpr, PIN_SOFTMAX: gl.constexpr,
                KEYS: gl.constexpr, CAUSAL: gl.constexpr):
    """Lines 8-11 for the tile's key blocks lo to hi - 1 (the program's it + lo-th on), after block
    lo - 1's line 9 (its P~ held in `p`): S_j and P~_{j-1} V_{j-1} in flight, line 9 for block j
    under P~ V (`_fwd_block_matmuls`), the softmax held there with PIN_SOFTMAX (`_pin_softmax`), then
    O rescaled. The blocks' mask is `_block_mask`'s (KEYS, CAUSAL); with neither the loop has no mask
    code: as FA3's and FA4's mainloops, the tile's blocks every row sees whole run in a loop of their
    own, the masked ones in another. With KEYS a row may see no key yet (`_online_softmax`'s
    EMPTY_ROWS). Two consumers without a window, softcap or ALiBi only: on three (192 query rows) the
    loops apart were slower, and their key blocks run in one loop, the mask behind a run-time branch,
    as a feature's do (docs/performance.md, "The key blocks without a mask in a loop of their own").
    Returns P~ of block hi - 1, O, m and l."""
    BLOCK_N: gl.constexpr = k_smem[0].type.shape[1]
    for i in range(lo, hi):
        s, acc_tok, p_op, prev = _fwd_block_matmuls(it + i, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar,
                                                    p, acc, s_init, PART, PINGPONG)
        s = _block_mask(s, i, mask, BLOCK_N, KEYS, CAUSAL)
        p, alpha, l_i, m_i = _online_softmax(s, m_i, l_i, qk_scale, KEYS)
        l_i = _pin_softmax(l_i, PIN_SOFTMAX)
        acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar)
        p = _held_p(p, acc, v_smem[0].dtype, False)
    return p, acc, m_i, l_i


@gluon.jit
def _softmax_step_alibi(s, m_i, l_i, qk_scale, block_bias, offs_m, offs_n, block, diagonal, BLOCK_N: gl.constexpr):
    """_softmax_step (causal) on scores whose matmul added ALiBi's key term (`_alibi_query_tile`):
    S * scale holds scale * q.k + slope * log2(e) * (key offset in the block), and `block_bias`
    (slope * log2(e) * (the block's first key - the reference row)) completes the key term in the
    per-row math, so each element costs what the dense step's does."""
    if block >= diagonal:
        s = _causal_mask(s, block * BLOCK_N + offs_n, offs_m)
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
def _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n, offs_n_f, block, CAUSAL: gl.constexpr,
                       BLOCK_N: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """_softmax_step with a sliding window, softcap or ALiBi. `window` = (left, right, full_lo,
    full_hi): with WINDOW a block outside [full_lo, full_hi) is masked (a row may see no key of a
    block at a window's edge), else causal masks the blocks from full_hi (the diagonal ones). Per
    element this costs the dense step's work plus, with ALiBi, one
    add and the column term's share (from `offs_n_f`, the block's key offsets as floats, which
    the compiler recomputes per block: a thread holds BLOCK_N / 4 keys of 2 rows, so each
    operation per key costs about half a one per element; docs/performance.md has the counters) and, with a
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
        if block >= window[3]:  # the diagonal blocks
            s = _causal_mask(s, cols, offs_m)
    return _online_softmax(s, m_i, l_i, scale, WINDOW)


@gluon.constexpr_function
def _alibi_by_matmul(causal, window, softcap, alibi):
    """Whether the forward adds ALiBi's key term by the tensor cores: a BLOCK_N-key wgmma of depth
    16 that each S matmul chains on (`_alibi_query_tile`, `_alibi_key_tile`), faster than adding it
    per element in registers (docs/performance.md, "ALiBi's key term"). Causal, without a window or
    softcap only: the bias is linear in the key index only where every visible key is at or before
    the query, and a softcap comes before it. Its B tile takes shared memory that V's ring gives up
    where they do not fit together (flash_attn_hopper.forward_stages: 2 V blocks at head dim 128)."""
    return bool(alibi) and bool(causal) and not window and not softcap


@gluon.jit
def _fwd_shared_buffers(q_descs, k_descs, v_descs, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                        CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr = 1):
    """The forward's shared memory: Q_BUFFERS buffers of Q_i (`_q_slot`), each one 64-row part a
    consumer warpgroup (part slot * CONSUMERS + consumer), rings of STAGES K_j and V_STAGES V_j
    blocks (each a tuple of head-dim sections: `_head_sections`), and their mbarriers (q_bar, k_bar,
    v_bar: a TMA load has landed; empty_bar: a stage is free; q_free: a Q part's consumer has
    written its output through it). With rings of one size a key block's K and V share a stage,
    released once P~ V is done; with V's ring shorter (`_split_release`) empty_bar holds K's stages
    then V's, each released once its matmul is done."""
    q_smem = _allocate_sections(q_descs, Q_BUFFERS * CONSUMERS)
    k_smem = _allocate_sections(k_descs, STAGES)
    v_smem = _allocate_sections(v_descs, V_STAGES)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    RELEASES: gl.constexpr = STAGES + V_STAGES if V_STAGES != STAGES else STAGES
    empty_bar = gl.allocate_shared_memory(gl.int64, [RELEASES, 1], mbarrier.MBarrierLayout())
    for part in gl.static_range(Q_BUFFERS * CONSUMERS):
        mbarrier.init(q_bar.index(part), count=1)
        mbarrier.init(q_free.index(part), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(stage), count=1)
        if V_STAGES == STAGES:
            mbarrier.init(v_bar.index(stage), count=1)
        mbarrier.init(empty_bar.index(stage), count=CONSUMERS)  # released by every consumer warpgroup
    if V_STAGES != STAGES:
        for stage in gl.static_range(V_STAGES):
            mbarrier.init(v_bar.index(stage), count=1)
            mbarrier.init(empty_bar.index(STAGES + stage), count=CONSUMERS)
    return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free


@gluon.jit
def _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free, q_row, col0,
               kv_row0, kv_col0, first_block, n_blocks, it, local, Q_BUFFERS: gl.constexpr):
    """FA2 Alg. 1 line 4 (Q_i, as one 64-row part a consumer, into the buffer of the program's
    `local`-th tile: `_q_slot`) and line 7 (K_j, V_j of key blocks first_block .. first_block +
    n_blocks - 1 from row kv_row0) as TMA loads, the program's it-th key block on (`_load_k`,
    `_load_v`). Q_i waits for its buffer's consumers to have written their output through it
    (q_free), so the first K block is issued before it (with one buffer it loads while the tile
    before ends) and the first V block after it (the first S matmul needs Q and K, not V).
    Descriptors and tiles are tuples of head-dim sections (`_head_sections`)."""
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    CONSUMERS: gl.constexpr = q_smem[0].type.shape[0] // Q_BUFFERS
    first_row = kv_row0 + first_block * BLOCK_N
    _load_k(k_desc, k_smem, k_bar, empty_bar, it, first_row, kv_col0)
    slot, q_phase = _q_slot(local, Q_BUFFERS)
    for part in gl.static_range(CONSUMERS):
        buffer = slot * CONSUMERS + part
        # a fresh mbarrier counts as having completed the phase before its first: a buffer's first
        # use passes at once
        mbarrier.wait(q_free.index(buffer), q_phase ^ 1)
        _expect_sections(q_bar.index(buffer), q_desc)
        _load_sections(q_desc, q_row + part * q_desc[0].block_type.shape[0], col0, q_bar.index(buffer),
                       _at(q_smem, buffer))
    _load_v(v_desc, k_smem, v_smem, v_bar, empty_bar, it, first_row, kv_col0)
    for i in range(1, n_blocks):
        row = kv_row0 + (first_block + i) * BLOCK_N
        _load_k(k_desc, k_smem, k_bar, empty_bar, it + i, row, kv_col0)
        _load_v(v_desc, k_smem, v_smem, v_bar, empty_bar, it + i, row, kv_col0)


@gluon.jit
def _load_k(k_desc, k_smem, k_bar, empty_bar, position, row, kv_col0):
    """Line 7's K_j for the program's position-th key block (counted over all its tiles, so the
    rings run on across them) from `row`, into the ring stage every consumer has released
    (empty_bar counts them)."""
    STAGES: gl.constexpr = k_smem[0].type.shape[0]
    stage = position % STAGES
    # a fresh mbarrier counts as having completed the phase before its first, so the first
    # STAGES waits pass at once
    mbarrier.wait(empty_bar.index(stage), ((position // STAGES) & 1) ^ 1)
    _expect_sections(k_bar.index(stage), k_desc)
    _load_sections(k_desc, row, kv_col0, k_bar.index(stage), _at(k_smem, stage))


@gluon.jit
def _load_v(v_desc, k_smem, v_smem, v_bar, empty_bar, position, row, kv_col0):
    """Line 7's V_j as `_load_k` loads K_j: into its own ring's stage where V's ring is shorter
    (`_split_release`, its stages released apart), else into the stage K_j's wait freed."""
    STAGES: gl.constexpr = k_smem[0].type.shape[0]
    V_STAGES: gl.constexpr = v_smem[0].type.shape[0]
    v_stage = position % V_STAGES
    if _split_release(empty_bar, k_smem[0]):
        mbarrier.wait(empty_bar.index(STAGES + v_stage), ((position // V_STAGES) & 1) ^ 1)
    _expect_sections(v_bar.index(v_stage), v_desc)
    _load_sections(v_desc, row, kv_col0, v_bar.index(v_stage), _at(v_smem, v_stage))


@gluon.constexpr_function
def _split_release(empty_bar, k_ring):
    """Whether K's and V's stages are released apart (`_fwd_shared_buffers`: V's ring is shorter);
    `k_ring`: K's ring of the first head-dim section."""
    return empty_bar.type.shape[0] > k_ring.type.shape[0]


@gluon.jit
def _s_matmul(q_op, k_tile, s_init, bias=None):
    """Line 8's S = Q K_j^T (unscaled), issued asynchronously, one matmul per head-dim section
    (`q_op`, Q's tiles in shared memory or registers: `_q_operand`; `k_tile`: tuples of them)
    chained on the first; with `bias` (ALiBi's (A, B) tiles, `_alibi_by_matmul`) chained on A B, so
    S holds ALiBi's key term with no work per element."""
    if bias is None:
        s_tok = warpgroup_mma(q_op[0], k_tile[0].permute((1, 0)), s_init, use_acc=False, is_async=True)
    else:
        s_tok = warpgroup_mma(bias[0], bias[1], s_init, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(q_op[0], k_tile[0].permute((1, 0)), s_tok, is_async=True)
    if len(q_op) == 2:
        s_tok = warpgroup_mma(q_op[1], k_tile[1].permute((1, 0)), s_tok, is_async=True)
    return s_tok


@gluon.jit
def _q_operand(q_buf, s_layout: gl.constexpr, Q_IN_REGS: gl.constexpr):
    """Line 8's A operand for every key block: Q_i's tiles in shared memory (each S matmul SS), or
    with Q_IN_REGS (FwdConfig.hopper_gluon_q_in_registers) loaded into registers once (RS): each S
    matmul then reads only K_j from shared memory, whose bandwidth a 64-key SS matmul fills."""
    if Q_IN_REGS:
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        first = q_buf[0].load(a_layout)
        if len(q_buf) == 1:
            return (first,)
        else:
            return (first, q_buf[1].load(a_layout))
    else:
        return q_buf


@gluon.jit
def _p_operand(p, acc, dtype: gl.constexpr):
    """P~ in `dtype` as the register-held A operand of line 10's matmul on `acc` (a tuple of head-dim
    sections)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc[0].type.layout, k_width=2)
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _held_p(p, acc, dtype: gl.constexpr, EARLY: gl.constexpr):
    """P~ as the key loop holds it until the next block's P~ V: with EARLY (three consumers, 160
    registers a thread) already the A operand (`_p_operand`), made once the block before's P~ V is
    waited for, as FA3 does, so that the float32 P~ and the next S never hold registers together;
    else in float32, converted by `_pv_matmul` after the next S is issued (off that issue's path;
    two consumers' 240 registers hold both)."""
    if EARLY:
        return _p_operand(p, acc, dtype)
    else:
        return p


@gluon.jit
def _pv_matmul(p, v_tile, acc):
    """Line 10's P~ V added to O, one matmul per head-dim section (`v_tile`, `acc`: tuples), issued
    asynchronously from P~ as `_held_p` holds it: (the accumulators' tokens, P~'s A operand)."""
    if p.dtype == gl.float32:
        p_op = _p_operand(p, acc, v_tile[0].dtype)
    else:
        p_op = p
    first = warpgroup_mma(p_op, v_tile[0], acc[0], is_async=True)
    if len(acc) == 1:
        return (first,), p_op
    else:
        tail_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc[1].type.layout, k_width=2)
        return (first, warpgroup_mma(gl.convert_layout(p_op, tail_layout), v_tile[1], acc[1], is_async=True)), p_op


@gluon.jit
def _pv_wait(acc_tok, p_op):
    """The P~ V matmuls of `_pv_matmul` waited for: the accumulators."""
    if len(acc_tok) == 1:
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok[0], p_op])
        return (acc,)
    else:
        acc, tail, p_op = warpgroup_mma_wait(0, deps=[acc_tok[0], acc_tok[1], p_op])
        return (acc, tail)


@gluon.jit
def _scale_rows(acc, factor):
    """diag(factor) O, each head-dim section's accumulator (a tuple) times the row's factor."""
    first = acc[0] * gl.convert_layout(factor, gl.SliceLayout(1, acc[0].type.layout))[:, None]
    if len(acc) == 1:
        return (first,)
    else:
        return (first, acc[1] * gl.convert_layout(factor, gl.SliceLayout(1, acc[1].type.layout))[:, None])


@gluon.jit
def _await_turn(turn_bar, t, PART: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG (FwdConfig.hopper_gluon_pingpong; FA3's and FA4's warp-scheduler barriers at head
    dims up to 128) the consumers issue their matmuls in turns, a ring 0, 1(, 2), 0, ...: before its
    t-th step (the first block's S, then one step a loop iteration) consumer PART waits until the
    one before it in the ring has issued its t-th (consumer 0: the last one's (t-1)-th; its first
    turn is free, as a fresh mbarrier counts as having completed the phase before its first), so
    one consumer's softmax runs while another's matmuls do, in a fixed order."""
    if PINGPONG:
        if PART == 0:
            mbarrier.wait(turn_bar.index(0), (t & 1) ^ 1)
        else:
            mbarrier.wait(turn_bar.index(PART), t & 1)


@gluon.jit
def _turn_barriers(q_bar, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """`_await_turn`'s mbarriers, one a consumer, each completed once per turn by the consumer before
    it in the ring; without PINGPONG none (`q_bar` in their place, not read by the turns)."""
    if PINGPONG:
        turn_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for part in gl.static_range(CONSUMERS):
            mbarrier.init(turn_bar.index(part), count=1)
    else:
        turn_bar = q_bar
    return turn_bar


@gluon.jit
def _pass_turn(turn_bar, PART: gl.constexpr, PINGPONG: gl.constexpr):
    """`_await_turn`'s other half: once consumer PART has issued a step's matmuls, the next in the
    ring may issue its own."""
    if PINGPONG:
        CONSUMERS: gl.constexpr = turn_bar.type.shape[0]
        mbarrier.arrive(turn_bar.index((PART + 1) % CONSUMERS), count=1)


@gluon.jit
def _fwd_first_block(q_buf, q_ready, q_phase, k_smem, k_bar, empty_bar, turn_bar, it, s_layout: gl.constexpr,
                     PART: gl.constexpr, PINGPONG: gl.constexpr, bias=None, Q_IN_REGS: gl.constexpr = False):
    """A consumer's line 5 (O = 0, l = 0, m = -inf) and line 8 for its tile's first key block, the
    program's it-th (S = Q K^T, unscaled, waited for, through `_s_matmul`, issued in its turn:
    `_await_turn`), once Q's tile has landed (`q_ready` in phase `q_phase`), then that K's stage
    released: (m, l, O, the zero accumulator every S matmul starts from, S, Q's operand for the S
    matmuls: `_q_operand`). Q's tiles, K's rings and O are tuples of head-dim sections
    (`_head_sections`)."""
    ROWS: gl.constexpr = q_buf[0].type.shape[0]
    BLOCK_N: gl.constexpr = k_smem[0].type.shape[1]
    STAGES: gl.constexpr = k_smem[0].type.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = _zero_sections(ROWS, q_buf)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_ready, q_phase)
    q_op = _q_operand(q_buf, s_layout, Q_IN_REGS)
    stage = it % STAGES
    mbarrier.wait(k_bar.index(stage), (it // STAGES) & 1)
    _await_turn(turn_bar, it, PART, PINGPONG)
    s_tok = _s_matmul(q_op, _at(k_smem, stage), s_init, bias)
    _pass_turn(turn_bar, PART, PINGPONG)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    if _split_release(empty_bar, k_smem[0]):
        mbarrier.arrive(empty_bar.index(stage), count=1)  # the first K read
    return m_i, l_i, acc, s_init, s, q_op


@gluon.jit
def _fwd_block_matmuls(i, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, p, acc, s_init,
                       PART: gl.constexpr, PINGPONG: gl.constexpr, bias=None):
    """Line 8 for the program's i-th key block j (counted over its tiles: the ring's position; `_s_matmul`) and line 10's P~ V for block j - 1, both
    in flight; waits for S_j (wgmma groups complete in order; with two head-dim sections the wait
    also takes P~ V's first, leaving its second in flight), so the caller's line 9 for block j runs
    under P~ V. Both matmuls are issued in the consumer's i-th turn (`_await_turn`). Returns S_j, P~ V's accumulator tokens and A operand,
    and the empty barrier of block j - 1's V stage (with `_split_release`, K_j's is released here,
    S_j done)."""
    STAGES: gl.constexpr = k_smem[0].type.shape[0]
    V_STAGES: gl.constexpr = v_smem[0].type.shape[0]
    stage = i % STAGES
    prev = (i - 1) % V_STAGES
    mbarrier.wait(k_bar.index(stage), (i // STAGES) & 1)
    _await_turn(turn_bar, i, PART, PINGPONG)
    s_tok = _s_matmul(q_op, _at(k_smem, stage), s_init, bias)
    mbarrier.wait(v_bar.index(prev), ((i - 1) // V_STAGES) & 1)
    acc_tok, p_op = _pv_matmul(p, _at(v_smem, prev), acc)
    _pass_turn(turn_bar, PART, PINGPONG)
    s = warpgroup_mma_wait(1, deps=[s_tok])
    if _split_release(empty_bar, k_smem[0]):
        mbarrier.arrive(empty_bar.index(stage), count=1)  # K_j read
        prev = STAGES + prev
    return s, acc_tok, p_op, prev


@gluon.jit
def _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar):
    """Block j - 1's P~ V waited for and its V stage released (`prev`, the empty barrier
    _fwd_block_matmuls returned: this warpgroup is done with it), then line 10's rescale:
    O = diag(exp(m_old - m_new)) O, before P~_j V_j is added."""
    acc = _pv_wait(acc_tok, p_op)
    mbarrier.arrive(empty_bar.index(prev), count=1)
    return _scale_rows(acc, alpha)


@gluon.jit
def _pin_softmax(l_i, PIN_SOFTMAX: gl.constexpr):
    """With PIN_SOFTMAX (FwdConfig.hopper_gluon_pin_softmax) block j's softmax is held before block
    j - 1's P~ V is waited for. ptxas otherwise moves that wait (`_pv_wait`) above the softmax, which
    then runs after P~ V instead of under it (FA3's Algorithm 2 overlap, which the source has). The
    pin is a shared-memory store of the row sums l (which need every exponential of the block),
    predicated on l < 0, so never taken: ptxas keeps a store's place against the wait, as it does
    not a barrier or a fence, which carry no data (`exp2 under P V` of tools/compile_check_sm90.py).
    No buffer, no barrier: two instructions a row a thread. Returns l."""
    if PIN_SOFTMAX:
        l_i = gl.inline_asm_elementwise(
            "{\n\t.reg .pred never;\n\t.reg .b32 at;\n\tsetp.lt.f32 never, $1, 0f00000000;\n\tmov.b32 at, 0;\n\t"
            "@never st.shared.b32 [at], $1;\n\tmov.b32 $0, $1;\n\t}", "=r,r", [l_i], dtype=gl.float32,
            is_pure=False, pack=1)
    return l_i


@gluon.jit
def _fwd_last_block(end, p, acc, v_smem, v_bar, empty_bar):
    """Line 10 for the tile's last key block, the program's (end - 1)-th: O += P~ V, waited for, and
    its stage released."""
    V_STAGES: gl.constexpr = v_smem[0].type.shape[0]
    V_FIRST: gl.constexpr = empty_bar.type.shape[0] - V_STAGES  # V's first empty barrier: 0 unless released apart
    last = (end - 1) % V_STAGES
    mbarrier.wait(v_bar.index(last), ((end - 1) // V_STAGES) & 1)
    acc_tok, p_op = _pv_matmul(p, _at(v_smem, last), acc)
    acc = _pv_wait(acc_tok, p_op)
    mbarrier.arrive(empty_bar.index(V_FIRST + last), count=1)
    return acc


@gluon.jit
def _store_output(out, l_i, q_buf, o_desc, row, col0):
    """Lines 12 and 15 of one consumer: O = diag(l)^-1 O, each head-dim section staged in this
    part's Q tile (only this warpgroup read it) and written by TMA from column col0 on."""
    for section in gl.static_range(len(out)):
        tile = out[section] / gl.convert_layout(l_i, gl.SliceLayout(1, out[section].type.layout))[:, None]
        q_buf[section].store(tile.to(q_buf[section].dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc[0], [row, col0], q_buf[0])
    if len(out) == 2:
        tma.async_copy_shared_to_global(o_desc[1], [row, col0 + o_desc[0].block_type.shape[1]], q_buf[1])
    tma.store_wait(pendings=0)


@gluon.jit
def _load_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, GROUP_SHIFT: gl.constexpr,
                    Q_BUFFERS: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warp: _load_q_kv for each of the program's tiles and the key blocks it visits."""
    (q_desc, k_desc, v_desc, o_desc, LSE, Alibi, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free,
     num_tiles, num_m, num_heads, seqlen, kv_group, qk_scale, softcap_log2, stride_alibi_b, window_left, window_right,
     kx_smem, turn_bar) = args
    BLOCK_M: gl.constexpr = q_smem[0].type.shape[0] // Q_BUFFERS * q_desc[0].block_type.shape[0]
    it = 0
    local = 0
    rounds_end, rounds_step = _rounds(num_tiles, PERSISTENT)
    for first in range(0, rounds_end, rounds_step):  # a round of tiles, one a program
        tile = _round_tile(first)
        if tile < num_tiles:
            (pid_bh, b, h, start_m, q_row, kv_row0, col0, kv_col0, first_block, n_blocks, full_lo,
             full_hi) = _dense_tile(tile, num_m, num_heads, seqlen, kv_group, window_left, window_right,
                                    _head_dim(q_desc), BLOCK_M, k_desc[0].block_type.shape[0], CAUSAL, WINDOW, GROUP_SHIFT)
            _load_q_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free, q_row, col0,
                       kv_row0, kv_col0, first_block, n_blocks, it, local, Q_BUFFERS)
            it += n_blocks
            local += 1


@gluon.jit
def _softmax_partition(args, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                       PART: gl.constexpr, PINGPONG: gl.constexpr, PIN_SOFTMAX: gl.constexpr,
                       Q_IN_REGS: gl.constexpr, GROUP_SHIFT: gl.constexpr, Q_BUFFERS: gl.constexpr,
                       PERSISTENT: gl.constexpr):
    """One consumer warpgroup, for each of the program's tiles: FA2 Alg. 1 lines 5-15 for query rows
    [PART * 64, PART * 64 + 64) of the tile's block, in FA3's Algorithm 2 order, over its key blocks
    (_softmax_loop), then lines 12-15, O written through its Q buffer, which it then frees (q_free)."""
    (q_desc, k_desc, v_desc, o_desc, LSE, Alibi, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free,
     num_tiles, num_m, num_heads, seqlen, kv_group, qk_scale, softcap_log2, stride_alibi_b, window_left, window_right,
     kx_smem, turn_bar) = args
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    ROWS: gl.constexpr = q_desc[0].block_type.shape[0]
    CONSUMERS: gl.constexpr = q_smem[0].type.shape[0] // Q_BUFFERS
    # the S accumulator of one warpgroup (O's, one per head-dim section, are made by _zero_sections)
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    offs_n_f = offs_n.to(gl.float32)
    it = 0
    local = 0
    rounds_end, rounds_step = _rounds(num_tiles, PERSISTENT)
    for first in range(0, rounds_end, rounds_step):  # a round of tiles, one a program
        tile = _round_tile(first)
        if tile < num_tiles:
            (pid_bh, b, h, start_m, q_row, kv_row0, col0, kv_col0, first_block, n_blocks, full_lo,
             full_hi) = _dense_tile(tile, num_m, num_heads, seqlen, kv_group, window_left, window_right,
                                    _head_dim(q_desc), CONSUMERS * ROWS, BLOCK_N, CAUSAL, WINDOW, GROUP_SHIFT)
            alibi_log2 = 0.0
            if ALIBI:
                alibi_log2 = gl.load(Alibi + b * stride_alibi_b + h) * 1.4426950408889634
            slot, q_phase = _q_slot(local, Q_BUFFERS)
            buffer = slot * CONSUMERS + PART
            q_buf = _at(q_smem, buffer)
            mods = (softcap_log2, alibi_log2, start_m)  # ALiBi's reference row: the block's first
            window = (window_left, window_right, full_lo, full_hi)
            offs_m = start_m + PART * ROWS + gl.arange(0, ROWS, layout=row_layout)  # this part's rows in the sequence
            acc, l_i, m_i = _softmax_loop(q_buf, q_bar.index(buffer), q_phase, k_smem, v_smem, k_bar, v_bar, empty_bar,
                                          turn_bar, qk_scale, mods, window, offs_m, offs_n, offs_n_f, first_block,
                                          n_blocks, it, kx_smem, s_layout, CAUSAL, WINDOW, SOFTCAP, ALIBI, PART, PINGPONG,
                                          PIN_SOFTMAX, Q_IN_REGS, CONSUMERS)
            # lines 12-15: O = diag(l)^-1 O once, L = m + log(l) (m is in log2 units), write both
            lse2 = m_i + gl.log2(l_i)
            if ALIBI and CAUSAL:  # the query term the softmax left out (_scores_log2)
                lse2 = lse2 - mods[1] * (offs_m - mods[2]).to(gl.float32)
            gl.store(LSE + pid_bh.to(gl.int64) * seqlen + offs_m, lse2 * 0.6931471805599453)
            _store_output(acc, l_i, q_buf, o_desc, q_row + PART * ROWS, col0)
            mbarrier.arrive(q_free.index(buffer), count=1)
            it += n_blocks
            local += 1


@gluon.jit
def _softmax_loop(q_buf, q_ready, q_phase, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, qk_scale, mods,
                  window, offs_m, offs_n, offs_n_f, first_block, n_blocks, it, kx_smem, s_layout: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                  PART: gl.constexpr, PINGPONG: gl.constexpr, PIN_SOFTMAX: gl.constexpr, Q_IN_REGS: gl.constexpr,
                  CONSUMERS: gl.constexpr):
    """Lines 5-11 of one consumer over its tile's key blocks (the program's it-th on), the scores through _softmax_step (the
    first block; after it, on two consumers, `_fwd_blocks`: the blocks before the diagonal, then the diagonal ones), or, in one
    loop, through _softmax_step_alibi (ALiBi's key term added by the S matmul), _softmax_step_mods, or on three consumers
    _softmax_step; the matmuls issued in turns with PINGPONG (`_await_turn`), the softmax held before P~ V's wait with
    PIN_SOFTMAX (`_pin_softmax`): the unnormalised O, l and m."""
    ALIBI_MMA: gl.constexpr = _alibi_by_matmul(CAUSAL, WINDOW, SOFTCAP, ALIBI)
    MODS: gl.constexpr = WINDOW | SOFTCAP | ALIBI
    EARLY_P: gl.constexpr = CONSUMERS == 3  # (_held_p)
    BLOCK_N: gl.constexpr = k_smem[0].type.shape[1]
    if ALIBI_MMA:  # ALiBi's (A, B) tiles, and its key term's per-block part: slope * log2(e) * (j0 - row0)
        bias = (_alibi_query_tile(mods[1], qk_scale, k_smem[0].dtype,
                                  gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)),
                kx_smem.permute((1, 0)))
    else:
        bias = None
    # lines 5 and 8 for key block 0, then line 9
    m_i, l_i, acc, s_init, s, q_op = _fwd_first_block(q_buf, q_ready, q_phase, k_smem, k_bar, empty_bar, turn_bar, it,
                                                      s_layout, PART, PINGPONG, bias, Q_IN_REGS)
    if ALIBI_MMA:
        p, alpha, l_i, m_i = _softmax_step_alibi(s, m_i, l_i, qk_scale, mods[1] * (-mods[2]).to(gl.float32), offs_m,
                                                 offs_n, 0, window[3], BLOCK_N)
    elif MODS:
        p, alpha, l_i, m_i = _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n, offs_n_f, first_block,
                                                CAUSAL, BLOCK_N, WINDOW, SOFTCAP, ALIBI)
    else:
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, 0, window[3], BLOCK_N, CAUSAL)
    p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
    if ALIBI_MMA or MODS or EARLY_P:  # one loop: a feature's, or three consumers' (`_fwd_blocks`)
        for i in range(1, n_blocks):
            # line 8 for block j and line 10's P~ V for block j - 1; line 9 for block j runs under P~ V
            s, acc_tok, p_op, prev = _fwd_block_matmuls(it + i, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar,
                                                        p, acc, s_init, PART, PINGPONG, bias)
            if ALIBI_MMA:
                p, alpha, l_i, m_i = _softmax_step_alibi(s, m_i, l_i, qk_scale,
                                                         mods[1] * (i * BLOCK_N - mods[2]).to(gl.float32), offs_m,
                                                         offs_n, i, window[3], BLOCK_N)
            elif MODS:
                p, alpha, l_i, m_i = _softmax_step_mods(s, m_i, l_i, qk_scale, mods, window, offs_m, offs_n, offs_n_f,
                                                        first_block + i, CAUSAL, BLOCK_N, WINDOW, SOFTCAP, ALIBI)
            else:
                p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, i, window[3], BLOCK_N, CAUSAL)
            l_i = _pin_softmax(l_i, PIN_SOFTMAX)
            acc = _fwd_rescale(acc_tok, p_op, alpha, prev, empty_bar)
            p = _held_p(p, acc, v_smem[0].dtype, EARLY_P)
    else:  # the blocks before the diagonal without mask code, then (causal) the diagonal ones masked
        mask = (offs_m, offs_n, 0, 0)
        unmasked_end = n_blocks
        if CAUSAL:
            unmasked_end = gl.maximum(window[3], 1)
        p, acc, m_i, l_i = _fwd_blocks(1, unmasked_end, it, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, p,
                                       acc, s_init, m_i, l_i, qk_scale, mask, PART, PINGPONG, PIN_SOFTMAX, False,
                                       False)
        if CAUSAL:
            p, acc, m_i, l_i = _fwd_blocks(unmasked_end, n_blocks, it, q_op, k_smem, v_smem, k_bar, v_bar, empty_bar,
                                           turn_bar, p, acc, s_init, m_i, l_i, qk_scale, mask, PART, PINGPONG,
                                           PIN_SOFTMAX, False, True)
    acc = _fwd_last_block(it + n_blocks, p, acc, v_smem, v_bar, empty_bar)
    return acc, l_i, m_i


@gluon.jit
def _flash_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc, LSE,
                             num_heads, num_rows, seqlen, qk_scale, kv_group, window_left, window_right, softcap_log2,
                             Alibi, stride_alibi_b, STAGES: gl.constexpr, V_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
                             HEAD_SPLIT: gl.constexpr = False, CONSUMERS: gl.constexpr = 2,
                             PINGPONG: gl.constexpr = False, GROUP_SHIFT: gl.constexpr = 0,
                             PIN_SOFTMAX: gl.constexpr = False, Q_IN_REGS: gl.constexpr = False,
                             Q_BUFFERS: gl.constexpr = 1, PERSISTENT: gl.constexpr = False):
    """The tiles (query block, batch x head) of FA2 Section 3.2's grid over num_rows = batch x
    heads rows, one a program or, on a PERSISTENT grid (FwdConfig.hopper_gluon_persistent_below_keys: one
    program an SM), one a round (fwd_tiles.py `_round_tile`, `_rounds`), its loader warp loading the next tile's first K/V
    block and Q while the consumers finish the one before. Each
    tile is partitioned into warps as FA3 does: CONSUMERS warpgroups of 64 query rows (2 or 3) and a loader
    warp; Q_BUFFERS: Q's buffers (`_q_slot`); PINGPONG: the consumers issue their matmuls in turns
    (`_await_turn`); Q_IN_REGS: Q is the S matmuls' A operand from registers (`_q_operand`);
    GROUP_SHIFT: causal tiles start longest first across groups of rows (fwd_tiles.py `_fwd_program`). The
    descriptors view (batch * seqlen, heads * head dim); K and V have num_heads / kv_group heads
    (GQA/MQA: q head h reads kv head h // kv_group). CAUSAL reaches the partitions at compile time (a
    constexpr in their argument tuples), so the non-causal kernel has no mask code (as a run-time
    flag it cost the non-causal kernel its speed); so do WINDOW (a sliding window: only the key
    blocks it reaches are loaded), SOFTCAP and ALIBI (slopes of shape (heads,) or (batch, heads),
    batch stride stride_alibi_b). STAGES K blocks and V_STAGES V blocks in flight (fewer V than K
    where the tiles need the room: flash_attn_hopper.forward_stages). With HEAD_SPLIT the head dim
    is two sections (`_head_sections`), the *_tail_desc descriptors' boxes the second's; without,
    the tail arguments are not read."""
    q_desc, k_desc, v_desc, o_desc = _descriptor_sections(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc,
                                                          v_tail_desc, o_tail_desc, HEAD_SPLIT)
    ROWS: gl.constexpr = q_desc[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc[0].block_type.shape[0]
    BLOCK_M: gl.constexpr = CONSUMERS * ROWS
    # the causal loop's block count and its masked (diagonal) blocks assume whole key blocks per query block
    gl.static_assert(not CAUSAL or BLOCK_M % BLOCK_N == 0)
    num_m = seqlen // BLOCK_M

    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free = _fwd_shared_buffers(
        q_desc, k_desc, v_desc, STAGES, V_STAGES, CONSUMERS, Q_BUFFERS)
    if _alibi_by_matmul(CAUSAL, WINDOW, SOFTCAP, ALIBI):
        kx_smem = gl.allocate_shared_memory(q_desc[0].dtype, [BLOCK_N, 16],
                                            gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
        _alibi_key_tile(kx_smem)
    else:
        kx_smem = q_smem[0]  # not read

    args = (q_desc, k_desc, v_desc, o_desc, LSE, Alibi, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, empty_bar, q_free,
            num_m * num_rows, num_m, num_heads, seqlen, kv_group, qk_scale, softcap_log2, stride_alibi_b, window_left,
            window_right, kx_smem, _turn_barriers(q_bar, CONSUMERS, PINGPONG))
    # The run-time values travel as one tuple, the constexprs beside it in tuples written in the
    # call (a tuple assigned to a name holds run-time values: the flags would be). The default
    # partition (4 warps) and one or two workers (4 warps each) consume, one function PART apart;
    # one warp loads. Registers (flash_attn_hopper.forward_launch_options at launch, then moved):
    # two consumers 240 a thread, three 168, 160 and 160 (FA3's 160), the loader 24.
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS,
                                  GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS,
                                  GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 2, PINGPONG, PIN_SOFTMAX, Q_IN_REGS,
                                  GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_load_partition, (args, CAUSAL, WINDOW, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 0, PINGPONG, PIN_SOFTMAX, Q_IN_REGS,
                                  GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_softmax_partition, (args, CAUSAL, WINDOW, SOFTCAP, ALIBI, 1, PINGPONG, PIN_SOFTMAX, Q_IN_REGS,
                                  GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
            (_load_partition, (args, CAUSAL, WINDOW, GROUP_SHIFT, Q_BUFFERS, PERSISTENT)),
        ], [4, 1], [240, 24])
