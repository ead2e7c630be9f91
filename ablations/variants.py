"""The kernels the reviewers' studies measure, by name: forward rungs with one switch changed,
the backward ladder, the production backward, and the peers from the provider registry.

A variant is what a result row's `variant` column names: a callable in the providers' signature
(`forward(q, k, v, causal, softmax_scale) -> out`, with autograd where `mode` is 'bwd'), its
label, the mode it is measured in, and the Nsight Compute regex of its main kernel. Kernels
are imported when a variant first runs, so this module imports without Triton's JIT.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    mode: str  # 'fwd' or 'bwd': what is timed
    forward: Callable  # (q, k, v, causal, softmax_scale) -> out, flash-attn layout (B, S, H, D)
    kernel_regex: str  # its main kernel, for Nsight Compute ('' when not profiled)
    config: str = ""  # the kernel configuration, as recorded in the rows
    availability: Callable[[], str | None] | None = None  # None when usable here, else the reason


def forward_rung(rung: int, config=None, **switches) -> Callable:
    """Forward ladder rung `rung` with a tile config and switches of `ladder_forward`."""
    def forward(q, k, v, causal, softmax_scale):
        from kernels.fa_ladder import ladder_forward

        return ladder_forward(q, k, v, softmax_scale, causal, rung=rung, config=config, **switches)[0]

    return forward


def backward_rung(rung: int) -> Callable:
    def forward(q, k, v, causal, softmax_scale):
        from kernels.ladder_backward import ladder_attention

        return ladder_attention(q, k, v, causal, softmax_scale, rung=rung)

    return forward


def production_forward(config) -> Callable:
    """The production Triton forward (kernels/forward.py's _flash_fwd_kernel) with `config`,
    kept off the Gluon forward as rung 4 is."""
    def forward(q, k, v, causal, softmax_scale):
        from dataclasses import replace

        from kernels import forward as fwd
        from kernels.fa_ladder import check_ladder_inputs

        scale = check_ladder_inputs(q, k, v, softmax_scale)
        return fwd.flash_attn_forward(q, k, v, scale, causal, replace(config, hopper_gluon_min_keys=0))[0]

    return forward


def _production_attention(q, k, v, causal, softmax_scale):
    from kernels import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


def provider_variant(provider_name: str, mode: str) -> Variant:
    """A peer from baselines.providers (its availability is checked when measured)."""
    from baselines.providers import get_provider
    from baselines.providers.core import unavailable_reason

    provider = get_provider(provider_name)
    regex = provider.kernel_regex if mode == "fwd" else provider.bwd_kernel_regex

    def availability() -> str | None:
        reason = unavailable_reason(provider)
        if reason is None and mode != "fwd" and not provider.has_backward:
            reason = "it has no backward"
        return reason

    return Variant(provider_name, provider.label, mode, provider.forward, regex, availability=availability)


def one_tile(split: str) -> Callable:
    def forward(q, k, v, causal, softmax_scale):
        from kernels.ladder_warp_split import one_tile_forward

        return one_tile_forward(q, k, v, causal, softmax_scale, split=split)

    return forward


def _gluon_availability() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "Gluon has no CPU interpreter: the one-tile pair needs a GPU"


ONE_TILE_LABELS = {"split-q": "one tile: warps along query rows (split-Q)",
                   "split-k-p": "one tile: warps along keys, P exchanged (Triton's split-K)",
                   "split-k-o": "one tile: warps along keys, partial O exchanged (FA1's split-K)"}
BWD_LABELS = ("0: FA1 backward", "1: + fewer non-matmul FLOPs", "2: + parallel over K/V blocks (atomic dQ)",
              "3: + warps along key rows (FA2)")


@functools.cache
def variants() -> dict[str, Variant]:
    """Every named variant but the tuning candidates (ablations/parts.py builds those)."""
    table = [
        Variant("fwd-rung0-skip", "FA1 (rung 0), causal blocks skipped", "fwd", forward_rung(0), "_ladder_kv_outer_kernel"),
        Variant("fwd-rung0-noskip", "FA1 (rung 0), fully masked blocks computed", "fwd",
                forward_rung(0, skip_masked_blocks=False), "_ladder_kv_outer_kernel"),
        *(Variant(f"fwd-rung{rung}", label, "fwd", forward_rung(rung), regex) for rung, label, regex in (
            (0, "0: FA1 algorithm", "_ladder_kv_outer_kernel"),
            (1, "1: + fewer non-matmul FLOPs", "_ladder_kv_outer_kernel"),
            (2, "2: + sequence parallelism", "_ladder_q_outer_kernel"),
            (3, "3: + split-Q warps (FA2)", "_ladder_q_outer_kernel"))),
        *(Variant(f"bwd-rung{rung}", label, "bwd", backward_rung(rung), "_ladder_bwd_kernel")
          for rung, label in enumerate(BWD_LABELS)),
        Variant("bwd-production", "4: production backward (beyond the paper: several changes)", "bwd",
                _production_attention, ""),
        *(Variant(f"ws-{split}", label, "fwd", one_tile(split), "_one_tile_fwd_kernel",
                  availability=_gluon_availability) for split, label in ONE_TILE_LABELS.items()),
    ]
    return {variant.name: variant for variant in table}


def barrier_variant(extra_barriers: int) -> Variant:
    """Rung 3 with `extra_barriers` CTA barriers added to every K/V step, nothing else changed."""
    return Variant(f"fwd-rung3-barriers{extra_barriers}", f"3 + {extra_barriers} barriers per K/V step", "fwd",
                   forward_rung(3, extra_barriers=extra_barriers), "_ladder_q_outer_kernel",
                   config=f'{{"extra_barriers": {extra_barriers}}}')


def get_variant(name: str) -> Variant:
    """A variant by name: the table, `fwd-rung3-barriersN`, or `peer:<provider>:<mode>`."""
    if name.startswith("fwd-rung3-barriers") and name.removeprefix("fwd-rung3-barriers").isdigit():
        return barrier_variant(int(name.removeprefix("fwd-rung3-barriers")))
    if name.startswith("peer:"):
        _, provider, mode = name.split(":")
        return provider_variant(provider, mode)
    table = variants()
    if name not in table:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(table)}, fwd-rung3-barriersN, "
                         "peer:<provider>:<mode>")
    return table[name]
