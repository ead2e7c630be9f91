"""The ablation ladder's rungs as providers (ablations/ladder.py; rung 0 is the FA1
algorithm). The ladder is imported on first use, so that it may itself import this package
and a broken ladder disables only its rungs, with the import error as their reason."""

from __future__ import annotations

import functools
import importlib

from baselines.providers.core import Provider, Spec, triton_supports

# The ablation rungs (docs/architecture.md), in ladder order; their kernels live in ablations/ladder.py.
RUNG_NAMES = ("rung0-fa1", "rung1-fewer-nonmatmul", "rung2-seq-parallel", "rung3-split-q", "rung4-hopper")


@functools.cache
def ladder_rungs() -> dict:
    """{rung name: Rung} from ablations.ladder, imported on first use."""
    ladder = importlib.import_module("ablations.ladder")
    return {rung.name: rung for rung in ladder.RUNGS}


def _rung_availability(rung_name: str):
    def availability() -> str | None:
        try:
            rungs = ladder_rungs()
        except Exception as exc:  # noqa: BLE001 -- a broken ladder disables only its rungs
            return f"ablations.ladder does not import: {type(exc).__name__}: {exc}"
        if rung_name not in rungs:
            return f"ablations.ladder.RUNGS has no rung {rung_name!r} (has {', '.join(rungs)})"
        return None

    return availability


def _rung_forward(rung_name: str):
    def forward(q, k, v, causal, softmax_scale):
        return ladder_rungs()[rung_name].forward(q, k, v, causal, softmax_scale)

    return forward


def _forward_only_triton(spec: Spec) -> str | None:
    if spec.mode != "fwd":
        return "forward only (the ablation ladder has no backward)"
    return triton_supports(spec)


def rung_provider(name: str, rung_name: str, label: str | None = None) -> Provider:
    """A provider running ladder rung `rung_name`; label and kernel regex from the ladder when it
    imports (else the rung name and no regex: its availability then says why)."""
    try:
        rung = ladder_rungs()[rung_name]
        ladder_label, regex = rung.label, rung.kernel_regex
    except Exception:  # noqa: BLE001 -- the availability check reports why
        ladder_label, regex = rung_name, ""
    return Provider(
        name=name, label=label or ladder_label, forward=_rung_forward(rung_name),
        availability=_rung_availability(rung_name), supports=_forward_only_triton,
        kernel_regex=regex, has_backward=False,
    )


def rung_providers() -> list[Provider]:
    """'fa1' (rung 0 under its own name), then every rung."""
    return [rung_provider("fa1", RUNG_NAMES[0], "FA1 algorithm (ablation rung 0)"),
            *(rung_provider(name, name) for name in RUNG_NAMES)]
