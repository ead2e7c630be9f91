"""What the Gluon kernels share: their tile sizes (fixed by the warp layout), the wgmma accumulator
layout, the dQ accumulator's register-order tile, and the TMA reduce-add Gluon does not wrap."""
from __future__ import annotations

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin

LOG2E = 1.4426950408889634

# The forward (fwd.py)
BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per block where the config does not ask for fewer (FwdConfig.hopper_gluon_block_n)
STAGES = 3  # K and V blocks in flight, each, where they fit (flash_attn_hopper.forward_stages)
FWD_HEAD_DIMS = (64, 96, 128, 192, 256)  # the head dims the forwards serve (dispatch.hopper_gluon_refusal)
SHARED_MEMORY_BYTES = 227 * 1024  # an sm_90 program's shared memory at most

# The dK/dV kernels (bwd.py, bwd_varlen.py)
BWD_HEAD_DIMS = (64, 128)  # the head dims the dK/dV kernels serve
BWD_BLOCK_M = 64  # query rows per step of the key block's loop
BWD_BLOCK_N = 128  # keys per program: two consumer warpgroups of 64
BWD_STAGES = 2  # Q/dO tiles in flight (shared memory at head dim 128: K and V 64 KiB + 2 x 32 KiB; 64 KiB more for the fused dQ's dS^T and dQ tiles)
# The head dims at which the dK/dV kernels can add dQ (bwd.py): at 128 each consumer computes 64 of
# a step's dQ columns, at 64 the consumers take turns by step, each computing the step's whole tile
# (one 64 x 64 register-order tile, DQ_TILE_BASES, per consumer and step either way)
FUSED_DQ_HEAD_DIMS = (64, 128)
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
