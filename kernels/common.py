"""Pieces the forward and backward Triton kernels share: jit helpers for tiles, masks and the
causal key range, and the host helpers of their launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2):   ln(x) = log2(x) * LN2


@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2D tile, masking only the dimensions that can run out of bounds (so the
    masks compile out for block-aligned lengths and power-of-two head dims)."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=rows_ok[:, None] & cols_ok[None, :])
        else:
            tl.store(ptrs, tile, mask=rows_ok[:, None])
    else:
        if CHECK_COLS:
            tl.store(ptrs, tile, mask=cols_ok[None, :])
        else:
            tl.store(ptrs, tile)


@triton.jit
def _batch_head(pid_bh, num_heads):
    """(batch, head) of the program whose grid index over batch x heads is `pid_bh`, as int64
    so that offsets past 2^31 elements do not overflow."""
    return (pid_bh // num_heads).to(tl.int64), (pid_bh % num_heads).to(tl.int64)


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):
    """Key blocks a query block [start_m, start_m + BLOCK_M) visits, as [0, full) without a
    mask and [full, end) with one. Causal is bottom-right aligned: row i sees key j iff
    j <= i + seqlen_k - seqlen_q. Blocks entirely above the diagonal are never visited."""
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        end = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), seqlen_k)
        full = tl.minimum(tl.maximum(start_m + offset + 1, 0), seqlen_k) // BLOCK_N * BLOCK_N
    else:
        end = seqlen_k
        full = seqlen_k // BLOCK_N * BLOCK_N
    return full, end


@triton.jit
def _finalize(acc, l_i, m_i):
    """FA2 Alg. 1 lines 12-13: O = diag(l)^-1 O once, L = m + log(l) (natural log). A row
    that saw no key has l = 0: it outputs 0 and L = +inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(l_i)) * LN2)
    return out, lse


@triton.jit
def _query_block_start(CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query row of this program. Causal: the last query block (the most key blocks to
    visit) is launched first, so the long programs start early and short ones fill the tail
    of the last wave (longest-processing-time-first, as flash-attn's CUDA kernels order them)."""
    if CAUSAL:
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    return tl.program_id(0) * BLOCK_M




def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host: triton.cdiv is a constexpr function, about 3 us a call under
    cProfile (up to four calls per forward+backward; see kernels/launch.py on why host time
    matters)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1) on the host, as triton.next_power_of_2
    without its constexpr-function wrapper (host time, as `cdiv`)."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def l2_cache_bytes(device_index: int) -> int:
    """The L2 cache of CUDA device `device_index` in bytes, as torch reports it; a torch without
    the property, or without a CUDA device (a launch recorded on the CPU): 50 MiB (the H100/H200's)."""
    if not torch.cuda.is_available():
        return 50 << 20
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 50 << 20))


@functools.cache
def sm_count(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index`; without a CUDA device (a launch
    recorded on the CPU): 132 (the H100 SXM's and the H200's)."""
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def interpreter_enabled() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, sequence and head strides of a (batch, seqlen, heads, headdim) tensor."""
    return t.stride()[:3]


def torch_scratch(size: int, alignment: int, stream):
    """Global scratch for Triton from torch's caching allocator, aligned as Triton asks (a
    view into a slightly larger buffer, which the view keeps alive)."""
    buffer = torch.empty(size + alignment, dtype=torch.int8, device="cpu" if interpreter_enabled() else "cuda")
    offset = -buffer.data_ptr() % alignment
    return buffer[offset:offset + size]


def ensure_descriptor_allocator() -> None:
    """Descriptors made inside a kernel (tl.make_tensor_descriptor) live in a global scratch
    buffer that Triton asks the host for at launch. Triton keeps that allocator in a context
    variable (per thread), so this is checked at every TMA launch: torch's allocator is set
    only where none is, and an allocator the caller set is kept."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(torch_scratch)
