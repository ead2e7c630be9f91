"""What `runner.py --ablation STUDY` measures: the paper's settings A and B at their own sizes,
then (unless --settings-only) the forward sweep of seqlen x head dim x causal at paper shapes,
for the study's rungs and the peers measured beside them."""

from __future__ import annotations

import argparse

from ablations.ladder import RUNGS, SETTINGS, STUDIES
from baselines.providers import Spec
from harness.plan import ABLATION_SWEEP, suite_jobs
from harness.sweep import Job

# Triton's interpreter: the settings shrink to seqlen 128, head dim 64, 2 heads, batch at most 2 (A: 2, B: 1)
INTERPRETER_ABLATION = {"seqlen": 128, "hdim": 64, "heads": 2}
INTERPRETER_ABLATION_MAX_BATCH = 2
# measured next to the rungs in the same run: the official FA2 kernel, cuDNN and FlashAttention-4
# (a row with its reason where FA4 is not installed)
ABLATION_PEERS = ("sdpa-flash", "sdpa-cudnn", "fa4")


def ablation_plan(args, interpreter: bool) -> tuple[list, list[str]]:
    """(jobs, provider names) of `--ablation STUDY` from ablations.ladder's SETTINGS, STUDIES, RUNGS."""
    if args.ablation not in STUDIES:
        raise SystemExit(f"--ablation {args.ablation}: ablations.ladder.STUDIES has {sorted(STUDIES)}")
    jobs = []
    for name, setting in SETTINGS.items():  # the paper's settings, at their own sizes
        missing = {"batch", "heads", "hdim", "seqlen", "causal", "mode"} - set(setting)
        if missing:
            raise SystemExit(f"ablations.ladder.SETTINGS[{name!r}] lacks {sorted(missing)}")
        sizes = {key: setting[key] for key in ("batch", "heads", "hdim", "seqlen")}
        if interpreter:
            sizes.update(INTERPRETER_ABLATION, batch=min(sizes["batch"], INTERPRETER_ABLATION_MAX_BATCH))
        # the paper's settings keep their own batch and heads (--batch/--heads narrow the sweep only),
        # so the paper's A100 numbers cited beside them are for the same shape
        spec = Spec(setting["mode"], bool(setting["causal"]), sizes["hdim"], sizes["seqlen"],
                    sizes["batch"], sizes["heads"], args.dtype)
        jobs.append(Job(spec, setting=name))
    if not args.settings_only:  # the forward sweep: seqlen x head dim x causal, paper shapes
        sweep_args = argparse.Namespace(**{**vars(args), "modes": ("fwd",)})
        jobs += [Job(job.spec, setting=ABLATION_SWEEP) for job in suite_jobs(sweep_args, interpreter)]
    rungs = [RUNGS[index].name for index in STUDIES[args.ablation]]
    extras = [p for p in (args.providers or ABLATION_PEERS) if p not in rungs]
    return jobs, rungs + extras
