"""The Gluon forwards' tiles (kernels/hopper/fwd.py, fwd_varlen.py): which (query block, batch x
head) tile a program runs in each round of a grid of one program a tile or a persistent one, in
what order the tiles start, which Q buffer each takes, and what a dense tile covers (its rows, its
key blocks, the blocks with a mask). The loader warp and every consumer warpgroup work these out
alike, so they agree on every tile without exchanging a word."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _fwd_program(tile, num_m, num_heads, CAUSAL: gl.constexpr, GROUP_SHIFT: gl.constexpr = 0):
    """Tile `tile` of the (query block, batch x head) grid flattened query block first (num_m
    blocks a row; a program runs one a round of them: `_round_tile`):
    its (query block, batch x head, batch, head); causal runs the last query block (the most key
    blocks) first: the longest tiles start early. With GROUP_SHIFT (causal only;
    FwdConfig.hopper_gluon_head_section) the tiles are renumbered so that each group of
    2**GROUP_SHIFT (batch x head) rows starts x-major, every row's longest query block first, then
    every row's next (FA4's longest-processing-time scheduler over L2-sized head sections): tiles
    start in turn, and in the grid's own order the last rows' longest tiles would start near the
    end. Shifts and masks only: the rows are a multiple of the group."""
    block = tile % num_m
    row = tile // num_m
    if CAUSAL and GROUP_SHIFT:
        rows_mask: gl.constexpr = (1 << GROUP_SHIFT) - 1
        within = (row & rows_mask) * num_m + block
        pid_m = num_m - 1 - (within >> GROUP_SHIFT)
        pid_bh = (row & ~rows_mask) | (within & rows_mask)
    else:
        if CAUSAL:
            pid_m = num_m - 1 - block
        else:
            pid_m = block
        pid_bh = row
    return pid_m, pid_bh, pid_bh // num_heads, pid_bh % num_heads


@gluon.jit
def _rounds(num_tiles, PERSISTENT: gl.constexpr):
    """The end and step of a program's loop over rounds of tiles (`for first in range(0, end,
    step)`): on a persistent grid every round's, num_programs apart; on a grid of one program a tile
    the one round, with constant bounds, so that the compiler drops the loop and the kernel runs its
    tile straight through (the loop kept there cost the head-dim-64 forward time at 8k keys)."""
    if PERSISTENT:
        return num_tiles, gl.num_programs(0)
    else:
        return 1, 1


@gluon.jit
def _round_tile(first):
    """The tile this program runs in the round of tiles from `first` (one a program: a grid of one
    program a tile has one round), in rounds that alternate direction: program p takes tile
    first + p in even rounds and first + num_programs - 1 - p in odd ones. Tiles come longest first
    (`_fwd_program`), so a persistent grid's first programs would otherwise take the longest tile of
    every round; alternating pairs a round's longest with the next round's shortest."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    odd = (first // programs) & 1
    return first + pid + odd * (programs - 1 - 2 * pid)


@gluon.jit
def _q_slot(local, Q_BUFFERS: gl.constexpr):
    """The Q buffer of a program's `local`-th tile and the phase its mbarriers are in: Q_BUFFERS
    (1 or 2) buffers taken in turn, so with two the next tile's Q loads while this one's runs."""
    return local % Q_BUFFERS, (local // Q_BUFFERS) & 1


@gluon.jit
def _dense_tile(tile, num_m, num_heads, seqlen, kv_group, window_left, window_right, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                GROUP_SHIFT: gl.constexpr):
    """What a tile of the dense kernel covers (`_fwd_program`), which the loader and every consumer
    work out alike: (batch x head, batch, head, query block's first row in its sequence, its row
    in Q's (batch * seqlen) view, K's and V's first row there, Q's and K's first columns, the first
    key block and how many, and [full_lo, full_hi): the key blocks without a mask (a window's; causal:
    full_hi is the first diagonal block)."""
    pid_m, pid_bh, b, h = _fwd_program(tile, num_m, num_heads, CAUSAL, GROUP_SHIFT)
    start_m = pid_m * BLOCK_M
    full_lo = 0
    full_hi = 0
    if WINDOW:
        first_block, n_blocks, full_lo, full_hi = _window_key_blocks(start_m, seqlen, window_left, window_right,
                                                                     BLOCK_M, BLOCK_N)
    elif CAUSAL:  # key blocks up to the diagonal, the last BLOCK_M / BLOCK_N masked
        first_block = 0
        n_blocks = (start_m + BLOCK_M) // BLOCK_N
        full_hi = n_blocks - BLOCK_M // BLOCK_N
    else:
        first_block = 0
        n_blocks = seqlen // BLOCK_N
    return (pid_bh, b, h, start_m, b * seqlen + start_m, b * seqlen, h * HEAD_DIM, (h // kv_group) * HEAD_DIM,
            first_block, n_blocks, full_lo, full_hi)


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
