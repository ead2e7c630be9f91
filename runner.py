"""Benchmark harness: the FlashAttention-2 paper's figures and ablation on this machine.

    python runner.py --suite paper           # Figures 4-7: fwd, bwd, fwd+bwd; all providers
    python runner.py --ablation all          # the FA1 -> FA2 ladder, settings A and B
    python runner.py --list                  # providers, and why any is unavailable here
    python runner.py --reproduce paper       # regenerate a committed result (see below)

Every measurement is a row of OUT/results.csv, appended as it is made (so an interrupted
sweep keeps its rows and `--resume` goes on from there); results.json, the plots and
report.md are then made from the rows of the folder. Every job is checked against the
float64 reference before it is timed. Without a GPU the Triton kernels run in Triton's CPU
interpreter on tiny sizes, timed with time.perf_counter: the pipeline works, the numbers are
not performance.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from pathlib import Path

import torch

from harness.deadline import DEFAULT_CALL_TIMEOUT_S, MAX_GRACE_S
from harness.plan import (
    GPU_SIZES,
    INTERPRETER_SIZES,
    MODES,
    PAPER_HIDDEN,
    PAPER_TOKENS,
    QUICK_MODES,
    QUICK_REP_MS,
    QUICK_WARMUP_MS,
    REVIEWER_PARTS,
    STUDY_NAMES,
    _join,
    suite_jobs,
    suite_modes,
    suite_providers,
)
from harness.regression import DEFAULT_FALSE_POSITIVE_RATE
from harness.reproduce import TARGETS, help_text, steps
from harness.stages import EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_NOT_COMPARED
from harness.suite import SUITES
from harness.timing import DEFAULT_REP_MS, DEFAULT_WARMUP_MS
from harness.train import add_arguments as add_train_arguments

REPO_ROOT = Path(__file__).resolve().parent
BANNER = ("=" * 88 + "\nNO GPU: Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny sizes.\n"
          "These numbers are NOT performance; they show that the pipeline works.\n" + "=" * 88)
EXAMPLES = """examples:
  python runner.py --list
  python runner.py --quick
  python runner.py --suite paper --out results/h200
  python runner.py --suite paper --providers fa2,sdpa-flash --modes fwd --hdims 128 --causal true
  python runner.py --suite paper --providers pytorch --out results/h200 --resume   # add to a folder
  python runner.py --ablation all --dtype fp16
  python runner.py --suite features --quick --out results/features   # also: coverage, decode, host-overhead
  python runner.py --ablation warp-partitioning --ncu
  python runner.py --quick --save-baseline                 # reports/<gpu>/regression/baseline.json
  python runner.py --quick --providers fa2,sdpa-flash --dtype bf16 --repeats 3 --compare
  python runner.py --quick --provider-file my_kernels.py   # your kernel next to ours (see below)
  python -m harness.calibrate RUN1 RUN2 RUN3 --out calibration.csv   # the --compare rule's noise

exit codes: 0 done; 1 a regression or a failed configuration (--compare); 2 bad arguments, an
unusable baseline or results.csv, or nothing compared; 3 aborted: the GPU context broke, a call
hung in C code, or a file could not be written (disk full, read-only) (rows kept, --resume);
130 interrupted (rows kept, --resume).

--provider-file FILE: a Python file defining PROVIDERS = {name: forward}, forward(q, k, v,
causal, softmax_scale) -> out in flash-attn's layout (batch, seqlen, heads, headdim),
backward through autograd; a value may also be a baselines.providers.Provider. They are
measured after the registry's providers (or where --providers names them), with the same
accuracy gate, rows and plots. Pass the same file again with --resume.

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
        epilog=EXAMPLES + help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_argument_group("what to run (default: --suite paper)")
    sweep = what.add_mutually_exclusive_group()
    sweep.add_argument("--suite", choices=("paper", *SUITES),
                       help="paper: the paper's Figures 4-7 (modes x head dims x causal x seqlen 512..16384 with "
                            "batch = 16384/seqlen and heads = 2048/hdim; the default); "
                            + "; ".join(f"{name}: {suite.what}" for name, suite in SUITES.items()))
    sweep.add_argument("--reproduce", choices=tuple(TARGETS), metavar="TARGET",
                       help=f"regenerate one committed result from scratch: {', '.join(TARGETS)} (the exact "
                            "commands are listed at the end of --help); --out defaults to results/reproduce/TARGET")
    sweep.add_argument("--ablation", choices=(*STUDY_NAMES, *REVIEWER_PARTS),
                       help="the ablation ladder of ablations/ladder.py: the rungs of this study on its settings "
                            "A (batch 8) and B (batch 1); fwd, causal, head dim 128, seqlen 2048, 16 heads. "
                            "'all' then runs the reviewers' studies into the same folder (reviewers.md); "
                            f"each also runs alone: {', '.join(REVIEWER_PARTS)} (ablations/reviewers.py)")
    what.add_argument("--settings-only", action="store_true",
                      help="with --ablation: only the paper's settings A and B, not the forward sweep over "
                           "--seqlens x --hdims x --causal")
    what.add_argument("--ladder-only", action="store_true",
                      help="with --ablation all: the ladder (settings A and B and the sweep) without the reviewers' "
                           "studies, e.g. to re-measure the rungs next to a newly installed peer; the folder's "
                           "reviewers.csv is kept")
    what.add_argument("--report-only", action="store_true",
                      help="measure nothing: rebuild the report and plots (ablation.md with --ablation) of --out "
                           "from its results.csv and counters.csv, e.g. after merging runs into one folder")
    what.add_argument("--list", action="store_true", help="list the providers (with --provider-file's), whether "
                      "each is available here and why not, then exit")
    what.add_argument("--provider-file", type=Path, action="append", metavar="FILE",
                      help="bring your own kernel: a Python file defining PROVIDERS = {name: forward} (see below); "
                           "its providers are measured with the others. May be given more than once")
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
                        help="independent measurements per configuration, each a do_bench median; "
                             "--suite features and coverage: rounds over the whole suite, the bar's ratios taken within "
                             "each round (default: %(default)s)")
    timing.add_argument("--kernel-times", action="store_true",
                        help="--suite coverage: after each call's timing in the first round, its GPU kernels' "
                             "times by torch.profiler (ours' and FA4's main kernel against the rest of the call, "
                             "in coverage.md)")
    timing.add_argument("--warmup-ms", type=_number("--warmup-ms", lambda x: x > 0, "a number > 0"),
                        help=f"do_bench warm-up time per measurement in ms (default: {DEFAULT_WARMUP_MS}; "
                             f"--quick: {QUICK_WARMUP_MS})")
    timing.add_argument("--rep-ms", type=_number("--rep-ms", lambda x: x > 0, "a number > 0"),
                        help=f"do_bench timing time per measurement in ms (default: {DEFAULT_REP_MS}; "
                             f"--quick: {QUICK_REP_MS})")
    timing.add_argument("--eager", action="store_true",
                        help="--suite decode: time each call by do_bench with its host time included, as "
                             "model.generate calls it by default, instead of by CUDA-graph replay (a folder of its "
                             "own; reports.decode puts the two side by side)")
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
                        help="add to an existing OUT folder, skipping what it already measured with status ok "
                             "and every (provider, configuration) that timed out")
    timing.add_argument("--retry-timeouts", action="store_true",
                        help="with --resume: measure the (provider, configuration)s that timed out again")
    timing.add_argument("--call-timeout", type=_number("--call-timeout", lambda x: x >= 0, "seconds >= 0"),
                        default=DEFAULT_CALL_TIMEOUT_S, metavar="SECONDS",
                        help="deadline of each call into a provider (its availability, supports and config, the "
                             "accuracy check, each timing); a call past it is a row with status timeout and the "
                             "sweep goes on. 0: no deadline. A call stuck in Python is interrupted (SIGALRM; POSIX "
                             "only); one stuck in C code (a GPU kernel that never ends) cannot be: after a further "
                             f"min(SECONDS, {MAX_GRACE_S:g}) s its timeout row is written and the run exits with "
                             "code 3, --resume goes on after it (default: %(default)g)")
    timing.add_argument("-v", "--verbose", action="store_true", help="print every row as it is measured")
    checks = parser.add_argument_group("regression check and hardware counters")
    checks.add_argument("--save-baseline", nargs="?", const="", metavar="PATH",
                        help="save the results as a performance baseline (default PATH: "
                             "reports/<gpu>/regression/baseline.json)")
    checks.add_argument("--compare", nargs="?", const="", metavar="PATH",
                        help="compare each configuration's ratio to sdpa-flash (measured in the same run) with a "
                             "baseline's (default PATH: reports/<gpu>/regression/baseline.json; the rule is in "
                             "harness/regression.py); exit code 1 on a regression, 2 when nothing was compared")
    checks.add_argument("--tolerance", default=0.05,
                        type=_number("--tolerance", lambda x: 0 <= x < 1, "a fraction in [0, 1), e.g. 0.05 for 5%"),
                        help="the smallest slowdown --compare reports, as a fraction of the ratio to sdpa-flash "
                             "(default: %(default)s)")
    checks.add_argument("--false-positive-rate", default=DEFAULT_FALSE_POSITIVE_RATE,
                        type=_number("--false-positive-rate", lambda x: 0 < x < 0.5, "a fraction in (0, 0.5)"),
                        help="per-configuration chance that --compare flags an unchanged kernel, given the noise "
                             "in calibration.csv next to the baseline (default: %(default)s)")
    ncu = checks.add_mutually_exclusive_group()
    ncu.add_argument("--ncu", dest="ncu", action="store_const", const="also",
                     help="after timing, profile each measured provider's kernel with Nsight Compute "
                          "(default with --ablation when `ncu` works here; --suite profiles only on request)")
    ncu.add_argument("--no-ncu", dest="ncu", action="store_const", const="off", help="no profiling")
    ncu.add_argument("--ncu-only", dest="ncu", action="store_const", const="only",
                     help="profile with Nsight Compute, without timing")
    parser.set_defaults(ncu=None)
    add_train_arguments(parser)
    return parser


# --------------------------------------------------------------------------------------
# Reports: made from the rows (and counters, comparison) the harness's stages leave
# --------------------------------------------------------------------------------------
def write_reports(args, df, out_dir: Path, counters=None, comparison=None, provider_names=None) -> None:
    """counters.md (with counters), comparison.md (with --compare), then ablation.md (with
    --ablation) or report.md and the figures, from the folder's rows."""
    if counters is not None:
        from reports.counters import write_counter_report

        names = provider_names or list(dict.fromkeys(counters["provider"]))
        print(f"counters: {write_counter_report(counters, names, out_dir)}")
    if comparison is not None:
        from reports.comparison import format_comparison, write_comparison

        print(format_comparison(comparison))
        print(f"comparison: {write_comparison(comparison, out_dir)}")
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
    write_reports(args, load_results(out_dir), out_dir, counters)
    return 0


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def _reproduce(args) -> int:
    """--reproduce TARGET: its runner steps in order, into one folder."""
    out = str(args.out or REPO_ROOT / "results" / "reproduce" / args.reproduce)
    extra = ["-v"] if args.verbose else []
    for index, step in enumerate(steps(args.reproduce, out, extra)):
        print(f"--reproduce {args.reproduce} [{index + 1}]: runner.py {' '.join(step)}", file=sys.stderr)
        code = main(step)
        if code not in (0, 1):
            return code
    return 0


def _other_suite(args, out_dir: Path) -> int:
    """--suite features|coverage|decode|host-overhead|train (harness.suite): its rows into out_dir (not with --report-only),
    then its report from them (reports.suites), printed."""
    from harness.io import FolderBusy, FolderLock
    from harness.suite import measure
    from reports.suites import write_suite_report

    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with FolderLock(out_dir):
            if not args.report_only:
                measure(args.suite, args, out_dir)
            print(write_suite_report(args.suite, out_dir).read_text())
    except (FolderBusy, ValueError) as exc:  # ValueError: a suite's option it cannot take, named
        print(f"runner.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_out(parser, out_dir: Path) -> None:
    """--out must be a folder this process can write (or create)."""
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {out_dir} is a file: expected a folder for results.csv, report.md and plots/")
    parent = next((p for p in [out_dir, *out_dir.parents] if p.exists()), None)
    if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        parser.error(f"--out {out_dir}: {parent} is not a folder this user can write to")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reproduce:
        defaults = vars(parser.parse_args([]))
        extra = [f"--{key.replace('_', '-')}" for key, value in vars(args).items()
                 if key not in ("reproduce", "out", "verbose") and value != defaults[key]]
        if extra:
            parser.error(f"--reproduce runs fixed commands: only --out and -v go with it, not {', '.join(extra)}")
        return _reproduce(args)
    interpreter = not torch.cuda.is_available()
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports `kernels` (decoration time)
        if not args.report_only and not args.list:
            print(BANNER, file=sys.stderr)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set but a GPU is present: unset it to measure on the GPU")
    if args.ladder_only and args.ablation != "all":
        parser.error("--ladder-only goes with --ablation all (the other studies run no reviewers' studies)")
    if args.cuda_graph and not args.ablation and {"bwd", "fwd_bwd"} & set(suite_modes(args)):
        parser.error("--cuda-graph times forward passes only (the backward timing failed to capture in a "
                     "CUDA graph on the H200): add --modes fwd")
    if interpreter and (args.save_baseline is not None or args.compare is not None):
        parser.error("--save-baseline/--compare need a GPU: numbers from Triton's interpreter are not performance")
    out_dir = args.out or REPO_ROOT / "results" / datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y%m%d-%H%M%S")
    _check_out(parser, out_dir)

    from baselines.providers import PROVIDERS
    from harness.io import FolderBusy, FolderLock
    from harness.provider_file import ProviderFileError, file_digest, load_provider_file
    from harness.results import RESULTS_CSV, RowFileError
    from harness.stages import execute, print_provider_list

    extra, owners = {}, dict.fromkeys(PROVIDERS, "the registry")
    for path in args.provider_file or []:
        try:
            for provider in load_provider_file(path, owners):
                extra[provider.name] = provider
                owners[provider.name] = f"--provider-file {path}"
        except ProviderFileError as exc:
            parser.error(str(exc))
        except KeyboardInterrupt:
            print(f"INTERRUPTED while importing --provider-file {path}: nothing was measured", file=sys.stderr)
            return EXIT_INTERRUPTED
    if args.list:
        print_provider_list(extra.values())
        return 0
    if args.kernel_times and args.suite != "coverage":
        parser.error("--kernel-times goes with --suite coverage (it profiles that suite's calls)")
    if args.suite in SUITES:
        return _other_suite(args, out_dir)
    if args.ablation in REVIEWER_PARTS:  # one reviewers' study alone (ablations/reviewers.py)
        from ablations import reviewers

        if args.report_only:
            print(reviewers.write_report(out_dir))
            return 0
        return reviewers.run(args.ablation, args, out_dir)
    if args.ablation:
        from ablations.plan import ablation_plan

        jobs, provider_names = ablation_plan(args, interpreter)
    else:
        jobs, provider_names = suite_jobs(args, interpreter), suite_providers(args)
        if not args.providers:
            provider_names += list(extra)
    if args.ncu is None:  # the ablation profiles its rungs whenever Nsight Compute can
        from harness.ncu import ncu_status

        reason = "no GPU" if interpreter else ncu_status()
        args.ncu = "also" if args.ablation and reason is None else "off"
        if args.ablation and reason is not None:
            print(f"no Nsight Compute counters: {reason}", file=sys.stderr)
    if args.fa2_fwd_config is not None:
        from baselines.providers import override_fa2_fwd_config
        from kernels import FwdConfig

        override_fa2_fwd_config(FwdConfig(*args.fa2_fwd_config))
    known = {**PROVIDERS, **extra}
    unknown = [name for name in provider_names if name not in known]
    if unknown:
        parser.error(f"--providers: unknown provider {unknown[0]!r}; known providers: {', '.join(known)}")
    providers = [known[name] for name in provider_names]
    if args.retry_timeouts and not args.resume:
        parser.error("--retry-timeouts goes with --resume (it measures again what timed out in the folder)")
    if args.report_only:
        if args.ablation == "all" and (out_dir / "reviewers.csv").exists():
            from ablations import reviewers

            reviewers.write_report(out_dir)
        try:
            return rebuild_reports(args, out_dir)
        except RowFileError as exc:
            print(f"runner.py: error: {exc}", file=sys.stderr)
            return EXIT_NOT_COMPARED
    if (out_dir / RESULTS_CSV).exists() and not args.resume:
        parser.error(f"--out {out_dir} already holds {RESULTS_CSV}: pass --resume to add to it, "
                     "or choose another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {str(path): file_digest(path) for path in args.provider_file or []}
    try:
        with FolderLock(out_dir):
            outcome = execute(args, jobs, providers, out_dir, interpreter, {"provider_files": files})
            write_reports(args, outcome.rows, out_dir, outcome.counters, outcome.comparison,
                          [provider.name for provider in providers])
    except (FolderBusy, RowFileError) as exc:
        print(f"runner.py: error: {exc}", file=sys.stderr)
        return EXIT_NOT_COMPARED
    except OSError as exc:  # provider code's errors are rows: this is the harness's own writing
        print(f"runner.py: error: {exc}. The rows written so far are in {out_dir / RESULTS_CSV}: free space or make "
              "the folder writable, then run the same command with --resume to go on", file=sys.stderr)
        return EXIT_ABORTED
    from reports.tables import summary_table

    print(summary_table(outcome.rows))
    print(f"results: {out_dir}")
    exit_code = outcome.exit_code
    if args.ablation == "all" and not (args.settings_only or args.ladder_only):  # then the reviewers' studies
        from ablations import reviewers

        exit_code = max(exit_code, reviewers.run("all", args, out_dir))
    if interpreter:
        print(BANNER, file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
