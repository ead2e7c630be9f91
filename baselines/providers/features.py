"""Feature providers (kind 'features'): each provider's call of a training feature, for the
features suite (harness/features.py). Registered in the one registry with kind 'features'
(`registry("features")`); their call differs from the attention providers':

    provider.forward(case, inputs, mode) -> call, call() -> out

- case: the feature case (harness.features.Case): group, variant, causal, window (left,
  right), softcap, alibi, lengths (packed variable lengths when `packed`), heads, kv_heads
  (GQA/MQA: q head h reads kv head h // (heads // kv_heads)), seqlen, keys (the key length,
  masks aligned bottom-right), hdim.
- inputs (harness.features.Inputs): q, k, v in flash-attn's layout, dense (batch, seqlen,
  heads, hdim) or packed (total, heads, hdim) with cu_seqlens; ALiBi's slopes; the scale.
- mode 'fwd' or 'bwd': the call is the forward; 'bwd' times out.backward through autograd.
- A provider that does not have the case raises UnsupportedInput with the reason, never
  computes another function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from baselines.providers.builtin import sdpa_call
from baselines.providers.core import (
    Provider,
    UnsupportedInput,
    check_causal_lengths,
    cuda_available,
    everywhere,
    first,
    min_arch,
    optional_cuda_package,
    probe_call,
    register,
)
from baselines.providers.packages import (
    FA4_DISTRIBUTION,
    FLASHINFER_DISTRIBUTION,
    fa4_arch,
    fa4_forward,
    flashinfer_jit_probe,
    flashinfer_prefill_probe,
    flashinfer_ragged_forward,
)


def _ours(case, x, mode: str, bwd_config=None) -> Callable[[], torch.Tensor]:
    from kernels import flash_attn_func, flash_attn_varlen_func

    kw = {"causal": case.causal, "window_size": case.window, "softcap": case.softcap, "alibi_slopes": x.slopes,
          "bwd_config": bwd_config}
    if case.packed:
        longest = max(case.lengths)
        return lambda: flash_attn_varlen_func(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, longest, longest, **kw)
    return lambda: flash_attn_func(x.q, x.k, x.v, **kw)


def _ours_dense_bwd_table(case, x, mode: str):
    """Ours with the dense calls' backward table (HOPPER_BWD_CONFIGS) instead of the features'
    (HOPPER_FEATURE_BWD_CONFIGS): the rows that test that table's choice."""
    from kernels.configs import default_bwd_config

    return _ours(case, x, mode, bwd_config=default_bwd_config(case.hdim, x.q.device))


def _sdpa(backend: str):
    def make(case, x, mode: str):
        if case.window != (-1, -1) or case.softcap or case.alibi or case.packed:
            raise UnsupportedInput("SDPA has no sliding window, softcap, ALiBi or packed variable lengths in its "
                                   "fused backends")
        check_causal_lengths(x.q, x.k, case.causal, f"SDPA {backend}")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, backend)
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))  # (B, H, S, D) views
        # a backend that refuses the shape (a head dim, a length) says why, as an unsupported row
        sdpa_call(backend, q, k, v, is_causal=case.causal, scale=x.scale, enable_gqa=True)

        def call():
            with sdpa_kernel(chosen):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=x.scale,
                                                                        enable_gqa=True)
            return out.transpose(1, 2)

        return call

    return make


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    from baselines.providers.core import raise_recompile_limits

    raise_recompile_limits()
    return torch.compile(flex_attention, dynamic=False)


def _flex(case, x, mode: str):
    from torch.nn.attention.flex_attention import create_block_mask

    device = x.q.device
    offset = case.keys - case.seqlen  # query row i's diagonal key (bottom-right alignment)
    left = case.window[0]
    if case.packed:
        doc = torch.repeat_interleave(torch.arange(len(case.lengths), device=device),
                                      torch.tensor(case.lengths, device=device))

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        length = keys = doc.numel()
        q, k, v = (t[None].transpose(1, 2) for t in (x.q, x.k, x.v))  # (1, H, total, D)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx + offset
            return visible & (kv_idx >= q_idx + offset - left) if left >= 0 else visible

        length, keys = case.seqlen, case.keys
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
    block_mask = create_block_mask(mask_mod, None, None, length, keys, device=device)
    score_mod = None
    if case.softcap:
        def score_mod(score, b, h, q_idx, kv_idx):
            return case.softcap * torch.tanh(score / case.softcap)
    elif case.alibi:
        slopes = x.slopes

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx).abs()
    flex = _compiled_flex()

    def call():
        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=x.scale,
                   enable_gqa=case.kv_heads != case.heads).transpose(1, 2)
        return out[0] if case.packed else out

    return call


def _fa4(case, x, mode: str):
    if case.alibi:
        raise UnsupportedInput("FA4 has no ALiBi")
    if case.softcap and mode == "bwd":
        raise UnsupportedInput("FA4's backward has no softcap (it asserts softcap == 0)")
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    # a window with its right side 0 is FA4's local attention (causal=False: causal would drop the window)
    window = tuple(None if side < 0 else side for side in case.window)
    kw = {"softmax_scale": x.scale, "causal": case.causal and window == (None, None), "window_size": window,
          "softcap": case.softcap, "num_splits": 1}
    if case.packed:
        longest = max(case.lengths)
        # by keyword: FA4's varlen function has seqused_q/seqused_k among its positional parameters
        return lambda: first(flash_attn_varlen_func(x.q, x.k, x.v, cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens,
                                                     max_seqlen_q=longest, max_seqlen_k=longest, **kw))
    return lambda: first(flash_attn_func(x.q, x.k, x.v, **kw))


def _flashinfer(case, x, mode: str):
    if mode != "fwd":
        raise UnsupportedInput("FlashInfer has no attention backward")
    if case.alibi:
        raise UnsupportedInput("FlashInfer's ALiBi (pos_encoding_mode='ALIBI') derives its slopes from the head count "
                               "instead of taking the case's")
    if case.packed:
        q, k, v, lengths = x.q, x.k, x.v, case.lengths
    else:  # the dense batch packed without copies: (B * S, H, D) views
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (x.q, x.k, x.v))
        lengths = (case.seqlen,) * case.batch

    def call():
        out = flashinfer_ragged_forward(q, k, v, lengths, lengths, case.causal, x.scale, case.window[0], case.softcap)
        return out if case.packed else out.view_as(x.q)

    return call


for _name, _label, _make, _availability in (
    ("ours", "this repo's Triton kernels", _ours, everywhere),
    ("ours-dense-bwd-table", "this repo's kernels, the dense calls' backward configs", _ours_dense_bwd_table,
     everywhere),
    ("sdpa-flash", "SDPA flash (official FA2 CUDA)", _sdpa("FLASH_ATTENTION"), cuda_available),
    ("sdpa-cudnn", "SDPA cuDNN", _sdpa("CUDNN_ATTENTION"), cuda_available),
    ("flex-attention", "FlexAttention (torch.compile)", _flex, cuda_available),
    ("fa4", "FA4 (flash-attn-4, CuTe DSL)", _fa4,
     optional_cuda_package("flash_attn.cute", FA4_DISTRIBUTION, probe_call(fa4_forward), fa4_arch)),
    ("flashinfer", "FlashInfer prefill (ragged wrapper)", _flashinfer,
     optional_cuda_package("flashinfer", FLASHINFER_DISTRIBUTION,
                           flashinfer_jit_probe(flashinfer_prefill_probe, "prefill"), min_arch(8))),
):
    register(Provider(_name, _label, _make, _availability, kind="features"))
