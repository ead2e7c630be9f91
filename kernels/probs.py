"""flash-attn's `return_attn_probs=True` output (S_dmask), for tests and inspection.

flash-attn returns S_dmask only with dropout (an empty tensor without), in its CUDA kernel's
convention: the unnormalised probabilities exp(S - m) as its forward held them, with dropped
entries negated. Its kernel visits a row's key blocks of `block_size_n` columns from the last to
the first, so block j's m is the row's running max then: the max of the row's scores over blocks
j, j + 1, ... (flash-attn's tests undo this with the same block size, `normalize_flash_attn_S`).
Here it is recomputed in float32 PyTorch from q and k, with the kernels' own keep-mask
(kernels/dropout.py); it materialises (batch, heads, seqlen_q, seqlen_k). Entries the mask hides
are 0. Packed variable lengths give (batch, heads, max_seqlen_q, max_seqlen_k), sequence b in
[b, :, :len_q, :len_k] and zeros around it. Unlike flash-attn's, the tensor is float32 (its: the
inputs' dtype) and not padded to multiples of 128 rows and columns.
"""

from __future__ import annotations

import torch

from .checks import Features
from .dropout import dropout_keep_mask


def block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width of S_dmask's running max: flash-attn 2's CUDA forward tiles on sm80 and
    sm90 (flash_attn_interface.py's `_get_block_size_n`; its sm86/sm89 rows at head dim 128 are not
    taken: this convention does not follow the GPU). `device` and `is_causal` are kept for that
    function's signature."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


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


def _unnormalised(q, k, softmax_scale: float, causal: bool, features: Features, slopes, block_n: int):
    """(batch, heads, seqlen_q, seqlen_k) float32 exp(S - m_j) of one dense-layout batch, m_j the
    row's max over key blocks j, j + 1, ...; `slopes` (heads,) or (batch, heads) or None."""
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
    scores = scores.masked_fill(~visible, float("-inf"))
    blocks = -(-seqlen_k // block_n)
    padded = torch.nn.functional.pad(scores, (0, blocks * block_n - seqlen_k), value=float("-inf"))
    block_max = padded.unflatten(-1, (blocks, block_n)).amax(-1)  # (B, H, Nq, blocks)
    running = block_max.flip(-1).cummax(-1).values.flip(-1)  # max over blocks j..end: the kernel's m at j
    m = running.repeat_interleave(block_n, dim=-1)[..., :seqlen_k]
    # exp in float64, rounded once to float32: PyTorch's float32 exp on CPU was seen to differ by up
    # to 1.5e-4 (relative) between two calls on identical inputs; this way two calls differ by a float32
    # rounding at most.
    return torch.exp((scores - m).double()).float().masked_fill(~visible, 0.0).nan_to_num(0.0)


def attention_probs(q, k, softmax_scale: float, causal: bool, features: Features) -> torch.Tensor:
    """S_dmask of a call with dropout (dense or packed), in flash-attn's convention (above)."""
    slopes = features.alibi_slopes
    block_n = block_size_n(q.device, q.shape[-1], True, causal)
    if features.varlen:
        bounds_q, bounds_k = features.cu_seqlens_q.tolist(), features.cu_seqlens_k.tolist()
        batch, heads = len(bounds_q) - 1, q.shape[1]
        probs = torch.zeros(batch, heads, features.max_seqlen_q, features.max_seqlen_k, device=q.device)
        for b in range(batch):
            (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
            slopes_b = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
            probs[b, :, :q1 - q0, :k1 - k0] = _unnormalised(q[None, q0:q1], k[None, k0:k1], softmax_scale, causal,
                                                            features, slopes_b, block_n)[0]
    else:
        probs = _unnormalised(q, k, softmax_scale, causal, features, slopes, block_n)
    keep = dropout_keep_mask(features.rng_seed, features.dropout_p, *probs.shape)
    return torch.where(keep, probs, -probs)
