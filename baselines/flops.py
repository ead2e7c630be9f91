"""The one FLOP count, as the FlashAttention-2 paper counts it (Section 4.1).

Forward: two matmuls (S = QK^T and O = PV), 2 * 2 * b * h * n_q * n_k * d FLOPs, halved when
causal. Backward: five matmuls, 2.5x the forward. Forward + backward: 3.5x the forward.
Every TFLOPs/s figure in the project comes from `attention_flops`, or for masks the paper does
not have (sliding windows, packed variable lengths) from `visible_flops`, the same count over the
(query, key) pairs the mask leaves visible.

Training a whole model is counted as the paper counts it for its Table 1 (after Megatron-LM,
Narayanan et al. 2021): `training_flops_per_sequence`.

Decoding (one query token against a KV cache) is bound by reading the cache, so it is counted
in bytes: `decode_kv_bytes` is the K and V a decode step must read, the yardstick of every
decode GB/s figure.
"""

from __future__ import annotations

MODE_MULTIPLIER = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    causal: bool,
    mode: str = "fwd",
) -> float:
    """FLOPs of one attention call in `mode` ('fwd', 'bwd' or 'fwd_bwd')."""
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * headdim
    if causal:
        forward /= 2.0
    return forward * MODE_MULTIPLIER[mode]


def visible_flops(visible_pairs: int, heads: int, headdim: int, mode: str = "fwd") -> float:
    """FLOPs of one call in `mode` over `visible_pairs` (query, key) pairs per head: the paper's
    2 * 2 * d FLOPs a pair for the forward, times MODE_MULTIPLIER."""
    if mode not in MODE_MULTIPLIER:
        raise ValueError(f"mode must be one of {sorted(MODE_MULTIPLIER)}, got {mode!r}")
    return 4.0 * visible_pairs * heads * headdim * MODE_MULTIPLIER[mode]


def tflops_per_second(flops: float, ms: float) -> float:
    """TFLOPs/s from a FLOP count and a time in milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def training_flops_per_sequence(params: int, layers: int, hidden: int, seqlen: int) -> float:
    """FLOPs of one training step (forward + backward) on one sequence of `seqlen` tokens, as the
    FlashAttention-2 paper counts them (Section 4.2, after Megatron-LM): 6 x seqlen x params for
    the weights' matmuls (2 forward, 4 backward per parameter and token) plus 12 x layers x hidden
    x seqlen^2 for attention's (QK^T and PV, full and not halved for the causal mask). Activation
    recomputation is not counted."""
    for name, value in (("params", params), ("layers", layers), ("hidden", hidden), ("seqlen", seqlen)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return 6.0 * seqlen * params + 12.0 * layers * hidden * seqlen**2


def decode_kv_bytes(cached_tokens: int, kv_heads: int, headdim: int, element_bytes: int) -> int:
    """Bytes of K and V one decode step reads: `cached_tokens` (the sum of the sequences'
    cache lengths, not the allocated cache) x kv_heads x headdim, twice (K and V)."""
    for name, value in (("cached_tokens", cached_tokens), ("kv_heads", kv_heads), ("headdim", headdim),
                        ("element_bytes", element_bytes)):
        if not isinstance(value, int) or value < (0 if name == "cached_tokens" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'cached_tokens' else 'positive'} int, "
                             f"got {value!r}")
    return 2 * cached_tokens * kv_heads * headdim * element_bytes


def gigabytes_per_second(nbytes: float, ms: float) -> float:
    """GB/s (10^9 bytes per second) from a byte count and a time in milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9
