"""The kernels as a Hugging Face transformers attention implementation.

    from fa2_kernels.integrations.transformers import register   # in the checkout: kernels.integrations...
    register()  # once, before building models
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fa2_triton")

`register()` adds `attention_forward` to transformers' `AttentionInterface` and flash-attn's
mask convention to its `AttentionMaskInterface` under one name, so every model written against
the interface (Llama, Mistral, Qwen2, Gemma 2, ...) runs on the kernels: a padded batch is packed
(unpad -> `flash_attn_varlen_func` -> re-pad: no FLOPs on padding), GQA as is, a layer's sliding
window and logit softcap from the model, dropout while training, and `generate` with the KV cache
(the new queries attend to the cached keys, causal aligned to the end of each sequence, as
transformers' flash_attention_2 does; that path also assumes left padding while generating).

From a checkout of this project, the package is importable as `kernels`, the name of Hugging
Face's kernel-hub package, which transformers imports where it is installed: `register()` then
tells transformers that its kernel hub is unavailable (`_hide_shadowed_hub_kernels`), as it is
in that process. Installed, the package is `fa2_kernels` and nothing is shadowed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings
import weakref
from pathlib import Path

import torch

from ..interface import flash_attn_func, flash_attn_varlen_func
from ..padding import index_first_axis, pad_input, padding_indices


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (batch, heads, q_len, headdim), key and
    value (batch, kv_heads, kv_len, headdim) with the cache's keys, `attention_mask` None or the
    (batch, >= kv_len) padding mask (flash-attn's mask convention: 1 a token, 0 padding). Returns
    (out (batch, q_len, heads, headdim), None): no attention weights."""
    batch, _, q_len, _ = query.shape
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # flash-attn's (batch, seqlen, heads, headdim)
    options = {"dropout_p": dropout, "softmax_scale": scaling, "softcap": softcap or 0.0,
               "causal": bool(module.is_causal if is_causal is None else is_causal)}
    if sliding_window is not None and k.shape[1] > sliding_window:
        # the model's window holds sliding_window keys, the query's own among them
        options["window_size"] = (sliding_window - 1, sliding_window - 1)
    if attention_mask is None:
        return flash_attn_func(q, k, v, **options), None
    kv_len = min(k.shape[1], attention_mask.shape[1])  # a static cache's keys may outnumber its mask's
    (indices_k, cu_seqlens_k, max_seqlen_k), (indices_q, cu_seqlens_q, max_seqlen_q) = _packing(
        attention_mask, kv_len, q_len)
    k, v = k[:, :kv_len], v[:, :kv_len]
    out = flash_attn_varlen_func(index_first_axis(q, indices_q), index_first_axis(k, indices_k),
                                 index_first_axis(v, indices_k), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, **options)
    return pad_input(out, indices_q, batch, q_len), None


# padding mask (by id) -> (a weak reference to it, its version counter, kv_len, q_len, its packing):
# a model's layers get one mask tensor per forward, whose packing the first of them works out
_PACKINGS: dict[int, tuple] = {}
_PACKINGS_MAX = 64


def _packing(attention_mask: torch.Tensor, kv_len: int, q_len: int) -> tuple[tuple, tuple]:
    """The keys' and the queries' (indices, cu_seqlens, max_seqlen) of the padding mask's last
    kv_len positions, the queries being each row's last q_len of them. Each max_seqlen is read back
    from the device (a synchronisation): once per mask tensor and lengths, not once per layer."""
    seen = _PACKINGS.get(id(attention_mask))
    if seen is not None and seen[0]() is attention_mask and seen[1:4] == (attention_mask._version, kv_len, q_len):
        return seen[4]
    mask = attention_mask[:, -kv_len:]
    indices_k, cu_seqlens_k, max_seqlen_k, _ = padding_indices(mask)
    indices_q, cu_seqlens_q, max_seqlen_q, _ = padding_indices(mask[:, -q_len:])
    packing = (indices_k, cu_seqlens_k, max_seqlen_k), (indices_q, cu_seqlens_q, max_seqlen_q)
    if len(_PACKINGS) >= _PACKINGS_MAX:
        _PACKINGS.clear()
    _PACKINGS[id(attention_mask)] = (weakref.ref(attention_mask), attention_mask._version, kv_len, q_len, packing)
    return packing


def _hide_shadowed_hub_kernels() -> None:
    """Where `import kernels` finds this checkout's package while Hugging Face's `kernels`
    distribution is installed, transformers would import its hub API from ours (ImportError:
    cannot import name 'CUDAProperties'): mark the hub unavailable for transformers, before its
    modeling code is imported. Nothing to do for the installed package (`fa2_kernels`)."""
    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parents[1] / "__init__.py"
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != ours:
        return
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # no hub package installed: transformers finds no version for ours, nothing clashes
    import transformers.utils
    import transformers.utils.import_utils

    def unavailable(*_args, **_kwargs) -> bool:
        return False

    for module in (transformers.utils.import_utils, transformers.utils):
        module.is_kernels_available = unavailable
    warnings.warn("this checkout's `kernels` package shadows Hugging Face's `kernels`: transformers' kernel hub "
                  "is off in this process (install the project to import it as `fa2_kernels`)", stacklevel=3)


def register(name: str = "fa2_triton") -> str:
    """Register the kernels under `name` with transformers (pass it as `attn_implementation`)."""
    _hide_shadowed_hub_kernels()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
