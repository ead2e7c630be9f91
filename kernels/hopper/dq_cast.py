"""The fused dQ's float32 accumulator and its cast to dQ. The Gluon dK/dV kernels add each 64 x 64
tile of dQ (and 64 x 32 at head dim 96) into the accumulator as their consumers' registers lie
(shared.DQ_TILE_BASES): a 64 x 64 tile is two 64 x 32 ones side by side, so the accumulator is, per
64-row block, its columns' 64 x 32 tiles in order, and any two neighbours read as one 64 x 64 tile.
The kernels add dS K_j unscaled; these Triton kernels put each tile back in rows, apply the softmax
scale once (FA3's and FA4's dQ postprocess does the same), then cast and store it (each row's columns side by
side: faster than scattering each element to its place, docs/performance.md); 64-column tiles
where the row's columns (heads x head dim) are a multiple of 64, else 32-column ones. The varlen accumulator
holds each sequence's tiles from a padded row of its own (FA3's layout for its dQaccum), so that
no tile holds two sequences."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import CachedLauncher
from .shared import BWD_BLOCK_M


@triton.jit
def _register_tile_in_rows(acc, COLS: tl.constexpr):
    """A register-order tile's 64 * COLS floats (DQ_TILE_BASES, COLS 64 or 32) as its [64, COLS]
    block in rows: the offsets' bit groups, from the highest (columns 32-8 or 16-8, rows 32-16,
    rows 4-1, columns 4-2, row 8, column 1), as dimensions, permuted to the block's (rows 32-16,
    row 8, rows 4-1, columns 32-8, columns 4-2, column 1), so that each row's columns are side by
    side for the stores."""
    return tl.reshape(tl.permute(tl.reshape(acc, (COLS // 8, 4, 8, 4, 2, 2)), (1, 4, 2, 0, 3, 5)), (64, COLS))


@triton.jit
def _dq_rows_from_register_tiles_kernel(DQAccum, DQ, col_tiles, softmax_scale, COLS: tl.constexpr):
    """One 64 x COLS tile of the fused dQ's accumulator in register order (DQ_TILE_BASES; tiles in
    the order of the (batch x seqlen, heads x head dim) view's 64 x COLS blocks, `col_tiles` to a
    row of blocks) put in rows (_register_tile_in_rows), scaled and cast into its block of DQ, that view of
    a contiguous tensor, each row's COLS columns stored side by side."""
    tile = tl.program_id(0)
    acc = _register_tile_in_rows(tl.load(DQAccum + tile.to(tl.int64) * (64 * COLS) + tl.arange(0, 64 * COLS)), COLS)
    block_row, block_col = tile // col_tiles, tile % col_tiles
    rows, cols = tl.arange(0, 64)[:, None], tl.arange(0, COLS)[None, :]
    dst = (block_row.to(tl.int64) * 64 + rows) * (col_tiles * COLS) + block_col * COLS + cols
    tl.store(DQ + dst, (acc * softmax_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dq_rows_from_padded_register_tiles_kernel(DQAccum, DQ, CuSeqQ, col_tiles, softmax_scale, COLS: tl.constexpr):
    """One 64 x COLS tile (query block j of sequence b, column block c: the program's place) of the
    varlen accumulator (varlen_dq_accumulator's padded rows, DQ_TILE_BASES' tiles) put in rows,
    scaled and cast into sequence b's rows of DQ, a contiguous (total_q, heads, head dim) tensor: a program
    past its sequence's tiles does nothing, the others read their whole padded tile (within the
    accumulator: varlen_dq_accumulator) and store only the sequence's rows, each row's columns side
    by side."""
    j, b, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CuSeqQ + b)
    seqlen = tl.load(CuSeqQ + b + 1) - q_start
    if j * 64 < seqlen:
        tile = ((q_start + b * 64) // 64 + j).to(tl.int64) * col_tiles + c
        acc = _register_tile_in_rows(tl.load(DQAccum + tile * (64 * COLS) + tl.arange(0, 64 * COLS)), COLS)
        rows, cols = tl.arange(0, 64)[:, None], tl.arange(0, COLS)[None, :]
        dst = (q_start + j * 64 + rows).to(tl.int64) * (col_tiles * COLS) + c * COLS + cols
        tl.store(DQ + dst, (acc * softmax_scale).to(DQ.dtype.element_ty), mask=j * 64 + rows < seqlen)


def _tile_cols(columns: int) -> int:
    """The cast's tile width for rows of `columns` floats (heads x head dim): 64 where they hold
    whole 64-column tiles, else 32 (head dim 96 with an odd number of heads)."""
    return 64 if columns % 64 == 0 else 32


_dq_rows_from_register_tiles_launcher = CachedLauncher(_dq_rows_from_register_tiles_kernel)
_dq_rows_from_padded_register_tiles_launcher = CachedLauncher(_dq_rows_from_padded_register_tiles_kernel)


def dq_from_accumulator(dq_accum: torch.Tensor, dtype: torch.dtype, softmax_scale: float) -> torch.Tensor:
    """dQ in `dtype`, shaped like the fused dQ's float32 accumulator `dq_accum` (contiguous like q,
    its 64 x 32 tiles in register order, pairs of them the 64 x 64 ones, dS K unscaled), from that
    accumulator times `softmax_scale`."""
    columns = dq_accum.shape[-2] * dq_accum.shape[-1]  # heads x head dim
    if not dq_accum.is_contiguous() or columns % 32 or dq_accum.numel() % (64 * columns):
        raise ValueError("the register-order accumulator is a contiguous (..., heads, head dim) float32 tensor "
                         f"of whole 64 x 32 blocks; got shape {tuple(dq_accum.shape)}")
    dq = torch.empty(dq_accum.shape, device=dq_accum.device, dtype=dtype)
    cols = _tile_cols(columns)
    _dq_rows_from_register_tiles_launcher[(dq_accum.numel() // (64 * cols),)](dq_accum, dq, columns // cols, softmax_scale,
                                                                        COLS=cols)
    return dq


def _varlen_dq_accumulator_rows(total_q: int, batch: int) -> int:
    """Rows of the varlen accumulator: total_q + 64 batch, rounded up to whole tiles (sequence b's
    last tile ends by (cu_seqlens_q[b + 1] + 64 b) // 64 * 64 + 64)."""
    return triton.cdiv(total_q + batch * BWD_BLOCK_M, BWD_BLOCK_M) * BWD_BLOCK_M


def check_varlen_dq_accumulator(dq_accum: torch.Tensor, shape, batch: int) -> None:
    """A varlen accumulator as varlen_dq_accumulator makes it for packed `shape` and `batch`
    sequences, else a ValueError naming what differs (a TMA reduce-add past its end would be
    dropped silently)."""
    total_q, heads, headdim = shape
    rows = _varlen_dq_accumulator_rows(total_q, batch)
    if (dq_accum.dtype != torch.float32 or not dq_accum.is_contiguous()
            or tuple(dq_accum.shape) != (rows, heads, headdim)):
        raise ValueError(f"dq_accum must be a contiguous float32 ({rows}, {heads}, {headdim}) tensor for {batch} "
                         f"sequences of {total_q} tokens (varlen_dq_accumulator), got "
                         f"{dq_accum.dtype} {tuple(dq_accum.shape)}")


def varlen_dq_accumulator(q: torch.Tensor, batch: int) -> torch.Tensor:
    """The varlen dK/dV kernel's float32 dQ accumulator (uninitialised) for packed q (total_q,
    heads, head dim) of `batch` sequences: (rows, heads, head dim) with room for each sequence's
    64-row tiles from its padded row (cu_seqlens_q[b] + 64 b) // 64 * 64, FA3's padded offset, so
    that no tile holds two sequences: rows = total_q + 64 batch, rounded up to whole tiles."""
    total_q, heads, headdim = q.shape
    rows = _varlen_dq_accumulator_rows(total_q, batch)
    return torch.empty((rows, heads, headdim), device=q.device, dtype=torch.float32)


def dq_from_varlen_accumulator(dq_accum: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                               shape: tuple[int, int, int], dtype: torch.dtype, softmax_scale: float) -> torch.Tensor:
    """dQ in `dtype` and packed `shape` (total_q, heads, head dim) from the varlen accumulator
    `dq_accum` (varlen_dq_accumulator's, dS K unscaled) times `softmax_scale`."""
    batch = cu_seqlens_q.shape[0] - 1
    check_varlen_dq_accumulator(dq_accum, shape, batch)
    total_q, heads, headdim = shape
    dq = torch.empty(shape, device=dq_accum.device, dtype=dtype)
    if total_q and not (batch and max_seqlen_q):  # the cast would leave dq's rows unwritten
        raise ValueError(f"{total_q} packed tokens need at least one sequence and max_seqlen_q >= 1, got "
                         f"{batch} sequences and max_seqlen_q={max_seqlen_q}")
    if total_q:
        # query blocks on the axis CUDA does not limit to 65535; the batch within it (the varlen
        # kernels' dispatch keeps batch x heads so), the column tiles too (2 x heads at head dim 128)
        cols = _tile_cols(heads * headdim)
        grid = (triton.cdiv(max_seqlen_q, BWD_BLOCK_M), batch, heads * headdim // cols)
        _dq_rows_from_padded_register_tiles_launcher[grid](dq_accum, dq, cu_seqlens_q, heads * headdim // cols,
                                                           softmax_scale, COLS=cols)
    return dq
