"""The one provider registry: our kernels and every baseline, each an entry with a name, a
plot label, an availability check that explains itself, a shape check, and a callable.

Every provider's `forward(q, k, v, causal, softmax_scale) -> out` takes and returns
flash-attn's layout (batch, seqlen, heads, headdim); providers that want (batch, heads,
seqlen, headdim) get transposed views. Causal masks are bottom-right aligned (flash-attn
>= 2.1, baselines.reference). A provider that cannot compute the asked function raises
`UnsupportedInput` (recorded as 'unsupported'), never computes a different one.

The families, one module each: `builtin` (our FA2 kernel, PyTorch eager, SDPA's backends),
`compiled` (torch.compile of eager attention, FlexAttention), `packages` (FA4, the
flash-attn packages, FlashInfer, xformers: imported by their availability checks, which say
why one is missing), `rungs` (the ablation ladder), `decode` (kind 'decode': one query token
against a KV cache) and `features` (kind 'features': the features suite's calls of GQA,
windows, packed variable lengths, ALiBi and softcap). Each provider has a kind (`core.KINDS`,
each with its own call signature); `registry(kind)` and `get_provider(name, kind)` look within
one.

Importing this package imports no Triton kernel: `kernels` is imported by the first call,
ablations.ladder by the first use of `PROVIDERS`, so a caller can switch on Triton's
interpreter (TRITON_INTERPRET=1) before that.
"""

from __future__ import annotations

import functools

from baselines.providers import builtin, compiled, decode, features, packages  # noqa: F401 -- register in listing order
from baselines.providers.builtin import SDPA_BACKENDS, SDPA_REFUSALS, override_fa2_fwd_config
from baselines.providers.core import (
    BASE_PROVIDERS,
    DTYPES,
    INTERPRETER_BF16,
    KINDS,
    MAX_HEADDIM,
    NEEDS_CUDA,
    Provider,
    Spec,
    UnsupportedInput,
    unavailable_reason,
)
from baselines.providers.rungs import RUNG_NAMES, rung_providers

__all__ = [
    "DTYPES", "INTERPRETER_BF16", "KINDS", "MAX_HEADDIM", "NEEDS_CUDA", "RUNG_NAMES", "SDPA_BACKENDS", "SDPA_REFUSALS",
    "Provider", "Spec", "UnsupportedInput", "get_provider", "override_fa2_fwd_config", "unavailable_reason",
]


def __getattr__(name: str):
    """`PROVIDERS` is built on first access: the rung providers take their labels and kernel
    names from ablations.ladder, imported then (not when this package is imported, so that
    the ladder may itself import it, and a broken ladder breaks only its rungs)."""
    if name == "PROVIDERS":
        return registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def registry(kind: str = "attention") -> dict[str, Provider]:
    """{name: Provider} of one kind, in listing order: for 'attention' the base providers, then
    'fa1' and the rungs; for the other kinds, theirs."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    providers: dict[str, Provider] = {}
    for provider in [*BASE_PROVIDERS, *(rung_providers() if kind == "attention" else ())]:
        if provider.kind != kind:
            continue
        if provider.name in providers:
            raise ValueError(f"{kind} provider {provider.name!r} is registered twice")
        providers[provider.name] = provider
    return providers


def get_provider(name: str, kind: str = "attention") -> Provider:
    providers = registry(kind)
    if name not in providers:
        which = "" if kind == "attention" else f"{kind} "
        raise ValueError(f"unknown {which}provider {name!r}; known {which}providers: {', '.join(providers)}")
    return providers[name]
