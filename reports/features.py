"""The features suite's report (features.md), from its rows alone: TFLOPs/s by variant,
provider and sequence length, and the bar's checks, each ratio taken within a round."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.features import FEATURES_CSV, FEATURES_MD, load_rows
from reports.tables import run_environment


def _ms_rounds(df, group, variant, provider, mode, seqlen=None) -> pd.Series:
    """The ok rows' times by round (index: repeat; the median where a round has several)."""
    sel = df[(df.group == group) & (df.variant == variant) & (df.provider == provider) & (df["mode"] == mode)
             & (df.status == "ok")]
    if seqlen is not None:
        sel = sel[sel.seqlen_q == seqlen]
    return sel.groupby("repeat").ms.median().astype(float)


def ratio_rounds(numerator: pd.Series, denominator: pd.Series) -> pd.Series:
    """numerator / denominator within each round both measured (a same-run ratio per round)."""
    return (numerator / denominator).dropna()


def ratio_cell(ratios: pd.Series, fmt: str) -> str:
    """Per-round ratios as a cell: their median, with their range when there are several rounds."""
    if not len(ratios):
        return cell(math.nan)
    text = cell(float(ratios.median()), fmt)
    if len(ratios) > 1:
        text += f" ({cell(float(ratios.min()), fmt)}-{cell(float(ratios.max()), fmt)} over {len(ratios)} rounds)"
    return text


def _check(name: str, ratios: pd.Series, fmt: str, passes) -> tuple[str, str, str]:
    """A bar check from per-round ratios: ratio_cell and the verdict on their median, noting the
    rounds that disagree with it."""
    if not len(ratios):
        return name, cell(math.nan), "n/a"
    value = float(ratios.median())
    text = ratio_cell(ratios, fmt)
    ok = bool(passes(value))
    dissent = sum(bool(passes(r)) != ok for r in ratios)
    verdict = "met" if ok else "not met"
    if dissent:
        verdict += f" ({'not met' if ok else 'met'} in {dissent} of {len(ratios)} rounds)"
    return name, text, verdict


def cell(value: float, fmt: str = "{:.0f}") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _tflops_table(df: pd.DataFrame, group: str) -> list[str]:
    """TFLOPs/s by (variant, provider, mode) and sequence length (the median over the rounds);
    providers that measured nothing in the group are listed below the table with their reasons."""
    sub = df[df.group == group]
    measured = sub[~sub.status.isin(["unsupported", "unavailable"])]
    lengths = sorted(set(sub.seqlen_q))
    lines = ["| variant | provider | mode | " + " | ".join(map(str, lengths)) + " |",
             "|---|---|---|" + "---|" * len(lengths)]
    for (variant, provider, mode), rows in measured.groupby(["variant", "provider", "mode"], sort=False):
        cells = []
        for n in lengths:
            row = rows[rows.seqlen_q == n]
            ok = row[row.status == "ok"]
            if not len(row):
                cells.append("")
            elif len(ok):
                cells.append(cell(float(ok.tflops.astype(float).median()), "{:.3g}"))
            else:
                cells.append(row.status.iloc[0])
        lines.append(f"| {variant} | {provider} | {mode} | " + " | ".join(cells) + " |")
    missing = sub[sub.status.isin(["unsupported", "unavailable"])]
    for (provider, variant, reason), _ in missing.groupby(["provider", "variant", "reason"], sort=False):
        lines.append(f"\n{provider} ({variant}): {reason}")
    return lines


def bar_checks(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(check, value, verdict) for the bar: GQA >= 0.9x FA4 and >= 1.2x SDPA flash; windows and
    packed variable lengths >= 0.9x FA4 (SDPA has neither); the window's time within 10% of its
    visible-FLOP ratio; ALiBi <= 1.1x and softcap <= 1.5x the dense time. Each ratio is taken within
    a round (_check: the median over the rounds)."""
    checks = []

    def at_least(bar):
        return lambda x: x >= bar

    def at_most(bar):
        return lambda x: x <= bar

    for n in sorted(set(df[df.group == "gqa"].seqlen_q)):
        for mode in ("fwd", "bwd"):
            ours = _ms_rounds(df, "gqa", "gqa", "ours", mode, n)
            for peer, bar in (("fa4", 0.9), ("sdpa-flash", 1.2)):
                speed = ratio_rounds(_ms_rounds(df, "gqa", "gqa", peer, mode, n), ours)
                checks.append(_check(f"GQA {n} {mode}: speed over {peer} >= {bar}", speed, "{:.2f}x", at_least(bar)))
    window = df[(df.group == "window") & (df.variant == "window")]
    for n in sorted(set(window.seqlen_q)):
        row = window[window.seqlen_q == n].iloc[0]
        full = df[(df.group == "window") & (df.variant == "full-causal") & (df.seqlen_q == n)].iloc[0]
        visible = float(row.visible_pairs) / float(full.visible_pairs)
        sides = (int(row.window_left), int(row.window_right))
        for mode in ("fwd", "bwd"):
            ours = _ms_rounds(df, "window", "window", "ours", mode, n)
            ratio = ratio_rounds(ours, _ms_rounds(df, "window", "full-causal", "ours", mode, n))
            checks.append(_check(f"window {sides} at {n} {mode}: time / full causal within 10% of visible "
                                 f"{visible:.2f}", ratio, "{:.2f}", at_most(1.1 * visible)))
            speed = ratio_rounds(_ms_rounds(df, "window", "window", "fa4", mode, n), ours)
            checks.append(_check(f"window {sides} at {n} {mode}: speed over fa4 >= 0.9", speed, "{:.2f}x",
                                 at_least(0.9)))
    for mode in ("fwd", "bwd"):
        varlen = _ms_rounds(df, "varlen", "varlen", "ours", mode)
        padded = ratio_rounds(_ms_rounds(df, "varlen", "padded", "ours", mode), varlen)
        checks.append((f"varlen {mode}: padding to the longest costs (x the varlen time)",
                       ratio_cell(padded, "{:.2f}x"), "info"))
        speed = ratio_rounds(_ms_rounds(df, "varlen", "varlen", "fa4", mode), varlen)
        checks.append(_check(f"varlen {mode}: speed over fa4 >= 0.9", speed, "{:.2f}x", at_least(0.9)))
        dense = _ms_rounds(df, "score", "dense", "ours", mode)
        for variant, bar in (("alibi", 1.1), ("softcap", 1.5)):
            ratio = ratio_rounds(_ms_rounds(df, "score", variant, "ours", mode), dense)
            checks.append(_check(f"{variant} {mode}: time over dense <= {bar}", ratio, "{:.2f}x", at_most(bar)))
    return checks


def write_features_report(out_dir) -> Path:
    df = load_rows(out_dir)
    env = df.iloc[0] if len(df) else {}
    lines = ["# Features: GQA, sliding window, variable lengths, ALiBi, softcap", "",
             (f"TFLOPs/s on the visible (query, key) pairs (backward 2.5x the forward's count), "
              f"{env.get('dtype', '')}, head dim {env.get('hdim', '')}; {run_environment(env)}. "
              f"Rows: `{FEATURES_CSV}`."), ""]
    rounds = int(df["repeat"].max()) + 1 if len(df) else 1
    if rounds > 1:
        lines += [(f"{rounds} rounds over the suite: each cell is the median over the rounds; each ratio of the "
                   "bar is taken within a round (the same clocks), then its median and range over the rounds."), ""]
    titles = {"gqa": "GQA", "window": "Sliding window against the full causal call",
              "varlen": "Packed variable lengths against padding to the longest (columns: the longest)",
              "score": "ALiBi and softcap against the dense call"}
    for group, title in titles.items():
        sub = df[df.group == group]
        if len(sub):
            first = sub.iloc[0]
            shape = (f"{first.heads} q heads, {first.kv_heads} kv heads, causal {first.causal}, batch "
                     f"{'/'.join(map(str, sorted(set(sub.batch))))}")
            if first.lengths:
                shape += f", lengths {first.lengths}"
            lines += [f"## {title}", "", shape, "", *_tflops_table(df, group), ""]
    lines += ["## The bar", "", "| check | value | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {v} | {verdict} |" for c, v, verdict in bar_checks(df)]
    bad = df[~df.status.isin(["ok", "unsupported", "unavailable"])]
    if len(bad):
        lines += ["", "## Rows that did not measure", ""]
        lines += [f"- {r.group}/{r.variant} {r.provider} {r['mode']} {r.seqlen_q}: {r.status}: {r.reason}"
                  for _, r in bad.iterrows()]
    notes = Path(out_dir) / "notes.txt"
    if notes.exists() and notes.read_text().strip():
        lines += ["", "## Notes", "", *notes.read_text().strip().splitlines()]
    path = Path(out_dir) / FEATURES_MD
    path.write_text("\n".join(lines) + "\n")
    return path
