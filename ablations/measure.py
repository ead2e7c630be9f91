"""Rows for the reviewers' studies: timing a variant on one shape, and Nsight Compute counters
of many variants in one profiled process.

A timing row is a result row (harness/results.py's columns) plus `question` (which reviewer's
question it answers) and `variant` (ablations/variants.py); every time comes from
harness.timing, every FLOP count from baselines.flops, so these rows compare with the ladder's.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ablations.variants import Variant
from baselines.flops import attention_flops, tflops_per_second
from baselines.providers.core import Spec
from harness.environment import ENV_COLUMNS

ROW_COLUMNS = ["question", "variant", "label", "setting", "mode", "causal", "hdim", "seqlen", "batch", "heads",
               "dtype", "repeat", "status", "reason", "ms", "ms_p20", "ms_p80", "tflops", "tflops_p20", "tflops_p80",
               "config", "interpreter", *ENV_COLUMNS]
SPEC_FIELDS = ["mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]


@dataclass
class Context:
    """How a run of the studies measures: device, sizes, clock and where it writes."""

    device: torch.device
    interpreter: bool
    dtype: str  # 'fp16' | 'bf16' (the interpreter measures fp16: its bf16 dot is not usable)
    warmup_ms: float
    rep_ms: float
    repeats: int
    out_dir: Path
    ncu: bool  # profile the studies that need counters
    environment: dict = field(default_factory=dict)
    log: Callable[[str], None] = print


def spec_of(mode: str, causal: bool, hdim: int, seqlen: int, batch: int, heads: int, dtype: str) -> Spec:
    return Spec(mode, bool(causal), int(hdim), int(seqlen), int(batch), int(heads), dtype)


def _row(ctx: Context, question: str, variant: Variant, spec: Spec, setting: str, repeat: int, **values) -> dict:
    environment = {column: ctx.environment.get(column, "") for column in ENV_COLUMNS}
    return {"question": question, "variant": variant.name, "label": variant.label, "setting": setting,
            **{name: getattr(spec, name) for name in SPEC_FIELDS}, "repeat": repeat, "status": "ok", "reason": "",
            "ms": math.nan, "ms_p20": math.nan, "ms_p80": math.nan, "tflops": math.nan, "tflops_p20": math.nan,
            "tflops_p80": math.nan, "config": variant.config, "interpreter": ctx.interpreter, **environment, **values}


def measure(ctx: Context, question: str, variant: Variant, spec: Spec, setting: str = "") -> list[dict]:
    """Time `variant` on `spec` (mode 'fwd': the forward; 'bwd': the backward alone, after one
    forward), ctx.repeats times on fresh random inputs; one row per repeat. A failure is a row
    with its status (oom, unsupported, error) and a one-line reason; the run goes on."""
    from harness.sweep import classify_failure
    from harness.timing import random_inputs, seed_of, time_attention

    if spec.mode != variant.mode:
        raise ValueError(f"variant {variant.name} is measured in mode {variant.mode!r}, not {spec.mode!r}")
    flops = attention_flops(spec.batch, spec.heads, spec.seqlen, spec.seqlen, spec.hdim, spec.causal, spec.mode)
    rows = []
    reason = variant.availability() if variant.availability is not None else None
    if reason is not None:
        return [_row(ctx, question, variant, spec, setting, 0, status="unavailable", reason=reason)]
    for repeat in range(ctx.repeats):
        try:
            q, k, v = random_inputs(spec, ctx.device, seed_of(spec, repeat), requires_grad=spec.mode != "fwd")
            timing = time_attention(variant.forward, q, k, v, spec.causal, 1.0 / math.sqrt(spec.hdim), spec.mode,
                                    ctx.warmup_ms, ctx.rep_ms)
        except Exception as exc:  # noqa: BLE001 -- a failed cell is a row, not the end of the run
            status, reason = classify_failure(exc)
            rows.append(_row(ctx, question, variant, spec, setting, repeat, status=status, reason=reason))
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows.append(_row(ctx, question, variant, spec, setting, repeat, ms=timing.ms, ms_p20=timing.ms_p20,
                         ms_p80=timing.ms_p80, tflops=tflops_per_second(flops, timing.ms),
                         tflops_p20=tflops_per_second(flops, timing.ms_p80),
                         tflops_p80=tflops_per_second(flops, timing.ms_p20)))
    return rows


# --------------------------------------------------------------------------------------
# Nsight Compute: one process, one profiled range per job
# --------------------------------------------------------------------------------------
THEORETICAL_OCCUPANCY = "sm__maximum_warps_per_active_cycle_pct"
SM_ACTIVE = "sm__cycles_active.avg.pct_of_peak_sustained_elapsed"
LIMIT_WARPS = "launch__occupancy_limit_warps"
LIMIT_BLOCKS = "launch__occupancy_limit_blocks"


def reviewer_metrics() -> list[str]:
    """What occupancy and shared-memory-versus-synchronisation read (harness/ncu.py's names)."""
    from harness import ncu

    return [ncu.GRID, ncu.WAVES, ncu.WARPS_ACTIVE, THEORETICAL_OCCUPANCY, SM_ACTIVE, ncu.OCCUPANCY_LIMIT_REGISTERS,
            ncu.OCCUPANCY_LIMIT_SHARED, LIMIT_WARPS, LIMIT_BLOCKS, ncu.SHARED_WAVEFRONTS, ncu.BANK_CONFLICTS,
            ncu.BARRIER_STALL, ncu.DURATION, ncu.REGISTERS, ncu.SHARED_PER_BLOCK]


def ncu_command(jobs: list[dict], kernel_regex: str, metrics: list[str]) -> list[str]:
    """ncu over `python -m ablations.ncu_target JOBS`: every launch of `kernel_regex` inside the
    target's profiled ranges (one range per job, one matching kernel in each)."""
    from harness.ncu import build_ncu_command

    command = build_ncu_command([json.dumps(jobs)], kernel_regex, metrics)
    module = len(command) - 1 - command[::-1].index("-m") + 1  # the profiled target: `python -m <module>`
    command[module] = "ablations.ncu_target"
    launch_count = command.index("--launch-count")
    command[launch_count + 1] = str(len(jobs))
    return command


def profile(ctx: Context, question: str, jobs: list[tuple[Variant, Spec, str]], timeout_s: float = 300,
            metrics: list[str] | None = None) -> list[dict]:
    """Counters of each (variant, spec, setting) job: one row per job, the metrics in base units
    (harness.ncu.parse_ncu_csv), or the status and reason of a failure. A metric ncu does not know
    makes the whole profile fail: it is retried with those of harness.ncu's own list. `metrics`
    defaults to `reviewer_metrics()`."""
    from harness import ncu

    status = ncu.ncu_status()
    base = [{"question": question, "variant": v.name, "label": v.label, "setting": setting,
             **{name: getattr(spec, name) for name in SPEC_FIELDS}} for v, spec, setting in jobs]
    if status is not None or not jobs:
        return [{**row, "status": "unavailable", "reason": status or "no jobs"} for row in base]
    regex = "|".join(sorted({v.kernel_regex for v, _, _ in jobs}))
    payload = [{"variant": v.name, **{name: getattr(spec, name) for name in SPEC_FIELDS}} for v, spec, _ in jobs]
    log_dir = ctx.out_dir / "ncu_reviewers"
    log_dir.mkdir(parents=True, exist_ok=True)
    wanted = list(metrics or reviewer_metrics())
    for attempt, asked in enumerate((wanted, [m for m in wanted if m in ncu.METRICS])):
        command = ncu_command(payload, regex, asked)
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s,
                                  cwd=ncu.REPO_ROOT)
        except subprocess.TimeoutExpired:
            return [{**row, "status": "timeout", "reason": f"ncu did not finish within {timeout_s:g} s"} for row in base]
        (log_dir / f"{question}_{attempt}.log").write_text(" ".join(command) + "\n" + done.stdout + done.stderr)
        output = done.stdout + done.stderr
        if any(ncu.UNKNOWN_METRIC.search(line) for line in output.splitlines()) and attempt == 0:
            continue
        kernels = ncu.parse_ncu_csv(done.stdout)
        if done.returncode != 0 or len(kernels) != len(jobs):
            reason = (f"ncu exited with {done.returncode} and profiled {len(kernels)} kernels for {len(jobs)} jobs: "
                      f"{ncu._last_line(done.stderr or done.stdout)}")
            return [{**row, "status": "error", "reason": reason} for row in base]
        rows = []
        for row, (_, kernel) in zip(base, kernels.iterrows()):
            rows.append({**row, "status": "ok", "reason": "", "kernel_name": kernel.get("Kernel Name", ""),
                         "block_size": kernel.get("Block Size", ""),
                         **{metric: kernel.get(metric, math.nan) for metric in asked}})
        return rows
    return [{**row, "status": "unknown-metric", "reason": "ncu refused a metric of its own list"} for row in base]


def frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows).reindex(columns=ROW_COLUMNS) if rows else pd.DataFrame(columns=ROW_COLUMNS)
