"""The host side of the Gluon kernels for Hopper (kernels/hopper/): tensor descriptors, grids,
per-shape launch plans and the entry points forward.py and backward.py call.

The kernels (FA2 Algorithms 1 and 2 in FlashAttention-3's warp layout, Shah et al. 2024), by role:
- kernels/hopper/fwd.py: the forward, dense (GQA/MQA, sliding windows, softcap, ALiBi as
  constexpr flags), and kernels/hopper/fwd_varlen.py over packed variable lengths;
- kernels/hopper/bwd.py: the dK/dV kernel, with line 15's dQ fused (TMA reduce-adds into a
  float32 accumulator) or not, and the steps kernels/hopper/bwd_varlen.py's packed-sequence
  variant and kernels/hopper/bwd_wide.py's kernel for head dims 192 and 256 share with it;
- kernels/hopper/dq_cast.py: the fused dQ's accumulator and its cast to dQ;
- kernels/hopper/shared.py: tile sizes, layouts, the TMA reduce-add.

Scope (`dispatch.fwd_memory_path` picks this path, "gluon-ws", only where
`dispatch.hopper_gluon_applies` holds, and `forward.flash_attn_forward` only on an sm_90 device):
query and key lengths equal and whole query blocks (128 rows; at head dim 64 without a feature, 192); head dims 96 and 128 from 1k keys, 192 and
256 from 512 (in 64-key blocks, FwdConfig.hopper_gluon_block_n; 96 and 192 as two head-dim
sections, `head_sections`), 64 from 1k, causal 4k (on 192 query rows, FwdConfig.hopper_gluon_block_m;
at 2k causal it was slower than the Triton kernel); fp16 or bf16; each tensor a (batch * seqlen, heads *
head dim) 2D view with rows that do not overlap. Beyond dense attention they take GQA/MQA, sliding windows, softcap and ALiBi (the
backward with dQ fused only, `dispatch.bwd_dkdv_path`). Packed variable lengths have kernels of
their own, causal or not and with no other feature: a forward (`dispatch.hopper_gluon_varlen_applies`)
and, at head dims 64, 96 and 128 (VARLEN_BWD_HEAD_DIMS), a dK/dV kernel with dQ fused
(`dispatch.hopper_gluon_varlen_bwd_applies`).
A dense call off the dense kernels' scope (lengths off the 128-row grid, fewer or more queries
than keys) runs these varlen kernels with each batch row a packed sequence
(`dispatch.GluonPath.PACKED`).
`backward.flash_attn_backward` takes the dK/dV kernels at head dims 64, 96, 128, 192 and 256
(BWD_HEAD_DIMS; at 192 and 256 with GQA but no window, softcap or ALiBi) from 1k keys (64 and 256: 512) in the same scope
(`dispatch.bwd_dkdv_path`), with dQ fused unless asked to be deterministic
(`dispatch.bwd_gluon_fuses_dq`). Dropout's forward runs on the Triton kernels, its backward on
the dense dK/dV kernel with dQ fused where BwdConfig.hopper_gluon_dropout asks (the table's at head
dims 64, 96 and 128; kernels/hopper/dropout.py: the same keep-mask), else on the Triton kernels. The
backward's schedule and launch order are BwdConfig fields (kernels/configs.py: hopper_gluon_dq_first,
hopper_gluon_head_section, hopper_gluon_causal_head_section, hopper_gluon_varlen_grid).

Gluon has no CPU interpreter: the CPU tests compile these kernels for sm_90, the GPU tests run them.
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import l2_cache_bytes, sm_count
from .configs import BwdConfig
from .hopper.bwd import _flash_bwd_dkdv_hopper_kernel
from .hopper.bwd_varlen import _flash_bwd_dkdv_hopper_varlen_kernel
from .hopper.bwd_wide import _flash_bwd_dkdv_hopper_wide_kernel
from .hopper.dq_cast import (  # noqa: F401 -- the accumulators' API, for backward.py
    check_varlen_dq_accumulator,
    dq_from_accumulator,
    dq_from_varlen_accumulator,
    varlen_dq_accumulator,
)
from .hopper.fwd import _alibi_by_matmul, _flash_fwd_hopper_kernel
from .hopper.fwd_varlen import _flash_fwd_hopper_varlen_kernel
from .hopper.shared import (
    BLOCK_M,
    BLOCK_N,
    BWD_BLOCK_M,
    BWD_BLOCK_N,
    BWD_HEAD_DIMS,  # noqa: F401 -- the scope dispatch.py checks
    BWD_MAX_KEY_BLOCKS,
    BWD_STAGES,
    DQ_REGISTER_BOX,
    DQ_TAIL_REGISTER_BOX,
    FUSED_DQ_HEAD_DIMS,
    FWD_HEAD_DIMS,  # noqa: F401 -- the scope dispatch.py checks
    LOG2E,
    SHARED_MEMORY_BYTES,
    STAGES,
    VARLEN_BWD_HEAD_DIMS,
    VARLEN_SCAN_LANES,
    WIDE_BWD_HEAD_DIMS,
)
from .launch import CachedLauncher, DirectLaunch, descriptor_template

# The score modifications and masks the Gluon kernels take (kernels/features.py's constexprs);
# dropout is a constexpr of the dK/dV kernel's own (DROPOUT: backward_dkdv_hopper_plan), taken where
# BwdConfig.hopper_gluon_dropout asks.
GLUON_FEATURE_FLAGS = ("WINDOW", "SOFTCAP", "ALIBI")
VARLEN_BWD_GRIDS = ("longest", "packed", "auto")  # BwdConfig.hopper_gluon_varlen_grid's values


@functools.cache
def _tile_layout(rows: int, headdim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [rows, headdim] tile (computed once per shape and dtype: four
    descriptors per launch would otherwise recompute it)."""
    return gl.NVMMASharedLayout.get_default_for([rows, headdim], gl.float16 if dtype == torch.float16 else gl.bfloat16)


@functools.cache
def _stats_layout() -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [1, BWD_BLOCK_M] float32 row of L or D (unswizzled)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def _fp32_tile_layout_unswizzled() -> gl.NVMMASharedLayout:
    """The shared-memory layout of the register-order dQ tile's [16, 256] TMA box: row-major."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _row_descriptor(t: torch.Tensor, rows: int, width: int | None = None) -> TensorDescriptor:
    """A (batch * seqlen, heads * head dim) 2D view of a (batch, seqlen, heads, head dim) tensor,
    `rows` rows per tile of `width` columns (the head dim, or one of its head_sections) (the
    layout `dispatch._flat_view_is_exact` checks)."""
    batch, seqlen, heads, headdim = t.shape
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the Hopper kernels take float16 or bfloat16 tensors, got {t.dtype}")
    width = width or headdim
    return TensorDescriptor(t, [batch * seqlen, heads * headdim], [t.stride(1), 1], [rows, width],
                            _tile_layout(rows, width, t.dtype))


def _packed_descriptor(t: torch.Tensor, rows: int, width: int | None = None) -> TensorDescriptor:
    """A (total, heads * head dim) 2D view of a packed (total, heads, head dim) tensor, tiles as
    _row_descriptor's."""
    total, heads, headdim = t.shape
    if t.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the Hopper kernels take float16 or bfloat16 tensors, got {t.dtype}")
    width = width or headdim
    return TensorDescriptor(t, [total, heads * headdim], [t.stride(0), 1], [rows, width],
                            _tile_layout(rows, width, t.dtype))


def head_sections(head_dim: int) -> tuple[int, ...]:
    """The forward's head-dim sections (fwd._head_sections): the head dim where it is a power of
    two, else the largest power of two below it and the rest, which must be one too and at least
    16 (a wgmma's depth): 96 = 64 + 32, 192 = 128 + 64. Register tiles are powers of two; each
    section is a TMA box and a matmul of its own, so no column is padded."""
    first = 1 << (head_dim.bit_length() - 1)
    tail = head_dim - first
    if tail and (tail < 16 or tail & (tail - 1)):
        raise ValueError(f"head dim {head_dim} is not a power of two nor two of them (at least 16 each)")
    return (first, tail) if tail else (first,)


def _section_descriptors(describe, tensors, rows, head_dim: int) -> tuple[list, dict]:
    """The forward's eight descriptor arguments for q, k, v and out (`tensors`, `rows` rows a tile
    each, made by `describe`: _row_descriptor or _packed_descriptor), then their tail sections'
    (head_sections): without a tail, placeholders the kernel does not read. Returns the
    descriptors and the kernel's HEAD_SPLIT constexpr."""
    sections = head_sections(head_dim)
    first = [describe(t, r, sections[0]) for t, r in zip(tensors, rows)]
    if len(sections) == 1:
        return first + [None] * 4, {"HEAD_SPLIT": False}
    return first + [describe(t, r, sections[1]) for t, r in zip(tensors, rows)], {"HEAD_SPLIT": True}


def _stats_template(rows: int, seqlen: int) -> TensorDescriptor:
    """A descriptor template (descriptor_like gives it its tensor) of the (batch x heads, seqlen)
    view of a contiguous (batch, heads, seqlen) float32 L or D, one BWD_BLOCK_M-query row per tile."""
    template = object.__new__(TensorDescriptor)
    template.__dict__.update(base=None, shape=[rows, seqlen], strides=[seqlen, 1], block_shape=[1, BWD_BLOCK_M],
                             layout=_stats_layout(), padding="zero")
    return template


def _register_order_descriptor(dq_accum: torch.Tensor, box=DQ_REGISTER_BOX) -> TensorDescriptor:
    """The descriptor of a register-order dQ accumulator (contiguous, dense or varlen): its floats as
    rows of DQ_REGISTER_BOX[1], one [16, 256] box per 64 x 64 tile (`box` DQ_TAIL_REGISTER_BOX:
    [8, 256] per 64 x 32 tile, head dim 96's second section)."""
    return TensorDescriptor(dq_accum, [dq_accum.numel() // box[1], box[1]], [box[1], 1], list(box),
                            _fp32_tile_layout_unswizzled())


def wide_bwd_sections(head_dim: int) -> tuple[int, int]:
    """bwd_wide.py's head-dim sections (WIDE_BWD_HEAD_DIMS): the S warpgroup's first 128 columns of
    dK_j and dV_j and the dP warpgroup's rest, 192 = 128 + 64, 256 = 128 + 128."""
    return (128, head_dim - 128)


def wide_bwd_constexprs(head_dim: int) -> dict:
    """bwd_wide.py's DQ_ATOMIC and DQ_BY_SECTION at this head dim: dQ added from registers where its
    staging tiles (the head dim's 64 x 64 float32 tiles) do not fit shared memory beside K_j, V_j,
    the ring of BWD_STAGES Q_i and dO_i tiles, P^T (float32 and 16-bit) and dS^T (2 KiB left for L_i, D_i and
    the mbarriers): 256, not 192; and each warpgroup computing dQ's columns of its own section where
    the sections are equal (256), so that both do half of a step's matmul work (at 192 the dP
    warpgroup computes them all: 7 / 15 against 8 / 15, where by section it would be 9 against 6)."""
    first, tail = wide_bwd_sections(head_dim)
    tiles = (2 + 2 * BWD_STAGES) * BWD_BLOCK_M * head_dim * 2 + BWD_BLOCK_M * BWD_BLOCK_M * (4 + 2 * 2)
    staging = BWD_BLOCK_M * head_dim * 4
    atomic = tiles + staging > SHARED_MEMORY_BYTES - 2048
    return {"DQ_ATOMIC": atomic, "DQ_BY_SECTION": atomic and first == tail}


def _backward_descriptors(describe, q, k, v, do, dk, dv, dq_accum) -> tuple[list, list, dict]:
    """The dK/dV kernels' fourteen descriptor arguments (made by `describe`: _row_descriptor or
    _packed_descriptor): q, k, v, do, dk, dv and dQ's accumulator (without one, dk's in its place,
    not read), then their tail sections' (head_sections, or at the wide head dims
    wide_bwd_sections; dQ's the [8, 256] boxes of its 64 x 32 tiles), or placeholders the kernel
    does not read where the head dim is one section. Returns the first seven, the tails (None for
    placeholders) and the kernel's HEAD_SPLIT constexpr."""
    headdim = q.shape[-1]
    sections = wide_bwd_sections(headdim) if headdim in WIDE_BWD_HEAD_DIMS else head_sections(headdim)
    rows = (BWD_BLOCK_M, BWD_BLOCK_N // 2, BWD_BLOCK_N // 2, BWD_BLOCK_M, BWD_BLOCK_N // 2, BWD_BLOCK_N // 2)
    tensors = (q, k, v, do, dk, dv)
    first = [describe(t, r, sections[0]) for t, r in zip(tensors, rows)]
    first.append(_register_order_descriptor(dq_accum) if dq_accum is not None else first[4])
    if len(sections) == 1:
        return first, [None] * 7, {"HEAD_SPLIT": False}
    tails = [describe(t, r, sections[1]) for t, r in zip(tensors, rows)]
    tails.append(_register_order_descriptor(dq_accum, DQ_TAIL_REGISTER_BOX) if dq_accum is not None else tails[4])
    return first, tails, {"HEAD_SPLIT": True}


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
_fwd_launcher = CachedLauncher(_flash_fwd_hopper_kernel)  # kernels/launch.py
_fwd_varlen_launcher = CachedLauncher(_flash_fwd_hopper_varlen_kernel)


def forward_stages(head_dim: int, block_n: int, alibi_tile: bool = False, block_m: int = BLOCK_M,
                   q_buffers: int = 1) -> tuple[int, int]:
    """The K and V blocks in flight (STAGES, V_STAGES) of the forward at this head dim and block_n
    keys a block: STAGES of each where they fit beside `q_buffers` of Q's [block_m, head dim] tiles
    (and, with `alibi_tile`, ALiBi's [block_n, 16] key tile: `_alibi_by_matmul`) in
    SHARED_MEMORY_BYTES, less a margin for the mbarriers; else one V block fewer, then one K block
    fewer, in turn (FA3 sizes its forward tiles to the same limit). At head dim 128 with 128 keys a
    block: 3 and 3 (224 KiB), 2 V blocks with ALiBi's tile; at 256 with 64 keys: 3 and 2. Refuses
    fewer than 2 K blocks: with one, K_{j+1}'s load waits for the stage that block j's P V still
    holds (the kernel's loop issues S_{j+1} before it releases block j)."""
    element = 2  # fp16 and bf16

    def fits(k_stages: int, v_stages: int) -> bool:
        tiles = (q_buffers * block_m * head_dim + (k_stages + v_stages) * block_n * head_dim
                 + (block_n * 16 if alibi_tile else 0))
        return tiles * element + 1024 <= SHARED_MEMORY_BYTES

    k_stages = v_stages = STAGES
    while not fits(k_stages, v_stages):
        if v_stages == k_stages:
            v_stages -= 1
        else:
            k_stages -= 1
        if k_stages < 2:
            raise ValueError(f"fewer than 2 K blocks of {block_n} keys at head dim {head_dim} fit beside Q in shared "
                             f"memory (hopper_gluon_block_n)")
    return k_stages, v_stages


def forward_q_buffers(head_dim: int, block_n: int, alibi_tile: bool, block_m: int, persistent: bool) -> int:
    """Q's buffers in the forward (fwd_tiles.py `_q_slot`): on a persistent grid (forward_persistent)
    two where the second fits beside the K and V blocks forward_stages gives one (head dims 64 and 96
    in 128-key blocks), so that the next tile's Q loads while a tile runs; else one (its next Q
    loads once the tile's output has left through it)."""
    if not persistent:
        return 1
    try:
        two = forward_stages(head_dim, block_n, alibi_tile, block_m, q_buffers=2)
    except ValueError:
        return 1
    return 2 if two == forward_stages(head_dim, block_n, alibi_tile, block_m) else 1


def forward_persistent(config, keys: int) -> bool:
    """Whether a forward of `keys` keys (the longest sequence's) runs on a persistent grid: fewer
    than the FwdConfig's hopper_gluon_persistent_below_keys (a `config` without the field: no)."""
    return keys < getattr(config, "hopper_gluon_persistent_below_keys", 0)


def forward_grid(tiles: int, persistent: bool, device: torch.device) -> tuple[int]:
    """The forwards' grid over `tiles` (query block, batch x head) tiles (fwd.py's and fwd_varlen.py's kernels): one
    program a tile, or persistent (forward_persistent), one an SM of `device`'s GPU
    (one program fits an SM: its shared memory and registers) and no more than the tiles."""
    if persistent:
        return (max(1, min(tiles, sm_count(_device_index(device)))),)
    return (tiles,)


def forward_constexprs(causal: bool, head_dim: int, flags: dict | None, block_n: int = BLOCK_N,
                       block_m: int = BLOCK_M, schedule=None, persistent: bool = False) -> dict:
    """The forward kernel's feature constexprs for GLUON_FEATURE_FLAGS `flags`, its K and V
    blocks in flight for this head dim, block_n keys a block, block_m query rows, its Q buffers
    (forward_stages, forward_q_buffers: two only on a `persistent` grid), PERSISTENT (the tiles'
    loop, fwd_tiles.py `_rounds`), its key loop's `schedule` (forward_schedule; a dict of
    constexprs may set Q_BUFFERS and PERSISTENT) and its launch options (forward_launch_options)."""
    flags = {name: bool((flags or {}).get(name)) for name in GLUON_FEATURE_FLAGS}
    by_matmul = _alibi_by_matmul(causal, flags["WINDOW"], flags["SOFTCAP"], flags["ALIBI"])
    loop = dict(forward_schedule(schedule))
    persistent = loop.pop("PERSISTENT", persistent)
    q_buffers = loop.pop("Q_BUFFERS", None) or forward_q_buffers(
        head_dim, block_n, by_matmul, block_m, persistent)
    stages, v_stages = forward_stages(head_dim, block_n, by_matmul, block_m, q_buffers)
    return {**flags, "STAGES": stages, "V_STAGES": v_stages, "Q_BUFFERS": q_buffers, "PERSISTENT": persistent, **loop,
            **forward_launch_options(block_m)}


def _device_index(device: torch.device) -> int:
    """The CUDA device a launch on `device` asks about: its own index, the current GPU where it
    names none, and for a CPU device (a launch recorded on the CPU) the first."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def device_l2_bytes(device: torch.device) -> int:
    """The L2 cache of `device`'s GPU in bytes (common.l2_cache_bytes; `_device_index`'s GPU, or
    the H100/H200's where there is none)."""
    return l2_cache_bytes(_device_index(device))


def fwd_group_shift(section: int | str, rows: int, seqlen_k: int, headdim: int, element_size: int,
                    device: torch.device) -> int:
    """log2 of the (batch x head) rows whose causal programs start together longest first (fwd.py's
    GROUP_SHIFT, fwd_tiles.py `_fwd_program`; FwdConfig.hopper_gluon_head_section): the largest power of two that
    divides `rows`, is at most `section` ("l2": no bound of its own) and keeps that many rows' K and
    V (seqlen_k x headdim each) within the L2 cache (common.l2_cache_bytes), the budget
    FlashAttention-4's forward tile scheduler sizes its head sections by (SingleTileLPTScheduler in
    flash_attn/cute/tile_scheduler.py). 0 (one row): the grid's own order. The varlen forward's
    rows are its sequences x heads, `seqlen_k` the longest sequence's keys."""
    if section != "l2" and (isinstance(section, bool) or not isinstance(section, int) or section < 1):
        raise ValueError(f"hopper_gluon_head_section must be a positive int or 'l2', got {section!r}")
    if section == 1 or rows < 1:
        return 0
    fits = max(1, device_l2_bytes(device) // max(2 * seqlen_k * headdim * element_size, 1))
    limit = fits if section == "l2" else min(section, fits)
    shift = 0
    while rows % (2 << shift) == 0 and (2 << shift) <= limit:
        shift += 1
    return shift


def forward_schedule(config=None) -> dict:
    """The forwards' key-loop constexprs from a FwdConfig (or a dict of them, as made here; None:
    the defaults): PINGPONG (hopper_gluon_pingpong: the consumers issue their matmuls in turns) and
    PIN_SOFTMAX (hopper_gluon_pin_softmax: the softmax kept under the P~ V matmul, fwd._pin_softmax)
    and Q_IN_REGS (hopper_gluon_q_in_registers: Q the S matmuls' A operand from registers, fwd._q_operand)."""
    if isinstance(config, dict):
        return config
    return {"PINGPONG": bool(config and config.hopper_gluon_pingpong),
            "PIN_SOFTMAX": bool(config and config.hopper_gluon_pin_softmax),
            "Q_IN_REGS": bool(config and config.hopper_gluon_q_in_registers)}


THREE_CONSUMER_ACCUMULATORS = 128  # three_consumer_refusal


def forward_launch_options(block_m: int) -> dict:
    """The forwards' consumer warpgroups for block_m query rows (FwdConfig.hopper_gluon_block_m: 128
    or 192, two or three warpgroups of 64 rows), their warps and registers a thread at launch: the
    SM's 65536 shared by the consumers' warpgroups and the loader warp's, padded to a warpgroup
    (12 warps at 168, 16 at 128), then moved between the partitions by setmaxnreg (fwd.py's
    warp_specialize)."""
    consumers, rest = divmod(block_m, BLOCK_M // 2)
    if rest or consumers not in (2, 3):
        raise ValueError(f"hopper_gluon_block_m must be one of (128, 192), got {block_m}")
    warps = 4 * (consumers + 1)
    return {"CONSUMERS": consumers, "num_warps": 4, "maxnreg": 65536 // (32 * warps) // 8 * 8}


def three_consumer_refusal(headdim: int, block_n: int) -> str:
    """Why three consumer warpgroups (192 query rows, 160 registers a consumer thread) do not take
    this head dim and key block ('' where they do). A consumer thread holds headdim / 2 float32 of O,
    block_n / 2 of S and block_n / 4 of P: ptxas (sm_90) keeps 112-128 of those without spills (head
    dim 64 in 128-key blocks, 96 and 128 in 64-key blocks) and spills from 144 (96 in 128-key blocks,
    192 in 64-key blocks; wgmma then serialised), and at 256 the kernel does not assemble."""
    accumulators = headdim // 2 + 3 * block_n // 4
    if accumulators > THREE_CONSUMER_ACCUMULATORS:
        return (f"hopper_gluon_block_m 192 at head dim {headdim} in {block_n}-key blocks: O, S and P take "
                f"{accumulators} registers a consumer thread, more than the {THREE_CONSUMER_ACCUMULATORS} "
                "three consumer warpgroups hold without spilling")
    return ""


def forward_hopper_plan(q, k, v, out, causal: bool, flags: dict | None = None, block_n: int = BLOCK_N,
                        block_m: int = BLOCK_M, schedule=None):
    """The launch for tensors shaped, strided and aligned like these, as a function of (q, k, v,
    out, lse, softmax_scale, features=()): descriptors are copied from ones made (and validated)
    here, and the compiled kernel is launched directly after the first call (launch.DirectLaunch).
    `flags`: the GLUON_FEATURE_FLAGS constexprs of kernels/features.py's `feature_args`; `features`
    then holds its run-time values (qk_scale, window sides, softcap * log2(e), the slopes and their
    batch stride). `block_n`: keys a block (FwdConfig.hopper_gluon_block_n), `block_m` query rows a
    program (FwdConfig.hopper_gluon_block_m); the lengths a multiple of both, and causal block_n a
    divisor of block_m. `schedule`: the config whose key-loop fields the kernel takes (forward_schedule),
    and causal, its programs' launch order (fwd_group_shift)."""
    batch, seqlen, heads, _ = q.shape
    if block_m % block_n and causal:
        raise ValueError(f"hopper_gluon_block_n must divide the Gluon forward's {block_m} query rows, got {block_n}")
    descriptors, split_constexprs = _section_descriptors(_row_descriptor, (q, k, v, out),
                                                         (BLOCK_M // 2, block_n, block_n, BLOCK_M // 2), q.shape[-1])
    # 4 warps in the default partition and 4 a further consumer, 1 loader warp: padded to whole
    # warpgroups, their registers at launch moved by setmaxnreg (forward_launch_options)
    persistent = forward_persistent(schedule, k.shape[1])
    constexprs = {**forward_constexprs(causal, q.shape[-1], flags, block_n, block_m, schedule, persistent),
                  **split_constexprs}
    # the causal programs' launch order (FwdConfig.hopper_gluon_head_section); passed where 0 too, as
    # every parameter must be for the plan to keep the compiled kernel (launch.DirectLaunch)
    constexprs["GROUP_SHIFT"] = 0
    if causal:
        constexprs["GROUP_SHIFT"] = fwd_group_shift(getattr(schedule, "hopper_gluon_head_section", 1), batch * heads,
                                                    k.shape[1], q.shape[-1], q.element_size(), q.device)
    # the descriptors' tensors are passed and the launch makes them (launch.DirectLaunch)
    # without a tail section the tail arguments are the logsumexp's pointer, not read
    launch = DirectLaunch(sys.modules[__name__], "_fwd_launcher",
                          forward_grid(seqlen // block_m * batch * heads, persistent, q.device),
                          {"CAUSAL": causal, **constexprs},
                          descriptors={i: descriptor_template(d) for i, d in enumerate(descriptors) if d is not None})
    kv_group = heads // k.shape[2]
    head_split = constexprs["HEAD_SPLIT"]

    def run(q, k, v, out, lse, softmax_scale, features=()):
        qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b = (
            features or (softmax_scale * LOG2E, 0, 0, 0.0, None, 0))
        tails = (q, k, v, out) if head_split else (lse, lse, lse, lse)
        launch(q, k, v, out, *tails, lse, heads, batch * heads, seqlen, qk_scale, kv_group, window_left, window_right,
               softcap_log2, alibi if alibi is not None else lse, stride_alibi_b)

    return run


def varlen_forward_hopper_plan(q, k, v, out, lse, batch: int, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                               block_n: int = BLOCK_N, block_m: int = BLOCK_M, schedule=None):
    """The varlen forward's launch for packed tensors shaped, strided and aligned like these (see
    flash_attn_varlen_forward_hopper), `batch` sequences, as a function of (q, k, v, out, lse,
    cu_seqlens_q, cu_seqlens_k, qk_scale): the descriptors' templates, grid and launch order made
    once, each call's descriptors encoded from its tensors' addresses by the launch
    (launch.DirectLaunch), as the dense plans do; the caller's key holds what the launch depends on
    (shapes, strides, dtypes, the pointers' 16-byte alignment, batch, the longest lengths, causal,
    the tiles and the schedule)."""
    total_q, heads, headdim = q.shape
    num_m = triton.cdiv(max_seqlen_q, block_m)
    persistent = forward_persistent(schedule, max_seqlen_k)
    grid = forward_grid(num_m * batch * heads, persistent, q.device)
    group_shift = 0
    if causal:  # the causal programs' launch order (FwdConfig.hopper_gluon_head_section)
        group_shift = fwd_group_shift(getattr(schedule, "hopper_gluon_head_section", 1), batch * heads,
                                      max_seqlen_k, headdim, q.element_size(), q.device)
    lse_strides = (total_q, 0) if lse.dim() == 2 else (max_seqlen_q, (heads - 1) * max_seqlen_q)
    q_buffers = forward_q_buffers(headdim, block_n, False, block_m, persistent)
    stages, v_stages = forward_stages(headdim, block_n, block_m=block_m, q_buffers=q_buffers)
    descriptors, split_constexprs = _section_descriptors(_packed_descriptor, (q, k, v, out),
                                                         (BLOCK_M // 2, block_n, block_n, BLOCK_M // 2), headdim)
    head_split = split_constexprs["HEAD_SPLIT"]
    kv_group = heads // k.shape[1]
    # Q, K, V, O, then their tail sections (without them, L's pointer in their place, not read): the
    # tensors are passed and the launch makes the descriptors
    templates = {i: descriptor_template(d) for i, d in enumerate(descriptors) if d is not None}
    launch = DirectLaunch(sys.modules[__name__], "_fwd_varlen_launcher", grid,
                          {"STAGES": stages, "V_STAGES": v_stages, "CAUSAL": causal, "GROUP_SHIFT": group_shift,
                           **forward_schedule(schedule), "Q_BUFFERS": q_buffers, "PERSISTENT": persistent,
                           **forward_launch_options(block_m),
                           **split_constexprs},
                          descriptors=templates)

    def run(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, qk_scale):
        sections = (q, k, v, out)
        launch(*sections, *(sections if head_split else (lse,) * 4), out, lse, cu_seqlens_q, cu_seqlens_k, heads,
               batch * heads, num_m, *lse_strides, out.stride(0), qk_scale, kv_group)

    return run


def flash_attn_varlen_forward_hopper(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                     max_seqlen_k: int, qk_scale: float, causal: bool, block_n: int = BLOCK_N,
                                     block_m: int = BLOCK_M, schedule=None) -> None:
    """Write O into `out` (packed like q) and the natural-log logsumexp into `lse` for packed
    sequences (q (total_q, heads, d), k and v (total_k, kv_heads, d), each a (total, heads * d)
    2D view with rows that do not overlap; d one of FWD_HEAD_DIMS; fp16 or bf16); `lse` is (heads,
    total_q), or for a dense call's batch rows packed (dispatch.GluonPath.PACKED, every sequence
    max_seqlen_q long) its contiguous (batch, heads, seqlen_q); `max_seqlen_k` the longest sequence's
    keys. `qk_scale` is the softmax scale
    times log2(e); `block_n` keys a block (FwdConfig.hopper_gluon_block_n), `block_m` query rows a
    program (FwdConfig.hopper_gluon_block_m), `schedule` the config whose key-loop fields it takes
    (forward_schedule) and, causal, its programs' launch order over the sequences x heads rows
    (fwd_group_shift; a group is mostly heads of one sequence, so the L2 budget takes the longest
    sequence's keys). The launch is varlen_forward_hopper_plan's, made and run once."""
    plan = varlen_forward_hopper_plan(q, k, v, out, lse, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k,
                                      causal, block_n, block_m, schedule)
    plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, qk_scale)


# --------------------------------------------------------------------------------------
# Backward: the dK/dV kernels
# --------------------------------------------------------------------------------------
_bwd_dkdv_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_kernel)  # kernels/launch.py
_bwd_dkdv_varlen_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_varlen_kernel)
_bwd_dkdv_wide_launcher = CachedLauncher(_flash_bwd_dkdv_hopper_wide_kernel)


def bwd_key_block(headdim: int) -> int:
    """Keys a dense dK/dV program owns: BWD_BLOCK_N (two consumers of 64), or at the wide head dims
    (WIDE_BWD_HEAD_DIMS, bwd_wide.py) 64, both consumers on the same keys."""
    return BWD_BLOCK_N // 2 if headdim in WIDE_BWD_HEAD_DIMS else BWD_BLOCK_N


def bwd_head_section(config: BwdConfig, causal: bool) -> int | str:
    """The dK/dV grid's section bound (bwd_grid) for a call: the config's
    hopper_gluon_causal_head_section where the call is causal, else its hopper_gluon_head_section."""
    return config.hopper_gluon_causal_head_section if causal else config.hopper_gluon_head_section


def bwd_grid(n_blocks: int, pairs: int, kv_group: int, seqlen_q: int, headdim: int, element_size: int,
             device: torch.device, section: int | str) -> tuple[int, int, int]:
    """The dK/dV kernels' grid (pairs in a section, key blocks, sections) for n_blocks key blocks
    of `pairs` (batch, kv head) pairs (bwd._bwd_program; the varlen kernel's packed grid passes its
    kv heads, every sequence's blocks on the key-block axis: bwd_varlen._varlen_packed_program),
    `section` from bwd_head_section.
    Programs start in grid order, so each section's key blocks run block-major. A section holds
    the largest divisor of `pairs` at most `section`; "l2":
    at most as many pairs as keep their Q, dO and float32 dQ accumulator (kv_group q heads of
    seqlen_q rows each) within the L2 cache (common.l2_cache_bytes), the budget FlashAttention-4's
    backward tile scheduler (SingleTileLPTBwdScheduler in flash_attn/cute/tile_scheduler.py) sizes
    its head sections by; it rounds down to a power of two and runs a narrower last section, here
    the largest divisor of the pairs keeps every section whole. The accumulator is counted whether
    or not the call fuses dQ. Refuses more than BWD_MAX_KEY_BLOCKS key blocks, which the dispatch
    keeps off these kernels (dispatch.bwd_dkdv_path, hopper_gluon_varlen_bwd_applies)."""
    if not 0 < n_blocks <= BWD_MAX_KEY_BLOCKS or pairs < 1:
        raise ValueError(f"the dK/dV grid takes 1..{BWD_MAX_KEY_BLOCKS} key blocks and at least one (batch, kv head) "
                         f"pair, got {n_blocks} key blocks and {pairs} pairs")
    if section == "l2":
        section = max(1, device_l2_bytes(device) // max(kv_group * seqlen_q * headdim * (2 * element_size + 4), 1))
    if not isinstance(section, int) or section < 1:
        raise ValueError("hopper_gluon_head_section and hopper_gluon_causal_head_section must be a positive int or "
                         f"'l2', got {section!r}")
    width = next(w for w in range(min(section, pairs), 0, -1) if pairs % w == 0)
    return width, n_blocks, pairs // width


def dq_first(config: BwdConfig, kv_group: int, flags: dict, headdim: int = 128) -> bool:
    """Whether the fused dQ's matmul goes before dK's (the dK/dV kernels' DQ_FIRST): never at head
    dims 64 and 96, where the consumers compute dQ in turns (bwd._dq_in_turns) after dK; at the wide
    head dims (WIDE_BWD_HEAD_DIMS: 192 and 256, bwd_wide.py, where the dP warpgroup then issues
    dQ's matmuls before dV's and dK's and writes dQ out while they run) unless
    config.hopper_gluon_dq_first is False: faster or level there (gluon_backward_dq_first_d192.csv,
    gluon_backward_wide_fields.csv); at 128 as config.hopper_gluon_dq_first says,
    or where it is None with GQA/MQA, a window or ALiBi, where it measured faster; dense MHA
    measured level or slower (docs/performance.md)."""
    if headdim in WIDE_BWD_HEAD_DIMS:
        return config.hopper_gluon_dq_first is not False
    if headdim != 128:  # in turns
        return False
    if config.hopper_gluon_dq_first is not None:
        return config.hopper_gluon_dq_first
    return kv_group > 1 or bool(flags["WINDOW"]) or bool(flags["ALIBI"])


def backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, causal: bool, config: BwdConfig,
                              flags: dict | None = None, dropout: bool = False):
    """The dK/dV launch for tensors shaped, strided and aligned like these, as a function of (q, k,
    v, do, lse, delta, dk, dv, dq_accum, softmax_scale, features=()) (see forward_hopper_plan;
    `dropout`: the forward dropped entries (BwdConfig.hopper_gluon_dropout; dQ fused, bwd.py's
    kernel); `features` = (qk_scale, window sides, softcap * log2(e), slopes, their batch stride,
    dropout_p, the (seed, offset) tensor) from
    kernels/features.py's feature_args; with `flags` or GQA/MQA, dQ must be fused: the dQ kernel
    has neither). `lse` and `delta` are (batch, heads, seqlen) float32; `dq_accum`, where dQ is
    fused, a zeroed float32 tensor contiguous like q (FUSED_DQ_HEAD_DIMS), which the kernel
    fills in register order with dS K unscaled (dq_cast.dq_from_accumulator reads and scales it). At the wide head dims
    (WIDE_BWD_HEAD_DIMS: 192, 256) the launch is bwd_wide.py's kernel, dQ fused and no feature.
    `config`'s hopper_gluon_dq_first (`dq_first`) and head sections (bwd_head_section) pick the
    schedule and the launch order."""
    batch, seqlen, heads, headdim = q.shape
    kv_heads = k.shape[2]
    fused = dq_accum is not None
    if fused and headdim not in FUSED_DQ_HEAD_DIMS:
        raise ValueError(f"the Gluon kernel fuses dQ at head dims {FUSED_DQ_HEAD_DIMS}, got {headdim}")
    flags = {name: bool((flags or {}).get(name)) for name in GLUON_FEATURE_FLAGS}
    if (any(flags.values()) or kv_heads != heads) and not fused:
        raise ValueError("the Gluon backward takes features and GQA/MQA with dQ fused only")
    wide = headdim in WIDE_BWD_HEAD_DIMS
    if dropout and (wide or not fused):
        raise ValueError("the Gluon backward takes dropout with dQ fused, below head dim 192 (bwd.py's kernel)")
    if wide and (any(flags.values()) or not fused):
        raise ValueError(f"the Gluon backward at head dim {headdim} (bwd_wide.py) fuses dQ and takes no window, "
                         "softcap or ALiBi")
    first, tails, split_constexprs = _backward_descriptors(_row_descriptor, q, k, v, do, dk, dv, dq_accum)
    head_split = split_constexprs["HEAD_SPLIT"]
    kv_group = heads // kv_heads
    # the descriptors' tensors are passed and the launch makes them (launch.DirectLaunch): Q, K, V, dO,
    # dK, dV, then dQ's accumulator (contiguous like q, backward.py makes it so: whole tiles; without
    # the fused dQ, unused: dK's again), the same seven's tail sections (without them, L's pointer
    # in their place, not read), then L and D (seqlen is a multiple of BWD_BLOCK_N: their rows are
    # aligned)
    descriptors = {i: descriptor_template(d) for i, d in enumerate(first + tails) if d is not None}
    descriptors[14] = descriptors[15] = _stats_template(batch * heads, seqlen)
    grid = bwd_grid(seqlen // bwd_key_block(headdim), batch * kv_heads, kv_group, seqlen, headdim, q.element_size(),
                    q.device, bwd_head_section(config, causal))
    if wide:
        launch = DirectLaunch(sys.modules[__name__], "_bwd_dkdv_wide_launcher", grid,
                              {"STAGES": BWD_STAGES, "CAUSAL": causal, "num_warps": 4, "maxnreg": 168,
                               "DQ_FIRST": dq_first(config, kv_group, flags, headdim),
                               **wide_bwd_constexprs(headdim)},
                              descriptors=descriptors)
    else:
        launch = DirectLaunch(sys.modules[__name__], "_bwd_dkdv_launcher", grid,
                              {"STAGES": BWD_STAGES, "CAUSAL": causal, "FUSED_DQ": fused, "num_warps": 4,
                               "maxnreg": 168, "DQ_FIRST": fused and dq_first(config, kv_group, flags, headdim),
                               "DROPOUT": dropout, **flags, **split_constexprs},
                              descriptors=descriptors)

    def run(q, k, v, do, lse, delta, dk, dv, dq_accum, softmax_scale, features=()):
        qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b, dropout_p, rng_seed = (
            features or (softmax_scale * LOG2E, 0, 0, 0.0, None, 0, 0.0, None))
        if not lse.is_contiguous() or lse.data_ptr() % 16:  # another caller's L: a contiguous, aligned copy
            lse = lse.clone(memory_format=torch.contiguous_format)
        dq_or_dk = dk if dq_accum is None else dq_accum
        tails = (q, k, v, do, dk, dv, dq_or_dk) if head_split else (lse,) * 7
        # bwd_wide.py's kernel takes the dQ accumulator's pointer where bwd.py's takes dropout's seed
        seed_or_dq = dq_accum if wide else rng_seed if rng_seed is not None else lse
        launch(q, k, v, do, dk, dv, dq_or_dk, *tails, lse, delta, heads, seqlen, softmax_scale, qk_scale, kv_group,
               window_left, window_right, softcap_log2, alibi if alibi is not None else lse, stride_alibi_b,
               seed_or_dq, dropout_p)

    return run


def varlen_bwd_key_blocks(grid: str, batch: int, total_k: int, max_seqlen_k: int) -> int:
    """The varlen dK/dV grid's key blocks in `grid`: "longest", the longest sequence's; "packed",
    every sequence's from its padded block (bwd_varlen._varlen_packed_program): the block after
    the last sequence's, (total_k + BWD_BLOCK_N batch) // BWD_BLOCK_N."""
    if grid == "longest":
        return triton.cdiv(max_seqlen_k, BWD_BLOCK_N)
    if grid == "packed":
        return (total_k + BWD_BLOCK_N * batch) // BWD_BLOCK_N
    raise ValueError(f"the varlen dK/dV grid is 'longest' or 'packed', got {grid!r}")


def varlen_bwd_grid(batch: int, total_k: int, max_seqlen_k: int, grid: str) -> str:
    """The varlen dK/dV kernel's key blocks for `batch` sequences of `total_k` keys, the longest
    `max_seqlen_k`, in `grid` (BwdConfig.hopper_gluon_varlen_grid, one of VARLEN_BWD_GRIDS):
    "longest", every sequence given the longest one's, the programs past a shorter sequence's end
    exiting at once; "packed", sequence b's from block (cu_seqlens_k[b] + 128 b) // 128 of one axis
    over the batch (FA3's padded offsets), at most one empty program a sequence; "auto" packed
    where the longest grid's batch x blocks are more than twice the packed axis's (more than half
    empty, counted against the packed axis, which holds up to one empty block a sequence), where
    it measured faster, level or slower elsewhere (docs/performance.md). Packed only for at most
    VARLEN_SCAN_LANES - 1 sequences (a program's scan) and BWD_MAX_KEY_BLOCKS blocks. The packed
    axis runs each section's sequences in turn, each one's blocks in order, so it gives up the
    longest grid's start of every sequence's longest programs first within a section."""
    if grid not in VARLEN_BWD_GRIDS:
        raise ValueError(f"hopper_gluon_varlen_grid must be one of {VARLEN_BWD_GRIDS}, got {grid!r}")
    packed_blocks = varlen_bwd_key_blocks("packed", batch, total_k, max_seqlen_k)
    if grid == "auto":
        longest = batch * varlen_bwd_key_blocks("longest", batch, total_k, max_seqlen_k)
        grid = "packed" if longest > 2 * packed_blocks else "longest"
    if grid == "packed" and (batch + 1 > VARLEN_SCAN_LANES or packed_blocks > BWD_MAX_KEY_BLOCKS):
        grid = "longest"  # more sequences than a program scans, or more blocks than the axis holds
    return grid


def varlen_backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, batch: int, max_seqlen_k: int, causal: bool,
                                     config: BwdConfig):
    """The varlen dK/dV launch for packed tensors shaped, strided and aligned like these, `batch`
    sequences, the longest of `max_seqlen_k` keys, as a function of (q, k, v, do, lse, delta, dk,
    dv, dq_accum, cu_seqlens_q, cu_seqlens_k, softmax_scale) (flash_attn_varlen_backward_dkdv_hopper's
    arguments): the descriptors' templates and the grid made once, each call's descriptors encoded
    from its tensors' addresses by the launch (launch.DirectLaunch), as the dense plan does; the
    caller's key holds what the launch depends on (shapes, strides, dtypes, the pointers' 16-byte
    alignment, batch, max_seqlen_k, causal, config)."""
    total_q, heads, headdim = q.shape
    if headdim not in VARLEN_BWD_HEAD_DIMS:
        raise ValueError(f"the Gluon varlen dK/dV kernel takes head dims {VARLEN_BWD_HEAD_DIMS}, got {headdim}")
    check_varlen_dq_accumulator(dq_accum, q.shape, batch)
    first, tails, split_constexprs = _backward_descriptors(_packed_descriptor, q, k, v, do, dk, dv, dq_accum)
    head_split = split_constexprs["HEAD_SPLIT"]
    kv_heads = k.shape[1]
    kv_group = heads // kv_heads
    key_grid = varlen_bwd_grid(batch, k.shape[0], max_seqlen_k, config.hopper_gluon_varlen_grid)
    key_blocks = varlen_bwd_key_blocks(key_grid, batch, k.shape[0], max_seqlen_k)
    scan = 0 if key_grid == "longest" else VARLEN_SCAN_LANES
    # sections of (sequence, kv head) pairs, or of kv heads over every sequence's blocks ("packed");
    # the mean length sizes them
    pairs = batch * kv_heads if key_grid == "longest" else kv_heads
    grid = bwd_grid(key_blocks, pairs, kv_group, max(total_q // max(batch, 1), 1), headdim,
                    q.element_size(), q.device, bwd_head_section(config, causal))
    # Q, K, V, dO, dK, dV and dQ's accumulator, then their tail sections (without them, L's pointer
    # in their place, not read): the tensors are passed and the launch makes the descriptors
    descriptors = {i: descriptor_template(d) for i, d in enumerate(first + tails) if d is not None}
    launch = DirectLaunch(sys.modules[__name__], "_bwd_dkdv_varlen_launcher", grid,
                          {"STAGES": BWD_STAGES, "CAUSAL": causal, "SCAN": scan, "num_warps": 4, "maxnreg": 168,
                           **split_constexprs}, descriptors=descriptors)

    def run(q, k, v, do, lse, delta, dk, dv, dq_accum, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        sections = (q, k, v, do, dk, dv, dq_accum)
        launch(*sections, *(sections if head_split else (lse,) * 7), dk, dv, lse, delta, cu_seqlens_q, cu_seqlens_k,
               heads, total_q, dk.stride(0), dv.stride(0), softmax_scale, softmax_scale * LOG2E, kv_group, batch)

    return run


def flash_attn_varlen_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, dq_accum, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_k: int, softmax_scale: float, causal: bool,
                                           config: BwdConfig) -> None:
    """dK and dV of packed sequences (q, do (total_q, heads, head dim), k, v, dk, dv (total_k,
    kv_heads, head dim), head dim 64, 96 or 128 (VARLEN_BWD_HEAD_DIMS), laid out as
    flash_attn_varlen_forward_hopper takes them), and dQ added into `dq_accum` (a zeroed float32
    accumulator from dq_cast.varlen_dq_accumulator, dS K unscaled: dq_from_varlen_accumulator scales it);
    `lse` and `delta` (heads, total_q) float32: varlen_backward_dkdv_hopper_plan's launch, made and
    run once. `config`'s hopper_gluon_varlen_grid and head sections (bwd_head_section) pick the grid."""
    plan = varlen_backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_accum, cu_seqlens_q.shape[0] - 1, max_seqlen_k,
                                            causal, config)
    plan(q, k, v, do, lse, delta, dk, dv, dq_accum, cu_seqlens_q, cu_seqlens_k, softmax_scale)
