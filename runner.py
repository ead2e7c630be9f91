"""Benchmark harness: the FlashAttention-2 paper's figures and ablation on this machine.

    python runner.py --suite paper           # Figures 4-7: fwd, bwd, fwd+bwd; all providers
    python runner.py --ablation all          # the FA1 -> FA2 ladder, settings A and B
    python runner.py --list                  # providers, and why any is unavailable here

Every measurement is a row of OUT/results.csv, appended as it is made (so an interrupted
sweep keeps its rows and `--resume` goes on from there); results.json, the plots and
report.md are then made from the rows of the folder. Without a GPU the Triton kernels run
in Triton's CPU interpreter on tiny sizes: the pipeline works, the numbers are not performance.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from reports.timing import DEFAULT_REP_MS, DEFAULT_WARMUP_MS

REPO_ROOT = Path(__file__).resolve().parent
MODES = ("fwd", "bwd", "fwd_bwd")
STUDY_NAMES = ("all", "fewer-nonmatmul", "seq-parallel", "warp-partitioning", "hopper")
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
# Triton's interpreter: tiny sizes so that a whole sweep takes minutes on a CPU. The ablation
# settings shrink to seqlen 128, head dim 64, 2 heads, batch at most 2 (A: 2, B: 1).
INTERPRETER_SIZES = Sizes(hdims=(32, 64), seqlens=(32, 64, 128), quick_hdims=(32,), quick_seqlens=(64,), batch=1,
                          heads=2)
INTERPRETER_ABLATION = {"seqlen": 128, "hdim": 64, "heads": 2}
INTERPRETER_ABLATION_MAX_BATCH = 2
ABLATION_SWEEP = "sweep"  # the `setting` of the ablation's seqlen x head dim x causal rows
ABLATION_PEERS = ("sdpa-flash", "sdpa-cudnn")  # measured next to the rungs in the same run
BANNER = ("=" * 88 + "\nNO GPU: Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny sizes.\n"
          "These numbers are NOT performance; they show that the pipeline works.\n" + "=" * 88)
EXAMPLES = """examples:
  python runner.py --list
  python runner.py --quick
  python runner.py --suite paper --out results/h200
  python runner.py --suite paper --providers fa2,sdpa-flash --modes fwd --hdims 128 --causal true
  python runner.py --suite paper --providers pytorch --out results/h200 --resume   # add to a folder
  python runner.py --ablation all --dtype fp16
  python runner.py --ablation warp-partitioning --ncu
  python runner.py --quick --save-baseline                 # reports/baselines/<gpu>.json
  python runner.py --quick --compare --tolerance 0.05      # exit code 1 on a regression
"""


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def _csv_of(kind, name: str, allowed=None):
    """argparse type: a comma-separated list of `kind` (int: positive ints), checked against `allowed`."""

    def parse(text: str):
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{name} needs at least one value, got {text!r}")
        if kind is int:
            if not all(item.isdigit() and int(item) > 0 for item in items):
                raise argparse.ArgumentTypeError(f"{name} must be positive integers separated by commas, "
                                                 f"got {text!r}")
            return tuple(int(item) for item in items)
        unknown = [item for item in items if allowed is not None and item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"{name}: unknown {unknown}; choose from {', '.join(allowed)}")
        return tuple(items)

    return parse


def _positive_int(name: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return int(text)

    return parse


def _number(name: str, accept, expectation: str):
    """argparse type: a float for which accept(value) holds, else an error naming the option."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{name} must be {expectation}, got {text!r}")
        return value

    return parse


def _fwd_config(text: str):
    """argparse type of --fa2-fwd-config: four positive integers BM,BN,WARPS,STAGES (a tuple:
    `kernels` must not be imported before main() has decided on Triton's interpreter)."""
    try:
        values = [int(x) for x in text.split(",")]
        if len(values) != 4 or min(values) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected four positive integers BM,BN,WARPS,STAGES, got {text!r}") from None
    return tuple(values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runner.py", description=__doc__.split("\n\n")[0].strip() + " Results go to OUT/results.csv, "
        "results.json, plots/ and report.md (ablation: ablation.md).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to run (default: --suite paper)")
    sweep = what.add_mutually_exclusive_group()
    sweep.add_argument("--suite", choices=("paper",), help="the paper's Figures 4-7: modes x head dims x causal x "
                       "seqlen 512..16384 with batch = 16384/seqlen and heads = 2048/hdim (default: paper)")
    sweep.add_argument("--ablation", choices=STUDY_NAMES,
                       help="the ablation ladder of ablations/ladder.py: the rungs of this study on its settings "
                            "A (batch 8) and B (batch 1); fwd, causal, head dim 128, seqlen 2048, 16 heads")
    what.add_argument("--settings-only", action="store_true",
                      help="with --ablation: only the paper's settings A and B, not the forward sweep over "
                           "--seqlens x --hdims x --causal")
    what.add_argument("--report-only", action="store_true",
                      help="measure nothing: rebuild the report and plots (ablation.md with --ablation) of --out "
                           "from its results.csv and counters.csv, e.g. after merging runs into one folder")
    what.add_argument("--list", action="store_true", help="list the providers, whether each is available here "
                      "and why not, then exit")
    narrow = parser.add_argument_group("narrowing a sweep (defaults: the paper's; without a GPU: tiny sizes)")
    narrow.add_argument("--providers", type=_csv_of(str, "--providers"),
                        help="comma-separated provider names (see --list). Default: every provider but the "
                             "ablation rungs for --suite; the study's rungs plus sdpa-flash and sdpa-cudnn for --ablation "
                             "(whose rungs are always included)")
    narrow.add_argument("--modes", type=_csv_of(str, "--modes", MODES),
                        help=f"comma-separated from {','.join(MODES)} (default: all three; --quick: "
                             f"{_join(QUICK_MODES)})")
    narrow.add_argument("--hdims", type=_csv_of(int, "--hdims"),
                        help=f"head dims (default: {_join(GPU_SIZES.hdims)}; --quick: {_join(GPU_SIZES.quick_hdims)}; "
                             f"no GPU: {_join(INTERPRETER_SIZES.hdims)}, --quick {_join(INTERPRETER_SIZES.quick_hdims)})")
    narrow.add_argument("--seqlens", type=_csv_of(int, "--seqlens"),
                        help=f"sequence lengths (default: {_join(GPU_SIZES.seqlens)}; --quick: "
                             f"{_join(GPU_SIZES.quick_seqlens)}; no GPU: {_join(INTERPRETER_SIZES.seqlens)}, --quick "
                             f"{_join(INTERPRETER_SIZES.quick_seqlens)})")
    narrow.add_argument("--causal", choices=("true", "false", "both"), default="both",
                        help="causal masking (default: %(default)s)")
    narrow.add_argument("--batch", type=_positive_int("--batch"),
                        help=f"batch size for every configuration of a sweep, not the ablation's settings A/B (default: {PAPER_TOKENS} // seqlen; no GPU: "
                             f"{INTERPRETER_SIZES.batch})")
    narrow.add_argument("--heads", type=_positive_int("--heads"),
                        help=f"number of heads for every configuration of a sweep, not settings A/B (default: {PAPER_HIDDEN} // hdim; no GPU: "
                             f"{INTERPRETER_SIZES.heads})")
    narrow.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16",
                        help="input dtype (default: %(default)s, as in the paper)")
    narrow.add_argument("--quick", action="store_true",
                        help="a small sweep for a smoke test: fwd and fwd_bwd, one head dim, two seqlens "
                             "(one without a GPU), shorter timing")
    timing = parser.add_argument_group("timing and output")
    timing.add_argument("--repeats", type=_positive_int("--repeats"), default=1,
                        help="independent measurements per configuration, each a do_bench median "
                             "(default: %(default)s)")
    timing.add_argument("--warmup-ms", type=_number("--warmup-ms", lambda x: x > 0, "a number > 0"),
                        help=f"do_bench warm-up time per measurement in ms (default: {DEFAULT_WARMUP_MS}; "
                             f"--quick: {QUICK_WARMUP_MS})")
    timing.add_argument("--rep-ms", type=_number("--rep-ms", lambda x: x > 0, "a number > 0"),
                        help=f"do_bench timing time per measurement in ms (default: {DEFAULT_REP_MS}; "
                             f"--quick: {QUICK_REP_MS})")
    timing.add_argument("--cuda-graph", action="store_true",
                        help="time by replaying a CUDA graph of back-to-back calls (triton's "
                             "do_bench_cudagraph): no host launch overhead and no L2 flush between calls. "
                             "Use it for kernels of ~0.1 ms (the ablation's setting B), whose do_bench time "
                             "includes Python launch time; forward modes only (--modes fwd; the ablation is "
                             "forward only); recorded in results.json's arguments")
    timing.add_argument("--fa2-fwd-config", type=_fwd_config, metavar="BM,BN,WARPS,STAGES",
                        help="run the fa2 provider's forward with this block config instead of the tuned "
                             "table (e.g. 16,16,4,1 to show that --compare flags a slowed kernel); "
                             "recorded in each row's config")
    timing.add_argument("--out", type=Path, help="output folder (default: results/<UTC timestamp>/)")
    timing.add_argument("--resume", action="store_true",
                        help="add to an existing OUT folder, skipping what it already measured with status ok")
    timing.add_argument("-v", "--verbose", action="store_true", help="print every row as it is measured")
    checks = parser.add_argument_group("regression check and hardware counters")
    checks.add_argument("--save-baseline", nargs="?", const="", metavar="PATH",
                        help="save the results as a performance baseline (default PATH: "
                             "reports/baselines/<gpu>.json)")
    checks.add_argument("--compare", nargs="?", const="", metavar="PATH",
                        help="compare the results with a baseline (default PATH: reports/baselines/<gpu>.json); "
                             "a suspected regression is re-measured once; exit code 1 on a regression")
    checks.add_argument("--tolerance", type=_number("--tolerance", lambda x: 0 <= x < 1, "a fraction in [0, 1), e.g. 0.05 for 5%"), default=0.05,
                        help="regression tolerance beyond the measured spread, as a fraction (default: %(default)s)")
    ncu = checks.add_mutually_exclusive_group()
    ncu.add_argument("--ncu", dest="ncu", action="store_const", const="also",
                     help="after timing, profile each measured provider's kernel with Nsight Compute "
                          "(default with --ablation when `ncu` works here; --suite profiles only on request)")
    ncu.add_argument("--no-ncu", dest="ncu", action="store_const", const="off", help="no profiling")
    ncu.add_argument("--ncu-only", dest="ncu", action="store_const", const="only",
                     help="profile with Nsight Compute, without timing")
    parser.set_defaults(ncu=None)
    return parser


# --------------------------------------------------------------------------------------
# Planning: which configurations and providers
# --------------------------------------------------------------------------------------
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
    from reports.sweep import Job

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


def ablation_plan(args, interpreter: bool) -> tuple[list, list[str]]:
    """(jobs, provider names) of `--ablation STUDY` from ablations.ladder's SETTINGS, STUDIES, RUNGS."""
    from baselines.providers import Spec
    from reports.sweep import Job

    try:
        from ablations.ladder import RUNGS, SETTINGS, STUDIES
    except Exception as exc:
        raise SystemExit(f"--ablation needs ablations/ladder.py (SETTINGS, STUDIES, RUNGS): "
                         f"{type(exc).__name__}: {exc}") from exc
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


def suite_providers(args) -> list[str]:
    from baselines.providers import PROVIDERS, RUNG_NAMES

    return list(args.providers) if args.providers else [name for name in PROVIDERS if name not in RUNG_NAMES]


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------
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
    --ncu-only) via reports.counters; returns its DataFrame."""
    try:
        from reports.counters import profile_providers, write_counter_report
    except Exception as exc:
        raise SystemExit(f"--ncu needs reports/counters.py (profile_providers): {type(exc).__name__}: {exc}") from exc
    from baselines.providers import get_provider, unavailable_reason
    from reports.results import row_key

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
        from reports.paper_report import write_report
        from reports.plots import plot_suite
        from reports.results import load_runs

        figures = plot_suite(df, out_dir / "plots")
        print(f"report: {write_report(df, out_dir, load_runs(out_dir), figures)}")


def rebuild_reports(args, out_dir: Path) -> int:
    """--report-only: the reports of an existing results folder."""
    import pandas as pd

    from reports.results import RESULTS_CSV, load_results

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
        from reports import regression
    except Exception as exc:
        raise SystemExit(f"--save-baseline/--compare need reports/regression.py: {type(exc).__name__}: {exc}") from exc
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
            print(regression.format_comparison(comparison))
            print(f"comparison: {regression.write_comparison(comparison, out_dir)}")
            status = 1 if comparison.regressed else 0
    if args.save_baseline is not None:
        path = Path(args.save_baseline) if args.save_baseline else regression.baseline_path(environment["gpu"])
        try:
            print(f"baseline saved: {regression.save_baseline(df, path, environment)}")
        except ValueError as exc:
            print(f"--save-baseline: {exc}", file=sys.stderr)
            return 2
    return status


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    interpreter = not torch.cuda.is_available()
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports `kernels` (decoration time)
        if not args.report_only:
            print(BANNER, file=sys.stderr)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set but a GPU is present: unset it to measure on the GPU")
    if args.cuda_graph and not args.ablation and {"bwd", "fwd_bwd"} & set(suite_modes(args)):
        parser.error("--cuda-graph times forward passes only (the backward timing failed to capture in a "
                     "CUDA graph on the H200): add --modes fwd")
    if interpreter and (args.save_baseline is not None or args.compare is not None):
        parser.error("--save-baseline/--compare need a GPU: numbers from Triton's interpreter are not performance")

    from baselines.providers import get_provider
    from reports.environment import capture_environment, throttle_warnings
    from reports.results import RESULTS_CSV, ResultWriter, completed_keys, load_results, record_run
    from reports.sweep import Job, Sweep, SweepAborted

    if args.list:
        print_provider_list()
        return 0
    if args.ablation:
        jobs, provider_names = ablation_plan(args, interpreter)
    else:
        jobs, provider_names = suite_jobs(args, interpreter), suite_providers(args)
    if args.ncu is None:  # the ablation profiles its rungs whenever Nsight Compute can
        from reports.counters import ncu_status

        reason = "no GPU" if interpreter else ncu_status()
        args.ncu = "also" if args.ablation and reason is None else "off"
        if args.ablation and reason is not None:
            print(f"no Nsight Compute counters: {reason}", file=sys.stderr)
    if args.fa2_fwd_config is not None:
        from baselines.providers import override_fa2_fwd_config
        from kernels.flash_attn import FwdConfig

        override_fa2_fwd_config(FwdConfig(*args.fa2_fwd_config))
    try:
        providers = [get_provider(name) for name in provider_names]
    except ValueError as exc:
        parser.error(f"--providers: {exc}")
    out_dir = args.out or REPO_ROOT / "results" / datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y%m%d-%H%M%S")
    if args.report_only:
        return rebuild_reports(args, out_dir)
    if (out_dir / RESULTS_CSV).exists() and not args.resume:
        parser.error(f"--out {out_dir} already holds {RESULTS_CSV}: pass --resume to add to it, "
                     "or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)

    environment = capture_environment()
    run = {"run_id": f"{environment['timestamp']} {uuid.uuid4().hex[:8]}", "command": shlex.join([sys.executable, *sys.argv]),
           "arguments": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()},
           "environment_before": environment, "finished": None}
    record_run(out_dir, run)
    print(f"{len(jobs)} configurations x {len(providers)} providers -> {out_dir / RESULTS_CSV}", file=sys.stderr)
    device = torch.device("cpu" if interpreter else "cuda")
    warmup_ms = args.warmup_ms or (QUICK_WARMUP_MS if args.quick else DEFAULT_WARMUP_MS)
    rep_ms = args.rep_ms or (QUICK_REP_MS if args.quick else DEFAULT_REP_MS)

    def new_sweep(writer, skip=frozenset()):
        from tqdm import tqdm

        return Sweep(writer, environment, device=device, repeats=args.repeats, warmup_ms=warmup_ms, rep_ms=rep_ms,
                     cuda_graph=args.cuda_graph, skip=skip, log=tqdm.write if args.verbose else None)

    exit_code = 0
    if args.ncu != "only":
        skip = frozenset(completed_keys(load_results(out_dir))) if args.resume else frozenset()
        signal.signal(signal.SIGTERM, _interrupt)  # a time limit's SIGTERM: keep the rows, write the reports
        with ResultWriter(out_dir / RESULTS_CSV) as writer:
            try:
                counts = new_sweep(writer, skip).run(jobs, providers)
                print(f"rows written: {dict(counts)}", file=sys.stderr)
            except SweepAborted as exc:
                print(f"SWEEP ABORTED: {exc}", file=sys.stderr)
                exit_code = 3
            except KeyboardInterrupt:
                print(f"INTERRUPTED: the rows measured so far are in {out_dir / RESULTS_CSV}; run the same "
                      "command with --resume to go on", file=sys.stderr)
                exit_code = 130
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    after = capture_environment()
    run.update(environment_after=after, throttle_warnings=throttle_warnings(environment, after),
               finished=after["timestamp"] if exit_code == 0 else None, exit_code=exit_code)
    record_run(out_dir, run)
    for warning in run["throttle_warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)

    df = load_results(out_dir)
    counters = run_counters(jobs, provider_names, df, out_dir, args.ncu == "only") if args.ncu != "off" else None

    if args.compare is not None or args.save_baseline is not None:
        def remeasure(keys):
            """Measure the configurations `keys` (regression KEY_COLUMNS) again; their new rows."""
            import pandas as pd

            from baselines.providers import Spec

            settings = {job.spec: job.setting for job in jobs}
            with ResultWriter(out_dir / RESULTS_CSV) as writer:
                sweep = new_sweep(writer)
                for key in keys.itertuples(index=False):
                    spec = Spec(key.mode, bool(key.causal), int(key.hdim), int(key.seqlen), int(key.batch),
                                int(key.heads), key.dtype)
                    sweep.run([Job(spec, settings.get(spec, ""))], [get_provider(key.provider)], progress=False)
            return pd.DataFrame(sweep.rows)

        exit_code = max(exit_code, regression_check(args, df, environment, out_dir, remeasure))
        record_run(out_dir, run)  # results.json with any re-measured rows

    # reports last, from the final rows (a re-measured key replaces its first measurement)
    write_reports(args, load_results(out_dir), out_dir, counters)
    print(summary_table(load_results(out_dir)))
    print(f"results: {out_dir}")
    if interpreter:
        print(BANNER, file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
