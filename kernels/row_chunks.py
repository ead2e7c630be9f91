"""Calls with more (batch x head) rows than a launch grid's second axis takes.

The Triton kernels and the backward's preprocess put a call's (batch x head) rows, and the Gluon
dK/dV grid up to its (batch x kv head) pairs, on a grid axis that CUDA bounds to 65535 programs (a
ViT's batch of 8192 images of 12 heads has 98,304). Such a call runs here as several calls over whole batch rows
(sequences, for packed variable lengths), each within the bound, into outputs of the whole call's
shape. With dropout, each chunk's keep-mask counts batch x head within the chunk, so the chunks
draw under offsets of their own (the rng tensor's offset plus the chunk's number) rather than
repeating the first chunk's mask (`chunk_seed`; dropout.dropout_keep_mask draws the same).
"""

from __future__ import annotations

import dataclasses

import torch

from .checks import Features

GRID_ROWS = 65535  # CUDA's bound on a launch grid's y and z axes


def row_spans(batch: int, heads: int) -> list[tuple[int, int]] | None:
    """[start, end) of batch rows in chunks of at most GRID_ROWS (batch x head) rows, or None where
    the call fits one grid."""
    if batch * heads <= GRID_ROWS:
        return None
    if heads > GRID_ROWS:
        raise ValueError(f"heads: at most {GRID_ROWS} a call (the kernels' grids), got {heads}")
    per = GRID_ROWS // heads
    return [(start, min(start + per, batch)) for start in range(0, batch, per)]


def chunk_seed(rng_seed: torch.Tensor, index: int) -> torch.Tensor:
    """The (seed, offset) tensor chunk `index` draws its dropout under: the offset moved by the
    index (dropout.dropout_keep_mask draws a chunked call's mask the same way)."""
    if not index:
        return rng_seed
    return rng_seed + torch.tensor([0, index], dtype=rng_seed.dtype, device=rng_seed.device)


def _chunk_features(features: Features, index: int, start: int, end: int) -> Features:
    """`features` for batch rows [start, end): ALiBi's per-batch slopes and the packed offsets
    sliced, dropout's offset moved by the chunk's number (`features` itself where none of them is
    there: a dense call's chunks stay on the dense path, which asks `features is DENSE`)."""
    alibi = features.alibi_slopes
    if features.rng_seed is None and not features.varlen and (alibi is None or alibi.dim() == 1):
        return features
    if alibi is not None and alibi.dim() == 2:
        alibi = alibi[start:end]
    seed = features.rng_seed if features.rng_seed is None else chunk_seed(features.rng_seed, index)
    cu_q, cu_k = features.cu_seqlens_q, features.cu_seqlens_k
    if cu_q is not None:
        cu_q = cu_q[start:end + 1] - cu_q[start]
        cu_k = cu_k[start:end + 1] - cu_k[start]
    return dataclasses.replace(features, alibi_slopes=alibi, rng_seed=seed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the stream `t`'s work goes to."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _rows(features: Features, spans: list[tuple[int, int]]) -> tuple[list[slice], list[slice]]:
    """Each chunk's rows of q and of k: batch rows, or the packed rows of its sequences."""
    if not features.varlen:
        return [slice(s, e) for s, e in spans], [slice(s, e) for s, e in spans]
    if _capturing(features.cu_seqlens_q):
        raise ValueError(f"cu_seqlens_q: more than {GRID_ROWS} (sequences x heads) run in chunks whose rows the host "
                         "reads from cu_seqlens, which a CUDA graph's capture cannot; capture fewer sequences a call")
    cu_q, cu_k = features.cu_seqlens_q.tolist(), features.cu_seqlens_k.tolist()
    return ([slice(cu_q[s], cu_q[e]) for s, e in spans], [slice(cu_k[s], cu_k[e]) for s, e in spans])


def _batch_and_heads(q: torch.Tensor, features: Features) -> tuple[int, int]:
    if features.varlen:
        return features.cu_seqlens_q.shape[0] - 1, q.shape[1]
    return q.shape[0], q.shape[2]


def spans_of(q: torch.Tensor, features: Features) -> list[tuple[int, int]] | None:
    """row_spans for a call's q (and packed offsets): None where it fits one grid."""
    return row_spans(*_batch_and_heads(q, features))


def forward_in_chunks(forward, spans, q, k, v, softmax_scale, causal, config, features: Features):
    """`forward` (flash_attn_forward's signature) over `spans`' batch rows: (out, lse) of the whole
    call. Packed rows after the last sequence (flash-attn lets q hold them) get 0 and lse +inf,
    as rows without a key do."""
    q_rows, k_rows = _rows(features, spans)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if features.varlen:
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device, dtype=torch.float32)
    else:
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), device=q.device, dtype=torch.float32)
    for index, ((start, end), qr, kr) in enumerate(zip(spans, q_rows, k_rows)):
        part_out, part_lse = forward(q[qr], k[kr], v[kr], softmax_scale, causal, config,
                                     _chunk_features(features, index, start, end))
        out[qr] = part_out
        if features.varlen:
            lse[:, qr] = part_lse
        else:
            lse[qr] = part_lse
    return out, lse


def backward_in_chunks(backward, spans, do, q, k, v, out, lse, softmax_scale, causal, config, deterministic,
                       features: Features):
    """`backward` (flash_attn_backward's signature) over `spans`' batch rows: (dq, dk, dv) of the
    whole call (0 in packed rows after the last sequence)."""
    q_rows, k_rows = _rows(features, spans)
    grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    for index, ((start, end), qr, kr) in enumerate(zip(spans, q_rows, k_rows)):
        part_lse = lse[:, qr].contiguous() if features.varlen else lse[qr]
        parts = backward(do[qr], q[qr], k[kr], v[kr], out[qr], part_lse, softmax_scale, causal, config,
                         deterministic, _chunk_features(features, index, start, end))
        for grad, part, rows in zip(grads, parts, (qr, kr, kr)):
            grad[rows] = part
    return tuple(grads)
