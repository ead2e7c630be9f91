"""Decoding with a KV cache: flash-attn 2.x's `flash_attn_with_kvcache`, on split-KV kernels.

The public function checks its arguments and calls PyTorch custom ops, so that
`torch.compile(fullgraph=True)` sees opaque nodes and a decode step can be captured in a CUDA
graph (kernels in kernels/decode_kernels.py):

* `fa2::rotary(q, cos, sin, start, step, interleaved) -> q_rotated`: the new query tokens'
  rotary embedding (one kernel), when cos/sin are given;
* `fa2::kvcache_append(k_cache, v_cache, k, v, cache_seqlens, ...)` writes the new keys (rotated)
  and values into the cache in place at positions cache_seqlens[b] + i (`mutates_args`; one
  kernel); only those slots are written;
* `fa2::fwd_kvcache(q, k_cache, v_cache, seqlens_k, ...) -> (out, lse)` runs the split-KV kernel
  and, with more than one split, the combine kernel.

Eager calls run the ops' implementations directly (the dispatcher's round trip costs more host
time than a decode step's kernels). Argument values that live on the device (cache lengths,
block-table entries, cache_batch_idx, cache_leftpad) are checked with one device-to-host copy,
which waits for the device: for CPU tensors at every call; for CUDA tensors at the first call of
each combination of shapes, strides, dtypes and scalar arguments, whose argument checks are then
kept (`_CHECKED`), so a decode loop's later steps neither synchronise nor check again (as
flash-attn, which never checks them); not under torch.compile, nor while a CUDA graph is being
captured (a copy cannot be captured): a graph replays the checked call's shapes, not its values.
`cache_leftpad` is taken for contiguous caches (not with a block table, as flash-attn). Paged caches take pages of any
multiple of 16 tokens (flash-attn's CUDA kernel: multiples of 256). Without a block table and
without `cache_batch_idx`, the cache's batch must equal q's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import torch

from .checks import check_flag, check_scalars, softmax_scale_or_default, window_sides
from .common import cdiv, next_power_of_2, sm_count
from .decode_kernels import (
    _fwd_kvcache_combine_kernel,
    _fwd_kvcache_split_kernel,
    _kvcache_append_kernel,
    _rotary_kernel,
)
from .launch import CachedLauncher, DirectLaunch, PlanCache
from .ops import tracing
from .row_chunks import GRID_ROWS

PAGE_MULTIPLE = 16  # page sizes the paged cache takes: multiples of this many tokens
PAGE_SPAN_LIMIT = 2 ** 31  # elements one page may span: the split kernel's in-page row offsets are int32
MAX_HEADDIM = 256  # the tile holds the whole head dim (padded to a power of two)
MAX_SPLITS = 128  # the combine kernel holds all splits of a row in one tile
# The split heuristic's and the tile's constants are design choices (two resident programs per
# SM, each with a 3-deep cp.async pipeline of 64-key K and V tiles: 70 KB of shared memory at
# head dim 128, so three fit an SM); `python -m harness.decode --tune` measures the alternatives.
PROGRAMS_PER_SM = 2  # the split heuristic's target number of programs per SM
MIN_BLOCKS_PER_SPLIT = 4  # a split reads at least this many key blocks of the cache's capacity
INTERPRETER_SMS = 4  # the CPU interpreter has no SMs; the heuristic assumes this many
GPU_CONFIG = (64, 4, 3)  # (block_n, num_warps, num_stages)
# More programs than three per SM: a 2-deep pipeline, whose shared memory (about half the
# 3-deep one's) lets five programs share an SM, so that they all run at once (choose_tile)
SHALLOW_CONFIG = (64, 4, 2)
DEEP_PROGRAMS_PER_SM = 3  # GPU_CONFIG's programs resident on an H100/H200 SM at head dim 128
INTERPRETER_CONFIG = (16, 4, 1)  # small key blocks: tiny test caches still span several blocks

_split_launcher = CachedLauncher(_fwd_kvcache_split_kernel)
_combine_launcher = CachedLauncher(_fwd_kvcache_combine_kernel)
_append_launcher = CachedLauncher(_kvcache_append_kernel)
_rotary_launcher = CachedLauncher(_rotary_kernel)


def choose_num_splits(batch: int, kv_heads: int, m_blocks: int, cache_len: int, block_n: int,
                      num_sms: int, fill_sms: bool = True) -> int:
    """Splits of the KV sequence for `num_splits=0`.

    Without splitting, batch x kv_heads x m_blocks programs run (m_blocks: query tiles of
    packed q heads). Split into as many as fit PROGRAMS_PER_SM x num_sms programs, rounding
    down so that no partial wave of programs follows the full one (at batch 1 with 8 kv heads
    on a 132-SM H200: 33 splits; with 32 kv heads 8, not 9) where fewer than num_sms run (from
    one program per SM on, no split: at batch 32 x 4k with 8 kv heads, 2 splits measured slower
    than none), keeping at least MIN_BLOCKS_PER_SPLIT key blocks
    of the cache's capacity (`cache_len`, known from shapes alone, so a CUDA graph keeps one
    split count) in each split, and at most MAX_SPLITS. With `fill_sms`, where the floor splits
    (into two or more) but leaves SMs without a program, as many more splits as give at most
    one program per SM with at least one block each (at batch 1 x 1k with 8 kv heads: 16
    one-block splits, 128 programs, instead of 4; measured faster:
    reports/h200/decisions/decode_split_floor.csv, whose shortest cache was 1k: shorter caches the floor does not split stay unsplit);
    `fill_sms=False` is the heuristic before that term (the rows measured with it)."""
    programs = batch * kv_heads * m_blocks
    if programs >= num_sms:  # every SM has a program: a split would only add the combine's pass
        return 1
    wanted = PROGRAMS_PER_SM * num_sms // programs
    blocks = cdiv(cache_len, block_n)
    most = max(1, blocks // MIN_BLOCKS_PER_SPLIT)
    if fill_sms and most > 1:
        most = max(most, min(blocks, num_sms // programs))
    return max(1, min(wanted, most, MAX_SPLITS))


def interleave_splits(paged: bool, window_left: int) -> bool:
    """Whether the splits share a sequence's key blocks round robin (else one run of consecutive
    blocks per split): round robin for a contiguous cache and under a left window, whose blocks it
    shares among all splits; one run for a paged cache without a window (likely because its
    block-table reads then stay in the lines the previous block read and its loop keeps a
    constant step; the two were not measured apart). Measured
    (reports/h200/decisions/decode_interleave.csv): round robin level or a little faster on contiguous caches, slower on paged ones, and several times
    faster under a 4096-key window at the end of a 64k cache, where one run gives the window's
    blocks to one or two splits."""
    return not paged or window_left >= 0


def kv_addressing(page_size: int, block_n: int, shallow: bool, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> dict:
    """The split kernel's PAGE_LAYOUT (0: each row's page and offset per block; 1: a key block holds
    whole pages; 2: a page holds whole key blocks; 0 too for a contiguous cache, page_size 0) and
    SAME_KV_STRIDES (K and V caches strided alike): the key rows' addresses worked out once per
    launch where pages and key blocks divide each other, V's taken from K's where their strides
    agree, faster than working out each paged row's page and offset at every block
    (docs/performance.md has the measured effect). A paged cache
    under the shallow pipeline (`shallow`: the tile is SHALLOW_CONFIG, chosen so that more programs
    share an SM) keeps the per-block addresses: the hoisted ones hold more registers per thread, and a
    decode suite run with them there was slower than the contiguous cache at batch 64 with 8 kv
    heads (likely fewer programs resident; docs/performance.md)."""
    if page_size > 0 and shallow:
        return {"PAGE_LAYOUT": 0, "SAME_KV_STRIDES": False}
    layout = 0
    if page_size > 0:
        layout = 2 if page_size % block_n == 0 else 1 if block_n % page_size == 0 else 0
    return {"PAGE_LAYOUT": layout, "SAME_KV_STRIDES": k_cache.stride() == v_cache.stride()}


def choose_tile(programs: int, num_sms: int, block_d: int = 128) -> tuple[int, int, int]:
    """The split kernel's (block_n, num_warps, num_stages) for a launch of `programs` programs
    whose tiles hold `block_d` head-dim columns: GPU_CONFIG (3 cp.async stages of 64-key K and V
    tiles) while its resident programs, DEEP_PROGRAMS_PER_SM per SM, hold them all; beyond,
    SHALLOW_CONFIG (2 stages, the same key block, so the split count is the same), of which more
    programs share an SM, so that a second, partial wave of deep-pipeline programs does not
    follow the first. Measured (reports/h200/decisions/decode_tiles.csv) at head dim 128: faster at batch 64 with 8 kv
    heads (512 programs), the same from 1024 programs on, slower where one wave of GPU_CONFIG
    holds every program. Other tile widths, where residency differs and nothing was measured,
    keep GPU_CONFIG."""
    if block_d == 128 and programs > DEEP_PROGRAMS_PER_SM * num_sms:
        return SHALLOW_CONFIG
    return GPU_CONFIG


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _rotary_meta(headdim: int, rotary_cos: torch.Tensor | None) -> dict:
    """The rotary kernels' constexprs: the head dim, and half the rotary dim (0: no rotation)."""
    half = 0 if rotary_cos is None else rotary_cos.shape[1]
    return {"HEAD_DIM": headdim, "BLOCK_D": next_power_of_2(headdim), "ROTARY_HALF": half,
            "BLOCK_HALF": max(1, next_power_of_2(half))}


def _capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Keys one sequence can hold: the cache's length, or its pages' total."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _check_values(device: torch.device, checks: Callable[[], list[tuple[torch.Tensor, str]]]) -> None:
    """Raise ValueError with the message of each (bad-entry mask, message) of `checks()` that
    holds anywhere; one device-to-host copy for all. While a CUDA graph is captured the masks are
    not even built: their elementwise kernels would otherwise be captured and run at every replay
    (a paged call's block-table check alone is about ten small kernels)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    masks = checks()
    if not masks:
        return
    flags = torch.stack([bad.any() for bad, _ in masks]).tolist()
    failed = [message for flag, (_, message) in zip(flags, masks) if flag]
    if failed:
        raise ValueError("; ".join(failed))


def _page_checks(block_table: torch.Tensor, first_page: torch.Tensor, end_page: torch.Tensor, num_pages: int,
                 what: str) -> tuple[torch.Tensor, str]:
    """The block-table entries first_page[b] <= i < end_page[b] must name pages of the pool."""
    index = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    used = (index >= first_page[:, None]) & (index < end_page[:, None])
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    return bad, f"block_table entries used by {what} must be page indices in [0, {num_pages})"


def _append_checks(k_cache, k, cache_seqlens, cache_batch_idx, block_table, rotary_cos) -> list:
    """The (bad-entry mask, message) pairs of an append's device values (`_check_values`)."""
    seqlen_new, capacity = k.shape[1], _capacity(k_cache, block_table)
    masks = [(cache_seqlens < 0, "cache_seqlens must be >= 0"),
             (cache_seqlens.long() + seqlen_new > capacity,
              (f"appending {seqlen_new} new keys at cache_seqlens must stay within the cache's "
               f"{capacity} keys per sequence"))]
    if rotary_cos is not None:
        masks.append((cache_seqlens.long() + seqlen_new > rotary_cos.shape[0],
                      (f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions; appending at "
                       f"cache_seqlens needs cache_seqlens + {seqlen_new}")))
    if block_table is not None:
        page = k_cache.shape[1]
        masks.append(_page_checks(block_table, cache_seqlens.long() // page,
                                  (cache_seqlens.long() + seqlen_new + page - 1) // page,
                                  k_cache.shape[0], "the appended keys"))
    if cache_batch_idx is not None:
        masks.append(((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0]),
                      f"cache_batch_idx must hold indices in [0, {k_cache.shape[0]})"))
    return masks


def _kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache_seqlens: torch.Tensor, cache_batch_idx: torch.Tensor | None,
                    block_table: torch.Tensor | None, rotary_cos: torch.Tensor | None,
                    rotary_sin: torch.Tensor | None, rotary_interleaved: bool) -> None:
    """Write k (rotated at its cache index cache_seqlens[b] + i when cos/sin are given) and v
    into the caches at cache_seqlens[b] + i, in place. Arguments are checked by
    `flash_attn_with_kvcache`."""
    batch, seqlen_new = k.shape[:2]
    if batch * seqlen_new == 0:
        return
    dummy = cache_seqlens  # stands for absent optional tensors (never read)
    paged = block_table is not None
    _append_launcher[(batch * seqlen_new, k.shape[2])](
        k, v, k_cache, v_cache, cache_seqlens, dummy if cache_batch_idx is None else cache_batch_idx,
        block_table if paged else dummy, k if rotary_cos is None else rotary_cos,
        k if rotary_sin is None else rotary_sin,
        *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0, 0 if rotary_cos is None else rotary_cos.stride(0),
        seqlen_new, **_rotary_meta(k.shape[3], rotary_cos), INTERLEAVED=rotary_interleaved,
        PAGE_SIZE=k_cache.shape[1] if paged else 0, HAS_BATCH_IDX=cache_batch_idx is not None,
        num_warps=1, num_stages=1)


kvcache_append = torch.library.custom_op("fa2::kvcache_append", _kvcache_append, mutates_args=("k_cache", "v_cache"))


@kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
      rotary_interleaved) -> None:
    return None


def _rotary_checks(start, seqlen: int, step: bool, rotary_cos) -> list:
    """The query rotation's positions must lie in the cos/sin tables (`_check_values`)."""
    return [((start < 0) | (start.long() + (seqlen - 1 if step else 0) >= rotary_cos.shape[0]),
             (f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions; the query "
              f"tokens need cache_seqlens + {seqlen if step else 1}"))]


def _rotary(x: torch.Tensor, rotary_cos: torch.Tensor, rotary_sin: torch.Tensor, start: torch.Tensor, step: bool,
            rotary_interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, headdim) rotated at positions start[b] + i (step) or start[b]."""
    batch, seqlen, heads, headdim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel():
        _rotary_launcher[(batch * seqlen, heads)](
            x, out, start, rotary_cos, rotary_sin, *x.stride()[:3], *out.stride()[:3], rotary_cos.stride(0), seqlen,
            **_rotary_meta(headdim, rotary_cos), INTERLEAVED=rotary_interleaved, STEP=step,
            num_warps=1, num_stages=1)
    return out


rotary = torch.library.custom_op("fa2::rotary", _rotary, mutates_args=())


@rotary.register_fake
def _(x, rotary_cos, rotary_sin, start, step, rotary_interleaved):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _attend_checks(k_cache, seqlens_k, cache_batch_idx, block_table, cache_leftpad) -> list:
    """The (bad-entry mask, message) pairs of the attention's device values (`_check_values`)."""
    capacity = _capacity(k_cache, block_table)
    masks = [((seqlens_k < 0) | (seqlens_k > capacity),
              f"cache_seqlens (plus the appended keys) must be in [0, {capacity}], the cache's keys per sequence")]
    if block_table is not None:
        page = k_cache.shape[1]
        masks.append(_page_checks(block_table, torch.zeros_like(seqlens_k),
                                  (seqlens_k.long() + page - 1) // page, k_cache.shape[0], "the cached keys"))
    if cache_batch_idx is not None:
        masks.append(((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0]),
                      f"cache_batch_idx must hold indices in [0, {k_cache.shape[0]})"))
    if cache_leftpad is not None:
        masks.append(((cache_leftpad < 0) | (cache_leftpad > seqlens_k),
                      "cache_leftpad must hold values in [0, cache_seqlens]"))
    return masks


def _fwd_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
                 cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
                 alibi_slopes: torch.Tensor | None, softmax_scale: float, window_left: int, window_right: int,
                 softcap: float, num_splits: int, cache_leftpad: torch.Tensor | None = None,
                 tile: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, seqlen_q, heads, headdim) over the first seqlens_k[b] keys of each
    sequence's cache (from key cache_leftpad[b] on, when given). Returns (out like q, contiguous;
    lse (batch, heads, seqlen_q) float32). window_right = 0 is causal; num_splits = 0 picks the
    split count (choose_num_splits); `tile`, the split kernel's (block_n, num_warps, num_stages)
    on a GPU, None for choose_tile's. The launches are planned once per combination of the
    tensors' shapes, strides, dtypes, devices and 16-byte alignment, the window, softcap and
    split and tile arguments (`_attend_plan`), as the dense forward's
    (kernels/forward.py)."""
    if q.numel() == 0:
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))
    tensors = (q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes, cache_leftpad)
    key = (window_left, window_right, softcap > 0, num_splits, None if tile is None else tuple(tile),
           *(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors))
    plan = _ATTEND_PLANS.get(key) or _ATTEND_PLANS.put(key, _attend_plan(*tensors, window_left, window_right,
                                                                            softcap, num_splits, tile))
    return plan(*tensors, softmax_scale, softcap)


_ATTEND_PLANS = PlanCache()


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of this shape (as torch.empty gives it)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _attend_plan(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes, cache_leftpad,
                 window_left: int, window_right: int, softcap: float, num_splits: int, tile: list[int] | None):
    """_fwd_kvcache for tensors like these: the tile, the split count, the grids and every
    constant argument decided once, as a function of (the tensors, softmax_scale, softcap)."""
    batch, seqlen_q, heads, headdim = q.shape
    kv_heads = k_cache.shape[2]
    if batch * kv_heads > GRID_ROWS:  # the split kernel's grid axis
        raise ValueError(f"q batch x k_cache heads: at most {GRID_ROWS} in one call (the decode kernel's grid), got "
                         f"{batch} x {kv_heads}; split the batch")
    group = heads // kv_heads
    capacity = _capacity(k_cache, block_table)
    interpreted = q.device.type != "cuda"
    # the same tiles for both layouts: 128 keys over 8 warps read a paged cache faster at batch
    # 1 x 64k (reports/h200/decode/tuning.csv, one run) but slower from batch 8 on (a suite run
    # with that tile against the suite run before it: across runs)
    block_n, num_warps, num_stages = INTERPRETER_CONFIG if interpreted else tuple(tile or GPU_CONFIG)
    block_m = max(16, min(64, next_power_of_2(seqlen_q * group)))
    m_blocks = cdiv(seqlen_q * group, block_m)
    num_sms = _num_sms(q.device)
    if num_splits == 0:
        num_splits = choose_num_splits(batch, kv_heads, m_blocks, capacity, block_n, num_sms)
    num_splits = min(num_splits, MAX_SPLITS)
    if not interpreted and tile is None:
        block_n, num_warps, num_stages = choose_tile(num_splits * batch * kv_heads * m_blocks, num_sms,
                                                     next_power_of_2(headdim))
    split = num_splits > 1
    out_shape, lse_shape = (batch, seqlen_q, heads, headdim), (batch, heads, seqlen_q)
    if split:  # the partial results' strides, as the buffers each call allocates will have them
        o_split_stride, *o_strides = _contiguous_strides((num_splits, *out_shape))[:4]
        l_split_stride, *l_strides = _contiguous_strides((num_splits, *lse_shape))[:3]
    else:
        o_split_stride = l_split_stride = 0
        o_strides, l_strides = _contiguous_strides(out_shape)[:3], _contiguous_strides(lse_shape)[:2]
    slope_batch_stride = 0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0)
    paged = block_table is not None
    # the split kernel's integer arguments between the tensors and the scale
    sizes = (*q.stride()[:3], *(k_cache.stride()[:3]), *(v_cache.stride()[:3]),
             o_split_stride, *o_strides, l_split_stride, *l_strides,
             block_table.stride(0) if paged else 0, slope_batch_stride,
             block_table.shape[1] * k_cache.shape[1] if paged else 0, seqlen_q, kv_heads)
    module = sys.modules[__name__]
    split_launch = DirectLaunch(module, "_split_launcher", (num_splits, batch * kv_heads, m_blocks), dict(
        GROUP=group, HEAD_DIM=headdim, BLOCK_D=next_power_of_2(headdim),
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=k_cache.shape[1] if paged else 0,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_LEFTPAD=cache_leftpad is not None,
        INTERLEAVE_SPLITS=interleave_splits(paged, window_left),
        **kv_addressing(k_cache.shape[1] if paged else 0, block_n,
                        not interpreted and (block_n, num_warps, num_stages) == SHALLOW_CONFIG, k_cache, v_cache),
        num_warps=num_warps, num_stages=num_stages))
    combine_launch = DirectLaunch(module, "_combine_launcher", (batch * seqlen_q * heads,), {
        "HEAD_DIM": headdim, "BLOCK_D": next_power_of_2(headdim), "BLOCK_S": max(2, next_power_of_2(num_splits)),
        "num_warps": 4, "num_stages": 1})

    def run(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes, cache_leftpad,
            softmax_scale: float, softcap: float):
        out = torch.empty(out_shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
        o_dst, l_dst = out, lse
        if split:
            o_dst = torch.empty((num_splits, *out_shape), device=q.device, dtype=torch.float32)
            l_dst = torch.empty((num_splits, *lse_shape), device=q.device, dtype=torch.float32)
        dummy = seqlens_k  # stands for absent optional tensors (never read)
        split_launch(q, k_cache, v_cache, o_dst, l_dst, seqlens_k,
                     dummy if cache_batch_idx is None else cache_batch_idx,
                     dummy if block_table is None else block_table, dummy if alibi_slopes is None else alibi_slopes,
                     dummy if cache_leftpad is None else cache_leftpad,
                     *sizes, softmax_scale, softcap, window_left, window_right)
        if split:
            combine_launch(o_dst, l_dst, out, lse, o_split_stride, l_split_stride, num_splits, heads, seqlen_q)
        return out, lse

    return run


fwd_kvcache = torch.library.custom_op("fa2::fwd_kvcache", _fwd_kvcache, mutates_args=())


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes, softmax_scale,
      window_left, window_right, softcap, num_splits, cache_leftpad=None, tile=None):
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {t.device}")


class _Call(NamedTuple):
    """A call's checked scalar arguments, normalised (`_check_arguments`)."""

    softmax_scale: float
    rotary_step: bool  # causal or local: q's rotary positions step with the new keys (flash-attn's rule)
    window_left: int
    window_right: int  # 0 when causal
    softcap: float
    num_splits: int
    capacity: int  # keys one sequence can hold
    rotary_interleaved: bool


def _check_arguments(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, alibi_slopes, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                     num_splits) -> _Call:
    """Every check of flash_attn_with_kvcache's arguments that needs no device value."""

    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4D tensor (batch, seqlen_q, heads, headdim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    batch, _, heads, headdim = q.shape
    if not 0 < headdim <= MAX_HEADDIM:
        raise ValueError(f"q's head dim must be in 1..{MAX_HEADDIM}, got {headdim}")
    device = q.device
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be a 4D tensor, got {getattr(cache, 'shape', type(cache).__name__)}")
        if cache.dtype != q.dtype or cache.device != device:
            raise TypeError(f"{name} must be {q.dtype} on {device} like q, got {cache.dtype} on {cache.device}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (it is written in place)")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache's shape {tuple(v_cache.shape)} must equal k_cache's {tuple(k_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache's head dim {k_cache.shape[3]} must equal q's {headdim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k_cache's kv heads ({kv_heads}) must divide q's heads ({heads})")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be an int32 tensor, got "
                            f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.device != device:
            raise ValueError(f"block_table must be (batch={batch}, max_pages) on {device}, got "
                             f"{tuple(block_table.shape)} on {block_table.device}")
        if k_cache.shape[1] % PAGE_MULTIPLE or k_cache.shape[1] == 0:
            raise ValueError(f"page size (k_cache.shape[1] with a block_table) must be a positive multiple of "
                             f"{PAGE_MULTIPLE}, got {k_cache.shape[1]}")
        page_span = k_cache.shape[1] * max(k_cache.stride(1), v_cache.stride(1))
        if page_span >= PAGE_SPAN_LIMIT:  # the kernel works out a row's offset within its page in int32
            raise ValueError(f"a page of k_cache/v_cache must span fewer than {PAGE_SPAN_LIMIT} elements (page "
                             f"size x row stride), got {page_span}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with a block_table (the table picks the pages)")
    elif cache_batch_idx is not None:
        _check_tensor("cache_batch_idx", cache_batch_idx, torch.int32, (batch,), device)
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache's batch {k_cache.shape[0]} must equal q's batch {batch} "
                         "(or pass cache_batch_idx)")
    if cache_leftpad is not None:
        if block_table is not None:  # as flash-attn: a paged cache starts each sequence on its first page
            raise ValueError("cache_leftpad cannot be used with a block_table")
        _check_tensor("cache_leftpad", cache_leftpad, torch.int32, (batch,), device)
    capacity = _capacity(k_cache, block_table)

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is needed with k and v: it says where they are appended")
        for name, new in (("k", k), ("v", v)):
            if not isinstance(new, torch.Tensor) or new.dim() != 4 or new.shape[0] != batch or \
                    tuple(new.shape[2:]) != (kv_heads, headdim):
                raise ValueError(f"{name} must be (batch={batch}, seqlen_new, kv_heads={kv_heads}, "
                                 f"headdim={headdim}), got {getattr(new, 'shape', type(new).__name__)}")
            if new.dtype != q.dtype or new.device != device:
                raise TypeError(f"{name} must be {q.dtype} on {device} like q, got {new.dtype} on {new.device}")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v's shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin apply only when k and v are appended")
        if rotary_cos.dim() != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape) or \
                not 0 < 2 * rotary_cos.shape[1] <= headdim:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                             f"<= headdim ({headdim}), got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if isinstance(cache_seqlens, bool) or not (cache_seqlens is None or isinstance(cache_seqlens, (int, torch.Tensor))):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        seqlen_new = 0 if k is None else k.shape[1]
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens={cache_seqlens} (+ {seqlen_new} appended) must be in "
                             f"[0, {capacity}], the cache's keys per sequence")
    elif cache_seqlens is not None:
        _check_tensor("cache_seqlens", cache_seqlens, torch.int32, (batch,), device)
    if alibi_slopes is not None and (
            not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32
            or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)) or alibi_slopes.device != device):
        raise ValueError(f"alibi_slopes must be float32 of shape ({heads},) or ({batch}, {heads}) on {device}")
    causal = check_flag("causal", causal)
    local = window_sides(window_size, False) != (-1, -1)
    window_left, window_right = window_sides(window_size, causal)
    _, softcap = check_scalars(0.0, softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: heuristic, 1: no split), got {num_splits!r}")
    return _Call(softmax_scale_or_default(softmax_scale, headdim), causal or local, window_left, window_right, softcap,
                 num_splits, capacity, check_flag("rotary_interleaved", rotary_interleaved))


# CUDA calls whose arguments passed `_check_arguments`, by the tensors' shapes, strides, dtypes and
# devices and the scalar arguments (`_call_key`): a repeated call (each decode step) skips the checks
# and its device values' check (`_check_values`, which waits for the GPU).
_CHECKED = PlanCache()
_EAGER_OPS = SimpleNamespace(rotary=_rotary, kvcache_append=_kvcache_append, fwd_kvcache=_fwd_kvcache)


def _cacheable(q) -> bool:
    """Whether a call on q's device keeps its checks in _CHECKED: a CUDA tensor's (a CPU tensor's
    values cost no synchronisation to check)."""
    return type(q) is torch.Tensor and q.is_cuda


def _call_key(tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of a CUDA call in _CHECKED, or None for a call checked every time (CPU tensors, a
    tensor subclass or fake tensor, a scalar given as a tensor, a window given as a tensor)."""
    if not _cacheable(tensors[0]):
        return None
    key = []
    for t in tensors:
        if type(t) is torch.Tensor:
            key.append((t.shape, t.stride(), t.dtype, t.device))
        elif t is None or type(t) is int:
            key.append(t)
        else:
            return None
    for scalar in scalars:
        if isinstance(scalar, (torch.Tensor, list)):
            return None
    return (*key, *scalars)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            tile=None):
    """flash-attn 2.x's `flash_attn_with_kvcache`: attention of q over a KV cache, appending k/v first.

    q (batch, seqlen_q, heads, headdim), fp16/bf16/fp32; k_cache/v_cache (batch_cache, seqlen_cache,
    kv_heads, headdim), or with `block_table` (batch, max_pages) int32 a paged cache (num_pages,
    page_size, kv_heads, headdim), page_size a multiple of 16; kv_heads divides heads (GQA/MQA).
    `cache_seqlens` (int, or (batch,) int32): keys already cached per sequence (None: the whole
    cache). With k, v (batch, seqlen_new, kv_heads, headdim), these are written into the cache in
    place at cache_seqlens[b] + i and attended to; with rotary_cos/rotary_sin (seqlen_ro,
    rotary_dim / 2) they rotate k at those positions and q at cache_seqlens[b] + i when causal or
    local, else all of q at cache_seqlens[b]. `cache_batch_idx` (batch,) int32 picks each
    sequence's row of a contiguous cache. `cache_leftpad` (batch,) int32 (contiguous caches only):
    sequence b's keys start at cache index cache_leftpad[b] (left padding; rotary positions stay
    cache indices, as flash-attn's). causal aligns to the end of each sequence's keys;
    window_size, softcap and alibi_slopes ((heads,) or (batch, heads) float32) as flash-attn.
    num_splits: 1 no split, 0 the heuristic (`choose_num_splits`), n > 1 that many (at most 128).
    tile (not in flash-attn): the split kernel's (block_n, num_warps, num_stages) on a GPU instead
    of `choose_tile`'s (`python -m harness.decode --tune` times the alternatives). Returns out (batch, seqlen_q, heads, headdim), and with return_softmax_lse also lse (batch,
    heads, seqlen_q) float32 (+inf for a row that sees no key, whose output is zero)."""
    key = _call_key((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, block_table, alibi_slopes),
                    (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                     None if tile is None else tuple(tile)))
    call = None if key is None else _CHECKED.get(key)
    check_values = call is None  # device values: at every CPU call, at a CUDA call's first (a sync)
    if tile is not None and (len(tile) != 3 or not all(isinstance(x, int) and x > 0 for x in tile)):
        raise ValueError(f"tile must be (block_n, num_warps, num_stages), three positive ints, or None, got {tile!r}")
    if call is None:
        call = _check_arguments(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_size, softcap,
                                rotary_interleaved, num_splits)
    traced = tracing(q)
    # eagerly the implementations themselves (the dispatcher's round trip costs more host time
    # than a decode step's kernels); traced, the ops, which torch.compile sees as opaque nodes
    ops = torch.ops.fa2 if traced else _EAGER_OPS
    batch = q.shape[0]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if block_table is not None:
        block_table = block_table.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    seqlens_k = cache_seqlens
    if k is not None:
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        seqlens_k = cache_seqlens + k.shape[1]
    elif seqlens_k is None:
        seqlens_k = torch.full((batch,), call.capacity, dtype=torch.int32, device=q.device)
    if check_values and not traced:
        def masks():
            found = _attend_checks(k_cache, seqlens_k, cache_batch_idx, block_table, cache_leftpad)
            if k is not None:
                found += _append_checks(k_cache, k, cache_seqlens, cache_batch_idx, block_table, rotary_cos)
                if rotary_cos is not None:
                    found += _rotary_checks(cache_seqlens, q.shape[1], call.rotary_step, rotary_cos)
            return found

        _check_values(q.device, masks)
        if key is not None:  # kept once its values passed too
            _CHECKED.put(key, call)
    if k is not None:
        if rotary_cos is not None:
            q = ops.rotary(q, rotary_cos, rotary_sin, cache_seqlens, call.rotary_step, call.rotary_interleaved)
        ops.kvcache_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                           rotary_sin, call.rotary_interleaved)
    out, lse = ops.fwd_kvcache(q, k_cache, v_cache, seqlens_k, cache_batch_idx, block_table, alibi_slopes,
                               call.softmax_scale, call.window_left, call.window_right, call.softcap,
                               call.num_splits, cache_leftpad, None if tile is None else list(tile))
    return (out, lse) if return_softmax_lse else out
