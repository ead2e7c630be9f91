"""Padding helpers under flash-attn's names (`flash_attn.bert_padding`): between a padded batch
(batch, seqlen, ...) whose (batch, seqlen) mask marks the real tokens and the packed layout
(total_tokens, ...) that the varlen functions take with cu_seqlens. Plain indexing, so autograd
differentiates through them."""

from __future__ import annotations

import torch


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` of x (batch, seqlen, ...) flattened to (batch * seqlen, ...)."""
    return x.reshape(-1, *x.shape[2:])[indices]


def padding_indices(attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """What `unpad_input` packs by, without packing: (indices into the flattened batch (total,),
    cu_seqlens (batch + 1,) int32, max_seqlen (an int: one device-to-host read), seqused (batch,)
    int32)."""
    keep = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max()), attention_mask.bool().sum(dim=-1, dtype=torch.int32)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Pack the tokens a (batch, seqlen) mask keeps (nonzero: a token; `unused_mask` marks more rows
    to keep, allocated but unused, as flash-attn's). Returns (packed (total, ...), indices into the
    flattened batch (total,), cu_seqlens (batch + 1,) int32, max_seqlen (an int: one device-to-host
    read), seqused (batch,) int32: the tokens `attention_mask` alone keeps per sequence)."""
    indices, cu_seqlens, max_seqlen, seqused = padding_indices(attention_mask, unused_mask)
    return index_first_axis(hidden_states, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """unpad_input's inverse: packed rows (total, ...) back to (batch, seqlen, ...), zeros at padding."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_put((indices,), hidden_states).view(batch, seqlen, *hidden_states.shape[1:])
