"""Which kernel and memory path serves a call: the one place that decides. The forward runs the
Gluon kernel of flash_attn_hopper.py (FA3's warp layout) or forward.py's Triton kernel with
TMA descriptors made on the host, in the kernel, or pointer tiles; the backward's dK/dV pass
runs the Gluon kernel (with dQ fused or not) or backward.py's Triton kernel. The rules read the
configs of configs.py; docs/performance.md holds the measurements behind them."""

from __future__ import annotations

import enum
import warnings

import torch
import triton
from triton.runtime.errors import PTXASError
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import DENSE, Features
from .configs import BwdConfig, FwdConfig, padded_headdim
from .launch import PlanCache
from .row_chunks import GRID_ROWS

# The Gluon kernels are written against Triton 3.6's Gluon API, which later releases change
# (3.8 removed gl.thread_barrier). Where they cannot be imported or compiled, every call takes
# the Triton kernels instead, with one warning; `gluon_unavailable` says why ('' when usable).
try:
    from . import flash_attn_hopper
    gluon_unavailable = ""
except (ImportError, AttributeError, TypeError) as exc:  # an API the module uses at import time
    flash_attn_hopper = None
    gluon_unavailable = f"the Gluon kernels do not import on Triton {triton.__version__}: {exc!r}"

# What a Gluon kernel that cannot be built on this Triton raises at its first launch.
GLUON_BUILD_ERRORS = (AttributeError, ImportError, TypeError, NotImplementedError, triton.CompilationError,
                      PTXASError)


def disable_gluon(exc: BaseException) -> None:
    """After a Gluon kernel failed to build: warn once, and route every later call to Triton's."""
    global gluon_unavailable
    gluon_unavailable = f"a Gluon kernel failed to compile on Triton {triton.__version__}: {exc!r}"
    warnings.warn(f"{gluon_unavailable}; using the Triton kernels instead (same results, slower on Hopper)",
                  RuntimeWarning, stacklevel=3)

FWD_MEMORY_PATHS = ("pointer", "tma-kernel", "tma-host")  # the kernel's TMA constexpr: 0, 1, 2


class GluonPath(str, enum.Enum):
    """The Gluon kernels (kernels/flash_attn_hopper.py) a call can take: what fwd_memory_path and
    bwd_dkdv_path return instead of a Triton path, and what plans and result rows record (the
    values compare, hash and print as their strings)."""

    # the dense kernels, or for packed variable lengths the varlen ones
    DENSE = "gluon-ws"
    # a dense call the dense kernels do not take (a length off their 128-row grid, fewer or more
    # queries than keys) on the varlen kernels, each batch row one packed sequence: they mask the
    # partial last blocks and align causal masks to the bottom right, as FA3's and FA4's sm_90
    # kernels do for every dense call (docs/hopper_peers.md)
    PACKED = "gluon-ws-packed"

    __str__ = str.__str__
    __hash__ = str.__hash__


def packed_view(t: torch.Tensor) -> torch.Tensor | None:
    """A dense (batch, seqlen, heads, headdim) tensor as packed (batch * seqlen, heads, headdim)
    rows, a view; None where the batches are not back to back (no such view)."""
    batch, seqlen = t.shape[:2]
    if batch > 1 and t.stride(0) != seqlen * t.stride(1):
        return None
    return t.view(batch * seqlen, *t.shape[2:]) if t.is_contiguous() else t.as_strided(
        (batch * seqlen, *t.shape[2:]), (t.stride(1), *t.stride()[2:]))


_DENSE_CU_SEQLENS = PlanCache()


def packed_features(q: torch.Tensor, k: torch.Tensor) -> Features:
    """The packed-sequence Features of a dense call (each batch row one sequence, seqlen_q queries
    against seqlen_k keys), for the varlen kernels: cu_seqlens made on q's device once per (batch,
    lengths, device) and kept, except while a CUDA graph is being captured (a tensor made then
    holds its values only once the graph replays: that call's own are made for it alone)."""
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    key = (batch, seqlen_q, seqlen_k, q.device)
    cu = _DENSE_CU_SEQLENS.get(key)
    if cu is None:
        steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        cu = (steps * seqlen_q, steps * seqlen_k)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DENSE_CU_SEQLENS.put(key, cu)
    return Features(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)


def _packed_scope(q: torch.Tensor, k: torch.Tensor) -> Features:
    """What the varlen rules read of a dense call's packed_features (the lengths and, from
    cu_seqlens' length, the batch), without making its cu_seqlens on the device."""
    counts = torch.empty(q.shape[0] + 1, dtype=torch.int32)
    return Features(cu_seqlens_q=counts, cu_seqlens_k=counts, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1])


def _dense_as_packed_refusal(config: FwdConfig, q, k, v, out) -> str:
    """Why the Gluon varlen forward does not take this dense call as packed rows
    (GluonPath.PACKED): hopper_gluon_varlen_refusal of the packed views ('' where it does)."""
    views = [packed_view(t) for t in (q, k, v, out)]
    if any(t is None for t in views):
        return "the batch rows are not back to back (no packed view)"
    if q.shape[0] * max(q.shape[1], k.shape[1]) >= 2**31:
        return "2^31 or more packed rows"
    return hopper_gluon_varlen_refusal(config, *views, _packed_scope(q, k))


def _listed(values) -> str:
    """(64, 128) as '64 and 128', for a reason's text."""
    return ", ".join(map(str, values[:-1])) + f" and {values[-1]}" if len(values) > 1 else str(values[0])


def _lengths_refusal(q, k, block_m: int | None = None, block_n: int | None = None, causal: bool = False) -> str:
    """Why the dense Gluon kernels do not take these lengths ('' where they do): unequal, or off
    their grid of block_m query rows and block_n keys (128 and 128 unless given; causal, the key
    blocks whole within a query block), the calls GluonPath.PACKED is for."""
    block_m = block_m or flash_attn_hopper.BLOCK_M
    block_n = block_n or flash_attn_hopper.BLOCK_N
    grid = f"{block_m}-row blocks" if block_m % block_n == 0 else f"{block_m}-row and {block_n}-key blocks"
    if k.shape[1] != q.shape[1] or q.shape[1] % block_m or q.shape[1] % block_n:
        return f"{q.shape[1]} queries on {k.shape[1]} keys: the dense Gluon kernels take equal lengths in whole {grid}"
    if causal and block_m % block_n:
        return (f"causal on {block_m}-row blocks of {block_n} keys: the dense Gluon forward's causal blocks are whole "
                f"key blocks of a query block")
    return ""


# A call with a feature whose lengths only the varlen kernels take
OFF_GRID_FEATURES = ("a window, softcap, ALiBi or dropout with lengths off the 128-row grid or unequal: the Gluon "
                     "varlen kernels have none of them")


def _min_keys_refusal(config, keys: int, mode: str) -> str:
    """Why the config's hopper_gluon_min_keys keeps a call of `keys` keys off the Gluon kernels ('' where not)."""
    if not config.hopper_gluon_min_keys:
        return f"the {mode} config takes no Gluon kernel (hopper_gluon_min_keys 0)"
    if keys < config.hopper_gluon_min_keys:
        return f"{keys} keys: fewer than the {mode} config's hopper_gluon_min_keys {config.hopper_gluon_min_keys}"
    return ""


def fwd_gluon_path(config: FwdConfig, q, k, v, out, causal: bool, features: Features = DENSE) -> tuple[str, str]:
    """The Gluon forward that takes this call and why none does: (GluonPath.DENSE or
    GluonPath.PACKED, '') or ('', the reason). Packed variable lengths: the Gluon varlen
    kernel where hopper_gluon_varlen_refusal has none. Dense: the dense kernel from the config's
    hopper_gluon_min_keys keys, where hopper_gluon_refusal has none; else, with no feature but
    causal, the varlen kernel on each batch row as a packed sequence. Dropout: none."""
    if gluon_unavailable:
        return "", gluon_unavailable
    if features.dropout_p:
        return "", "dropout: on the Triton forward (the Gluon forwards have none)"
    if features is not DENSE and features.varlen:
        refusal = hopper_gluon_varlen_refusal(config, q, k, v, out, features)
        return (GluonPath.DENSE, "") if not refusal else ("", refusal)
    refusal = _min_keys_refusal(config, k.shape[1], "forward")
    rows, block_n = fwd_gluon_rows(config, features, causal, k.shape[1]), config.hopper_gluon_block_n
    refusal = refusal or hopper_gluon_refusal(q, k, v, out, block_m=rows, block_n=block_n, causal=causal)
    if not refusal and _forward_tile_refusal(config, q.shape[-1], rows):
        return "", _forward_tile_refusal(config, q.shape[-1], rows)
    if not refusal:
        return GluonPath.DENSE, ""
    # where only the lengths keep the dense kernel off, the packed rows' reason is the one that counts
    lengths = refusal == _lengths_refusal(q, k, rows, block_n, causal)
    if not (features is DENSE or features.dense):
        return "", OFF_GRID_FEATURES if lengths else refusal
    packed = _dense_as_packed_refusal(config, q, k, v, out)
    if not packed:
        return GluonPath.PACKED, ""
    return "", packed if lengths else refusal


def _forward_tile_refusal(config: FwdConfig, headdim: int, rows: int | None = None) -> str:
    """Why the config's hopper_gluon_block_n and hopper_gluon_block_m keep the Gluon forward off
    this head dim ('' where the key blocks are power-of-two tiles of at most 128 keys, `rows`
    (fwd_gluon_rows; the config's unless given) is a query block the kernels have warps for, at
    least 2 K blocks fit beside it in shared memory (flash_attn_hopper.forward_stages), and with
    192 rows the head dim and key block fit three consumers' registers (three_consumer_refusal))."""
    rows = rows or config.hopper_gluon_block_m
    block_n = config.hopper_gluon_block_n
    if flash_attn_hopper.BLOCK_N % block_n:
        return (f"hopper_gluon_block_n {block_n}: not a divisor of {flash_attn_hopper.BLOCK_N} (the key blocks are "
                f"power-of-two tiles of at most {flash_attn_hopper.BLOCK_N} keys)")
    try:
        consumers = flash_attn_hopper.forward_launch_options(rows)["CONSUMERS"]
        flash_attn_hopper.forward_stages(headdim, config.hopper_gluon_block_n, block_m=rows)
    except ValueError as exc:
        return str(exc)
    return flash_attn_hopper.three_consumer_refusal(headdim, block_n) if consumers == 3 else ""


def fwd_gluon_rows(config: FwdConfig, features: Features = DENSE, causal: bool = False, keys: int = 0) -> int:
    """The Gluon forward's query rows a program for a call of `keys` keys (the longest sequence's):
    the config's hopper_gluon_block_m, but 128 (two consumer warpgroups) with a window, softcap or
    ALiBi, whose score code takes the registers a third consumer would need, and causal on a
    persistent grid (fewer keys than hopper_gluon_persistent_below_keys), where 128 rows measured
    faster than 192 at head dim 64, the one entry with 192 (in a side-by-side run whose rows are not
    kept; the kept rows time the persistent grid on 128 rows against the table)."""
    if (features.window_left >= 0 or features.window_right >= 0 or features.softcap
            or features.alibi_slopes is not None):
        return flash_attn_hopper.BLOCK_M
    if causal and keys < config.hopper_gluon_persistent_below_keys:
        return flash_attn_hopper.BLOCK_M
    return config.hopper_gluon_block_m


def fwd_memory_path(config: FwdConfig, q, k, v, out, causal: bool, features: Features = DENSE) -> str:
    """How the forward runs for these (batch, seqlen, heads, headdim) tensors: a Gluon kernel
    where fwd_gluon_path names one ('gluon-ws': the Gluon kernels of flash_attn_hopper.py, dense or
    over packed variable lengths; 'gluon-ws-packed': the varlen one on a dense call's batch rows),
    or the Triton forward with 'tma-host' (2D descriptors made here), 'tma-kernel' (per-head
    descriptors made by each program) or 'pointer' (pointer tiles), by FwdConfig's rules. Packed
    variable lengths on Triton take 'tma-kernel' for K and V only (each program describes its
    sequence's keys; Q and O go by pointers, as a sequence may be empty and no descriptor has zero
    rows) or 'pointer', never the host's 2D descriptors (a tile would cross into the next
    sequence)."""
    gluon, _ = fwd_gluon_path(config, q, k, v, out, causal, features)
    if gluon:
        return gluon
    if features is not DENSE and features.varlen:
        keys = features.max_seqlen_k // 2 if causal else features.max_seqlen_k
        tma = config.tma and tma_compatible(q, k, v, out) and keys >= config.tma_min_keys
        return "tma-kernel" if tma else "pointer"
    if not config.tma or not tma_compatible(q, k, v, out):
        return "pointer"
    keys = k.shape[1] // 2 if causal else k.shape[1]
    if (config.tma_host_min_keys <= keys < config.tma_host_below_keys
            and _flat_view_is_exact(q, k, v, out, config)):
        return "tma-host"
    return "tma-kernel" if keys >= config.tma_min_keys else "pointer"


def _flat_view_is_exact(q, k, v, out, config: FwdConfig, tiles_padded: bool = True) -> bool:
    """Whether a (batch * seqlen, heads * headdim) 2D descriptor reads and writes exactly a
    (batch, head)'s tiles: whole blocks (no tile runs into the next batch's rows), a head dim
    with no padding columns where the tiles are padded to a power of two (`tiles_padded`, the
    Triton kernels': no tile runs into the next head's; the Gluon forward's head-dim sections
    are not), heads side by side in a row and batches back to back."""
    headdim = q.shape[3]
    if ((tiles_padded and headdim != padded_headdim(headdim)) or q.shape[1] % config.block_m
            or k.shape[1] % config.block_n or q.shape[0] * max(q.shape[1], k.shape[1]) >= 2**31):
        return False
    return all(t.stride(2) == headdim and t.stride(0) == t.shape[1] * t.stride(1) for t in (q, k, v, out))


def hopper_gluon_refusal(q, k, v, out, mode: str = "forward", block_m: int | None = None, block_n: int | None = None,
                         causal: bool = False) -> str:
    """Why the dense Gluon kernels (kernels/flash_attn_hopper.py) do not take these tensors ('' where
    they do). Their scope: a head dim of the forward's (FWD_HEAD_DIMS: 64, 96, 128, 192 and 256) or, with
    `mode` "backward", the dK/dV kernels' (BWD_HEAD_DIMS: 64, 96, 128, 192 and 256), fp16 or bf16, q heads a multiple of the kv heads
    (GQA/MQA), query and key lengths equal and whole blocks (_lengths_refusal, checked after the
    shapes, dtypes and strides: the lengths are what GluonPath.PACKED is for), and each
    tensor an exact 2D view for its descriptors (as the host-descriptor path needs, for the Gluon
    kernels' 128-row blocks). `out` is the forward's output, or
    dO for the backward's dK/dV kernel; block_m, block_n and causal: the forward's grid
    (_lengths_refusal)."""
    hopper = flash_attn_hopper
    if gluon_unavailable:
        return gluon_unavailable
    batch, _, heads, headdim = q.shape
    kv_heads = k.shape[2]
    head_dims = hopper.BWD_HEAD_DIMS if mode == "backward" else hopper.FWD_HEAD_DIMS
    if headdim not in head_dims:
        return f"head dim {headdim}: the Gluon {mode} kernels take head dims {_listed(head_dims)}"
    if q.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in (k, v, out)):
        return "the Gluon kernels take float16 or bfloat16 tensors, all of one dtype"
    if not (q.shape == out.shape and k.shape == v.shape and k.shape[0] == batch and k.shape[3] == headdim
            and kv_heads and heads % kv_heads == 0):
        return f"{heads} q heads on {kv_heads} kv heads, or shapes that do not match"
    if batch * heads > GRID_ROWS:  # a grid axis's bound: the API runs such calls in chunks (row_chunks.py)
        return f"batch x heads {batch * heads}: more than a grid axis's {GRID_ROWS}"
    # rows that do not overlap (no broadcast K or V with stride 0): one descriptor row each
    if any(t.stride(1) < t.shape[2] * headdim for t in (q, k, v, out)) or not tma_compatible(q, k, v, out):
        return "rows that overlap, a last stride other than 1, or not 16-byte aligned (TMA)"
    lengths = _lengths_refusal(q, k, block_m, block_n, causal)
    if lengths:
        return lengths
    grid = FwdConfig(block_m or hopper.BLOCK_M, block_n or hopper.BLOCK_N, 4, 1)
    if not _flat_view_is_exact(q, k, v, out, grid, tiles_padded=False):
        return "not an exact (batch x seqlen, heads x head dim) view"
    return ""


def hopper_gluon_applies(q, k, v, out, mode: str = "forward") -> bool:
    """Whether the dense Gluon kernels take these tensors (hopper_gluon_refusal has no reason)."""
    return not hopper_gluon_refusal(q, k, v, out, mode)


def hopper_gluon_varlen_refusal(config: FwdConfig, q, k, v, out, features: Features, mode: str = "forward") -> str:
    """Why the Gluon varlen forward (flash_attn_hopper's varlen kernel) does not take these packed
    sequences ('' where it does). Its scope: packed sequences and no other feature (no window,
    softcap, ALiBi or dropout), from hopper_gluon_min_keys keys in the longest sequence, a head dim
    of FWD_HEAD_DIMS (64, 96, 128, 192 and 256) whose key blocks fit (`_forward_tile_refusal`) or,
    with `mode` "backward", of VARLEN_BWD_HEAD_DIMS (64, 96 and 128), fp16 or bf16, q heads a multiple of the
    kv heads, each (total, heads, head dim) tensor's heads side by side in its rows (a (total,
    heads * head dim) 2D view) and TMA-compatible. `mode` also names the config's table in the
    reason."""
    if gluon_unavailable:
        return gluon_unavailable
    if features is DENSE or not features.varlen:
        return "not packed sequences"
    if features.dropout_p:
        return f"dropout: the Gluon varlen {mode} kernels have none"
    if (features.window_left >= 0 or features.window_right >= 0 or features.softcap
            or features.alibi_slopes is not None):
        return "a window, softcap or ALiBi: the Gluon varlen kernels have none of them"
    refusal = _min_keys_refusal(config, features.max_seqlen_k, mode)
    if refusal:
        return refusal
    _, heads, headdim = q.shape
    kv_heads = k.shape[1]
    batch = features.cu_seqlens_q.shape[0] - 1
    head_dims = flash_attn_hopper.VARLEN_BWD_HEAD_DIMS if mode == "backward" else flash_attn_hopper.FWD_HEAD_DIMS
    if headdim not in head_dims:
        return f"head dim {headdim}: the Gluon varlen {mode} kernels take head dims {_listed(head_dims)}"
    if mode == "forward" and _forward_tile_refusal(config, headdim, fwd_gluon_rows(config, features)):
        return _forward_tile_refusal(config, headdim, fwd_gluon_rows(config, features))
    if q.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in (k, v, out)):
        return "the Gluon kernels take float16 or bfloat16 tensors, all of one dtype"
    if not (q.shape == out.shape and k.shape == v.shape and k.shape[2] == headdim
            and kv_heads and heads % kv_heads == 0):
        return f"{heads} q heads on {kv_heads} kv heads, or shapes that do not match"
    if batch * heads > GRID_ROWS:  # a grid axis's bound: the API runs such calls in chunks (row_chunks.py)
        return f"batch x heads {batch * heads}: more than a grid axis's {GRID_ROWS}"
    if any(t.stride(1) != headdim or t.stride(0) < t.shape[1] * headdim for t in (q, k, v, out)):
        return "heads not side by side in their rows"
    if not tma_compatible(q, k, v, out):
        return "not 16-byte aligned (TMA)"
    return ""


def hopper_gluon_varlen_applies(config: FwdConfig, q, k, v, out, features: Features) -> bool:
    """Whether the Gluon varlen forward takes these packed sequences (hopper_gluon_varlen_refusal
    has no reason)."""
    return not hopper_gluon_varlen_refusal(config, q, k, v, out, features)


def hopper_gluon_varlen_bwd_refusal(config: BwdConfig, q, k, v, do, features: Features,
                                    deterministic: bool = False) -> str:
    """Why the Gluon varlen dK/dV kernel with dQ fused does not take these packed sequences ('' where
    it does): its scope is the forward's (hopper_gluon_varlen_refusal, with the backward table's
    hopper_gluon_min_keys) at the head dims where that kernel fuses dQ (64, 96 and 128), unless a
    deterministic backward is asked for (the dQ reduce-adds' order varies between runs)."""
    if gluon_unavailable:
        return gluon_unavailable
    if deterministic:
        return "deterministic: the dQ reduce-adds' order varies between runs"
    if not config.hopper_gluon_fused_dq:
        return ("packed lengths, GQA and lengths off the 128-row grid take the Gluon backward only with dQ fused, "
                "where the config asks for it")
    if features.varlen and -(-features.max_seqlen_k // flash_attn_hopper.BWD_BLOCK_N) > flash_attn_hopper.BWD_MAX_KEY_BLOCKS:
        return "more key blocks than the grid's second axis takes"  # flash_attn_hopper.bwd_grid
    scope = FwdConfig(128, 128, 4, 1, hopper_gluon_min_keys=config.hopper_gluon_min_keys)
    return hopper_gluon_varlen_refusal(scope, q, k, v, do, features, "backward")


def hopper_gluon_varlen_bwd_applies(config: BwdConfig, q, k, v, do, features: Features,
                                    deterministic: bool = False) -> bool:
    """Whether the Gluon varlen dK/dV kernel with dQ fused takes these packed sequences
    (hopper_gluon_varlen_bwd_refusal has no reason)."""
    return not hopper_gluon_varlen_bwd_refusal(config, q, k, v, do, features, deterministic)


def flat_descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    batch, seqlen, heads, headdim = t.shape
    return TensorDescriptor(t, [batch * seqlen, heads * headdim], [t.stride(1), 1], [block_rows, headdim])


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors (either kind, see fwd_memory_path) can describe these (batch,
    seqlen, heads, headdim) tensors: the copy engine needs 16-byte aligned addresses and row
    strides, so the base pointer and every stride but the last (which must be 1) in bytes are
    multiples of 16. Otherwise the forward uses pointer tiles (same results)."""
    for t in tensors:
        size = t.element_size()
        strides = t.stride()
        if strides[-1] != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in strides[:-1]):
            return False
    return True

def bwd_fuses_dq(config: BwdConfig, seqlen_q: int, deterministic: bool = False) -> bool:
    """Whether the dK/dV kernel adds dQ into a float32 accumulator (atomics, run-to-run rounding
    differences) instead of the dQ kernel writing it: where the config asks for it from this
    many query rows and the caller does not ask for a deterministic backward."""
    return bool(config.fused_dq_min_rows) and seqlen_q >= config.fused_dq_min_rows and not deterministic


def bwd_gluon_path(config: BwdConfig, q, k, v, do, features: Features = DENSE,
                   deterministic: bool = False) -> tuple[str, str]:
    """The Gluon dK/dV kernel that takes this dense call and why none does: (GluonPath.DENSE or
    GluonPath.PACKED, '') or ('', the reason). The dense kernel from the config's
    hopper_gluon_min_keys keys where hopper_gluon_refusal has none and the keys are whole blocks
    within the grid; a call with a feature or GQA/MQA only where it also adds dQ
    (bwd_gluon_fuses_dq), as the dQ kernel has neither; else, with no feature but causal, the
    varlen kernel on each batch row as a packed sequence (hopper_gluon_varlen_bwd_refusal)."""
    if gluon_unavailable:
        return "", gluon_unavailable
    headdim = q.shape[3]
    beyond_dense = (features is not DENSE and not features.dense) or k.shape[2] != q.shape[2]
    if features.dropout_p and not config.hopper_gluon_dropout:
        return "", "dropout: on the Triton kernels unless the config's hopper_gluon_dropout asks for the Gluon ones"
    if beyond_dense and not bwd_gluon_fuses_dq(config, headdim, deterministic):
        return "", ("deterministic: features and GQA take the Gluon backward only with dQ fused" if deterministic
                    else "features, GQA, packed lengths and lengths off the 128-row grid take the Gluon backward "
                         f"only with dQ fused (head dims {_listed(flash_attn_hopper.FUSED_DQ_HEAD_DIMS)})")
    refusal = _min_keys_refusal(config, k.shape[1], "backward") or hopper_gluon_refusal(q, k, v, do, "backward")
    if not refusal and (k.shape[1] % flash_attn_hopper.BWD_BLOCK_N
                        or k.shape[1] // flash_attn_hopper.bwd_key_block(headdim) > flash_attn_hopper.BWD_MAX_KEY_BLOCKS):
        refusal = "more key blocks than the grid's second axis takes"
    if not refusal and headdim in flash_attn_hopper.WIDE_BWD_HEAD_DIMS:
        if not bwd_gluon_fuses_dq(config, headdim, deterministic):
            refusal = (f"head dim {headdim}: its Gluon backward always fuses dQ (not with deterministic=True "
                       "or a config without hopper_gluon_fused_dq)")
        elif not (features is DENSE or features.dense):
            refusal = f"head dim {headdim}: its Gluon backward takes no window, softcap, ALiBi or dropout"
    if not refusal:
        return GluonPath.DENSE, ""
    lengths = refusal == _lengths_refusal(q, k)
    if not (features is DENSE or features.dense):
        return "", OFF_GRID_FEATURES if lengths else refusal
    views = [packed_view(t) for t in (q, k, v, do)]
    packed = ("the batch rows are not back to back (no packed view)" if any(t is None for t in views) else
              hopper_gluon_varlen_bwd_refusal(config, *views, _packed_scope(q, k), deterministic))
    if not packed:
        return GluonPath.PACKED, ""
    return "", packed if lengths else refusal


def bwd_dkdv_path(config: BwdConfig, q, k, v, do, features: Features = DENSE, deterministic: bool = False) -> str:
    """Which kernel computes dK and dV for these tensors by the config's rule: the Gluon one
    bwd_gluon_path names ('gluon-ws': flash_attn_hopper.py's dense kernel, from
    hopper_gluon_min_keys keys; a softcap's too, faster there than on the Triton feature kernels
    since the Gluon kernel's step reads D late: docs/performance.md, "The backward's step";
    'gluon-ws-packed': its varlen kernel on a dense call's batch rows, GluonPath.PACKED),
    else 'triton' (_flash_bwd_dkdv_kernel, or _flash_bwd_dkdv_features_kernel for a call with
    features or GQA). flash_attn_backward takes the Gluon paths only on an sm_90 device."""
    return bwd_gluon_path(config, q, k, v, do, features, deterministic)[0] or "triton"


def gluon_feature_flags(features: Features, causal: bool) -> dict:
    """The Gluon kernels' WINDOW, SOFTCAP and ALIBI constexprs for a call (kernels/features.py
    passes causal to the Triton kernels as a window; the Gluon ones keep their causal path and
    take WINDOW only for a bounded side)."""
    return {"WINDOW": features.window_left >= 0 or (not causal and features.window_right >= 0),
            "SOFTCAP": bool(features.softcap), "ALIBI": features.alibi_slopes is not None}


def bwd_gluon_fuses_dq(config: BwdConfig, headdim: int, deterministic: bool = False) -> bool:
    """On the 'gluon-ws' path: whether the Gluon kernel adds dQ itself (TMA reduce-adds, the sum's
    order varying between runs) instead of the dQ kernel writing it: where the config asks for it,
    at head dims 64 to 256 (bwd.py's two consumers split dQ's columns at 128 and take turns by
    step at 64 and 96; bwd_wide.py's dP warpgroup computes it at 192, each of its warpgroups its
    own section's columns at 256), unless a
    deterministic backward is asked for."""
    return (config.hopper_gluon_fused_dq and flash_attn_hopper is not None
            and headdim in flash_attn_hopper.FUSED_DQ_HEAD_DIMS and not deterministic)


def bwd_uses_tma(config: BwdConfig, q, k, v, do) -> bool:
    """Whether the backward streams its loop tiles through tensor descriptors: where the
    config asks for it and the copy engine can address the tensors (tma_compatible)."""
    return bool(config.tma) and tma_compatible(q, k, v, do)
