"""The one reference: attention in float64 PyTorch, with every feature the kernels have.

Every test, the runner's accuracy check and the benchmarks import this module; nothing else
in the project re-declares attention. It follows flash-attn 2.x's conventions exactly:

* layout: q (batch, seqlen_q, heads, headdim), k and v (batch, seqlen_k, kv_heads, headdim),
  kv_heads dividing heads (GQA/MQA: q head h reads kv head h // (heads // kv_heads));
* the order of operations on the scores: scale, softcap (`softcap * tanh(s / softcap)`),
  ALiBi bias (`-slope * |i + sk - sq - j|`), then the causal / sliding-window mask;
* masks are aligned to the bottom right (flash-attn >= 2.1): query row i sees key j iff
  `i + sk - sq - left <= j <= i + sk - sq + right` (`window_size=(left, right)`, -1 meaning
  unbounded; causal is right = 0);
* dropout multiplies the normalised probabilities by `keep / (1 - p)` after the softmax; the
  logsumexp does not see it;
* a query row that sees no key outputs zeros and has logsumexp +inf (flash-attn's
  convention, so that a backward pass recomputing exp(S - L) gets exactly zero).

Note on ALiBi with causal: flash-attn's CUDA kernel adds `slope * j` there, which differs from
`-slope * |i + sk - sq - j|` by a per-row constant: the outputs agree, the logsumexps do not.
This suite uses the distance form in both modes.
"""

from __future__ import annotations

import math

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1),
                 device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j (bottom right)."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)  # the diagonal's key
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may attend to key j (bottom right)."""
    return visible_mask(seqlen_q, seqlen_k, causal=True, device=device)


def alibi_bias(slopes: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) float64 bias `-slope * |i + sk - sq - j|` from slopes of
    shape (heads,) or (batch, heads)."""
    slopes = slopes.to(torch.float64).reshape(-1, heads)
    slopes = slopes.expand(batch, heads)[:, :, None, None]
    rows = torch.arange(seqlen_q, device=slopes.device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=slopes.device)[None, :]
    return -slopes * (rows - cols).abs().to(torch.float64)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, kv_heads, D) -> (B, N, heads, D): each kv head repeated for its group of q heads."""
    kv_heads = t.shape[2]
    if heads % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide q heads ({heads})")
    return t.repeat_interleave(heads // kv_heads, dim=2) if kv_heads != heads else t


def _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """Masked float64 scores (B, H, Nq, Nk) in natural-log units."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    q64 = q.to(torch.float64).transpose(1, 2)  # (B, H, Nq, D)
    k64 = _repeat_kv(k.to(torch.float64), heads).transpose(1, 2)  # (B, H, Nk, D)
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), batch, heads, seqlen_q, seqlen_k)
    if causal or tuple(window_size) != (-1, -1):
        visible = visible_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention. Returns (out, lse): out (batch, seqlen_q, heads, headdim) float64,
    lse (batch, heads, seqlen_q) float64 natural-log logsumexp (+inf for rows with no key).

    `dropout_keep` (bool, (batch, heads, seqlen_q, seqlen_k)) is the mask of kept entries, scaled
    by 1 / (1 - dropout_p); `seqlens_k` (batch,) uses only the first seqlens_k[b] keys of batch
    b, masks aligned to that length (a KV cache)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if seqlens_k is not None:  # one batch at a time, on its own key length
        outs, lses = [], []
        for b, length in enumerate(seqlens_k.tolist()):
            slopes = alibi_slopes
            if alibi_slopes is not None and alibi_slopes.dim() == 2:
                slopes = alibi_slopes[b:b + 1]
            keep = None if dropout_keep is None else dropout_keep[b:b + 1, :, :, :length]
            out_b, lse_b = attention_reference(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length],
                                               softmax_scale, causal, window_size, softcap, slopes,
                                               dropout_p, keep)
            outs.append(out_b)
            lses.append(lse_b)
        return torch.cat(outs), torch.cat(lses)
    heads = q.shape[2]
    scores = _scores(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Nq); -inf where a row sees no key
    empty_row = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty_row, 0.0)[..., None])
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(torch.float64) / (1.0 - dropout_p)
    v64 = _repeat_kv(v.to(torch.float64), heads).transpose(1, 2)  # (B, H, Nk, D)
    out = torch.matmul(probs, v64).transpose(1, 2)  # (B, Nq, H, D)
    return out, lse.masked_fill(empty_row, float("inf"))


def attention_reference_varlen(q, k, v, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               softmax_scale: float | None = None, causal: bool = False, **features):
    """Packed variable-length attention: q (total_q, heads, headdim), k/v (total_k, kv_heads,
    headdim), sequence b at rows cu_seqlens[b]:cu_seqlens[b+1]. Returns (out (total_q, heads,
    headdim) float64, lse (heads, total_q) float64), flash-attn's varlen layout. `features` are
    attention_reference's keywords (alibi_slopes of shape (batch, heads) are taken per sequence)."""
    outs, lses = [], []
    slopes = features.pop("alibi_slopes", None)
    keep = features.pop("dropout_keep", None)  # a list: one (1, heads, len_q, len_k) mask per sequence
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q_b = q[bounds_q[b]:bounds_q[b + 1]][None]
        k_b, v_b = (t[bounds_k[b]:bounds_k[b + 1]][None] for t in (k, v))
        slopes_b = slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        out_b, lse_b = attention_reference(q_b, k_b, v_b, softmax_scale, causal, alibi_slopes=slopes_b,
                                           dropout_keep=None if keep is None else keep[b], **features)
        outs.append(out_b[0])
        lses.append(lse_b[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def attention_same_dtype(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention computed in the inputs' own dtype (matmuls and softmax), as plain PyTorch
    would. Its error against `attention_reference` is the yardstick of flash-attn's tests:
    a kernel passes when its error is at most twice this one (plus a small epsilon).
    `dropout_keep`: as attention_reference's."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    qt = q.transpose(1, 2)  # (B, H, N, D)
    kt, vt = (_repeat_kv(t, heads).transpose(1, 2) for t in (k, v))
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), batch, heads, seqlen_q, seqlen_k).to(scores.dtype)
    masked = causal or tuple(window_size) != (-1, -1)
    if masked:
        visible = visible_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1)
    if masked:  # rows that see no key: softmax gives NaN, flash-attn 0
        probs = probs.nan_to_num(0.0)
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    probs = probs.to(q.dtype)
    return torch.matmul(probs, vt).transpose(1, 2)
