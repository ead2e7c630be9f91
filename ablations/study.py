"""The ablation report: ablation.md and grouped-bar plots, made from result rows only.

`write_ablation_report(results, out_dir, counters)` takes the long-format rows of
`runner.py --ablation ...` (harness/results.py: one row per provider, setting, shape and
repeat) and writes, in `out_dir`:

* ablation.md: per setting, one row per rung with TFLOPs/s (median over the ok repeats, and
  the min-max over repeats as the spread), the gain over the rung before and whether it clears
  the spread, the peers measured in the same run (SDPA flash = the official FA2 CUDA kernel,
  cuDNN) and the paper's A100 numbers (ablations/paper_a100.csv, cited); then one generated
  sentence per technique, the sweep (shapes other than the settings') and the Nsight Compute
  counter tables when given;
* plots/ablation.png|svg (one panel per setting: this run's bars with their spread next to
  the paper's A100 bars) and, with a sweep, plots/ablation_sweep.png|svg (one panel per
  setting, head dim and causal; sequence length on x; one bar per rung and peer).
Every number comes from the rows or the paper CSV; nothing is typed in.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ablations.ladder import RUNGS, SETTINGS
from harness.environment import ENV_COLUMNS
from reports.plots import cell_summary, environment_title, plot_figure, value_label
from reports.tables import markdown_table

PAPER_CSV = Path(__file__).with_name("paper_a100.csv")
REPORT_NAME = "ablation.md"
SHAPE_COLUMNS = ["mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]
RUNG_INDEX = {rung.name: rung.index for rung in RUNGS}
OFFICIAL_FA2 = "sdpa-flash"  # the FA2 CUDA kernel vendored in PyTorch
WITHIN_OFFICIAL = 0.15  # the bar the ladder is held to: rung 3 within 15% of the official kernel
STRONGEST_PEERS = ("sdpa-cudnn", "fa4")  # rung 4 against the fastest kernels on Hopper, where measured
INTERPRETER_NOTE = ("> **Triton's CPU interpreter on tiny sizes: these numbers are NOT performance.** They show "
                    "that every rung runs and the report is built end to end.")
INTRO = ("Rungs 0-3 are one Triton kernel family compiled to mma.sync (kernels/fa_ladder.py); neighbouring "
         "rungs share the tile's area, warps and pipelining stages, so each step is one section of the paper. "
         "Rung 4 is beyond the paper and changes several things at once: the "
         "production Triton FA2 kernel (kernels/forward.py, wgmma; without the Gluon forward of "
         "kernels/flash_attn_hopper.py). All rungs are forward passes; the backward ladder is in reviewers.md "
         "(`python -m ablations.reviewers backward`). TFLOPs/s use the paper's FLOP count (baselines/flops.py).")


# --------------------------------------------------------------------------------------
# Tables from rows
# --------------------------------------------------------------------------------------
def load_paper_numbers(path: Path = PAPER_CSV) -> pd.DataFrame:
    """The paper's A100 ablation (rung, name, setting, tflops, source, ...)."""
    return pd.read_csv(path)


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting, shape, provider): TFLOPs/s median/min/max over the ok repeats,
    their count, and the last status and reason when no repeat is ok."""
    cells = []
    for key, group in rows.groupby(["setting", *SHAPE_COLUMNS, "provider"], sort=False):
        ok = group[group["status"] == "ok"]
        cells.append({
            **dict(zip(["setting", *SHAPE_COLUMNS, "provider"], key)),
            "label": group["label"].iloc[0],
            "repeats": len(ok),
            "tflops": ok["tflops"].median() if len(ok) else float("nan"),
            "tflops_min": ok["tflops"].min() if len(ok) else float("nan"),
            "tflops_max": ok["tflops"].max() if len(ok) else float("nan"),
            "status": "ok" if len(ok) else group["status"].iloc[-1],
            "reason": "" if len(ok) else str(group["reason"].fillna("").iloc[-1]),
        })
    summary = pd.DataFrame(cells)
    summary["rung"] = summary["provider"].map(RUNG_INDEX)
    summary["_order"] = summary["rung"].fillna(len(RUNGS))
    return summary.sort_values(["setting", "_order"], kind="stable").drop(columns="_order")


def _shape_of(frame: pd.DataFrame) -> pd.Series:
    return pd.Series(list(frame[SHAPE_COLUMNS].itertuples(index=False, name=None)), index=frame.index)


def primary_shapes(summary: pd.DataFrame) -> dict[str, tuple]:
    """{setting: the shape its table shows}: the shape SETTINGS names (any dtype), or, when
    the rows hold a single shape for that setting (the interpreter's tiny stand-in), that one."""
    chosen = {}
    for setting, group in summary.groupby("setting", sort=True):
        shapes = list(dict.fromkeys(_shape_of(group)))
        wanted = SETTINGS.get(setting, {})
        named = [s for s in shapes if all(wanted.get(c) == v for c, v in zip(SHAPE_COLUMNS, s) if c != "dtype")]
        if named:
            chosen[setting] = named[0]
        elif len(shapes) == 1:
            chosen[setting] = shapes[0]
    return chosen


def with_gains(table: pd.DataFrame) -> pd.DataFrame:
    """Add each rung's gain over the rung before (median / median) and whether its slowest
    repeat beats the previous rung's fastest (`clears_spread`)."""
    table = table.copy()
    by_rung = table.dropna(subset=["rung"]).set_index("rung")
    gains, clears = [], []
    for rung in table["rung"]:
        previous = rung - 1
        if pd.isna(rung) or previous not in by_rung.index:
            gains.append(float("nan"))
            clears.append(None)
            continue
        this, before = by_rung.loc[rung], by_rung.loc[previous]
        gains.append(this["tflops"] / before["tflops"])
        clears.append(bool(this["tflops_min"] > before["tflops_max"]) if this["repeats"] > 1
                      and before["repeats"] > 1 else None)
    table["gain"] = gains
    table["clears_spread"] = clears
    return table


def with_paper(table: pd.DataFrame, paper: pd.DataFrame, setting: str) -> pd.DataFrame:
    """Add the paper's A100 TFLOPs/s and gain of the same rung in the same setting, when the
    table's shape is the paper's (else the columns stay empty)."""
    cited_setting = paper[paper["setting"] == setting]
    same_shape = cited_setting[SHAPE_COLUMNS[:-1]].drop_duplicates().merge(table[SHAPE_COLUMNS[:-1]].drop_duplicates())
    cited = cited_setting.set_index("name")["tflops"] if len(same_shape) else pd.Series()
    table = table.copy()
    table["paper_tflops"] = table["provider"].map(cited)
    previous = {rung.name: RUNGS[rung.index - 1].name for rung in RUNGS if rung.index > 0}
    table["paper_gain"] = [cited[p] / cited[previous[p]] if p in cited and previous.get(p) in cited
                           else float("nan") for p in table["provider"]]
    return table


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if pd.isna(value) else f"{value:{spec}}{suffix}"


def _tflops(value) -> str:
    """One decimal, or three significant digits below 1 (the interpreter's tiny numbers)."""
    return _fmt(value, ".1f" if pd.isna(value) or value >= 1 else ".3g")


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    spread = [f"{_tflops(lo)}-{_tflops(hi)}" if n > 1 else "one repeat" if n == 1 else "-"
              for lo, hi, n in zip(table["tflops_min"], table["tflops_max"], table["repeats"])]
    clears = {True: "yes", False: "no", None: "-"}
    return pd.DataFrame({
        "provider": table["provider"],
        "label": table["label"],
        "TFLOPs/s (median)": [_tflops(v) if s == "ok" else s for v, s in zip(table["tflops"], table["status"])],
        "spread (min-max)": spread,
        "repeats": table["repeats"],
        "gain over previous rung": [_fmt(v, ".2f", "x") for v in table["gain"]],
        "gain beyond spread": [clears.get(c, "-") for c in table["clears_spread"]],
        "paper A100 TFLOPs/s": [_fmt(v, ".0f") for v in table["paper_tflops"]],
        "paper gain": [_fmt(v, ".2f", "x") for v in table["paper_gain"]],
    })


# --------------------------------------------------------------------------------------
# Sentences: what each technique did here, against the paper
# --------------------------------------------------------------------------------------
TECHNIQUES = {
    1: "fewer non-matmul FLOPs (FA2 Sec. 3.1)",
    2: "parallelism over the sequence (FA2 Sec. 3.2)",
    3: "split-Q warp partitioning (FA2 Sec. 3.3)",
    4: "beyond the paper, several changes at once (wgmma, tuned tiles and stages, FMA-folded scale, "
       "longest-first launch, TMA loads): not one technique's gain",
}


def technique_sentences(tables: dict[str, pd.DataFrame]) -> list[str]:
    sentences = []
    for rung, name in TECHNIQUES.items():
        parts = []
        for setting, table in tables.items():
            row = table[table["rung"] == rung]
            if row.empty or pd.isna(row["gain"].iloc[0]):
                continue
            row = row.iloc[0]
            text = f"{row['gain']:.2f}x in {setting}"
            if not pd.isna(row["paper_gain"]):
                text += f" (paper A100: {row['paper_gain']:.2f}x)"
            if row["clears_spread"] is not None:
                text += ", beyond the spread" if row["clears_spread"] else ", NOT beyond the spread"
            parts.append(text)
        if parts:
            sentences.append(f"- Rung {rung}, {name}: {'; '.join(parts)}.")
    gains = {s: t.set_index("rung")["gain"].get(2, float("nan")) for s, t in tables.items()}
    if {"A", "B"} <= gains.keys() and not pd.isna(gains["A"]) and not pd.isna(gains["B"]):
        larger = gains["B"] > gains["A"]
        batch = {s: int(t["batch"].iloc[0]) for s, t in tables.items()}
        sentences.append(f"- The sequence-parallel gain is {'larger' if larger else 'NOT larger'} at batch "
                         f"{batch['B']} (B, {gains['B']:.2f}x) than at batch {batch['A']} (A, {gains['A']:.2f}x)"
                         f"{', as the paper found' if larger else ', unlike the paper'}.")
    for setting, table in tables.items():
        medians = table.set_index("provider")["tflops"]
        official = medians.get(OFFICIAL_FA2, float("nan"))
        if pd.isna(official):
            continue
        for rung in (3, 4):
            value = medians.get(RUNGS[rung].name, float("nan"))
            if pd.isna(value):
                continue
            ratio = value / official
            verdict = ("faster than" if ratio > 1 else
                       f"within {WITHIN_OFFICIAL:.0%} of" if rung == 3 and ratio >= 1 - WITHIN_OFFICIAL else
                       "slower than")
            sentences.append(f"- Setting {setting}: rung {rung} runs at {ratio:.2f}x the official FA2 kernel "
                             f"({OFFICIAL_FA2}): {verdict} it.")
        for peer in STRONGEST_PEERS:  # where the bar is on this GPU today
            value, reference = medians.get(RUNGS[4].name, float("nan")), medians.get(peer, float("nan"))
            if not (pd.isna(value) or pd.isna(reference)):
                sentences.append(f"- Setting {setting}: rung 4 runs at {value / reference:.2f}x {peer} "
                                 f"({'faster' if value > reference else 'slower'}).")
    return sentences


# --------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------
def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("png", "svg")]
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text
        for path in paths:
            fig.savefig(path, dpi=150)
    return paths


RUNG_COLOR, PEER_COLOR = "tab:blue", "tab:orange"
PAPER_STYLE = {"facecolor": "white", "edgecolor": "tab:gray", "hatch": "//"}


def plot_settings(tables: dict[str, pd.DataFrame], rows: pd.DataFrame, out_dir: Path) -> list[Path]:
    """One panel per setting: per rung and peer, this run's median with its min-max spread,
    and beside each rung the paper's A100 bar (hatched)."""
    if not tables:
        return []
    fig = Figure(figsize=(7.5 * len(tables), 5.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tables), squeeze=False)[0]
    width = 0.4
    for ax, (setting, table) in zip(axes, tables.items(), strict=True):
        shown = table[table["status"] == "ok"]
        xs = range(len(shown))
        measured = shown["tflops"].tolist()
        errors = [[m - lo for m, lo in zip(measured, shown["tflops_min"])],
                  [hi - m for m, hi in zip(measured, shown["tflops_max"])]]
        colors = [RUNG_COLOR if not pd.isna(r) else PEER_COLOR for r in shown["rung"]]
        bars = ax.bar([x - width / 2 for x in xs], measured, width, yerr=errors, capsize=2, color=colors)
        ax.bar_label(bars, labels=[value_label(v) for v in measured], fontsize=7, padding=2)
        paper = shown["paper_tflops"].tolist()
        paper_x = [x + width / 2 for x, v in zip(xs, paper) if not pd.isna(v)]
        paper_v = [v for v in paper if not pd.isna(v)]
        if paper_v:
            bars = ax.bar(paper_x, paper_v, width, **PAPER_STYLE)
            ax.bar_label(bars, labels=[value_label(v) for v in paper_v], fontsize=7, padding=2)
        ax.set_xticks(list(xs), [textwrap.fill(label, 14) for label in shown["label"]], fontsize=7)
        top = max([*measured, *paper_v, 1.0])
        ax.set_ylim(0, top * 1.18)
        ax.set_ylabel("TFLOPs/s")
        first = table.iloc[0]  # every row of the setting, measured or not, has its shape
        ax.set_title(f"{setting}: batch {first['batch']}, {first['heads']} heads, hdim {first['hdim']}, "
                     f"seqlen {first['seqlen']}, {first['dtype']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=RUNG_COLOR, label="this run: rungs (median, bars: min-max over repeats)"),
               Patch(color=PEER_COLOR, label="this run: peers"),
               Patch(**PAPER_STYLE, label="paper, A100 (FA2 authors' ablation)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"FA1 -> FA2 ablation, forward, causal\n{environment_title(rows)}", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, out_dir, "ablation")


def plot_sweep(sweep_rows: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The sweep in the paper suite's figure style (reports/plots.py): one panel per (head dim,
    causal), sequence length on x, one bar per rung and peer; failed cells written as such."""
    cells = cell_summary(sweep_rows)
    if not cells["tflops"].notna().any():
        return []
    order = {name: RUNG_INDEX.get(name, len(RUNGS) + i) for i, name in enumerate(dict.fromkeys(cells["provider"]))}
    palette = matplotlib.colormaps["tab10"].colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(sorted(order, key=order.get))}
    cells["order"] = cells["provider"].map(order)
    dtypes = ", ".join(sorted(set(cells["dtype"])))
    return plot_figure(cells, sweep_rows, "fwd", dtypes, colors, out_dir,
                       title=f"FA1 -> FA2 ablation sweep, forward, {dtypes}", stem="ablation_sweep")


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------
def _shape_text(shape: tuple) -> str:
    s = dict(zip(SHAPE_COLUMNS, shape))
    return (f"{s['mode']}, {'causal' if s['causal'] else 'non-causal'}, hdim {s['hdim']}, seqlen {s['seqlen']}, "
            f"batch {s['batch']}, {s['heads']} heads, {s['dtype']}")


def _environment_lines(rows: pd.DataFrame) -> list[str]:
    lines = []
    for column in ENV_COLUMNS:
        if column in rows:
            values = sorted(set(rows[column].dropna().astype(str)) - {""})
            lines.append(f"- {column}: {', '.join(values) if values else '-'}")
    return lines


def _run_lines(out_dir: Path) -> list[str]:
    """How the rows were timed: each run's command line from results.json, and the clock."""
    from harness.results import load_runs

    runs = load_runs(out_dir)
    if not runs:
        return []
    lines = ["## Runs", ""]
    for run in runs:
        arguments = run.get("arguments", {})
        if arguments.get("ncu") == "only":
            what = "Nsight Compute counters only, no timing"
        elif arguments.get("cuda_graph"):
            what = "timed with CUDA-graph replay of back-to-back calls (do_bench_cudagraph)"
        else:
            what = "timed with do_bench (CUDA events, L2 flushed before each call)"
        finished = "" if run.get("finished") else " (did not finish)"
        lines.append(f"- `{run.get('command', '?')}`: {what}{finished}")
    return [*lines, ""]


def write_ablation_report(results: pd.DataFrame, out_dir, counters: pd.DataFrame | None = None) -> Path:
    """Write ablation.md and the plots for the ablation rows in `results` (rows whose
    `setting` is empty are ignored); returns the path of ablation.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = results[results["setting"].fillna("").astype(str) != ""].copy()
    paper = load_paper_numbers()
    lines = ["# FA1 -> FA2 ablation, one technique per rung", ""]
    if rows.empty:
        lines += ["No ablation rows: run `python runner.py --ablation all`.", ""]
        path = out_dir / REPORT_NAME
        path.write_text("\n".join(lines))
        return path
    if rows["interpreter"].astype(bool).any():
        lines += [INTERPRETER_NOTE, ""]
    lines += [INTRO, ""]

    summary = summarise(rows)
    chosen = primary_shapes(summary)
    is_primary = pd.Series([chosen.get(s) == shape for s, shape in zip(summary["setting"], _shape_of(summary))],
                           index=summary.index, dtype=bool)
    tables = {}
    for setting, shape in chosen.items():
        table = summary[is_primary & (summary["setting"] == setting)]
        tables[setting] = with_paper(with_gains(table), paper, setting)
        lines += [f"## Setting {setting}: {_shape_text(shape)}", "", markdown_table(display_table(tables[setting])),
                  ""]
        failed = tables[setting][tables[setting]["status"] != "ok"]
        lines += [f"- {r.provider}: {r.status} ({r.reason})" for r in failed.itertuples()]
        lines += [""] if len(failed) else []

    figures = plot_settings(tables, rows, out_dir / "plots")
    sentences = technique_sentences(tables)
    if sentences:
        lines += ["## What each technique did", "", *sentences, ""]
    sources = sorted(set(paper["source"]))
    lines += ["Paper numbers (A100 80GB SXM4, forward, causal, head dim 128, seqlen 2048) from ablations/paper_a100.csv:",
              *[f"{source}." for source in sources], ""]

    sweep = summary[~is_primary]
    if not sweep.empty:
        sweep_keys = set(sweep[["setting", *SHAPE_COLUMNS]].itertuples(index=False, name=None))
        sweep_rows = rows[[key in sweep_keys for key in rows[["setting", *SHAPE_COLUMNS]].itertuples(index=False,
                                                                                                   name=None)]]
        figures += plot_sweep(sweep_rows, out_dir / "plots")
        pivot = sweep.assign(cell=[_tflops(v) if s == "ok" else s for v, s in zip(sweep["tflops"], sweep["status"])])
        providers = list(dict.fromkeys(pivot["provider"]))
        wide = pivot.pivot_table(index=["setting", "hdim", "causal", "seqlen", "batch", "heads", "dtype"],
                                 columns="provider", values="cell", aggfunc="first").reindex(columns=providers)
        lines += ["## Sweep (TFLOPs/s, median over repeats)", "", markdown_table(wide.fillna("-").reset_index()), ""]

    lines += ["## Plots", "", *[f"![{p.stem}](plots/{p.name})" for p in figures if p.suffix == ".png"], ""]
    if counters is not None and not counters.empty:
        from reports.counters import counter_table

        order = [rung.name for rung in RUNGS] + [p for p in dict.fromkeys(rows["provider"]) if p not in RUNG_INDEX]
        lines += [counter_table(counters, order)[0], ""]
    else:
        lines += ["## Performance counters", "", "Not profiled in this run (`python runner.py --ablation all --ncu`).",
                  ""]
    lines += ["## Environment", "", *_environment_lines(rows), "", *_run_lines(out_dir)]
    path = out_dir / REPORT_NAME
    path.write_text("\n".join(lines))
    return path
