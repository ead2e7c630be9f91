"""Block-size configurations of the Triton kernels: data, not code, with one line of reason per
choice. The measurements behind each table entry are in docs/performance.md."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Tensor-descriptor (TMA) loads and stores where the inputs allow them (16-byte aligned),
    # with descriptors made one of two ways, chosen by the keys a program visits on average
    # (all of seqlen_k, half when causal); see fwd_memory_path().
    tma: bool = False
    # In the kernel, per (batch, head), bounded at the true seqlen and head dim (any ragged
    # shape), from this many keys: each program makes its own (a global write and a proxy
    # fence each), a fixed cost that only a long key loop amortises (against pointer tiles at
    # head dim 128: docs/performance.md, "TMA in the forward, by length of the key loop").
    tma_min_keys: int = 2048
    # On the host, 2D over (batch * seqlen, heads * head dim), for key counts in
    # [tma_host_min_keys, tma_host_below_keys) where that view is exact (whole blocks, a
    # power-of-two head dim): no per-program set-up, but four descriptors to encode on the
    # host per launch. tma_host_below_keys = 0: never. At head dim 128 they beat pointer tiles
    # at 1024-4096 keys and lost to in-kernel descriptors at 8k-16k; at 512 keys the paper
    # sweep's short launches became host-bound (the same section; rows:
    # reports/h200/decisions/forward_memory_path.csv).
    tma_host_min_keys: int = 1024
    tma_host_below_keys: int = 0
    # From this many keys, the Gluon forward with FA3's warp layout (kernels/flash_attn_hopper.py:
    # a loader warp, two consumer warpgroups, the softmax under the P V matmul) where its scope
    # holds (hopper_gluon_applies); 0 = never.
    hopper_gluon_min_keys: int = 0
    # That kernel's keys per block (a divisor of its 128 query rows): 128 where Q, K and V tiles
    # of the head dim fit shared memory 3 blocks deep; 64 at head dims 192 and 256, where 128-key
    # blocks leave room for 2 K and 1 V block at 192 and too few at 256 (flash_attn_hopper.forward_stages;
    # dispatch refuses a config whose blocks do not fit).
    hopper_gluon_block_n: int = 128
    # That kernel's query rows a program, one consumer warpgroup of 64 each: 128, or 192 (three
    # consumers at 160 registers a thread, FA3's tile at head dims 64 and 96). The dense kernel
    # takes lengths in whole blocks of both; others run its varlen variant (dispatch's GluonPath.PACKED).
    # Calls with a window, softcap or ALiBi take 128 (dispatch.fwd_gluon_rows).
    hopper_gluon_block_m: int = 128
    # Whether that kernel's consumer warpgroups issue their matmuls in turns (a ring of mbarriers),
    # as FA3's and FA4's warp-scheduler barriers order them at head dims up to 128 ("ping-pong"):
    # one's softmax runs while another's matmuls do, in a fixed order; else the warp schedulers
    # interleave them as they come.
    hopper_gluon_pingpong: bool = False
    # Whether each consumer of that kernel stores its row sums to an unread shared row after the
    # softmax of key block j and before it waits for block j - 1's P~ V (hopper/fwd.py
    # _pin_softmax): without, ptxas moves that wait above the softmax, which then runs after the
    # matmul instead of under it (FA3's Algorithm 2 overlap; docs/hopper_peers.md).
    hopper_gluon_pin_softmax: bool = False
    # Whether that kernel's consumers load their Q tile into registers once and read it from there
    # in every S = Q K^T matmul (RS; hopper/fwd.py _q_operand), else from shared memory (SS, as FA3
    # and FA4 do: "Register bandwidth is actually a bottleneck so we don't want Q to be in
    # registers"). An SS matmul on 64-key blocks reads as many bytes of Q as of K for each of its
    # FLOPs, as much as shared memory delivers at the tensor cores' rate; RS reads K alone.
    hopper_gluon_q_in_registers: bool = False
    # The order that kernel's causal programs start in (dense calls, and the varlen kernel's over
    # sequence x head rows, K and V counted at the longest sequence's keys): groups of at most this many
    # batch x head rows (a power of two), and no more than keep their K and V within the L2 cache
    # ("l2": that bound only; FA4's forward tile scheduler's rule), start together longest first,
    # every row's longest query block, then every row's next (flash_attn_hopper.fwd_group_shift);
    # 1, the grid's own order (each row's query blocks longest first, row after row). 8 measured
    # faster than the grid's order at head dim 128 and level or faster at 96, and faster than
    # L2-sized groups alone at 1k-2k keys, where those grew to 16-64 rows
    # (gluon_forward_launch_order.csv); on the varlen kernel faster at 5 x 3000 causal and level
    # on a ragged batch (the same rows).
    hopper_gluon_head_section: int | str = 8
    # Below this many keys that kernel's grid is persistent (0: never): one program an SM, each
    # running tiles (query block, batch x head) in rounds, in the order above (hopper/fwd_tiles.py
    # _round_tile), its loader warp loading the next tile's first K/V block and (in a second Q buffer
    # where one fits beside the rings: flash_attn_hopper.forward_q_buffers) its Q while the consumers
    # finish the tile before, as FA3's persistent scheduler does; else one program a tile, each
    # paying the pipeline's fill and drain, which short key loops feel. Causal calls on a
    # persistent grid take 128 query rows (dispatch.fwd_gluon_rows).
    hopper_gluon_persistent_below_keys: int = 0


@dataclass(frozen=True)
class BwdConfig:
    block_m1: int  # query rows per step of the dK/dV pass
    block_n1: int  # keys owned by one dK/dV program
    block_m2: int  # query rows owned by one dQ program
    block_n2: int  # keys per step of the dQ pass
    num_warps: int
    num_stages: int
    # the dQ kernel's warps and stages, where they differ from the dK/dV kernel's
    dq_num_warps: int | None = None
    dq_num_stages: int | None = None
    # dK/dV matmuls laid out with the query block as M (S = Q K^T) instead of the key block
    # (S^T = K Q^T): K and V then stay in shared memory as wgmma B operands instead of
    # registers, which is what lets head dim 256 keep both 64x256 accumulators in registers.
    query_major: bool = False
    # Tensor-descriptor (TMA) loads for the tiles each loop step streams (Q and dO in the
    # dK/dV kernel, K and V in the dQ kernel), descriptors made per program and bounded at
    # (seqlen, head dim) like the forward's in-kernel path: no address registers per tile.
    tma: bool = False
    # From this many query rows, dQ added by the dK/dV kernel into a float32 accumulator (TMA
    # reduce-adds; FA2 Alg. 2 line 15 as the paper has it: 5 matmuls, not 7) unless flash_attn_backward
    # is asked to be deterministic. 0 = never: the dQ kernel. 0 in every table: on the H200 the
    # fused backward (its best config per point) was not faster than the two-kernel one at head
    # dims 64 and 128 (docs/performance.md, "Tried, and lost"; rows:
    # reports/h200/decisions/triton_fused_dq.csv), nor on the H100 at 256, where the dQ tile spills
    # beside dK and dV on 128- and 64-row steps (reports/h100/decisions/triton_fused_dq_d256.csv).
    fused_dq_min_rows: int = 0
    # From this many keys, the dK/dV kernel is the Gluon one with FA3's warp layout
    # (kernels/flash_attn_hopper.py: a loader warp and two consumer warpgroups sharing each Q/dO
    # tile) where its scope holds (hopper_gluon_applies); 0 = never. It takes precedence over
    # fused_dq_min_rows.
    hopper_gluon_min_keys: int = 0
    # Whether that Gluon kernel also adds dQ (FA3's scheme: TMA reduce-adds into a float32
    # accumulator, at head dim 256 reductions from registers, so the sum's order varies between
    # runs), at head dims 64 to 256, unless
    # flash_attn_backward is asked to be deterministic; the dQ kernel then does not run.
    hopper_gluon_fused_dq: bool = False
    # That kernel's schedule and launch order (kernels/flash_attn_hopper.py): the fused dQ's matmul
    # issued before dK's (True), after (False), or None: before with GQA/MQA, a window or ALiBi,
    # where it measured faster, after for dense MHA, where it measured level or slower. Head dims
    # 64 and 96 ignore it: their consumers take turns and compute dQ after dK. At head dims 192 and
    # 256 (kernels/hopper/bwd_wide.py) True or None issues dQ's matmuls before dV's and dK's, its
    # tiles written out while those run, faster or level than after them at 192 and faster at 256,
    # which False keeps (reports/h100/decisions/gluon_backward_dq_first_d192.csv,
    # gluon_backward_wide_fields.csv; flash_attn_hopper.dq_first).
    hopper_gluon_dq_first: bool | None = None
    # (batch, kv head) pairs in sections of at most this many, each section's key blocks launched
    # block-major (flash_attn_hopper.bwd_grid); "l2": as many as keep their Q, dO and dQ
    # accumulator within the L2 cache (FA4's head sections for its longest-first order); 1: each
    # pair's key blocks next to each other (FA4's sm_90 order), so that the programs sharing a
    # pair's Q, dO and accumulator run together. hopper_gluon_head_section orders calls without a
    # causal mask, hopper_gluon_causal_head_section causal ones. Without the mask 1 (or 4: at 96
    # only 4 was timed) measured faster than "l2" at head dims 64 to 192 (most at 192 with 2k keys,
    # level at 192 with 8k); causal, level or slower at 64 and 128 and faster at 192, which the
    # table gives 1, as 256 (faster than "l2" at 8k keys causal there: gluon_backward_wide_fields.csv)
    # (docs/performance.md, "Launch order"; reports/h100/decisions/gluon_backward_launch_order.csv).
    hopper_gluon_head_section: int | str = 1
    hopper_gluon_causal_head_section: int | str = "l2"
    # The packed-sequence kernel's key blocks: "longest" (every sequence given the longest one's),
    # "packed" (every sequence's on one axis, FA3's padded offsets) or "auto" (packed where the
    # longest grid would be more than half empty, where it measured faster).
    hopper_gluon_varlen_grid: str = "auto"
    # Whether calls with dropout take that kernel (dense calls on its grid, dQ fused, head dims 64
    # to 128), redrawing the forward's keep-mask (kernels/hopper/dropout.py), or the Triton backward.
    hopper_gluon_dropout: bool = False

    @property
    def dq_warps(self) -> int:
        """Warps of the dQ kernel."""
        return self.num_warps if self.dq_num_warps is None else self.dq_num_warps

    @property
    def dq_stages(self) -> int:
        """Pipeline stages of the dQ kernel."""
        return self.num_stages if self.dq_num_stages is None else self.dq_num_stages


# Hopper (sm_90), keyed by (padded head dim, causal). Chosen on the H200 by tools/tune_fa2.py
# (bf16, seqlen 4096, paper shapes): rows in reports/h200/decisions/block_sizes.csv, reasoning
# in docs/performance.md ("Block-size tables").
HOPPER_FWD_CONFIGS = {
    # small head dims: 4 warps of wgmma on 128x64 tiles; causal prefers 8 warps (more rows
    # in flight to hide the diagonal blocks' mask arithmetic).
    (16, False): FwdConfig(128, 64, 4, 3),
    (16, True): FwdConfig(128, 64, 8, 3),
    (32, False): FwdConfig(128, 64, 4, 3),
    (32, True): FwdConfig(128, 64, 8, 3),
    # head dim 64: the Gluon forward (below for 128) on 192 query rows a program (three consumer
    # warpgroups, FA3's tile at this head dim), faster in the same process than its 128 rows at 8k
    # keys, full and causal, and than this kernel at 2k full, so taken from 1024 keys full; causal
    # from 4096 keys, as at 2k causal it was slower than this kernel (rows:
    # reports/h200/decisions/gluon_fields.csv; with 128 rows, gluon_forward_d64.csv). Its three
    # consumers issue their matmuls in turns (hopper_gluon_pingpong, as FA3 and FA4 order them at head
    # dims up to 128): faster at 2k and 8k keys without causal and at 4k causal, level at 8k causal,
    # same process (reports/h100/decisions/gluon_fields.csv). Below 4096 keys its grid is persistent
    # (hopper_gluon_persistent_below_keys; causal on 128 rows), and causal it takes the Gluon forward
    # from 1000 keys: faster than the table before it at 16 x 1000 and 8 x 2048 causal (on the Triton
    # forward then) and 8 x 2048 full, slower at 2 x 8192 causal and level full (docs/performance.md,
    # "A persistent grid for short key loops"; rows: reports/h100/decisions/gluon_forward_persistent.csv).
    (64, False): FwdConfig(128, 64, 4, 3, hopper_gluon_min_keys=1024, hopper_gluon_block_m=192,
                           hopper_gluon_pingpong=True, hopper_gluon_persistent_below_keys=4096),
    (64, True): FwdConfig(128, 64, 8, 3, hopper_gluon_min_keys=1000, hopper_gluon_block_m=192,
                          hopper_gluon_pingpong=True, hopper_gluon_persistent_below_keys=4096),
    # head dim 128: 128x128 tiles with 8 warps halve the K/V re-reads per output row; TMA
    # frees the pointer registers (ptxas: no spills with it). From 1024 keys, equal lengths in
    # whole blocks take the Gluon kernel instead (other lengths its varlen variant, dispatch's
    # GluonPath.PACKED), faster than this one at 1k-16k in bf16 and fp16,
    # same process (docs/performance.md, "Gluon forward with FlashAttention-3's warp layout";
    # rows: reports/h200/decisions/gluon_forward.csv). Head dim 96 (padded to 128 here) takes the
    # Gluon forward in two head-dim sections, 64 + 32 (flash_attn_hopper.head_sections), faster
    # than this kernel at 1k-8k keys (reports/h100/decisions/gluon_forward_wide_heads.csv). Its two
    # consumers issue their matmuls in turns (hopper_gluon_pingpong): faster at head dim 96 full and
    # level or faster causal, level at 128, same process (reports/h100/decisions/gluon_fields.csv).
    # Its softmax is pinned under P~ V (hopper_gluon_pin_softmax): faster at 128 (but for level at
    # 2 x 8192 full) and at 96 full, level at 96 causal; off at 64, where it was slower (three
    # consumers: the pin spills; two on 128 rows with it slower still, gluon_fields.csv), and at
    # 192 and 256, which share a row, where it was level or slower at 192 and mixed at 256
    # (reports/h100/decisions/gluon_forward_pin_softmax.csv).
    (128, False): FwdConfig(128, 128, 8, 3, tma=True, tma_host_below_keys=8192, hopper_gluon_min_keys=1024,
                            hopper_gluon_pingpong=True, hopper_gluon_pin_softmax=True),
    # causal: in-kernel descriptors from 4096 visited keys (seqlen 8k, whose longest programs
    # visit all 8192), faster than host ones there in the same process (forward_memory_path.csv);
    # this applies to shapes outside the Gluon kernel's scope, and to the ablation's rung 4.
    (128, True): FwdConfig(128, 128, 8, 3, tma=True, tma_host_below_keys=4096, hopper_gluon_min_keys=1024,
                           hopper_gluon_pingpong=True, hopper_gluon_pin_softmax=True),
    # head dim 256 (and 192): only 2 stages of 128x64 K/V tiles fit next to Q in shared memory; TMA
    # (host descriptors to 4k keys, in-kernel from 8k) measured level with pointer tiles up to
    # 4k keys and faster at 16k by tools/tune_fa2.py (those head-dim-256 rows are not kept).
    # From 512 keys the Gluon forward with 64-key blocks instead (3 K and 2 V blocks in flight at
    # 256; 192 runs in two head-dim sections, 128 + 64, with 3 and 3), faster at 512-8192 keys in
    # the same process; 128-key blocks at 192 were slower (docs/performance.md, "The Gluon forward
    # at head dims 96, 192 and 256"; rows: reports/h100/decisions/gluon_forward_*.csv). Its consumers'
    # matmuls in turns (hopper_gluon_pingpong) were slower here (gluon_fields.csv), as FA3 and FA4
    # turn them off above head dim 128.
    (256, False): FwdConfig(128, 64, 8, 2, tma=True, tma_host_below_keys=8192, hopper_gluon_min_keys=512,
                            hopper_gluon_block_n=64),
    (256, True): FwdConfig(128, 64, 8, 2, tma=True, tma_host_below_keys=8192, hopper_gluon_min_keys=512,
                           hopper_gluon_block_n=64),
}
# Head dim 192 (padded to 256 above): the 256 entries, with the Gluon forward's Q in registers
# (hopper_gluon_q_in_registers): its S matmuls on 64-key blocks then read K alone from shared
# memory, faster in the same process (docs/performance.md, "Q in registers at head dim 192";
# rows: reports/h100/decisions/gluon_forward_q_in_registers.csv). At 256 it does not fit
# the consumers' registers (ptxas spills and serialises the wgmma).
HOPPER_FWD_CONFIGS.update({
    (192, causal): dataclasses.replace(HOPPER_FWD_CONFIGS[(256, causal)], hopper_gluon_q_in_registers=True)
    for causal in (False, True)
})
HOPPER_BWD_CONFIGS = {
    # tutorial 06's shape: narrow query steps against wide key blocks and vice versa.
    16: BwdConfig(32, 128, 128, 32, 4, 3),
    32: BwdConfig(32, 128, 128, 32, 4, 3),
    # head dim 64: from 512 keys the Gluon dK/dV kernel with dQ fused, its consumers computing
    # dQ in turns by query step, faster than this kernel with the dQ kernel in the same process
    # (docs/performance.md, "Gluon dK/dV with dQ fused at head dim 64"; rows:
    # reports/h100/decisions/gluon_backward_d64.csv: dense MHA, GQA and one length off the grid, from
    # 1024 keys; reports/h200/decisions/gluon_fields.csv: 1000 keys, causal; the features and packed
    # lengths with it were checked against float64, not timed). Without dQ fused it was not faster.
    # Calls with dropout take it too (on its grid), faster than this kernel (no features table at this
    # head dim: the same tiles) at 2k keys causal and 4k full, same process (gluon_fields.csv on the H100).
    64: BwdConfig(32, 128, 128, 32, 4, 3, hopper_gluon_min_keys=512, hopper_gluon_fused_dq=True,
                  hopper_gluon_dropout=True),
    # head dim 128: 64-row query steps and 8 warps keep the four dK/dV matmuls on wgmma. From 1024
    # keys the Gluon dK/dV kernel instead, with dQ fused (5 matmuls, not 7), faster at 1k-16k in
    # bf16 and fp16, same process, than this kernel with the dQ kernel (docs/performance.md,
    # "Gluon dK/dV with dQ fused, FA3's way"; rows: reports/h200/decisions/gluon_backward.csv).
    # Head dim 96 (which this entry serves) takes the same kernel in two head-dim sections
    # (docs/performance.md, "The Gluon backward at head dim 96"). Calls with dropout take it too (on
    # its grid), faster than the Triton backward on HOPPER_FEATURE_BWD_CONFIGS' tiles (which a dropout
    # call takes otherwise) at 96 and 128, full and causal, same process (reports/h100/decisions/gluon_fields.csv).
    128: BwdConfig(64, 128, 128, 32, 8, 3, hopper_gluon_min_keys=1024, hopper_gluon_fused_dq=True,
                   hopper_gluon_dropout=True),
    # head dim 256: query-major dK/dV with 128 query rows per step at 8 warps and 1 stage (the
    # only stage count that fits), dQ 64x32 at 4 warps and 3 stages. Against the v1 key-major 64x64 (4
    # warps), faster in the dK/dV kernel and the whole backward (docs/performance.md, "Query-major
    # head-dim-256 backward"; rows: reports/h200/decisions/query_major_backward_d256.csv).
    # Descriptor loads free the address registers that spilled (ptxas: no spills with them) and
    # took time off at 4k-16k (backward_descriptors_d256.csv); at head dims 128 and 64 the whole
    # backward was slower with them, so those keep pointer loads. From 512 keys the Gluon kernel
    # for wide heads takes the call instead (kernels/hopper/bwd_wide.py, dQ fused), faster in the
    # same process at 512-8192 keys (docs/performance.md, "The Gluon backward at head dim 256"; rows:
    # reports/h100/decisions/gluon_backward_d256.csv, gluon_backward_min_keys_d256.csv); these tiles
    # serve what it does not take (fewer keys, features, a deterministic backward).
    256: BwdConfig(128, 64, 64, 32, 8, 1, dq_num_warps=4, dq_num_stages=3, query_major=True, tma=True,
                   hopper_gluon_min_keys=512, hopper_gluon_fused_dq=True, hopper_gluon_causal_head_section=1),
}
# Head dim 192 (padded to 256 above): the 256 entry, with the Gluon kernel for wide heads from 1024
# keys, where at 512 it was slower without a causal mask (docs/performance.md, "The Gluon backward
# at head dim 192"; rows: reports/h100/decisions/gluon_backward_d192.csv, gluon_backward_min_keys_d192.csv).
HOPPER_BWD_CONFIGS[192] = dataclasses.replace(HOPPER_BWD_CONFIGS[256], hopper_gluon_min_keys=1024)
# The backward of calls with a window (causal included), softcap, ALiBi, dropout or packed
# variable lengths (kernels/backward_features.py), where it differs from HOPPER_BWD_CONFIGS. Head dim 128: the
# table's 64x128 key-major dK/dV kernel, with the features' mask, tanh and keep tiles beside its
# two 128x128 accumulators and its K and V operands, spills 880-1728 B a thread (ptxas, sm_90, by
# tools/compile_check_sm90.py's method); query-major 128x64 at 2 stages keeps K and V in shared
# memory and spills 100-296 B. Non-causal GQA alone keeps the table's (20 B).
HOPPER_FEATURE_BWD_CONFIGS = {
    128: BwdConfig(128, 64, 128, 32, 8, 2, dq_num_stages=3, query_major=True),
}
# Any other CUDA GPU (Ampere, Ada): smaller tiles, fewer stages (less shared memory).
GENERIC_FWD_CONFIG = FwdConfig(64, 64, 4, 2)
GENERIC_BWD_CONFIG = BwdConfig(32, 64, 64, 32, 4, 2)
# Triton's CPU interpreter: small tiles so that tiny test shapes still span several blocks.
# On CPU both TMA paths run: host descriptors for whole-block shapes below 64 keys, in-kernel
# descriptors for the rest.
INTERPRETER_FWD_CONFIG = FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0,
                                   tma_host_below_keys=64)
INTERPRETER_BWD_CONFIG = BwdConfig(16, 32, 32, 16, 4, 1)


def padded_headdim(headdim: int) -> int:
    """Head dim as the kernels tile it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (headdim - 1).bit_length())



@functools.cache
def _is_hopper(device_index: int) -> bool:
    """Whether this CUDA device is sm_90 (asked once per device: the query costs ~7 us of host
    time, which calls of ~0.1 ms feel)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def on_hopper(device: torch.device) -> bool:
    """Whether `device` is an sm_90 CUDA device."""
    return device.type == "cuda" and _is_hopper(torch.cuda.current_device() if device.index is None else device.index)


def hopper_fwd_config(headdim: int, causal: bool) -> FwdConfig:
    """HOPPER_FWD_CONFIGS' entry for this head dim: its own where the table has one (192), else its
    padded head dim's."""
    return HOPPER_FWD_CONFIGS.get((headdim, causal)) or HOPPER_FWD_CONFIGS[(padded_headdim(headdim), causal)]


def default_fwd_config(headdim: int, causal: bool, device: torch.device) -> FwdConfig:
    if device.type != "cuda":
        return INTERPRETER_FWD_CONFIG
    if on_hopper(device):
        return hopper_fwd_config(headdim, causal)
    return GENERIC_FWD_CONFIG


def takes_feature_tiles(flags: dict) -> bool:
    """Whether a call of the feature kernels (kernels/backward_features.py) with these constexprs
    (kernels/features.py's feature_args: WINDOW, causal included, SOFTCAP, ALIBI, DROPOUT, VARLEN)
    takes HOPPER_FEATURE_BWD_CONFIGS' tiles when no config is passed: any of them but a softcap,
    whose backward measured faster on the table's tiles (H200, causal 8k:
    reports/h200/decisions/softcap_backward_tables.log)."""
    return any(flags.values()) and not flags["SOFTCAP"]


def hopper_bwd_config(headdim: int) -> BwdConfig:
    """HOPPER_BWD_CONFIGS' entry for this head dim: its own where the table has one (192), else its
    padded head dim's."""
    return HOPPER_BWD_CONFIGS.get(headdim) or HOPPER_BWD_CONFIGS[padded_headdim(headdim)]


def default_bwd_config(headdim: int, device: torch.device, masked_features: bool = False) -> BwdConfig:
    """The backward's table entry; `masked_features`: a feature-kernel call with a window (causal
    included), softcap, ALiBi, dropout or packed variable lengths (HOPPER_FEATURE_BWD_CONFIGS
    where it has the head dim)."""
    if device.type != "cuda":
        return INTERPRETER_BWD_CONFIG
    if on_hopper(device):
        padded = padded_headdim(headdim)
        if masked_features and padded in HOPPER_FEATURE_BWD_CONFIGS:
            return HOPPER_FEATURE_BWD_CONFIGS[padded]
        return hopper_bwd_config(headdim)
    return GENERIC_BWD_CONFIG
