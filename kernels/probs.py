"""flash-attn's `return_attn_probs=True` output (S_dmask): the attention probabilities a call
used, recomputed in float32 PyTorch from q, k and the kernel's logsumexp, for tests and
inspection only (it materialises (batch, heads, seqlen_q, seqlen_k)). Entries the mask hides
are 0; with dropout, dropped entries are negated, as flash-attn marks them, using the kernels'
own keep-mask (kernels/dropout.py). Packed variable lengths give (batch, heads, max_seqlen_q,
max_seqlen_k), sequence b in [b, :, :len_q, :len_k] and zeros around it."""

from __future__ import annotations

import torch

from .checks import Features
from .dropout import dropout_keep_mask


def _visible(seqlen_q: int, seqlen_k: int, causal: bool, features: Features, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, bottom-right aligned (kernels/checks.py: window sides)."""
    diagonal = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    right = 0 if causal else features.window_right
    if right >= 0:
        visible &= cols <= diagonal + right
    if features.window_left >= 0:
        visible &= cols >= diagonal - features.window_left
    return visible


def _probs(q, k, lse, softmax_scale: float, causal: bool, features: Features, slopes) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) float32 of one dense-layout batch; `slopes` (heads,)
    or (batch, heads) or None."""
    heads, kv_heads = q.shape[2], k.shape[2]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    qf = q.float().transpose(1, 2)  # (B, H, Nq, D)
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)  # (B, H, Nk, D)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    if features.softcap:
        scores = features.softcap * torch.tanh(scores / features.softcap)
    if slopes is not None:
        diagonal = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        distance = (diagonal - torch.arange(seqlen_k, device=q.device)[None, :]).abs().float()
        scores = scores - slopes.float().reshape(-1, heads)[:, :, None, None] * distance
    visible = _visible(seqlen_q, seqlen_k, causal, features, q.device)
    probs = torch.exp(scores - lse[..., None])
    return probs.masked_fill(~visible, 0.0).nan_to_num(0.0)


def attention_probs(q, k, v, lse, softmax_scale: float, causal: bool, features: Features) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) float32 probabilities of a call (dense or packed)."""
    slopes = features.alibi_slopes
    if features.varlen:
        bounds_q, bounds_k = features.cu_seqlens_q.tolist(), features.cu_seqlens_k.tolist()
        batch, heads = len(bounds_q) - 1, q.shape[1]
        probs = torch.zeros(batch, heads, features.max_seqlen_q, features.max_seqlen_k, device=q.device)
        for b in range(batch):
            (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
            slopes_b = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
            probs[b, :, :q1 - q0, :k1 - k0] = _probs(q[None, q0:q1], k[None, k0:k1], lse[None, :, q0:q1],
                                                    softmax_scale, causal, features, slopes_b)[0]
    else:
        probs = _probs(q, k, lse, softmax_scale, causal, features, slopes)
    if features.dropout_p:
        keep = dropout_keep_mask(features.rng_seed, features.dropout_p, *probs.shape)
        probs = torch.where(keep, probs, -probs)
    return probs
