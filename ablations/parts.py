"""The reviewers' studies, one function per part: each measures its rows (ablations/measure.py)
and returns (timing rows, counter rows), every row tagged with the question it answers.

Sizes: the paper's settings A and B (ablations/ladder.py) and sweeps in the paper's shape family
(batch x seqlen = 16k tokens, heads x head dim = 2048); in Triton's interpreter everything
shrinks to a few blocks (INTERPRETER_*), which shows the pipeline works and nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ablations.ladder import SETTINGS
from ablations.measure import Context, measure, profile, spec_of
from ablations.variants import (
    Variant,
    barrier_variant,
    forward_rung,
    get_variant,
    production_forward,
    provider_variant,
)

PAPER_TOKENS, PAPER_HIDDEN = 16384, 2048
INTERPRETER_SETTING = {"seqlen": 64, "hdim": 32, "heads": 1}  # batch kept at most 2 (A: 2, B: 1)
INTERPRETER_SWEEP = {"hdims": (32,), "seqlens": (64,)}
BACKWARD_SWEEP = {"hdims": (64, 128), "seqlens": (1024, 4096), "causal": (True,)}
TUNING_SWEEP = {"hdims": (128,), "seqlens": (1024, 4096, 16384), "causal": (False, True)}
CUTLASS_SWEEP = {"hdims": (64, 128), "seqlens": (2048,), "causal": (False, True)}
OFFICIAL_FA2, CUTLASS = "sdpa-flash", "sdpa-efficient"


@dataclass(frozen=True)
class Part:
    name: str  # the `--ablation` name
    question: str  # the rows' `question`
    run: Callable[[Context], tuple[list[dict], list[dict]]]
    needs_gpu_counters: bool = False


def settings(ctx: Context, mode: str) -> list[tuple[str, object]]:
    """[(setting name, Spec)] of the paper's settings A and B in `mode`."""
    chosen = []
    for name, setting in SETTINGS.items():
        sizes = {key: setting[key] for key in ("batch", "heads", "hdim", "seqlen")}
        if ctx.interpreter:
            sizes.update(INTERPRETER_SETTING, batch=min(sizes["batch"], 2))
        chosen.append((name, spec_of(mode, setting["causal"], sizes["hdim"], sizes["seqlen"], sizes["batch"],
                                     sizes["heads"], ctx.dtype)))
    return chosen


def sweep(ctx: Context, mode: str, hdims, seqlens, causal=(False, True)) -> list:
    if ctx.interpreter:
        hdims, seqlens = INTERPRETER_SWEEP["hdims"], INTERPRETER_SWEEP["seqlens"]
    return [spec_of(mode, c, d, s, 1 if ctx.interpreter else PAPER_TOKENS // s,
                    1 if ctx.interpreter else PAPER_HIDDEN // d, ctx.dtype)
            for d in hdims for c in causal for s in seqlens]


def _timed(ctx: Context, question: str, variants: list[Variant], jobs: list[tuple[str, object]]) -> list[dict]:
    rows = []
    for setting, spec in jobs:
        for variant in variants:
            rows += measure(ctx, question, variant, spec, setting)
    return rows


# --------------------------------------------------------------------------------------
# The parts
# --------------------------------------------------------------------------------------
def fa1_causal_skip(ctx: Context):
    """FA1 (forward rung 0) with and without skipping the fully masked causal blocks."""
    variants = [get_variant("fwd-rung0-skip"), get_variant("fwd-rung0-noskip")]
    return _timed(ctx, "fa1-causal-skip", variants, settings(ctx, "fwd")), []


def backward_ladder(ctx: Context):
    """Backward rungs 0-3, the production backward and the official FA2 backward: settings A
    and B, then a sweep."""
    variants = [get_variant(f"bwd-rung{rung}") for rung in range(4)]
    variants += [get_variant("bwd-production"), provider_variant(OFFICIAL_FA2, "bwd")]
    jobs = settings(ctx, "bwd") + [("sweep", spec) for spec in sweep(ctx, "bwd", **BACKWARD_SWEEP)]
    counters = []
    if ctx.ncu:  # the forward ladder's counter groups (harness/ncu.py) and occupancy's, for backward rungs 0-3
        from ablations.measure import reviewer_metrics
        from harness.ncu import METRICS

        counters = profile(ctx, "backward-ladder", [(variant, spec, setting) for setting, spec in settings(ctx, "bwd")
                                                    for variant in variants[:4]],
                           metrics=list(dict.fromkeys([*METRICS, *reviewer_metrics()])))
    return _timed(ctx, "backward-ladder", variants, jobs), counters


def _config_text(config) -> str:
    return json.dumps({"block_m": config.block_m, "block_n": config.block_n, "num_warps": config.num_warps,
                       "num_stages": config.num_stages})


def tuning_candidates(ctx: Context, headdim: int) -> dict[str, tuple[list, object]]:
    """{kernel: (candidate configs, the one fixed config)} for rung 3 and the production forward.
    Rung 3's candidates keep its warp split (BLOCK_M >= head dim); the fixed ones are the tables'."""
    from kernels import configs
    from kernels.configs import FwdConfig
    from kernels.fa_ladder import default_ladder_config

    if ctx.interpreter:
        rung3 = [FwdConfig(32, 16, 4, 1), FwdConfig(32, 32, 4, 1)]
        production = [configs.INTERPRETER_FWD_CONFIG, FwdConfig(16, 32, 4, 1)]
        return {"rung3": (rung3, rung3[0]), "production": (production, production[0])}
    block_m = max(128, headdim)
    rung3 = [FwdConfig(block_m, n, 4, s) for n in (32, 64, 128) for s in (1, 2)]
    rung3 += [FwdConfig(block_m, 128, 8, s) for s in (1, 2)]
    fixed3 = default_ladder_config(3, headdim, ctx.device)
    fixed = configs.default_fwd_config(headdim, False, ctx.device)
    production = [fixed, *(FwdConfig(m, n, w, s) for m, n, w, s in (
        (128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)))]
    return {"rung3": (list(dict.fromkeys([fixed3, *rung3])), fixed3),
            "production": (list(dict.fromkeys(production)), fixed)}


def _candidate(kernel: str, config, fixed) -> Variant:
    label = f"{config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
    text = json.loads(_config_text(config)) | {"kernel": kernel, "fixed": config == fixed}
    forward = forward_rung(3, config=config) if kernel == "rung3" else production_forward(config)
    return Variant(f"tune-{kernel} {label}", f"{kernel} {label}", "fwd", forward, "", config=json.dumps(text))


def block_size_tuning(ctx: Context):
    """Every candidate tile config of rung 3 and of the production forward on each sweep shape."""
    rows = []
    for spec in sweep(ctx, "fwd", **TUNING_SWEEP):
        for kernel, (candidates, fixed) in tuning_candidates(ctx, spec.hdim).items():
            for config in candidates:
                rows += measure(ctx, "block-size-tuning", _candidate(kernel, config, fixed), spec, "sweep")
    return rows, []


def triton_vs_cutlass(ctx: Context):
    """FA1 and FA2 within the Triton ladder (forward rungs 0 and 3, backward rungs 0 and 3) next to
    the official FA2 kernel and xformers' cutlass kernel (SDPA efficient), same shapes, same run."""
    rows = []
    for mode, rungs in (("fwd", ("fwd-rung0", "fwd-rung3")), ("bwd", ("bwd-rung0", "bwd-rung3"))):
        variants = [get_variant(name) for name in rungs]
        variants += [provider_variant(OFFICIAL_FA2, mode), provider_variant(CUTLASS, mode)]
        rows += _timed(ctx, "triton-vs-cutlass", variants, [("sweep", s) for s in sweep(ctx, mode, **CUTLASS_SWEEP)])
    return rows, []


def occupancy(ctx: Context):
    """Counters of forward rungs 0-3 in settings A and B (no timing: the ladder's own rows time
    them); the backward rungs' come with the backward part's counters."""
    if not ctx.ncu:
        return [], []
    jobs = [(get_variant(f"fwd-rung{rung}"), spec, setting) for setting, spec in settings(ctx, "fwd")
            for rung in range(4)]
    return [], profile(ctx, "occupancy", jobs)


def barrier_gap(ctx: Context, spec) -> int:
    """CTA barriers per K/V step that rung 2's compiled kernel has beyond rung 3's (bar.sync in
    the PTX, over its two K/V loops), at least 1; 1 in the interpreter, which has no PTX."""
    if ctx.interpreter:
        return 1
    from harness.timing import random_inputs
    from kernels.fa_ladder import plan_ladder_forward

    counts = []
    for rung in (2, 3):
        q, k, v = random_inputs(spec, ctx.device, 0, requires_grad=False)
        launch = plan_ladder_forward(q, k, v, None, spec.causal, rung=rung)[2]
        counts.append(len(re.findall(r"\bbar\.sync\b", launch.run().asm["ptx"])))
    return max(1, round((counts[0] - counts[1]) / 2))


def smem_vs_sync(ctx: Context):
    """Forward rungs 2 and 3 and rung 3 with rung 2's extra barriers added (nothing else changed),
    timed in A and B; counters of those and of backward rungs 2-3 in A."""
    jobs = settings(ctx, "fwd")
    extra = barrier_gap(ctx, jobs[0][1])
    variants = [get_variant("fwd-rung2"), get_variant("fwd-rung3"), barrier_variant(extra)]
    if ctx.interpreter:  # inline PTX barriers do not exist there
        variants[2] = Variant(variants[2].name, variants[2].label, "fwd", variants[2].forward, "",
                              variants[2].config, availability=lambda: "inline PTX barriers need a GPU")
    rows = _timed(ctx, "smem-vs-sync", variants, jobs)
    counters = []
    if ctx.ncu:
        setting, spec = jobs[0]
        bwd_setting, bwd_spec = settings(ctx, "bwd")[0]
        counters = profile(ctx, "smem-vs-sync", [(v, spec, setting) for v in variants]
                           + [(get_variant(f"bwd-rung{r}"), bwd_spec, bwd_setting) for r in (2, 3)])
    return rows, counters


def warp_split_one_tile(ctx: Context):
    """The Gluon variants at one tile (kernels/ladder_warp_split.py) and the compiler-chosen pair
    (forward rungs 2 and 3) in settings A and B; the compiled code's registers and spills go into
    each row's config."""
    from kernels import ladder_warp_split

    names = ["ws-split-q", "ws-split-k-p", "ws-split-k-o", "fwd-rung2", "fwd-rung3"]
    jobs = settings(ctx, "fwd")
    rows = []
    for setting, spec in jobs:
        for name in names:
            variant = get_variant(name)
            measured = measure(ctx, "warp-split-one-tile", variant, spec, setting)
            if name.startswith("ws-"):
                facts = ladder_warp_split.COMPILED_FACTS.get((name.removeprefix("ws-"), spec.hdim, spec.causal,
                                                              spec.torch_dtype))
                for row in measured:
                    row["config"] = json.dumps(facts or {})
            rows += measured
    counters = []
    if ctx.ncu:
        setting, spec = jobs[0]
        counters = profile(ctx, "warp-split-one-tile", [(get_variant(name), spec, setting) for name in names])
    return rows, counters


PARTS: dict[str, Part] = {part.name: part for part in (
    Part("warp-split", "warp-split-one-tile", warp_split_one_tile, needs_gpu_counters=True),
    Part("fa1-causal-skip", "fa1-causal-skip", fa1_causal_skip),
    Part("backward", "backward-ladder", backward_ladder),
    Part("tuning", "block-size-tuning", block_size_tuning),
    Part("triton-vs-cutlass", "triton-vs-cutlass", triton_vs_cutlass),
    Part("occupancy", "occupancy", occupancy, needs_gpu_counters=True),
    Part("smem-vs-sync", "smem-vs-sync", smem_vs_sync, needs_gpu_counters=True),
)}
