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
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baselines.providers.builtin import sdpa_call
from baselines.providers.core import (
    DTYPES,
    MAX_HEADDIM,
    NEEDS_CUDA,
    CompiledOnce,
    Provider,
    cuda_available,
    everywhere,
    first,
    min_arch,
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


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens) -> None:
    """ValueError naming the argument when the inputs do not follow the contract (shapes,
    dtypes and devices only: the lengths' values are not read here)."""
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be (batch, 1, heads, headdim), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (batch, cache_len, kv_heads, headdim), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, _, heads, hdim = q.shape
    if k_cache.shape[0] != batch or k_cache.shape[3] != hdim or heads % k_cache.shape[2]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} must match q {tuple(q.shape)}: same batch and "
                         "headdim, kv_heads dividing heads")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must be int32 of shape ({batch},), got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    if not (q.device == k_cache.device == v_cache.device == cache_seqlens.device):
        raise ValueError("q, k_cache, v_cache and cache_seqlens must be on one device")


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
# FlashInfer: the paged decode wrapper, one page of S slots per sequence (the cache as it is)
# --------------------------------------------------------------------------------------
def _plan_flashinfer_decode(host, batch, cache_len, heads, kv_heads, hdim, scale, dtype, device):
    import flashinfer

    _checked_host_lengths(host, cache_len)
    # tensor cores pay off once several q heads share a kv head (FlashInfer's own advice)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(flashinfer_workspace(device), "NHD",
                                                            use_tensor_cores=heads // kv_heads >= 4)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)  # sequence b owns page b
    indices = torch.arange(batch, dtype=torch.int32, device=device)
    last_page_len = torch.tensor(host, dtype=torch.int32, device=device)
    wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, hdim, cache_len, sm_scale=scale,
                 q_data_type=dtype, kv_data_type=dtype)
    return wrapper


def flashinfer_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, _, heads, hdim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = _scale(q, softmax_scale)
    key = ("flashinfer", batch, cache_len, heads, kv_heads, hdim, scale, q.dtype, str(q.device))
    wrapper = _PER_LENGTHS.get(cache_seqlens, key, lambda host: _plan_flashinfer_decode(
        host, batch, cache_len, heads, kv_heads, hdim, scale, q.dtype, str(q.device)))
    # k_cache (B, S, Hkv, D) is a paged cache of B pages of S slots in FlashInfer's NHD layout
    out = wrapper.run(q.reshape(batch, heads, hdim), (k_cache, v_cache))  # (B, H, D)
    return out.view(batch, 1, heads, hdim)


# --------------------------------------------------------------------------------------
# xformers' split-K decoding op (pure Triton: it runs where xformers' compiled ops do not load)
# --------------------------------------------------------------------------------------
def _xformers_bias(host, batch, cache_len, device):
    from xformers.ops.fmha.attn_bias import BlockDiagonalPaddedKeysMask

    _checked_host_lengths(host, cache_len)
    return BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen=[1] * batch, kv_padding=cache_len,
                                                    kv_seqlen=list(host), device=device)


def xformers_splitk_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    from xformers.ops import fmha
    from xformers.ops.fmha import triton_splitk

    check_decode_inputs(q, k_cache, v_cache, cache_seqlens)
    batch, _, heads, hdim = q.shape
    cache_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    bias = _PER_LENGTHS.get(cache_seqlens, ("xformers", batch, cache_len, str(q.device)),
                            lambda host: _xformers_bias(host, batch, cache_len, q.device))
    # xformers' BMGHK layout, the batch folded into the sequence axis (block-diagonal bias):
    # q (1, B, Hkv, G, D); k/v (1, B * S, Hkv, G, D), the G q heads of a kv head as a stride-0 expand
    q5 = q.reshape(1, batch, kv_heads, group, hdim)
    k5, v5 = (t.reshape(1, batch * cache_len, kv_heads, 1, hdim).expand(-1, -1, -1, group, -1)
              for t in (k_cache, v_cache))
    out = fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=_scale(q, softmax_scale),
                                                  op=triton_splitk.FwOp)
    return out.reshape(batch, 1, heads, hdim)


def _xformers_triton_probe() -> None:
    import xformers

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


def decode_probe(decode: Callable) -> Callable[[], object]:
    """A tiny fp16 GQA decode on the GPU (2 sequences of 100 and 128 keys, 4 q / 2 kv heads, head
    dim 64), for availability checks."""
    def probe():
        q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
        decode(q, k, v, torch.tensor([100, 128], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()

    return probe


def _sdpa_decode_availability(cuda_only: bool):
    return cuda_available if cuda_only else everywhere


def _register(name: str, label: str, decode: Callable, availability: Callable, supports: Callable,
              kernel_regex: str) -> None:
    register(Provider(name, label, decode, availability, supports, kernel_regex, has_backward=False, kind="decode"))


for _name, _label, _backend, _regex, _cuda_only, _supports in (
    ("sdpa-flash", "FA2 official CUDA (SDPA flash)", "FLASH_ATTENTION", "flash_fwd", True,
     _half_up_to(MAX_HEADDIM, "SDPA flash")),
    ("sdpa-cudnn", "cuDNN (SDPA cudnn)", "CUDNN_ATTENTION", "cudnn", True, _half_up_to(MAX_HEADDIM, "SDPA cuDNN")),
    ("sdpa-efficient", "xformers cutlass (SDPA efficient)", "EFFICIENT_ATTENTION", "fmha_cutlassF", True, _any_shape),
    ("sdpa-math", "PyTorch SDPA math", "MATH", "gemm|softmax", False, _any_shape),
):
    _register(_name, _label, sdpa_decode(_backend), _sdpa_decode_availability(_cuda_only), _supports, _regex)
_register("pytorch", "PyTorch eager (matmul + softmax)", eager_decode, everywhere, _any_shape, "gemm|softmax")
_register("torch-compile", "PyTorch eager under torch.compile (Inductor)", compiled_decode, cuda_available,
          _any_shape, "gemm|triton_(per|red)_fused")
_register("fa4", "FA4 (flash-attn-4, CuTe DSL)", fa4_decode,
          optional_cuda_package("flash_attn.cute", FA4_DISTRIBUTION, decode_probe(fa4_decode), fa4_arch),
          fa4_decode_supports, "FlashAttentionForwardSm[0-9]+")
_register("flashinfer", "FlashInfer decode", flashinfer_decode,
          optional_cuda_package("flashinfer", FLASHINFER_DISTRIBUTION,
                                flashinfer_jit_probe(decode_probe(flashinfer_decode), "decode"), min_arch(8)),
          _in_headdims(FLASHINFER_HEADDIMS, "FlashInfer's decode kernels"), "Decode")
_register("xformers-splitk", "xformers split-K (Triton)", xformers_splitk_decode,
          optional_cuda_package("xformers.ops.fmha.triton_splitk", "xformers", _xformers_triton_probe, min_arch(8)),
          _in_headdims(XFORMERS_SPLITK_HEADDIMS, "xformers' split-K op"), "_fwd_kernel_splitK")


__all__ = ["NEEDS_CUDA", "DecodeSpec", "check_decode_inputs"]
