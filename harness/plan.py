"""What a run measures: the paper suite's configurations and providers (the ablation's: ablations/plan.py).

The paper's sweep (FA2 paper Sec. 4.1): hidden size 2048 = heads x head dim and 16k tokens =
batch x seqlen, over head dims 64/128/256 and seqlens 512..16k. Without a GPU the sizes shrink
so that Triton's CPU interpreter gets through a sweep in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("fwd", "bwd", "fwd_bwd")
STUDY_NAMES = ("all", "fewer-nonmatmul", "seq-parallel", "warp-partitioning", "hopper")
# The reviewers' studies (ablations/parts.py), each runnable alone; `--ablation all` runs them too.
REVIEWER_PARTS = ("backward", "tuning", "warp-split", "fa1-causal-skip", "occupancy", "smem-vs-sync",
                  "triton-vs-cutlass")
# The paper's sweep (FA2 paper Sec. 4.1): hidden size 2048 = heads x head dim, 16k tokens = batch x seqlen.
PAPER_TOKENS = 16384
PAPER_HIDDEN = 2048
QUICK_MODES = ("fwd", "fwd_bwd")
QUICK_WARMUP_MS, QUICK_REP_MS = 10, 40


@dataclass(frozen=True)
class Sizes:
    """Default sweep sizes; batch/heads None means the paper's 16384 // seqlen and 2048 // hdim."""

    hdims: tuple[int, ...]
    seqlens: tuple[int, ...]
    quick_hdims: tuple[int, ...]
    quick_seqlens: tuple[int, ...]
    batch: int | None = None
    heads: int | None = None


GPU_SIZES = Sizes(hdims=(64, 128, 256), seqlens=(512, 1024, 2048, 4096, 8192, 16384), quick_hdims=(128,),
                  quick_seqlens=(1024, 4096))
# Triton's interpreter: tiny sizes so that a whole sweep takes minutes on a CPU.
INTERPRETER_SIZES = Sizes(hdims=(32, 64), seqlens=(32, 64, 128), quick_hdims=(32,), quick_seqlens=(64,), batch=1,
                          heads=2)
ABLATION_SWEEP = "sweep"  # the `setting` of the ablation's seqlen x head dim x causal rows

def _join(values) -> str:
    return ",".join(str(v) for v in values)


def _causal_values(choice: str) -> tuple[bool, ...]:
    return {"true": (True,), "false": (False,), "both": (False, True)}[choice]


def suite_modes(args) -> tuple[str, ...]:
    """The paper suite's modes: --modes, else the quick or the full default."""
    return tuple(args.modes or (QUICK_MODES if args.quick else MODES))


def suite_jobs(args, interpreter: bool) -> list:
    """The paper suite's configurations: modes x head dims x causal x seqlens (narrowed by args)."""
    from baselines.providers import Spec
    from harness.sweep import Job

    sizes = INTERPRETER_SIZES if interpreter else GPU_SIZES
    modes = suite_modes(args)
    hdims = args.hdims or (sizes.quick_hdims if args.quick else sizes.hdims)
    seqlens = args.seqlens or (sizes.quick_seqlens if args.quick else sizes.seqlens)
    jobs = []
    for mode in modes:
        for hdim in hdims:
            for causal in _causal_values(args.causal):
                for seqlen in seqlens:
                    batch = args.batch or sizes.batch or max(1, PAPER_TOKENS // seqlen)
                    heads = args.heads or sizes.heads or max(1, PAPER_HIDDEN // hdim)
                    jobs.append(Job(Spec(mode, causal, hdim, seqlen, batch, heads, args.dtype)))
    return jobs


def suite_providers(args) -> list[str]:
    from baselines.providers import PROVIDERS, RUNG_NAMES

    return list(args.providers) if args.providers else [name for name in PROVIDERS if name not in RUNG_NAMES]
