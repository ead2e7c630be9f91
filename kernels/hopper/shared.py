"""What the Gluon kernels share: their tile sizes (fixed by the warp layout), the wgmma accumulator
layout, the dQ accumulator's register-order tile, and the TMA reduce-add Gluon does not wrap."""
from __future__ import annotations

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

LOG2E = 1.4426950408889634

# The forward (fwd.py)
BLOCK_M = 128  # query rows per program where the config does not ask for 192: two consumer warpgroups of 64
BLOCK_N = 128  # keys per block where the config does not ask for fewer (FwdConfig.hopper_gluon_block_n)
STAGES = 3  # K and V blocks in flight, each, where they fit (flash_attn_hopper.forward_stages)
FWD_HEAD_DIMS = (64, 96, 128, 192, 256)  # the head dims the forwards serve (dispatch.hopper_gluon_refusal)
SHARED_MEMORY_BYTES = 227 * 1024  # an sm_90 program's shared memory at most

# The dK/dV kernels (bwd.py, bwd_varlen.py, bwd_wide.py)
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)  # the head dims the dense dK/dV kernels serve (96, 192, 256 in two sections)
WIDE_BWD_HEAD_DIMS = (192, 256)  # those bwd_wide.py's kernel serves: 64-key blocks, the warpgroups split by role
VARLEN_BWD_HEAD_DIMS = (64, 96, 128)  # those the varlen dK/dV kernel serves
BWD_BLOCK_M = 64  # query rows per step of the key block's loop
BWD_BLOCK_N = 128  # keys per program: two consumer warpgroups of 64
BWD_STAGES = 2  # Q/dO tiles in flight (shared memory at head dim 128: K and V 64 KiB + 2 x 32 KiB; 64 KiB more for the fused dQ's dS^T and dQ tiles)
# The head dims at which the dK/dV kernels can add dQ (bwd.py): at 128 each consumer computes 64 of
# a step's dQ columns, at 64 and 96 the consumers take turns by step, each computing the step's
# whole dQ_i (64 x 64 register-order tiles, DQ_TILE_BASES; at 96 a 64 x 32 one beside)
FUSED_DQ_HEAD_DIMS = (64, 96, 128, 192, 256)  # at 192 and 256 (bwd_wide.py) always fused
BWD_MAX_KEY_BLOCKS = 65535  # key blocks on the grid's second axis (bwd_grid): CUDA's limit there
# The varlen kernel's packed grid scans cu_seqlens with one lane a thread of its four warps, so it
# takes at most this many entries (batch + 1)
VARLEN_SCAN_LANES = 128

# The fused dQ's float32 accumulator holds each consumer's 64 x 64 tile as the consumer's wgmma
# registers lie (FA4's dQaccum order): each thread's four-register runs side by side, stored
# without bank conflicts and reduce-added as one contiguous [16, 256] box; dq_cast.py puts the
# tiles back in rows as it casts. A tile in that order: bit b of an element's offset in the tile
# moves it by DQ_TILE_BASES[b] (row, column); offsets 0-3 are one thread's registers 0-3 (columns
# c, c + 1 of rows r and r + 8), then the lanes, the warps (16 rows each), and the thread's higher
# registers (8 columns on). The wgmma layout's own bases (gl.to_linear_layout of
# _wgmma_layout(64)): registers [0, 1], [8, 0], [0, 8], [0, 16], [0, 32]; lanes [0, 2], [0, 4],
# [1, 0], [2, 0], [4, 0]; warps [16, 0], [32, 0].
DQ_TILE_BASES = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0), (0, 8), (0, 16), (0, 32))
DQ_REGISTER_BOX: gl.constexpr = gl.constexpr((16, 256))  # the tile's 4096 floats as one TMA box
DQ_REGISTER_TILE: gl.constexpr = gl.SharedLinearLayout(offset_bases=[[row, col] for row, col in DQ_TILE_BASES])
# A 64 x 32 tile (head dim 96's second section) in the same order: the bases without the last
# (column 32), so a 64 x 64 tile is two of them side by side in memory; one [8, 256] box
DQ_TAIL_REGISTER_BOX: gl.constexpr = gl.constexpr((8, 256))
DQ_TAIL_REGISTER_TILE: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[row, col] for row, col in DQ_TILE_BASES[:-1]])


@gluon.jit
def _dq_tile_offsets(rows, cols):
    """DQ_TILE_BASES inverted: the offsets in a 64 x 64 register-order tile of rows `rows` and of
    columns `cols` (to be added: row + column), for dQ added from registers (bwd_wide._wide_add_dq).
    Plain integer arithmetic, so the CPU tests check it on Python ints against DQ_TILE_BASES."""
    row_offs = ((rows >> 3) & 1) * 2 + (rows & 7) * 16 + (rows >> 4) * 128
    col_offs = (cols & 1) + ((cols >> 1) & 3) * 4 + (cols >> 3) * 512
    return row_offs, col_offs


@gluon.constexpr_function
def _wgmma_layout(cols):
    """The layout of a wgmma accumulator `cols` wide held by one warpgroup (its 4 warps split the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """A TMA reduce-add of shared-memory tile `src` into global memory at `coord` of `tensor_desc`
    (cp.reduce.async.bulk.tensor .add; completion as for tma.async_copy_shared_to_global, by
    tma.store_wait). Triton 3.6 lowers `tensor_descriptor.atomic_add` to this op, but its Gluon
    Hopper module does not wrap it; this calls the same builder method."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _head_sections(desc, tail_desc, HEAD_SPLIT: gl.constexpr):
    """A tensor's descriptors as the tuple of head-dim sections the kernels loop over: (desc,), or
    with HEAD_SPLIT (a head dim that is not a power of two: 96 = 64 + 32, 192 = 128 + 64; register
    tiles are powers of two) (desc, tail_desc), the second section's columns after the first's."""
    if HEAD_SPLIT:
        return (desc, tail_desc)
    else:
        return (desc,)


@gluon.jit
def _descriptor_sections(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc,
                         HEAD_SPLIT: gl.constexpr):
    """Q's, K's, V's and O's descriptors, each as its tuple of head-dim sections (`_head_sections`)."""
    return (_head_sections(q_desc, q_tail_desc, HEAD_SPLIT), _head_sections(k_desc, k_tail_desc, HEAD_SPLIT),
            _head_sections(v_desc, v_tail_desc, HEAD_SPLIT), _head_sections(o_desc, o_tail_desc, HEAD_SPLIT))


@gluon.constexpr_function
def _head_dim(descs):
    """The head dim: the head-dim sections' widths summed (`descs` a tuple of descriptors)."""
    return sum(int(gl._unwrap_if_constexpr(desc.block_type.shape[1])) for desc in descs)


@gluon.jit
def _allocate_sections(descs, count: gl.constexpr):
    """`count` shared-memory tiles of each head-dim section's box (a tuple like `descs`)."""
    ROWS: gl.constexpr = descs[0].block_type.shape[0]
    WIDTH: gl.constexpr = descs[0].block_type.shape[1]
    first = gl.allocate_shared_memory(descs[0].dtype, [count, ROWS, WIDTH], descs[0].layout)
    if len(descs) == 1:
        return (first,)
    else:
        TAIL: gl.constexpr = descs[1].block_type.shape[1]
        return (first, gl.allocate_shared_memory(descs[1].dtype, [count, ROWS, TAIL], descs[1].layout))


@gluon.jit
def _at(sections, index):
    """Tile `index` of each section's ring (a tuple like `sections`)."""
    if len(sections) == 1:
        return (sections[0].index(index),)
    else:
        return (sections[0].index(index), sections[1].index(index))


@gluon.jit
def _expect_sections(bar, descs):
    """mbarrier.expect for one tile of every head-dim section."""
    if len(descs) == 1:
        mbarrier.expect(bar, descs[0].block_type.nbytes)
    else:
        mbarrier.expect(bar, descs[0].block_type.nbytes + descs[1].block_type.nbytes)


@gluon.jit
def _load_sections(descs, row, col, bar, tiles):
    """TMA loads of one tile per head-dim section, from column `col` (the head's first) on, into
    `tiles` (a tuple like `descs`), completing on `bar`."""
    tma.async_copy_global_to_shared(descs[0], [row, col], bar, tiles[0])
    if len(descs) == 2:
        tma.async_copy_global_to_shared(descs[1], [row, col + descs[0].block_type.shape[1]], bar, tiles[1])


@gluon.jit
def _zero_sections(rows: gl.constexpr, tiles):
    """A zeroed float32 wgmma accumulator of `rows` rows per head-dim section of `tiles` (shared
    tiles or rings of them, a tuple; each section's width their last dimension): a tuple."""
    WIDTH: gl.constexpr = tiles[0].type.shape[-1]
    first = gl.zeros([rows, WIDTH], gl.float32, layout=_wgmma_layout(WIDTH))
    if len(tiles) == 1:
        return (first,)
    else:
        TAIL: gl.constexpr = tiles[1].type.shape[-1]
        return (first, gl.zeros([rows, TAIL], gl.float32, layout=_wgmma_layout(TAIL)))
