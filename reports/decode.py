"""The decode suite's report (report.md and plots/decode_bandwidth.png), from its rows alone:
GB/s of K and V read by batch x cache length, the device copy's ceiling, and the bar's checks."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness import decode as suite


def _series(df, provider, layout) -> pd.Series:
    rows = df[(df.provider == provider) & (df.layout == layout) & (df.status == "ok")]
    return rows.set_index(["kv_heads", "batch", "cache_len"])["gbps"].astype(float)


def bar_checks(df: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(check, measured, verdict) for the targets: batch 1 x 64k at >= 0.95x SDPA cuDNN and >= 5x
    ours with num_splits=1; no slower than SDPA flash anywhere; paged within 10% of contiguous."""
    ours, ours_one = _series(df, "ours-splitkv", "contiguous"), _series(df, "ours-nosplit", "contiguous")
    cudnn, flash = _series(df, "sdpa-cudnn", "contiguous"), _series(df, "sdpa-flash", "contiguous")
    paged = _series(df, "ours-splitkv", "paged")
    checks = []
    for kv_heads in suite.KV_HEADS:
        key = (kv_heads, 1, 65536)
        for what, other, target in (("SDPA cuDNN", cudnn, 0.95), ("ours num_splits=1", ours_one, 5.0)):
            if key in ours.index and key in other.index:
                ratio = ours[key] / other[key]
                measured = f"{ratio:.2f}x"
                fastest = df[(df.status == "ok") & (df.provider != "device-copy")]["gbps"].astype(float).max()
                if target > 1 and target * other[key] > fastest:  # a bar above every row of the run
                    measured += (f" (the bar needs {target * other[key]:,.0f} GB/s; the fastest row of the run "
                                 f"read {fastest:,.0f})")
                checks.append((f"1 x 64k, {kv_heads} kv heads: ours / {what} >= {target}", measured,
                               "met" if ratio >= target else "not met"))
    for label, faster, slower, bar in (("ours / SDPA flash", ours, flash, 1), ("paged / contiguous", paged, ours, 0.9)):
        common = faster.index.intersection(slower.index)
        if len(common):
            ratios = faster[common] / slower[common]
            worst = ratios.idxmin()
            checks.append((f"every shape: {label} >= {bar}", (f"min {ratios.min():.3f}x at {worst[1]} x {worst[2]} "
                           f"({worst[0]} kv heads)"), "met" if ratios.min() >= bar else "not met"))
    return checks


def _cache_text(cache_len: int) -> str:
    return f"{cache_len // 1024}k" if cache_len % 1024 == 0 else str(cache_len)


def _table(df: pd.DataFrame, kv_heads: int) -> list[str]:
    """Rows batch x cache, a column per provider that measured something (the others are listed
    under 'Rows not measured')."""
    ok = df[(df.kv_heads == kv_heads) & (df.provider != "device-copy")]
    measured = ok[ok.status.isin(["ok", "wrong", "oom", "error"])]
    columns = list(dict.fromkeys(zip(measured.provider, measured.layout)))
    labels = {(p, lay): lab for p, lay, lab in zip(ok.provider, ok.layout, ok.label)}
    header = ["batch x cache"] + [labels[c] + (" (paged)" if c[1] == "paged" else "") for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (batch, cache_len), rows in ok.groupby(["batch", "cache_len"], sort=True):
        cells = [f"{batch} x {_cache_text(cache_len)}"]
        for provider, layout in columns:
            row = rows[(rows.provider == provider) & (rows.layout == layout)]
            if row.empty:
                cells.append("")
            elif row.status.iloc[0] != "ok":
                cells.append(row.status.iloc[0])
            else:
                mark = "" if row.timing.iloc[0] == "cuda-graph" else " *"
                cells.append(f"{float(row.gbps.iloc[0]):,.0f} ({float(row.ms.iloc[0]) * 1e3:,.1f}){mark}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot_bandwidth(df: pd.DataFrame, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = df[df.provider == "device-copy"]
    ceiling = float(copy.gbps.iloc[0]) if len(copy) else None
    batches = sorted(set(df[df.batch > 0].batch))
    fig, axes = plt.subplots(len(suite.KV_HEADS), len(batches), figsize=(4 * len(batches), 3.4 * len(suite.KV_HEADS)),
                             squeeze=False, sharey=True)
    ok = df[(df.status == "ok") & (df.provider != "device-copy")]
    for row, kv_heads in enumerate(suite.KV_HEADS):
        for col, batch in enumerate(batches):
            ax = axes[row][col]
            sel = ok[(ok.kv_heads == kv_heads) & (ok.batch == batch)]
            for (provider, layout), series in sel.groupby(["provider", "layout"], sort=False):
                series = series.sort_values("cache_len")
                style = "--" if layout == "paged" else "-"
                label = series.label.iloc[0] + (" (paged)" if layout == "paged" else "")
                ax.plot(series.cache_len, series.gbps.astype(float), style, marker="o", markersize=3, label=label)
            if ceiling:
                ax.axhline(ceiling, color="black", linestyle=":", label="device-to-device copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"batch {batch}, {kv_heads} kv heads", fontsize=9)
            ax.set_xlabel("cache length (keys)")
            if col == 0:
                ax.set_ylabel("GB/s of K + V read")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_decode_report(out_dir) -> Path:
    """report.md and plots/decode_bandwidth.png from out_dir/decode.csv (and notes.txt)."""
    out_dir = Path(out_dir)
    df = suite.load_rows(out_dir)
    plot = plot_bandwidth(df, out_dir / "plots" / "decode_bandwidth.png")
    first = df.iloc[0]
    copy = df[df.provider == "device-copy"]
    lines = ["# Decoding: one query token against a KV cache", ""]
    if str(first.interpreter) == "True":
        lines += ["**Triton's CPU interpreter on tiny sizes: these numbers are NOT performance.**", ""]
    lines += [(f"{first.gpu}, torch {first.torch}, triton {first.triton}, CUDA {first.cuda}, driver {first.driver}, "
             f"commit {first.git_commit}, {first.timestamp}. {first.heads} q heads, head dim {first.hdim}, "
             f"{first['dtype']}, every sequence "
             "holding the whole cache. Each cell: GB/s of K and V read (bytes / median time) and, in brackets, the "
             "median latency in microseconds; timed by CUDA-graph "
             "replay (`do_bench_cudagraph`, each captured call reading another copy of the cache so L2 does not "
             "hold it) except cells marked *, timed by `do_bench` because the call could not be captured "
             f"(the row's `timing` says why). Rows: `{suite.DECODE_CSV}`."), ""]
    if len(copy):
        lines += [(f"Ceiling: a device-to-device copy moved {float(copy.gbps.iloc[0]):,.0f} GB/s "
                  "(bytes read + written / time) in the same run."), ""]
    if len(df[df.status == "wrong"]):
        lines += [("Rows marked `wrong` differ from the float64 reference by more than "
                  f"{suite.WRONG_REL_ERR} relative error."), ""]
    lines += ["## The targets", "", "| check | measured | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {m} | {v} |" for c, m, v in bar_checks(df)]
    for kv_heads in suite.KV_HEADS:
        if len(df[df.kv_heads == kv_heads]):
            lines += ["", f"## {kv_heads} kv heads", ""] + _table(df, kv_heads)
    reasons = df[(df.status != "ok") & (df.reason != "")].drop_duplicates(["provider", "layout", "status", "reason"])
    if len(reasons):
        lines += ["", "## Rows not measured", ""]
        lines += [f"- {r.label} ({r.layout or 'all'}): {r.status}: {r.reason}" for r in reasons.itertuples()]
    notes_path = out_dir / "notes.txt"
    notes = notes_path.read_text().split("\n") if notes_path.exists() else []
    if any(notes):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes if n]
    lines += ["", f"![decode bandwidth]({plot.relative_to(out_dir).as_posix()})", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    return report


