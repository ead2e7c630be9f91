"""The paper's figures (FA2 paper Figs. 4-7), drawn from result rows only.

One figure per (mode, dtype); one panel per (head dim, causal); sequence length on x,
TFLOPs/s on y, one bar per provider with its value on top. A provider whose measurement
failed at some sequence length gets 'OOM' or 'n/a' written at that place, never a zero
bar. A provider with no successful measurement in a figure is left out of it (the report
lists it with its reason). Files: <mode>_<dtype>.png and .svg.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.io import save_figure

MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
FAILED_TEXT = {"oom": "OOM"}  # any other failed status is written 'n/a'


def suite_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the paper suite (no ablation setting)."""
    return df[df["setting"].fillna("") == ""]


def cell_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (mode, dtype, hdim, causal, seqlen, batch, heads, provider): the median
    TFLOPs/s over the 'ok' repeats, or the failure text ('OOM', 'n/a') when none is ok."""
    keys = ["mode", "dtype", "hdim", "causal", "seqlen", "batch", "heads", "provider", "label"]
    cells = []
    for key, group in df.groupby(keys, sort=True):
        ok = group[group["status"] == "ok"]
        if len(ok):
            cells.append((*key, ok["tflops"].median(), ""))
        else:
            status = group["status"].iloc[-1]
            cells.append((*key, float("nan"), FAILED_TEXT.get(status, "n/a")))
    return pd.DataFrame(cells, columns=[*keys, "tflops", "failed"])


def value_label(tflops: float) -> str:
    return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"


def _x_labels(panel: pd.DataFrame) -> list[tuple]:
    """x categories: (seqlen, batch, heads), labelled by seqlen (plus b/h if seqlen repeats)."""
    return sorted(set(panel[["seqlen", "batch", "heads"]].itertuples(index=False, name=None)))


def environment_title(rows: pd.DataFrame) -> str:
    """The GPU(s) the rows were measured on, for a figure's title; says so when they come
    from Triton's interpreter."""
    gpus = ", ".join(sorted(set(rows["gpu"].astype(str)) - {"", "nan"})) or "unknown GPU"
    if rows["interpreter"].astype(bool).any():
        return f"{gpus}: Triton interpreter timed with perf_counter, numbers are NOT performance"
    return gpus


def plot_figure(cells: pd.DataFrame, rows: pd.DataFrame, mode: str, dtype: str, colors: dict[str, str],
                out_dir: Path, title: str | None = None, stem: str | None = None) -> list[Path]:
    """Draw one figure from its cells (their `order` column orders the bars); returns the
    PNG and SVG paths, `<stem>.png|svg` (default `<mode>_<dtype>`)."""
    measured = cells.groupby("provider")["tflops"].apply(lambda s: s.notna().any())
    cells = cells[cells["provider"].isin(measured[measured].index)]
    providers = list(dict.fromkeys(cells.sort_values("order")["provider"]))
    labels = dict(zip(cells["provider"], cells["label"], strict=False))
    panels = sorted(set(cells[["hdim", "causal"]].itertuples(index=False, name=None)))
    ncols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // ncols)
    n_x = max(len(_x_labels(cells[(cells["hdim"] == h) & (cells["causal"] == c)])) for h, c in panels)
    width = max(6.0, 0.22 * n_x * max(len(providers), 1) + 1.5)
    fig = Figure(figsize=(width * ncols, 3.6 * nrows))
    FigureCanvasAgg(fig)  # the Agg renderer, without pyplot's global state
    axes = fig.subplots(nrows, ncols, squeeze=False)
    bar_width = 0.8 / max(len(providers), 1)
    for ax, (hdim, causal) in zip(axes.flat, panels, strict=False):
        panel = cells[(cells["hdim"] == hdim) & (cells["causal"] == causal)]
        xs = _x_labels(panel)
        top = panel["tflops"].max()
        seqlens = [s for s, _, _ in xs]
        ticks = [str(s) if seqlens.count(s) == 1 else f"{s}\nb{b} h{h}" for s, b, h in xs]
        for i, provider in enumerate(providers):
            by_x = panel[panel["provider"] == provider].set_index(["seqlen", "batch", "heads"])
            positions = [j + (i - (len(providers) - 1) / 2) * bar_width for j in range(len(xs))]
            values = [by_x["tflops"].get(x, float("nan")) for x in xs]
            bars = ax.bar(positions, [0 if pd.isna(v) else v for v in values], bar_width,
                          label=labels[provider], color=colors[provider])
            ax.bar_label(bars, labels=["" if pd.isna(v) else value_label(v) for v in values],
                         fontsize=6, rotation=90, padding=2)
            for x, pos in zip(xs, positions, strict=True):
                failed = by_x["failed"].get(x, "")
                if failed:
                    ax.text(pos, 0.02 * top, failed, rotation=90, ha="center", va="bottom", fontsize=6,
                            color="dimgray")
        ax.set_xticks(range(len(xs)), ticks)
        ax.set_ylim(0, (top if top > 0 else 1.0) * 1.2)  # a panel with no ok cell shows only its failures
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPs/s")
        ax.set_title(f"head dim {hdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="lower center", ncol=min(len(providers), 4), fontsize=8,
               frameon=False)
    title = title or f"Attention {MODE_TITLES[mode]} speed, {dtype}"
    fig.suptitle(f"{title}\n{environment_title(rows)}", fontsize=11)
    legend_rows = -(-len(providers) // 4)
    fig.tight_layout(rect=(0, 0.04 * legend_rows + 0.02, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem or f'{mode}_{dtype}'}.{ext}" for ext in ("png", "svg")]
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text (searchable, editable)
        for path in paths:
            save_figure(fig, path, dpi=150)
    return paths


def plot_suite(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Every figure of the suite rows in `df`; returns the written PNG/SVG paths."""
    rows = suite_rows(df)
    if rows.empty:
        return []
    measured = rows.loc[rows["status"] == "ok", "provider"]
    order = {name: i for i, name in enumerate(dict.fromkeys(measured))}  # colours: same provider, same colour
    palette = matplotlib.colormaps["tab20" if len(order) > 10 else "tab10"].colors
    colors = {name: palette[i % len(palette)] for name, i in order.items()}
    cells = cell_summary(rows)
    cells["order"] = cells["provider"].map(order)
    paths = []
    for (mode, dtype), figure_cells in cells.groupby(["mode", "dtype"], sort=True):
        if figure_cells["tflops"].notna().any():
            figure_rows = rows[(rows["mode"] == mode) & (rows["dtype"] == dtype)]
            paths += plot_figure(figure_cells, figure_rows, mode, dtype, colors, Path(out_dir))
    return paths
