"""Dropout's keep-mask from a counter-based RNG (Philox 4x32-10, Salmon et al. 2011, as
`tl.philox` implements it), regenerated wherever it is needed and never stored.

The key is the 64-bit seed and the counter is (query row, key column, batch x head, offset),
the row and column counted within the sequence, so the forward, the backward (in either tile
orientation) and `dropout_keep_mask` draw the same bit for the same entry. (seed, offset) come
from an int64 tensor that the API fills from PyTorch's generator and the kernels read with
`tl.load`: `torch.manual_seed` reproduces a run, and a captured CUDA graph replays with whatever
the tensor holds. An entry is kept when its uniform draw in [0, 1) is >= dropout_p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv
from .row_chunks import chunk_seed, row_spans


@triton.jit
def _dropout_keep(seed, rng_offset, bh, rows, cols, dropout_p):
    """Bool tile: which entries (rows, cols: query and key indices, 2D broadcastable) are kept."""
    zero = (rows * 0 + cols * 0).to(tl.int32)
    r, _, _, _ = tl.philox(seed, (zero + rows).to(tl.int32), (zero + cols).to(tl.int32), (zero + bh).to(tl.int32),
                           (zero + rng_offset).to(tl.int32))
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _rng_state(RngSeed):
    """(seed int64, offset as int32) from the (seed, offset) tensor."""
    return tl.load(RngSeed), tl.load(RngSeed + 1).to(tl.int32)


@triton.jit
def _dropout_mask_kernel(RngSeed, Mask, seqlen_q, seqlen_k, dropout_p,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mask (batch x heads, seqlen_q, seqlen_k) int8: 1 where kept."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bh = tl.program_id(2)
    seed, rng_offset = _rng_state(RngSeed)
    keep = _dropout_keep(seed, rng_offset, bh, offs_m[:, None], offs_n[None, :], dropout_p)
    ptrs = Mask + bh.to(tl.int64) * seqlen_q * seqlen_k + offs_m[:, None] * seqlen_k + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(offs_m < seqlen_q)[:, None] & (offs_n < seqlen_k)[None, :])


def dropout_keep_mask(rng_seed: torch.Tensor, dropout_p: float, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int) -> torch.Tensor:
    """The keep-mask the kernels draw, (batch, heads, seqlen_q, seqlen_k) bool. For packed
    variable lengths, pass max_seqlen_q/k: sequence b's mask is [b, :, :len_q, :len_k]."""
    spans = row_spans(batch, heads)
    if spans:  # the kernels ran the call in chunks (kernels/row_chunks.py), each under its own offset
        return torch.cat([dropout_keep_mask(chunk_seed(rng_seed, index), dropout_p, end - start, heads, seqlen_q,
                                            seqlen_k) for index, (start, end) in enumerate(spans)])
    mask = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=rng_seed.device)
    if mask.numel():
        block = 32
        _dropout_mask_kernel[(cdiv(seqlen_q, block), cdiv(seqlen_k, block), batch * heads)](
            rng_seed, mask, seqlen_q, seqlen_k, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return mask.bool()
