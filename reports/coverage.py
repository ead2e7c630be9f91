"""The coverage suite's report (coverage.md), from its rows alone: per case and mode, each
provider's TFLOPs/s, ours over FA4 and over cuDNN (time ratios taken within a round), the
kernel that served ours, and the bar's checks, each naming its worst case; where the rows carry
them, ours' and FA4's time by kernel and the SM clock each provider's timing ran at."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from harness.coverage import COVERAGE_CSV, COVERAGE_MD, PROVIDERS
from harness.features import load_rows
from harness.timing import KERNEL_TIME_CALLS
from reports.features import cell, ratio_cell, ratio_rounds
from reports.tables import run_environment

# (peer, mode, bar): ours' speed over the peer's in every row the peer runs
SPEED_BARS = (("fa4", "fwd", 0.95), ("fa4", "bwd", 0.9), ("sdpa-cudnn", "fwd", 1.0), ("sdpa-cudnn", "bwd", 1.0))


def case_label(row) -> str:
    """A case as the report names it, from its row's columns."""
    shape = (f"{len(str(row.lengths).split())} seqs up to {row.seqlen_q}" if row.lengths
             else f"{row.batch} x {row.seqlen_q}" + (f" q, {row.seqlen_k} k" if row.seqlen_k != row.seqlen_q else ""))
    heads = f"{row.heads}" if row.heads == row.kv_heads else f"{row.heads}/{row.kv_heads}"
    return f"{row.group}: {shape}, {heads} heads, d {row.hdim}, {'causal' if _true(row.causal) else 'full'}"


def _true(value) -> bool:
    return str(value).lower() == "true"


def _ms_rounds(sub: pd.DataFrame, provider: str) -> pd.Series:
    """A provider's ok times in one case and mode, by round."""
    ok = sub[(sub.provider == provider) & (sub.status == "ok")]
    return ok.groupby("repeat").ms.median().astype(float)


def _speed(sub: pd.DataFrame, peer: str) -> pd.Series:
    """Ours' speed over the peer's (the peer's time over ours) within each round."""
    return ratio_rounds(_ms_rounds(sub, peer), _ms_rounds(sub, "ours"))


def _by_case(df: pd.DataFrame):
    """(label, mode, rows) per case and mode, in the rows' order."""
    for (_, _, mode), sub in df.groupby(["group", "variant", "mode"], sort=False):
        yield case_label(sub.iloc[0]), mode, sub


def _peer_cell(sub: pd.DataFrame, provider: str) -> str:
    """A provider's TFLOPs/s in one case and mode (the median over the rounds), or its status."""
    rows = sub[sub.provider == provider]
    if (rows.status == "ok").any():
        return cell(_median_of(sub, provider, "tflops"), "{:.3g}")
    return rows.status.iloc[0] if len(rows) else ""


def bar_checks(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(check, worst case, verdict): ours at least 0.95x FA4 forward and 0.9x backward in every
    case and mode FA4 measured, at least cuDNN's speed in every one cuDNN measured, on the median
    over the rounds (a case where the peer measured and ours did not fails the check; the verdict
    counts the failed cases of which a round was at or above the bar), and every row of ours on a
    Gluon kernel or with its reason."""
    checks = []
    for peer, mode, bar in SPEED_BARS:
        worst, failed, in_a_round = None, [], 0
        for label, case_mode, sub in _by_case(df):
            if case_mode != mode or not len(_ms_rounds(sub, peer)):
                continue
            speed = _speed(sub, peer)
            if not len(speed):
                failed.append(f"{label} (ours did not measure)")
                continue
            value = float(speed.median())
            if worst is None or value < worst[0]:
                worst = (value, label, speed)
            if value < bar:
                failed.append(label)
                in_a_round += int(float(speed.max()) >= bar)
        name = f"ours >= {bar}x {peer} {mode} in every case {peer} runs"
        if worst is None and not failed:
            checks.append((name, cell(math.nan), "n/a"))
            continue
        value = f"{ratio_cell(worst[2], '{:.2f}x')} at {worst[1]}" if worst else "–"
        verdict = "met" if not failed else f"not met in {len(failed)}: " + "; ".join(failed)
        if in_a_round:  # the median below the bar, one round at or above it: the rounds' spread
            verdict += f" ({in_a_round} of them at or above it in one of the rounds)"
        checks.append((name, value, verdict))
    ours = df[df.provider == "ours"].drop_duplicates(["group", "variant", "mode"])
    unexplained = [f"{case_label(r)} {r['mode']} ({r.kernel})" for _, r in ours.iterrows()
                   if not str(r.kernel).startswith("Gluon") and not r.kernel_reason]
    on_gluon = int(ours.kernel.astype(str).str.startswith("Gluon").sum())
    checks.append(("every row of ours on a Gluon kernel or with its stated reason",
                   f"{on_gluon} of {len(ours)} on Gluon kernels",
                   "met" if not unexplained else f"not met in {len(unexplained)}: " + "; ".join(unexplained)))
    return checks


def _median_of(sub: pd.DataFrame, provider: str, column: str) -> float:
    """A provider's ok rows' median of `column` in one case and mode (NaN without a reading)."""
    ok = sub[(sub.provider == provider) & (sub.status == "ok")]
    values = pd.to_numeric(ok[column], errors="coerce").dropna() if column in ok else pd.Series(dtype=float)
    return float(values.median()) if len(values) else math.nan


def clock_lines(df: pd.DataFrame) -> list[str]:
    """The clocks section: per case and mode the mean SM clock (MHz) during ours' and the peers'
    timing (harness.environment.ClockSampler); none where the rows carry no reading."""
    if "sm_clock_mhz" not in df or pd.to_numeric(df.sm_clock_mhz, errors="coerce").isna().all():
        return []
    lines = ["", "## SM clock while timed", "",
             ("Mean SM clock (MHz, NVML, read every 5 ms) while each provider's calls were timed (the median "
              "over the rounds). Each case runs the providers in the order of the columns in even rounds and reversed in odd ones, "
              "each one's forward then its backward; under the board's power cap the clock follows the power a "
              "kernel draws and what ran just before it."), "",
             "| case | mode | " + " | ".join(PROVIDERS) + " |", "|---|---|" + "---|" * len(PROVIDERS)]
    for label, mode, sub in _by_case(df):
        clocks = [cell(_median_of(sub, p, "sm_clock_mhz"), "{:.0f}") for p in PROVIDERS]
        lines.append(f"| {label} | {mode} | " + " | ".join(clocks) + " |")
    return lines


def _kernel_split(sub: pd.DataFrame, provider: str) -> tuple[str, float, float, float] | None:
    """A provider's (main kernel, its microseconds, the other kernels' microseconds, their sum's
    share of the profiled row's timed call in percent) in one call of a case and mode, from the
    `kernel_us` its profiled row carries (the first round's, profiled after that row's timing), or
    None."""
    rows = sub[(sub.provider == provider) & (sub.status == "ok")]
    profiled = [(json.loads(str(text)), ms) for text, ms in zip(rows.get("kernel_us", pd.Series(dtype=str)), rows.ms)
                if str(text).startswith("{") and str(text) != "{}"]
    if not profiled:
        return None
    times, ms = profiled[0]
    main = max(times, key=times.get)
    busy = 100 * sum(times.values()) / (1000 * ms) if ms and not math.isnan(ms) else math.nan
    return main, times[main], sum(times.values()) - times[main], busy


def kernel_lines(df: pd.DataFrame) -> list[str]:
    """The kernels section: per case and mode where ours was profiled (harness.timing.kernel_times),
    ours' and FA4's main kernel (the one that takes most of a call) and the rest of the call's
    kernels (a backward's preprocess and dQ cast), FA4's cells '–' where it was not profiled; then
    the profiles that failed."""
    lines = []
    for label, mode, sub in _by_case(df):
        ours, fa4 = _kernel_split(sub, "ours"), _kernel_split(sub, "fa4")
        if ours is None:
            continue
        fa4_main, fa4_rest, fa4_busy = fa4[1:] if fa4 else (math.nan,) * 3  # FA4 not profiled: –
        main_ratio = fa4_main / ours[1] if ours[1] else math.nan
        call_ratio = (fa4_main + fa4_rest) / (ours[1] + ours[2]) if ours[1] + ours[2] else math.nan
        lines.append(f"| {label} | {mode} | `{ours[0].split('(')[0]}` | {ours[1]:.0f} | {ours[2]:.0f} | "
                     f"{cell(fa4_main, '{:.0f}')} | {cell(fa4_rest, '{:.0f}')} | {cell(main_ratio, '{:.2f}x')} "
                     f"| {cell(call_ratio, '{:.2f}x')} | {cell(ours[3], '{:.0f}')} | {cell(fa4_busy, '{:.0f}')} |")
    failed = [f"- {case_label(r)} {r.provider} {r['mode']}: {r.kernel_us}" for _, r in df.iterrows()
              if str(r.get("kernel_us", "")).startswith("error:")]
    if not lines and not failed:
        return []
    notes = ["", "Profiles that failed (their rows' timings stand):", "", *failed] if failed else []
    return ["", "## Where the time goes: the main kernel and the rest", "",
            (f"Microseconds of GPU time in one call, by kernel (torch.profiler over {KERNEL_TIME_CALLS} calls "
             "after the first round's timing): the call's main kernel, the one that takes most of it, and the others together "
             "(a backward's preprocess, which computes D and zeroes the dQ accumulator, and its dQ cast). The "
             "last columns are ours' speed over FA4's: the main kernel's, then all of the call's kernels' "
             "(where our backward computes dQ in a kernel of its own, as the Triton path does, only the "
             "second compares like with like). \"GPU busy\" is the kernels' time (profiled back to back, L2 "
             "warm) over the same row's timed call (its median, L2 flushed before each call), so it reads "
             "about 100, give or take a tenth, where the GPU never waits; well under that, the GPU waited "
             "for the host between the call's launches."), "",
            ("| case | mode | our main kernel | ours, main | ours, the rest | fa4, main | fa4, the rest "
             "| main kernel, ours / fa4 | all kernels, ours / fa4 | ours, GPU busy % | fa4, GPU busy % |"),
            "|---|---|---|---|---|---|---|---|---|---|---|", *lines, *notes]


def write_coverage_report(out_dir) -> Path:
    df = load_rows(out_dir, COVERAGE_CSV)
    env = df.iloc[0] if len(df) else {}
    lines = ["# Coverage: the shapes a model meets, ours against FA4, cuDNN and the official FA2", "",
             (f"TFLOPs/s on the visible (query, key) pairs (backward 2.5x the forward's count), "
              f"{env.get('dtype', '')}; {run_environment(env)}. Ratios are ours' speed over the "
              f"peer's, taken within a round. Rows: `{COVERAGE_CSV}`."), ""]
    rounds = int(df["repeat"].max()) + 1 if len(df) else 1
    if rounds > 1:
        lines += [f"{rounds} rounds over the suite: each cell is the median over the rounds.", ""]
    lines += ["| case | mode | " + " | ".join(PROVIDERS) + " | ours / fa4 | ours / cudnn | our kernel |",
              "|---|---|" + "---|" * (len(PROVIDERS) + 3)]
    for label, mode, sub in _by_case(df):
        ours = sub[sub.provider == "ours"]
        kernel = ours.kernel.iloc[0] if len(ours) else ""
        if len(ours) and ours.kernel_reason.iloc[0]:
            kernel += f": {ours.kernel_reason.iloc[0]}"
        cells = [_peer_cell(sub, p) for p in PROVIDERS]
        ratios = [ratio_cell(_speed(sub, peer), "{:.2f}x") for peer in ("fa4", "sdpa-cudnn")]
        lines.append(f"| {label} | {mode} | " + " | ".join([*cells, *ratios, kernel]) + " |")
    lines += ["", "## The bar", "", "| check | worst | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {v} | {verdict} |" for c, v, verdict in bar_checks(df)]
    lines += kernel_lines(df)
    lines += clock_lines(df)
    missing = df[df.status.isin(["unsupported", "unavailable"])]
    if len(missing):
        lines += ["", "## Providers that did not take a case", ""]
        lines += [f"- {provider} ({status}): {reason}" for (provider, status, reason), _ in
                  missing.groupby(["provider", "status", "reason"], sort=False)]
    bad = df[~df.status.isin(["ok", "unsupported", "unavailable"])]
    if len(bad):
        lines += ["", "## Rows that did not measure", ""]
        lines += [f"- {case_label(r)} {r.provider} {r['mode']}: {r.status}: {r.reason}" for _, r in bad.iterrows()]
    notes = Path(out_dir) / "notes.txt"
    if notes.exists() and notes.read_text().strip():
        lines += ["", "## Notes", "", *notes.read_text().strip().splitlines()]
    path = Path(out_dir) / COVERAGE_MD
    path.write_text("\n".join(lines) + "\n")
    return path
