"""Decode providers: one new query token per sequence against a KV cache, registered in the one
registry with kind 'decode' (`registry("decode")`, `get_provider(name, "decode")`): their call
signature differs from the attention providers'.

Contract (the decode suite builds on it):

    provider.forward(q, k_cache, v_cache, cache_seqlens, softmax_scale=None) -> out

- q (B, 1, H, D); k_cache, v_cache (B, S, Hkv, D) with Hkv dividing H (GQA/MQA: q head h
  reads kv head h // (H // Hkv)); fp16/bf16 (fp32 where the provider's supports() allows).
- cache_seqlens: int32 (B,) on the cache's device, 1 <= cache_seqlens[b] <= S: sequence b
  attends to its first cache_seqlens[b] cached keys; the rest of its cache rows are ignored
  (they must be finite). No causal flag: the one query is the newest token and sees every
  key of its sequence. The float64 reference is
  `baselines.reference.attention_reference(q, k_cache, v_cache, seqlens_k=cache_seqlens)`.
- out (B, 1, H, D) in q's dtype. softmax_scale None means 1 / sqrt(D).
- The first call for a shape may compile (torch.compile, FA4's CuTe DSL, FlashInfer's nvcc,
  Triton) or plan: time only after one untimed call. Providers that need the lengths on the
  host (FlashInfer's plan, xformers' block-diagonal bias, SDPA's mask) read them once per
  cache_seqlens tensor, and again only after it changes in place (its version counter): never
  a device-to-host copy per timed call.
- availability() -> None or the reason (a sentence); supports(DecodeSpec) -> None or the
  reason; a call the kernel refuses raises UnsupportedInput.

Providers that read a paged cache also have

    provider.decode_paged(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None) -> out

- k_pages, v_pages (num_pages, page_size, Hkv, D); block_table int32 (B, pages_per_sequence):
  slot j of sequence b is k_pages[block_table[b, j // page_size], j % page_size], as in
  flash-attn's `flash_attn_with_kvcache`; 1 <= cache_seqlens[b] <= pages_per_sequence * page_size.
  The pages a sequence's length does not reach are not read.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from baselines.providers.builtin import SDPA_EFFICIENT_LABEL, sdpa_call
from baselines.providers.core import (
    DTYPES,
    MAX_HEADDIM,
    NEEDS_CUDA,
    CompiledOnce,
    Provider,
    UnsupportedInput,
    cuda_available,
    everywhere,
    first,
    min_arch,
    one_line,
    optional_cuda_package,
    register,
)
from baselines.providers.packages import (
    FA4_DISTRIBUTION,
    FLASHINFER_DISTRIBUTION,
    FLASHINFER_HEADDIMS,
    fa4_arch,
    fa4_input_reason,
    flashinfer_jit_probe,
    flashinfer_workspace,
)

XFORMERS_SPLITK_HEADDIMS = (16, 32, 64, 128, 256, 512)  # xformers triton_splitk.FwOp.shape_not_supported_reasons


@dataclass(frozen=True)
class DecodeSpec:
    """One decode configuration: batch sequences of one query token, a cache of cache_len slots."""

    batch: int
    heads: int
    kv_heads: int
    hdim: int
    cache_len: int
    dtype: str  # 'fp16' | 'bf16' | 'fp32'

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"DecodeSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("batch", "heads", "kv_heads", "hdim", "cache_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DecodeSpec.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"DecodeSpec.kv_heads ({self.kv_heads}) must divide heads ({self.heads})")


def _check_query_and_cache(q, k, v, names: str, layout: str) -> None:
    """What a contiguous and a paged cache share: q one token per sequence, k and v of one
    shape, the head dim of q, kv heads dividing q heads, one dtype."""
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be (batch, 1, heads, headdim), got shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"{names} must both be {layout}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{names.split()[0]} {tuple(k.shape)} must match q {tuple(q.shape)}: same headdim, kv_heads "
                         "dividing heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, {names.replace(' and', ',')} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_int32(name: str, tensor, shape: tuple, shape_text: str) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, shape)):
        raise ValueError(f"{name} must be int32 of shape {shape_text}, got {tensor.dtype} {tuple(tensor.shape)}")


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens) -> None:
    """ValueError naming the argument when the inputs do not follow the contract (shapes,
    dtypes and devices only: the lengths' values are not read here)."""
    _check_query_and_cache(q, k_cache, v_cache, "k_cache and v_cache", "(batch, cache_len, kv_heads, headdim)")
    batch = q.shape[0]
    if k_cache.shape[0] != batch:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} must match q {tuple(q.shape)}: same batch")
    _check_int32("cache_seqlens", cache_seqlens, (batch,), f"({batch},)")
    if not (q.device == k_cache.device == v_cache.device == cache_seqlens.device):
        raise ValueError("q, k_cache, v_cache and cache_seqlens must be on one device")


def check_paged_decode_inputs(q, k_pages, v_pages, block_table, cache_seqlens) -> None:
    """check_decode_inputs for a paged cache."""
    _check_query_and_cache(q, k_pages, v_pages, "k_pages and v_pages", "(num_pages, page_size, kv_heads, headdim)")
    batch = q.shape[0]
    _check_int32("block_table", block_table, (batch, None), f"({batch}, pages_per_sequence)")
    _check_int32("cache_seqlens", cache_seqlens, (batch,), f"({batch},)")
    if not (q.device == k_pages.device == v_pages.device == block_table.device == cache_seqlens.device):
        raise ValueError("q, k_pages, v_pages, block_table and cache_seqlens must be on one device")


def _scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


class _PerLengths:
    """Objects made from the values of one cache_seqlens tensor (its host copy, a mask, a
    plan), kept while that tensor lives and its version counter is unchanged."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, lengths: torch.Tensor, key: tuple, make: Callable[[tuple[int, ...]], object]):
        entry = self._entries.get(id(lengths))
        if entry is None or entry[0]() is not lengths or entry[1] != lengths._version:
            self._entries = {i: e for i, e in self._entries.items() if e[0]() is not None}
            entry = (weakref.ref(lengths), lengths._version, {}, tuple(lengths.tolist()))
            self._entries[id(lengths)] = entry
        derived, host = entry[2], entry[3]
        if key not in derived:
            derived[key] = make(host)
        return derived[key]


_PER_LENGTHS = _PerLengths()


def _checked_host_lengths(host: tuple[int, ...], cache_len: int) -> tuple[int, ...]:
    if any(not 1 <= n <= cache_len for n in host):
        raise ValueError(f"cache_seqlens must lie in 1..{cache_len} (the cache length), got {list(host)}")
    return host


# --------------------------------------------------------------------------------------
# PyTorch eager, and the same under torch.compile
# --------------------------------------------------------------------------------------
def eager_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, _, heads, hdim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    qg = q.reshape(batch, kv_heads, group, hdim)  # (B, Hkv, G, D): q head h = kv head h // G
    scores = torch.matmul(qg, k_cache.permute(0, 2, 3, 1)) * _scale(q, softmax_scale)  # (B, Hkv, G, S)
    visible = torch.arange(cache_len, device=q.device)[None, :] < cache_seqlens[:, None]  # (B, S)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v_cache.transpose(1, 2))  # (B, Hkv, G, D)
    return out.reshape(batch, 1, heads, hdim)


_EAGER_DECODE_COMPILED = CompiledOnce(eager_decode, "torch.compile(PyTorch eager decode)")


def compiled_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    key = (tuple(q.shape), tuple(k_cache.shape), q.dtype, str(q.device))
    return _EAGER_DECODE_COMPILED(key, q, k_cache, v_cache, cache_seqlens, softmax_scale)


# --------------------------------------------------------------------------------------
# SDPA, pinned to one backend each; per-sequence lengths as a boolean mask
# --------------------------------------------------------------------------------------
def _sdpa_mask(host: tuple[int, ...], cache_len: int, device) -> torch.Tensor | None:
    """(B, 1, 1, S) True where a key is visible; None when every sequence fills the cache
    (the backends that take no mask, SDPA flash among them, then still run)."""
    _checked_host_lengths(host, cache_len)
    if all(n == cache_len for n in host):
        return None
    lengths = torch.tensor(host, device=device)
    return (torch.arange(cache_len, device=device)[None, :] < lengths[:, None])[:, None, None, :]


def sdpa_decode(backend_name: str):
    def decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
        check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
        cache_len = k_cache.shape[1]
        mask = _PER_LENGTHS.get(cache_seqlens, ("sdpa-mask", cache_len, str(q.device)),
                                lambda host: _sdpa_mask(host, cache_len, q.device))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k_cache, v_cache))  # (B, H, 1, D), (B, Hkv, S, D)
        kwargs = {"scale": _scale(q, softmax_scale), "enable_gqa": k_cache.shape[2] != q.shape[2]}
        if mask is not None:
            kwargs["attn_mask"] = mask
        return sdpa_call(backend_name, qt, kt, vt, **kwargs).transpose(1, 2)

    return decode


# --------------------------------------------------------------------------------------
# FA4: flash_attn_varlen_func with seqused_k (the cache lengths, read on the device)
# --------------------------------------------------------------------------------------
def fa4_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """num_splits=1 on sm_90, where FA4 has no split-KV (it asserts on more); its split
    heuristic (num_splits=0) elsewhere."""
    from flash_attn.cute import flash_attn_varlen_func

    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    num_splits = 1 if torch.cuda.get_device_capability(q.device)[0] == 9 else 0
    return first(flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=cache_seqlens, softmax_scale=softmax_scale,
                                        causal=False, num_splits=num_splits))


# --------------------------------------------------------------------------------------
# FlashInfer: the paged decode wrapper, and its single-sequence decode
# --------------------------------------------------------------------------------------
def _plan_flashinfer_decode(host, block_table, page_size, heads, kv_heads, hdim, scale, dtype, device):
    """A BatchDecodeWithPagedKVCacheWrapper planned for these lengths and pages. FlashInfer's
    page table is CSR: sequence b owns indices[indptr[b]:indptr[b + 1]], its first
    ceil(n_b / page_size) pages of block_table[b], the last one filled to last_page_len[b]."""
    import flashinfer

    _checked_host_lengths(host, block_table.shape[1] * page_size)
    pages = [-(-n // page_size) for n in host]
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=device)
    indices = torch.cat([block_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * page_size for n, p in zip(host, pages)], dtype=torch.int32,
                                 device=device)
    # tensor cores pay off once several q heads share a kv head (FlashInfer's own advice)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(flashinfer_workspace(device), "NHD",
                                                            use_tensor_cores=heads // kv_heads >= 4)
    wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, hdim, page_size, sm_scale=scale,
                 q_data_type=dtype, kv_data_type=dtype)
    return wrapper


def _flashinfer_run(q, k_pages, v_pages, make_block_table, cache_seqlens, softmax_scale, key):
    """The planned wrapper for (cache_seqlens, key) run on pages (P, page_size, Hkv, D), FlashInfer's
    NHD paged layout; `make_block_table()` is called only when the plan is made."""
    batch, _, heads, hdim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    scale = _scale(q, softmax_scale)
    key = ("flashinfer", *key, page_size, heads, kv_heads, hdim, scale, q.dtype, str(q.device))
    wrapper = _PER_LENGTHS.get(cache_seqlens, key, lambda host: _plan_flashinfer_decode(
        host, make_block_table(), page_size, heads, kv_heads, hdim, scale, q.dtype, str(q.device)))
    out = wrapper.run(q.reshape(batch, heads, hdim), (k_pages, v_pages))  # (B, H, D)
    return out.view(batch, 1, heads, hdim)


def flashinfer_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """The contiguous cache (B, S, Hkv, D) as B pages of S slots, sequence b owning page b."""
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch = q.shape[0]

    def one_page_each():
        return torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]  # (B, 1)

    return _flashinfer_run(q, k_cache, v_cache, one_page_each, cache_seqlens, softmax_scale, ("contiguous", batch))


def flashinfer_decode_paged(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None):
    check_paged_decode_inputs(q, k_pages, v_pages, block_table, cache_seqlens)
    # a plan holds its page indices: one per block table (address and in-place version)
    key = ("paged", block_table.data_ptr(), tuple(block_table.shape), block_table._version)
    return _flashinfer_run(q, k_pages, v_pages, lambda: block_table, cache_seqlens, softmax_scale, key)


def flashinfer_single_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """flashinfer.single_decode_with_kv_cache: one sequence, its cache sliced to its length (a
    view, no copy); GQA through the kv heads of k. Tensor cores as the batch wrapper uses them."""
    import flashinfer

    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, _, heads, hdim = q.shape
    if batch != 1:
        raise UnsupportedInput(f"FlashInfer's single decode takes one sequence, not a batch of {batch}")
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    (length,) = _PER_LENGTHS.get(cache_seqlens, ("flashinfer-single", cache_len),
                                 lambda host: _checked_host_lengths(host, cache_len))
    out = flashinfer.single_decode_with_kv_cache(q[0, 0], k_cache[0, :length], v_cache[0, :length], kv_layout="NHD",
                                                 use_tensor_cores=heads // kv_heads >= 4,
                                                 sm_scale=_scale(q, softmax_scale))  # (H, D)
    return out.view(1, 1, heads, hdim)


# --------------------------------------------------------------------------------------
# xformers' split-K decoding op (pure Triton: it runs where xformers' compiled ops do not load)
# --------------------------------------------------------------------------------------
# xformers' operator check (fmha/common.py, `_built_with_cuda`) refuses every CUDA operator of a
# build whose C++ extension does not load, its pure-Triton split-K operator too, which needs none
XFORMERS_BUILD_REFUSAL = "xFormers wasn't build with CUDA support"


def xformers_fmha():
    """xformers.ops.fmha, imported with a `flash_attn` package that is not flash-attn 2's hidden
    from it: xformers' fmha/flash.py imports flash_attn.flash_attn_interface whenever
    `importlib.util.find_spec("flash_attn")` finds a package, and FlashAttention-4's wheel
    (flash-attn-4) installs a `flash_attn` package without that module (ModuleNotFoundError)."""
    if "xformers.ops.fmha" in sys.modules:
        return sys.modules["xformers.ops.fmha"]
    find_spec = importlib.util.find_spec
    try:
        spec = find_spec("flash_attn")
    except ValueError:  # a `flash_attn` module without a spec in sys.modules: left as it is
        spec = None
    # flash-attn 2's package has flash_attn_interface.py; FA4's has not (looked up, not imported)
    flash_attn_4 = spec is not None and not any(Path(folder, "flash_attn_interface.py").exists()
                                                for folder in spec.submodule_search_locations or ())

    def without_flash_attn_4(name, package=None):
        return None if name == "flash_attn" else find_spec(name, package)

    if flash_attn_4:
        importlib.util.find_spec = without_flash_attn_4
    try:
        return importlib.import_module("xformers.ops.fmha")
    finally:
        importlib.util.find_spec = find_spec


def _xformers_bias(host, batch, cache_len, device):
    xformers_fmha()  # before any other import of xformers' fmha (it imports flash_attn's modules)
    from xformers.ops.fmha.attn_bias import BlockDiagonalPaddedKeysMask

    _checked_host_lengths(host, cache_len)
    return BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen=[1] * batch, kv_padding=cache_len,
                                                    kv_seqlen=list(host), device=device)


def _xformers_paged_bias(host, block_table, page_size, device):
    """The block-diagonal bias over a paged cache: sequence b's slot j at row
    block_table[b, j // page_size] * page_size + j % page_size of the pool."""
    xformers_fmha()
    from xformers.ops.fmha.attn_bias import PagedBlockDiagonalPaddedKeysMask

    bias = _xformers_bias(host, block_table.shape[0], block_table.shape[1] * page_size, device)
    return bias.make_paged(block_tables=block_table, page_size=page_size, paged_type=PagedBlockDiagonalPaddedKeysMask)


def xformers_refusal(exc: Exception, who: str) -> str | None:
    """xformers' refusal ("No operator found", or "Operator ... does not support inputs") on
    one line, each operator's reasons first (the message opens with a long description of
    the inputs); None when `exc` is not such a refusal."""
    operators = []
    for line in str(exc).splitlines():
        if line.endswith("is not supported because:"):
            operators.append([line.split("`")[1]])
        elif operators and line.startswith("    "):
            operators[-1].append(line.strip())
    if not operators:
        return None
    return one_line(f"{who} has no operator for this input: "
                    + "; ".join(f"{name}: {', '.join(reasons)}" for name, *reasons in operators))


def _xformers_layout(q, k, v):
    """q (1, B, Hkv, G, D); k and v, a cache (B, S, Hkv, D) or a pool of pages (P, page_size,
    Hkv, D) alike, as (1, B * S or P * page_size, Hkv, G, D): xformers' BMGHK layout, the batch
    folded into the sequence axis (the block-diagonal bias separates the sequences), the G q heads
    of a kv head a stride-0 expand (which xformers reads as GQA)."""
    batch, _, heads, hdim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    q5 = q.reshape(1, batch, kv_heads, group, hdim)
    k5, v5 = (t.reshape(1, -1, kv_heads, 1, hdim).expand(-1, -1, -1, group, -1) for t in (k, v))
    return q5, k5, v5


def _xformers_dispatch_forward(q, k, v, bias, softmax_scale):
    """memory_efficient_attention_forward in xformers' BMGHK layout (_xformers_layout), the
    operator of its dispatcher's choice."""
    fmha = xformers_fmha()
    try:
        out = fmha.memory_efficient_attention_forward(*_xformers_layout(q, k, v), attn_bias=bias,
                                                      scale=_scale(q, softmax_scale))
    except (ValueError, NotImplementedError) as exc:
        reason = xformers_refusal(exc, "xformers' dispatcher")
        if reason is None:
            raise
        raise UnsupportedInput(reason) from exc
    return out.reshape(q.shape)


def _xformers_splitk_forward(q, k, v, bias, softmax_scale):
    """xformers' split-K operator (triton_splitk.FwOp) in the BMGHK layout (_xformers_layout),
    called as memory_efficient_attention_forward calls a chosen operator (validate, normalise,
    the operator's own checks, apply), except that XFORMERS_BUILD_REFUSAL, which does not concern
    a Triton kernel, is not a refusal; every other reason of the operator's is the row's."""
    fmha = xformers_fmha()
    op = fmha.triton_splitk.FwOp
    inp = fmha.Inputs(*_xformers_layout(q, k, v), attn_bias=bias, scale=_scale(q, softmax_scale))
    inp.validate_inputs()
    inp.normalize_bmhk()
    reasons = [reason for reason in op.not_supported_reasons(inp) if reason != XFORMERS_BUILD_REFUSAL]
    if reasons:
        raise UnsupportedInput(one_line(f"xformers' split-K op has no operator for this input: {op.NAME}: "
                                        + ", ".join(reasons)))
    out, _ = op.apply(inp, needs_gradient=False)
    return out.reshape(q.shape)


def xformers_splitk_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, cache_len = k_cache.shape[:2]
    bias = _PER_LENGTHS.get(cache_seqlens, ("xformers", batch, cache_len, str(q.device)),
                            lambda host: _xformers_bias(host, batch, cache_len, q.device))
    return _xformers_splitk_forward(q, k_cache, v_cache, bias, softmax_scale)


def xformers_splitk_decode_paged(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None):
    """Pages of a multiple of the op's key block only (FwOp.BLOCK_N, 64): xformers refuses others."""
    check_paged_decode_inputs(q, k_pages, v_pages, block_table, cache_seqlens)
    page_size = k_pages.shape[1]
    key = ("xformers-paged", block_table.data_ptr(), tuple(block_table.shape), block_table._version, page_size)
    bias = _PER_LENGTHS.get(cache_seqlens, key, lambda host: _xformers_paged_bias(host, block_table, page_size,
                                                                                  q.device))
    return _xformers_splitk_forward(q, k_pages, v_pages, bias, softmax_scale)


def xformers_dispatch_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """memory_efficient_attention_forward choosing its operator: FA3/FA2/cutlass (compiled),
    with its Triton split-K op first for GQA with few kv heads and a long cache."""
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, cache_len = k_cache.shape[:2]
    bias = _PER_LENGTHS.get(cache_seqlens, ("xformers", batch, cache_len, str(q.device)),
                            lambda host: _xformers_bias(host, batch, cache_len, q.device))
    return _xformers_dispatch_forward(q, k_cache, v_cache, bias, softmax_scale)


def _xformers_triton_probe() -> None:
    import xformers

    xformers_fmha()
    if not xformers._is_triton_available():
        raise RuntimeError("xformers finds no usable Triton on this GPU (it needs sm_80 or newer)")
    decode_probe(xformers_splitk_decode)()


# --------------------------------------------------------------------------------------
# Shape checks, probes, and the registry
# --------------------------------------------------------------------------------------
def _half_up_to(limit: int, who: str):
    def supports(spec: DecodeSpec) -> str | None:
        if spec.dtype not in ("fp16", "bf16"):
            return f"{who} takes fp16/bf16 inputs only, not {spec.dtype}"
        if spec.hdim > limit:
            return f"{who} takes head dims up to {limit}, not {spec.hdim}"
        return None

    return supports


def _any_shape(_spec: DecodeSpec) -> str | None:
    return None


def fa4_decode_supports(spec: DecodeSpec) -> str | None:
    return fa4_input_reason(spec.dtype, spec.hdim)


def _in_headdims(headdims: tuple[int, ...], who: str):
    def supports(spec: DecodeSpec) -> str | None:
        if spec.dtype not in ("fp16", "bf16"):
            return f"{who} takes fp16/bf16 inputs only, not {spec.dtype}"
        if spec.hdim not in headdims:
            return f"{who} takes head dims {headdims}, not {spec.hdim}"
        return None

    return supports


def _flashinfer_single_supports(spec: DecodeSpec) -> str | None:
    if spec.batch != 1:
        return f"FlashInfer's single decode takes one sequence, not a batch of {spec.batch}"
    return _in_headdims(FLASHINFER_HEADDIMS, "FlashInfer's decode kernels")(spec)


def decode_probe(decode: Callable, dtype: torch.dtype = torch.float16, hdim: int = 64,
                 lengths: tuple[int, ...] = (100, 128)) -> Callable[[], object]:
    """A tiny GQA decode on the GPU (4 q / 2 kv heads, a cache of 128 slots, one sequence per
    length), for availability checks."""
    def probe():
        batch = len(lengths)
        q = torch.randn(batch, 1, 4, hdim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, 128, 2, hdim, device="cuda", dtype=dtype) for _ in range(2))
        decode(q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()

    return probe


# FlashInfer compiles a module per dtype and head dim at first use (nvcc, tens of seconds): its
# probes take the decode suite's, so the suite's first call finds the module built.
SUITE_PROBE = {"dtype": torch.bfloat16, "hdim": 128}


def _sdpa_decode_availability(cuda_only: bool):
    return cuda_available if cuda_only else everywhere


def _register(name: str, label: str, decode: Callable, availability: Callable, supports: Callable,
              kernel_regex: str, decode_paged: Callable | None = None) -> None:
    register(Provider(name, label, decode, availability, supports, kernel_regex, has_backward=False, kind="decode",
                      decode_paged=decode_paged))


for _name, _label, _backend, _regex, _cuda_only, _supports in (
    ("sdpa-flash", "FA2 official CUDA (SDPA flash)", "FLASH_ATTENTION", "flash_fwd", True,
     _half_up_to(MAX_HEADDIM, "SDPA flash")),
    ("sdpa-cudnn", "cuDNN (SDPA cudnn)", "CUDNN_ATTENTION", "cudnn", True, _half_up_to(MAX_HEADDIM, "SDPA cuDNN")),
    ("sdpa-efficient", SDPA_EFFICIENT_LABEL, "EFFICIENT_ATTENTION", "fmha_cutlassF", True, _any_shape),
    ("sdpa-math", "PyTorch SDPA math", "MATH", "gemm|softmax", False, _any_shape),
):
    _register(_name, _label, sdpa_decode(_backend), _sdpa_decode_availability(_cuda_only), _supports, _regex)
_register("pytorch", "PyTorch eager (matmul + softmax)", eager_decode, everywhere, _any_shape, "gemm|softmax")
_register("torch-compile", "PyTorch eager under torch.compile (Inductor)", compiled_decode, cuda_available,
          _any_shape, "gemm|triton_(per|red)_fused")
_register("fa4", "FA4 (flash-attn-4, CuTe DSL)", fa4_decode,
          optional_cuda_package("flash_attn.cute", FA4_DISTRIBUTION, decode_probe(fa4_decode), fa4_arch),
          fa4_decode_supports, "FlashAttentionForwardSm[0-9]+")
_register("flashinfer", "FlashInfer batch decode (paged wrapper)", flashinfer_decode,
          optional_cuda_package("flashinfer", FLASHINFER_DISTRIBUTION, flashinfer_jit_probe(
              decode_probe(flashinfer_decode, **SUITE_PROBE), "decode"), min_arch(8)),
          _in_headdims(FLASHINFER_HEADDIMS, "FlashInfer's decode kernels"), "Decode|Prefill",
          decode_paged=flashinfer_decode_paged)
_register("flashinfer-single", "FlashInfer single decode", flashinfer_single_decode,
          optional_cuda_package("flashinfer", FLASHINFER_DISTRIBUTION, flashinfer_jit_probe(
              decode_probe(flashinfer_single_decode, lengths=(100,), **SUITE_PROBE), "single decode"), min_arch(8)),
          _flashinfer_single_supports, "SingleDecode|SinglePrefill")
_register("xformers-splitk", "xformers split-K (Triton)", xformers_splitk_decode,
          optional_cuda_package("xformers", "xformers", _xformers_triton_probe, min_arch(8)),
          _in_headdims(XFORMERS_SPLITK_HEADDIMS, "xformers' split-K op"), "_fwd_kernel_splitK",
          decode_paged=xformers_splitk_decode_paged)
_register("xformers-dispatch", "xformers memory_efficient_attention (its dispatcher)", xformers_dispatch_decode,
          optional_cuda_package("xformers", "xformers", decode_probe(xformers_dispatch_decode), min_arch(8)),
          _any_shape, "_fwd_kernel_splitK|fmha_cutlassF|flash_fwd")


__all__ = ["NEEDS_CUDA", "DecodeSpec", "check_decode_inputs"]
