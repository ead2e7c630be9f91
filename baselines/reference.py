"""The one reference: attention in float64 PyTorch.

Every test, the runner's accuracy check and the benchmarks import this module; nothing else
in the project re-declares attention. It follows flash-attn's conventions exactly:

* layout: q (batch, seqlen_q, heads, headdim), k and v (batch, seqlen_k, heads, headdim);
* causal masks are aligned to the bottom right (flash-attn >= 2.1): query row i sees key j
  iff j <= i + seqlen_k - seqlen_q;
* a query row that sees no key outputs zeros and has logsumexp +inf (flash-attn's
  convention, so that a backward pass recomputing exp(S - L) gets exactly zero).
"""

from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j (bottom right)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention. Returns (out, lse): out (batch, seqlen_q, heads, headdim) float64,
    lse (batch, heads, seqlen_q) float64 natural-log logsumexp (+inf for rows with no key)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q64, k64, v64 = (t.to(torch.float64).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * softmax_scale  # (B, H, Nq, Nk)
    if causal:
        visible = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Nq); -inf where a row sees no key
    empty_row = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty_row, 0.0)[..., None])
    out = torch.matmul(probs, v64).transpose(1, 2)  # (B, Nq, H, D)
    return out, lse.masked_fill(empty_row, float("inf"))


def attention_same_dtype(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention computed in the inputs' own dtype (matmuls and softmax), as plain PyTorch
    would. Its error against `attention_reference` is the yardstick of flash-attn's tests:
    a kernel passes when its error is at most twice this one (plus a small epsilon)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * softmax_scale
    if causal:
        visible = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)
    if causal and q.shape[1] > k.shape[1]:  # rows that see no key: softmax gives NaN, flash-attn 0
        probs = probs.nan_to_num(0.0)
    probs = probs.to(q.dtype)
    return torch.matmul(probs, vt).transpose(1, 2)
