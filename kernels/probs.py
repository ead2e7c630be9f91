"""flash-attn's `return_attn_probs=True` output (S_dmask): the attention probabilities a call
used, recomputed in float32 PyTorch from q, k and the kernel's logsumexp, for tests and
inspection only (it materialises (batch, heads, seqlen_q, seqlen_k)). Entries the mask hides
are 0; with dropout, dropped entries are negated, as flash-attn marks them."""

from __future__ import annotations

import torch

from .checks import Features


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


def attention_probs(q, k, v, lse, softmax_scale: float, causal: bool, features: Features) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) float32 probabilities of a dense-layout call."""
    if features.varlen or features.dropout_p or features.softcap or features.alibi_slopes is not None:
        raise NotImplementedError("return_attn_probs=True is implemented for dense calls with causal or "
                                  "sliding-window masks")
    heads, kv_heads = q.shape[2], k.shape[2]
    qf = q.float().transpose(1, 2)  # (B, H, Nq, D)
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)  # (B, H, Nk, D)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    visible = _visible(q.shape[1], k.shape[1], causal, features, q.device)
    probs = torch.exp(scores - lse[..., None])
    return probs.masked_fill(~visible, 0.0).nan_to_num(0.0)
