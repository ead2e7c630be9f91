"""flash-attn's Python API over the Triton/Gluon kernels: drop-ins for `flash_attn.flash_attn_func`,
the packed variants and the variable-length ones, with flash-attn 2.x argument names and
semantics, so existing code switches by changing an import.

Each call goes through kernels/ops.py: one opaque custom op under torch.compile and
torch.export, a direct autograd.Function eagerly. Which kernel serves a call is decided in
kernels/dispatch.py; the result is the same up to rounding.
"""

from __future__ import annotations

import itertools

import torch

from .checks import DENSE, Features, check_flag, check_scalars, softmax_scale_or_default, window_sides
from .configs import BwdConfig, FwdConfig
from .ops import attention
from .probs import attention_probs, block_size_n


def _features(q, causal, window_size, softcap, alibi_slopes, dropout_p, **varlen) -> Features:
    left, right = window_sides(window_size, causal)
    dropout_p, softcap = check_scalars(dropout_p, softcap)
    if not varlen and left < 0 and (right < 0 or causal) and not softcap and alibi_slopes is None and not dropout_p:
        return DENSE
    rng_seed = None
    if dropout_p:
        # (seed, offset) from PyTorch's generator: torch.manual_seed reproduces a run; read in the kernel
        rng_seed = torch.randint(0, 2**62, (2,), dtype=torch.int64, device=getattr(q, "device", None))
    return Features(left, -1 if causal else right, softcap, alibi_slopes, dropout_p, rng_seed, **varlen)


def _headdim(q) -> int:
    """q's head dim for the default scale; a non-tensor q is rejected by the op's checks."""
    return q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 1


def _returned(out, lse, features: Features, return_attn_probs: bool, q, k, softmax_scale, causal):
    if not return_attn_probs:
        return out
    if not features.dropout_p:  # as flash-attn: S_dmask exists only with dropout
        return out, lse, q.new_empty((0,))
    # only for tests and inspection: it materialises (batch, heads, seqlen_q, seqlen_k)
    return out, lse, attention_probs(q, k, softmax_scale, causal, features)


# flash-attn's name (flash_attn_interface.py): its tests undo S_dmask's convention with it
_get_block_size_n = block_size_n


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    fwd_config: FwdConfig | None = None, bwd_config: BwdConfig | None = None):
    """Drop-in for `flash_attn.flash_attn_func`.

    q: (batch, seqlen_q, heads, headdim); k, v: (batch, seqlen_k, kv_heads, headdim) with kv_heads
    dividing heads (GQA/MQA); float16, bfloat16 (or float32). Returns out (batch, seqlen_q, heads,
    headdim), or with `return_attn_probs=True` the tuple (out, softmax_lse, S_dmask): softmax_lse
    (batch, heads, seqlen_q) float32, S_dmask flash-attn's testing output: empty without dropout,
    with it the unnormalised probabilities with dropped entries negated (kernels/probs.py has the
    convention). Arguments are read as flash-attn's are (docs/api.md: bool-like flags, numpy and
    0-d tensor scalars, window_size as a pair or a 2-element int tensor). Causal and
    sliding-window masks are aligned to the bottom right. `deterministic=True` keeps the backward bit-identical between runs (where a
    kernel would otherwise add dQ with atomics). `fwd_config`/`bwd_config` override the
    block-size tables (benchmarks use them; results are identical up to rounding).
    """
    causal = check_flag("causal", causal)
    deterministic = check_flag("deterministic", deterministic, default=False)
    features = _features(q, causal, window_size, softcap, alibi_slopes, dropout_p)
    scale = softmax_scale_or_default(softmax_scale, _headdim(q))
    out, lse = attention(q, k, v, scale, causal, features, fwd_config, bwd_config, deterministic)
    return _returned(out, lse, features, return_attn_probs, q, k, scale, causal)


def _check_packed(name: str, t, dims: int, count: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[-3] != count:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {layout}, got {shape}")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_qkvpacked_func`: qkv (batch, seqlen, 3, heads, headdim)."""
    _check_packed("qkv", qkv, 5, 3, "(batch, seqlen, 3, heads, headdim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_kvpacked_func`: kv (batch, seqlen_k, 2, kv_heads, headdim)."""
    _check_packed("kv", kv, 5, 2, "(batch, seqlen_k, 2, kv_heads, headdim)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *,
                           fwd_config: FwdConfig | None = None, bwd_config: BwdConfig | None = None):
    """Drop-in for `flash_attn.flash_attn_varlen_func`: packed sequences without padding.

    q: (total_q, heads, headdim), k and v: (total_k, kv_heads, headdim); sequence b holds rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (int32, (batch + 1,), starting at 0) and the
    matching rows of k and v; max_seqlen_* bound the lengths. Each sequence attends only within
    itself; causal is aligned to the bottom right of each sequence. Returns out (total_q, heads,
    headdim) (and with `return_attn_probs`, softmax_lse (heads, total_q) and S_dmask).

    With `block_table` (batch, max_pages) int32, k and v are a paged KV cache (num_pages, page_size,
    kv_heads, headdim) as flash-attn takes it: sequence b's key i at page block_table[b, i //
    page_size], row i % page_size, cu_seqlens_k giving the lengths. The pages are gathered into
    packed keys and values (`gather_pages`: a copy of the sequences' keys, and a device-to-host
    read of cu_seqlens_k), which the varlen kernels then take; gradients flow to the pages.
    """
    if block_table is not None:
        k, v = gather_pages(k, v, block_table, cu_seqlens_k)
    causal = check_flag("causal", causal)
    deterministic = check_flag("deterministic", deterministic, default=False)
    features = _features(q, causal, window_size, softcap, alibi_slopes, dropout_p, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    scale = softmax_scale_or_default(softmax_scale, _headdim(q))
    out, lse = attention(q, k, v, scale, causal, features, fwd_config, bwd_config, deterministic)
    return _returned(out, lse, features, return_attn_probs, q, k, scale, causal)


def gather_pages(k_cache, v_cache, block_table, cu_seqlens_k):
    """Packed (total_k, kv_heads, headdim) keys and values of a paged cache (num_pages, page_size,
    kv_heads, headdim): sequence b's key i from page block_table[b, i // page_size], row i %
    page_size, with the lengths of cu_seqlens_k ((batch + 1,) int32)."""
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be a paged cache (num_pages, page_size, kv_heads, headdim) with "
                             f"block_table, got {getattr(cache, 'shape', type(cache).__name__)}")
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.dtype != torch.int32:
        raise TypeError("cu_seqlens_k must be a (batch + 1,) int32 tensor with block_table")
    batch = cu_seqlens_k.shape[0] - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != batch or block_table.device != k_cache.device:
        raise ValueError(f"block_table must be an int32 tensor (batch={batch}, max_pages) on {k_cache.device}, got "
                         f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                         f"{tuple(getattr(block_table, 'shape', ()))}")
    num_pages, page_size = k_cache.shape[:2]
    bounds = cu_seqlens_k.tolist()  # one device-to-host read: the packed count and the lengths
    total, capacity = bounds[-1], block_table.shape[1] * page_size
    if max(b - a for a, b in itertools.pairwise(bounds)) > capacity:
        raise ValueError(f"cu_seqlens_k's sequences must fit their block_table rows ({block_table.shape[1]} pages "
                         f"of {page_size} keys)")
    lengths = torch.diff(cu_seqlens_k)
    seq = torch.repeat_interleave(torch.arange(batch, device=lengths.device), lengths, output_size=total)
    position = torch.arange(total, device=lengths.device) - cu_seqlens_k[seq]
    page = block_table[seq, position // page_size].long()
    if ((page < 0) | (page >= num_pages)).any():
        raise ValueError(f"block_table entries of the sequences' keys must be page indices in [0, {num_pages})")
    row = position % page_size
    return k_cache[page, row], v_cache[page, row]


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_varlen_qkvpacked_func`: qkv (total, 3, heads, headdim)."""
    _check_packed("qkv", qkv, 4, 3, "(total_tokens, 3, heads, headdim)")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for `flash_attn.flash_attn_varlen_kvpacked_func`: kv (total_k, 2, kv_heads, headdim)."""
    _check_packed("kv", kv, 4, 2, "(total_tokens, 2, kv_heads, headdim)")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)
