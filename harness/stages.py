"""The measuring stages of a run: the sweep, Nsight Compute counters and the regression check,
in that order, each from the rows of the results folder. The reports are made from what they
return (runner.py hands it to reports/)."""

from __future__ import annotations

import shlex
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.plan import ABLATION_SWEEP, QUICK_REP_MS, QUICK_WARMUP_MS
from harness.timing import DEFAULT_REP_MS, DEFAULT_WARMUP_MS

EXIT_REGRESSION, EXIT_NOT_COMPARED, EXIT_ABORTED, EXIT_INTERRUPTED = 1, 2, 3, 130


def print_provider_list(extra=()) -> None:
    """Every provider of the registry (the attention providers, --provider-file's, then the decode
    providers), whether it is available here and why not."""
    from baselines.providers import PROVIDERS, registry, unavailable_reason

    providers = [*PROVIDERS.values(), *extra, *registry("decode").values()]
    width = max(len(provider.name) for provider in providers)
    for provider in providers:
        reason = unavailable_reason(provider)
        state = "available" if reason is None else f"unavailable: {reason}"
        what = "decode" if provider.kind == "decode" else "fwd+bwd" if provider.has_backward else "fwd only"
        print(f"{provider.name:<{width}}  {provider.label}  [{what}]\n{'':<{width}}  {state}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def measure(args, jobs, providers, out_dir: Path, environment: dict, interpreter: bool) -> int:
    """The sweep into out_dir/results.csv; returns its exit code (0, aborted, interrupted)."""
    from tqdm import tqdm

    from harness.results import (
        RESULTS_CSV,
        ResultWriter,
        completed_keys,
        load_results,
        recorded_outcomes,
        timed_out_configs,
    )
    from harness.sweep import Sweep, SweepAborted

    known = load_results(out_dir) if args.resume else None
    timed_out = frozenset(timed_out_configs(known)) if known is not None and not args.retry_timeouts else frozenset()
    if timed_out:
        print(f"--resume: skipping {len(timed_out)} (provider, configuration) that timed out before; "
              "--retry-timeouts measures them again", file=sys.stderr)
    sweep_kwargs = {
        "device": torch.device("cpu" if interpreter else "cuda"), "repeats": args.repeats,
        "warmup_ms": args.warmup_ms or (QUICK_WARMUP_MS if args.quick else DEFAULT_WARMUP_MS),
        "rep_ms": args.rep_ms or (QUICK_REP_MS if args.quick else DEFAULT_REP_MS), "cuda_graph": args.cuda_graph,
        "skip": frozenset(completed_keys(known)) if known is not None else frozenset(), "timed_out": timed_out,
        "known": recorded_outcomes(known) if known is not None else None, "call_timeout": args.call_timeout,
        "log": tqdm.write if args.verbose else None}
    signal.signal(signal.SIGTERM, _interrupt)  # a time limit's SIGTERM: keep the rows, write the reports
    exit_code = 0
    try:
        with ResultWriter(out_dir / RESULTS_CSV) as writer:
            counts = Sweep(writer, environment, **sweep_kwargs).run(jobs, providers)
            print(f"rows written: {dict(counts)}", file=sys.stderr)
    except SweepAborted as exc:
        print(f"SWEEP ABORTED: {exc}", file=sys.stderr)
        exit_code = EXIT_ABORTED
    except KeyboardInterrupt:
        print(f"INTERRUPTED: the rows measured so far are in {out_dir / RESULTS_CSV}; run the same "
              "command with --resume to go on", file=sys.stderr)
        exit_code = EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return exit_code


def run_counters(jobs, providers, df, out_dir: Path, only: bool):
    """Nsight Compute counters of each (provider, job) measured ok (every available one with
    --ncu-only) via harness.ncu, into out_dir/counters.csv; returns their DataFrame."""
    from baselines.providers import unavailable_reason
    from harness.ncu import profile_providers
    from harness.results import row_key

    measured = {row_key(row) for _, row in df[df["status"] == "ok"].iterrows()}
    ncu_jobs = []
    for job in jobs:
        if job.setting == ABLATION_SWEEP:  # one representative launch per rung and setting
            continue
        for provider in providers:
            if only:
                try:
                    wanted = unavailable_reason(provider) is None and provider.supports(job.spec) is None
                except Exception:  # noqa: BLE001 -- a raising supports() is not profiled
                    wanted = False
            else:
                key = {"provider": provider.name, "setting": job.setting, **vars(job.spec), "repeat": 0}
                wanted = row_key(key) in measured
            if wanted:
                # the backward kernel for 'bwd'; the forward kernel (launched first) for 'fwd_bwd'
                regex = provider.bwd_kernel_regex if job.spec.mode == "bwd" else provider.kernel_regex
                if not regex:
                    print(f"ncu: {provider.name} {job.spec.mode}: no kernel name known to select, not profiled",
                          file=sys.stderr)
                    continue
                ncu_jobs.append((provider.name, job.spec, regex, job.setting))
    return profile_providers(ncu_jobs, out_dir)


def regression_check(args, df, environment: dict) -> tuple[int, object]:
    """--save-baseline and --compare (harness.regression); returns the exit code (1 on a
    regression or a failed configuration, 2 when nothing could be compared: an unusable
    baseline, no shared configuration) and the comparison (None where none was made)."""
    from harness import regression

    status, comparison = 0, None
    if args.compare is not None:
        path = Path(args.compare) if args.compare else regression.baseline_path(environment["gpu"])
        try:
            baseline = regression.load_baseline(path)
            repeats = int(df.loc[df["status"] == "ok", "repeat"].max() + 1) if (df["status"] == "ok").any() else 1
            sigma = regression.calibrated_sigma(path.parent / regression.CALIBRATION_CSV, repeats)
            comparison = regression.compare_to_baseline(df, baseline, environment, args.tolerance,
                                                        args.false_positive_rate, sigma)
        except (regression.BaselineError, regression.BaselineMismatch) as exc:
            print(f"--compare: {exc}", file=sys.stderr)
            status = EXIT_NOT_COMPARED  # --save-baseline below still runs: the measurements are fine
        else:
            if comparison.regressed:
                status = EXIT_REGRESSION
            elif comparison.compared == 0:
                print("--compare: nothing was compared (see the warnings): exit code 2", file=sys.stderr)
                status = EXIT_NOT_COMPARED
    if args.save_baseline is not None:
        path = Path(args.save_baseline) if args.save_baseline else regression.baseline_path(environment["gpu"])
        try:
            print(f"baseline saved: {regression.save_baseline(df, path, environment)}")
        except ValueError as exc:
            print(f"--save-baseline: {exc}", file=sys.stderr)
            return EXIT_NOT_COMPARED, comparison
    return status, comparison


@dataclass
class Outcome:
    """What a run's stages leave for its reports: the exit code, the folder's rows, the counters
    (None without --ncu) and the --compare comparison (None without one)."""
    exit_code: int
    rows: object
    counters: object = None
    comparison: object = None


def execute(args, jobs, providers, out_dir: Path, interpreter: bool, extra_run_fields: dict) -> Outcome:
    """Measure, profile and compare into out_dir (its lock already held)."""
    from harness.environment import capture_environment, throttle_warnings
    from harness.results import load_results, record_run

    environment = capture_environment()
    run = {"run_id": f"{environment['timestamp']} {uuid.uuid4().hex[:8]}",
           "command": shlex.join([sys.executable, *sys.argv]),
           "arguments": {k: v if not isinstance(v, (Path, list)) else str(v) for k, v in vars(args).items()},
           "environment_before": environment, "finished": None, **extra_run_fields}
    record_run(out_dir, run)
    print(f"{len(jobs)} configurations x {len(providers)} providers -> {out_dir}", file=sys.stderr)
    exit_code = 0
    if args.ncu != "only":
        exit_code = measure(args, jobs, providers, out_dir, environment, interpreter)
    after = capture_environment()
    run.update(environment_after=after, throttle_warnings=throttle_warnings(environment, after),
               finished=after["timestamp"] if exit_code == 0 else None, exit_code=exit_code)
    record_run(out_dir, run)
    for warning in run["throttle_warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    df = load_results(out_dir)
    counters = run_counters(jobs, providers, df, out_dir, args.ncu == "only") if args.ncu != "off" else None
    comparison = None
    if args.compare is not None or args.save_baseline is not None:
        status, comparison = regression_check(args, df, environment)
        exit_code = max(exit_code, status)
    return Outcome(exit_code, df, counters, comparison)
