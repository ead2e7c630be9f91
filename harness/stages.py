"""The stages of a run after the sweep: counters, the regression check and the reports."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.plan import ABLATION_SWEEP


def print_provider_list() -> None:
    from baselines.providers import PROVIDERS, unavailable_reason

    width = max(len(name) for name in PROVIDERS)
    for provider in PROVIDERS.values():
        reason = unavailable_reason(provider)
        state = "available" if reason is None else f"unavailable: {reason}"
        backward = "fwd+bwd" if provider.has_backward else "fwd only"
        print(f"{provider.name:<{width}}  {provider.label}  [{backward}]\n{'':<{width}}  {state}")


def summary_table(df, max_rows: int = 60) -> str:
    """Median TFLOPs/s of the ok rows by configuration x provider, when it is short enough."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return "no ok measurement"
    table = ok.pivot_table(index=["setting", "mode", "hdim", "causal", "seqlen"], columns="provider",
                           values="tflops", aggfunc="median")
    if len(table) > max_rows:
        return f"{len(table)} configurations: see report.md"
    return table.to_string(float_format=lambda v: f"{v:.4g}")


def run_counters(jobs, providers: list[str], df, out_dir: Path, only: bool):
    """Nsight Compute counters of each (provider, job) measured ok (every available one with
    --ncu-only) via harness.ncu; returns its DataFrame."""
    try:
        from harness.ncu import profile_providers
        from reports.counters import write_counter_report
    except Exception as exc:
        raise SystemExit(f"--ncu needs harness/ncu.py and reports/counters.py: {type(exc).__name__}: {exc}") from exc
    from baselines.providers import get_provider, unavailable_reason
    from harness.results import row_key

    measured = {row_key(row) for _, row in df[df["status"] == "ok"].iterrows()}
    ncu_jobs = []
    for job in jobs:
        if job.setting == ABLATION_SWEEP:  # one representative launch per rung and setting
            continue
        for name in providers:
            provider = get_provider(name)
            if only:
                wanted = unavailable_reason(provider) is None and provider.supports(job.spec) is None
            else:
                wanted = row_key({"provider": name, "setting": job.setting, **vars(job.spec), "repeat": 0}) in measured
            if wanted:
                # the backward kernel for 'bwd'; the forward kernel (launched first) for 'fwd_bwd'
                regex = provider.bwd_kernel_regex if job.spec.mode == "bwd" else provider.kernel_regex
                if not regex:
                    print(f"ncu: {name} {job.spec.mode}: no kernel name known to select, not profiled",
                          file=sys.stderr)
                    continue
                ncu_jobs.append((name, job.spec, regex, job.setting))
    counters = profile_providers(ncu_jobs, out_dir)
    write_counter_report(counters, providers, out_dir)
    return counters


def write_reports(args, df, out_dir: Path, counters=None) -> None:
    """ablation.md (with --ablation) or report.md and the figures, from result rows."""
    if args.ablation:
        try:
            from ablations.study import write_ablation_report
        except Exception as exc:  # noqa: BLE001 -- the rows are saved; say why there is no report
            print(f"no ablation report: ablations/study.py does not import ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
        else:
            print(f"ablation report: {write_ablation_report(df[df['setting'] != ''], out_dir, counters)}")
    else:
        from harness.results import load_runs
        from reports.paper_report import write_report
        from reports.plots import plot_suite

        figures = plot_suite(df, out_dir / "plots")
        print(f"report: {write_report(df, out_dir, load_runs(out_dir), figures)}")


def rebuild_reports(args, out_dir: Path) -> int:
    """--report-only: the reports of an existing results folder."""
    import pandas as pd

    from harness.results import RESULTS_CSV, load_results

    if not (out_dir / RESULTS_CSV).exists():
        raise SystemExit(f"--report-only: {out_dir / RESULTS_CSV} does not exist")
    counters_csv = out_dir / "counters.csv"
    counters = pd.read_csv(counters_csv) if counters_csv.exists() else None
    if counters is not None:
        from reports.counters import write_counter_report

        print(f"counters: {write_counter_report(counters, list(dict.fromkeys(counters['provider'])), out_dir)}")
    write_reports(args, load_results(out_dir), out_dir, counters)
    return 0


def regression_check(args, df, environment: dict, out_dir: Path, remeasure) -> int:
    """--save-baseline and --compare (reports.regression); returns the exit code."""
    try:
        from harness import regression
        from reports.comparison import format_comparison, write_comparison
    except Exception as exc:
        raise SystemExit(f"--save-baseline/--compare need harness/regression.py: {type(exc).__name__}: {exc}") from exc
    status = 0
    if args.compare is not None:
        path = Path(args.compare) if args.compare else regression.baseline_path(environment["gpu"])
        try:
            baseline = regression.load_baseline(path)
            comparison = regression.compare_to_baseline(df, baseline, environment, args.tolerance)
            suspects = regression.suspected_regressions(comparison)
            if not suspects.empty:
                print(f"{len(suspects)} suspected regression(s): measuring them once more", file=sys.stderr)
                df = regression.merge_remeasured(df, remeasure(suspects))
                comparison = regression.compare_to_baseline(df, baseline, environment, args.tolerance)
        except (regression.BaselineError, regression.BaselineMismatch) as exc:
            print(f"--compare: {exc}", file=sys.stderr)
            status = 2  # --save-baseline below still runs: the measurements are fine
        else:
            print(format_comparison(comparison))
            print(f"comparison: {write_comparison(comparison, out_dir)}")
            status = 1 if comparison.regressed else 0
    if args.save_baseline is not None:
        path = Path(args.save_baseline) if args.save_baseline else regression.baseline_path(environment["gpu"])
        try:
            print(f"baseline saved: {regression.save_baseline(df, path, environment)}")
        except ValueError as exc:
            print(f"--save-baseline: {exc}", file=sys.stderr)
            return 2
    return status
