"""Generated sections of the README and the docs, from committed result rows.

Markdown files mark a generated section with `<!-- BEGIN name -->` ... `<!-- END name -->`;
`python -m reports.embed README.md docs/performance.md reports/h200/README.md` rewrites every
marked section from the CSVs under reports/h200/, so no number in them is typed by hand. A design
decision's table (`decision_table`) comes from its compact rows in reports/h200/decisions/<name>.csv.

    python -m reports.embed --kernel-vs-fa2 results/paper/results.csv --kernel-vs-fa2 results/paper_fp16/results.csv
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from harness.results import load_results, load_runs
from reports.host_overhead import host_engine_table, host_overhead_table
from reports.tables import ratio_cell, run_environment

H200 = Path(__file__).resolve().parent / "h200"
H100 = Path(__file__).resolve().parent / "h100"
DECISIONS = H200 / "decisions"
KERNEL_VS_FA2_CSV = H200 / "kernel_vs_fa2.csv"  # bf16, as the paper
KERNEL_VS_FA2_FP16_CSV = H200 / "kernel_vs_fa2_fp16.csv"
KERNEL_VS_FA2_BY_DTYPE = {"bf16": KERNEL_VS_FA2_CSV, "fp16": KERNEL_VS_FA2_FP16_CSV}
KERNEL_VS_FA2_COLUMNS = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "ms",
                         "ms_p20", "ms_p80", "tflops", "rel_err", "config", "gpu", "driver", "cuda",
                         "torch", "triton", "git_commit", "timestamp"]
OURS, OFFICIAL, CUDNN = "fa2", "sdpa-flash", "sdpa-cudnn"


def extract_kernel_vs_fa2(results_csv: Path, out_csv: Path | None = None) -> pd.DataFrame:
    """The rows of our FA2 kernel, the official FA2 kernel and cuDNN from a paper-suite run of
    one dtype, written to that dtype's CSV (KERNEL_VS_FA2_BY_DTYPE) unless `out_csv` is given."""
    rows = load_results(results_csv)  # a later row for the same key replaces an earlier one
    rows = rows[rows.provider.isin([OURS, OFFICIAL, CUDNN]) & (rows.status == "ok")]
    dtypes = sorted(rows.dtype.unique())
    if len(dtypes) != 1:
        raise ValueError(f"{results_csv}: expected the rows of one dtype, found {dtypes}")
    rows = rows[KERNEL_VS_FA2_COLUMNS].sort_values(["mode", "hdim", "causal", "seqlen", "provider"])
    rows.to_csv(out_csv or KERNEL_VS_FA2_BY_DTYPE[dtypes[0]], index=False)
    return rows


_ratio = ratio_cell


def _speedup_grid(rows: pd.DataFrame, peers: tuple[str, ...]) -> tuple[pd.DataFrame, list[str]]:
    """(the TFLOPs/s pivot, the table's lines): one line per (mode, hdim, causal), one column per
    seqlen, each cell our TFLOPs/s then our speed over each of `peers`, all from the same run."""
    wide = rows.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider",
                            values="tflops", aggfunc="median")
    for column in (OURS, *peers):
        if column not in wide:
            wide[column] = float("nan")
    seqlens = sorted(rows.seqlen.unique())
    lines = ["| mode | hdim | causal | " + " | ".join(str(n) for n in seqlens) + " |",
             "|---|---|---|" + "---|" * len(seqlens)]
    for (mode, hdim, causal), group in wide.groupby(level=[0, 1, 2], sort=True):
        group = group.droplevel([0, 1, 2])
        cells = []
        for n in seqlens:
            if n not in group.index or pd.isna(group.loc[n, OURS]):
                cells.append("n/a")
                continue
            r = group.loc[n]
            cells.append(f"{r[OURS]:.0f} · " + " · ".join(_ratio(r[OURS], r[peer]) for peer in peers))
        lines.append(f"| {mode} | {hdim} | {causal} | " + " | ".join(cells) + " |")
    return wide, lines


def file_section(path: Path, stop_at: str | None = None, start_at: str | None = None) -> str:
    """A generated Markdown file, embedded as it is from the first line starting with `start_at`
    up to the heading `stop_at` (its own headings demoted by one level)."""
    text = path.read_text().strip()
    if start_at:
        start = re.search("^" + re.escape(start_at), text, flags=re.MULTILINE)
        if start is None:
            raise ValueError(f"{path}: no line starts with {start_at!r}")
        text = text[start.start():]
    if stop_at and stop_at in text:
        text = text[:text.index(stop_at)].strip()
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.MULTILINE)


def matmul_ceiling_tflops(path: Path) -> float:
    """The bf16 matmul rate measured on the GPU (tools/matmul_ceiling.py's line)."""
    match = re.search(r"([0-9.]+) TFLOP/s", path.read_text())
    if match is None:
        raise ValueError(f"{path}: no 'TFLOP/s' figure in it")
    return float(match.group(1))


def utilisation_table(rows: pd.DataFrame, ceiling: float) -> str:
    """At each (mode, hdim)'s longest sequence: TFLOPs/s of ours, the official FA2 kernel and
    cuDNN as a fraction of the measured matmul ceiling, non-causal then causal (the floor of
    docs/performance.md: attention cannot run faster than its matmul FLOPs at the matmul rate)."""
    longest = rows[rows.seqlen == rows.seqlen.max()]
    wide = longest.pivot_table(index=["mode", "hdim", "causal"], columns="provider", values="tflops")
    for column in (OURS, OFFICIAL, CUDNN):
        if column not in wide:
            wide[column] = float("nan")
    lines = [f"Ceiling: {ceiling:.0f} TFLOP/s (bf16 8192^3 matmul, same GPU). Seqlen {rows.seqlen.max()}.", "",
             "| mode | hdim | ours | official FA2 | cuDNN | ours, causal | official FA2, causal | cuDNN, causal |",
             "|---|---|---|---|---|---|---|---|"]
    for (mode, hdim), group in wide.groupby(level=[0, 1], sort=True):
        cells = []
        for causal in (False, True):
            r = group.xs((mode, hdim, causal)) if (mode, hdim, causal) in group.index else None
            cells += ["n/a" if r is None or pd.isna(r[p]) else f"{r[p] / ceiling:.0%}" for p in (OURS, OFFICIAL, CUDNN)]
        lines.append(f"| {mode} | {hdim} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


UNITS = {"tflops": ("TFLOPs/s", "{:.0f}"), "ms": ("ms", "{:.3f}"), "us": ("us", "{:.1f}")}


def _settings(tool: str) -> str:
    """A decision's measuring settings, from its rows' `tool` column without the script that took
    them (`python tools/compare_configs.py` re-checks a decision now)."""
    parts = [part for part in str(tool).split(", ") if not part.startswith("tools/experiments/")]
    return ", ".join(parts)


def decision_table(path: Path, ratios: tuple[tuple[str, str, str], ...] = ()) -> str:
    """A design decision's rows (columns row, column, unit, value, tool, git_commit): one line per
    row label and one column per column label, both in file order, then one line per ratio
    (label, numerator row, denominator row) computed from those values, column by column. An
    experiment's float64 check rows (column 'check against float64') become the footer's note, and
    so does a row with no time at all (a peer that did not run there; its reason from the tool
    column), unless a ratio needs it."""
    rows = pd.read_csv(path, keep_default_na=False)
    checks = rows[rows["column"] == "check against float64"]
    rows = rows[rows["column"] != "check against float64"]
    units = rows["unit"].unique()
    if len(units) != 1 or units[0] not in UNITS:
        raise ValueError(f"{path}: expected one unit of {sorted(UNITS)}, found {list(units)}")
    unit, fmt = UNITS[units[0]]
    rounds = int(rows.groupby(["row", "column"]).size().max())  # an experiment's interleaved rounds
    values = pd.to_numeric(rows["value"], errors="coerce")
    wide = rows.assign(value=values).pivot_table(index="row", columns="column", values="value", aggfunc="median",
                                                 dropna=False)
    wide = wide.reindex(index=list(dict.fromkeys(rows["row"])), columns=list(dict.fromkeys(rows["column"])))
    referenced = {name for _, numerator, denominator in ratios for name in (numerator, denominator)}
    untimed = [label for label in wide.index if wide.loc[label].isna().all() and label not in referenced]
    wide = wide.drop(index=untimed)  # a peer that did not run: named in the footer with its reason
    lines = [f"| {unit} | " + " | ".join(wide.columns) + " |", "|---|" + "---|" * len(wide.columns)]
    for label, values in wide.iterrows():
        lines.append(f"| {label} | " + " | ".join("" if pd.isna(v) else fmt.format(v) for v in values) + " |")
    for label, numerator, denominator in ratios:
        for name in (numerator, denominator):
            if name not in wide.index:
                raise ValueError(f"{path}: no row {name!r} for the ratio {label!r}")
        quotient = wide.loc[numerator] / wide.loc[denominator]
        lines.append(f"| **{label}** | " + " | ".join("" if pd.isna(v) else f"{v:.2f}x" for v in quotient) + " |")
    source = _settings(rows["tool"].iloc[0])
    medians = f"; each cell the median of up to {rounds} rounds (those timed)" if rounds > 1 else ""
    failed = sorted(checks.loc[checks["unit"] != "ok", "row"])
    checked = ("" if checks.empty else "; each variant passed the experiment's float64 check first" if not failed
               else "; failed the float64 check (not timed): " + ", ".join(failed))
    tools = {label: str(rows.loc[rows["row"] == label, "tool"].iloc[0]) for label in untimed}
    reasons = [f"{label} ({tool.split('; ', 1)[1] if '; ' in tool else 'no time recorded'})"
               for label, tool in tools.items()]
    not_timed = "; not timed: " + ", ".join(reasons) if reasons else ""
    lines += ["", f"{source}{medians}{checked}{not_timed}; rows: `{_decision_rows_path(path)}`."]
    return "\n".join(lines)


def _repository_path(path: Path) -> str:
    return path.resolve().relative_to(H200.parents[1]).as_posix()


def _decision_rows_path(path: Path) -> str:
    """Where a decision's rows live, as the repository names it (reports/h200/decisions/...)."""
    try:
        return path.resolve().relative_to(H200.parents[1]).as_posix()
    except ValueError:  # rows outside the repository (a test's): named as if in the decisions folder
        return f"reports/h200/decisions/{path.name}"


# each decision's table, and the ratios that state its effect (numerator row / denominator row)
DECISION_RATIOS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "block_sizes": (),
    "forward_memory_path": (
        ("host descriptors / pointer loads", "TMA, descriptors made on the host", "pointer loads"),
        ("per-program descriptors / pointer loads", "TMA, descriptors made per program", "pointer loads")),
    "query_major_backward_d256": (
        ("key-major, 4 warps / query-major time", "key-major 64x64, 4 warps: backward",
         "query-major 128x64, 8 warps: backward"),),
    "gluon_forward": (("warp-specialised Gluon / Triton", "Gluon, warp-specialised, 3 stages", "Triton forward"),
                      ("warp-specialised Gluon / cuDNN", "Gluon, warp-specialised, 3 stages", "sdpa-cudnn")),
    "gluon_backward": (("speed-up of dQ fused over Triton's two kernels", "Triton dK/dV, then Triton dQ",
                        "Gluon dK/dV adding dQ"),
                       ("speed over cuDNN (cuDNN time / ours)", "sdpa-cudnn", "Gluon dK/dV adding dQ")),
    "host_launch_paths": (
        ("Python runner / SDPA flash", "ours: Python runner, Function.apply", "SDPA flash"),
        ("C launcher and C apply, encoded at each launch / SDPA flash", "ours: C launcher and C apply, descriptors encoded at each launch",
         "SDPA flash"),
        ("encodings kept / encoded at each launch", "ours: C launcher and C apply, encodings kept by address",
         "ours: C launcher and C apply, descriptors encoded at each launch"),
        ("Python runner / C launcher and C apply, encoded at each launch", "ours: Python runner, Function.apply",
         "ours: C launcher and C apply, descriptors encoded at each launch")),
    "timing_windows": (("cuDNN: 20-ms / default windows", "sdpa-cudnn, 20-ms windows", "sdpa-cudnn, default windows"),
                       ("ours: 20-ms / default windows", "ours, 20-ms windows", "ours, default windows")),
    "bwd_step_loop": (("D late / D with L, one loop, time", "one loop, D late, softcap on Gluon",
                       "one loop, D with L, softcap on Triton"),
                      ("diagonal loop / one loop, D late, time", "diagonal loop, D late, softcap on Gluon",
                       "one loop, D late, softcap on Gluon"),
                      ("both / the old step, time", "diagonal loop, D late, softcap on Gluon",
                       "one loop, D with L, softcap on Triton"),
                      ("both / FA4, time", "diagonal loop, D late, softcap on Gluon", "fa4")),
    "bwd_launch_order": (("L2-sized sections / each pair in turn, time", "sections sized to L2, block-major",
                          "each pair's key blocks in turn"),
                         ("sections of 8 / each pair in turn, time", "sections of 8 pairs, block-major",
                          "each pair's key blocks in turn"),
                         ("every pair together / each pair in turn, time", "every pair together, block-major",
                          "each pair's key blocks in turn"),
                         ("L2-sized sections / FA4, time", "sections sized to L2, block-major", "fa4")),
    "varlen_bwd_loads": (("by the loader / from global, one loop, time", "L, D by the loader, one loop",
                          "L, D from global, one loop"),
                         ("from global: masked steps apart / one loop, time", "L, D from global, masked steps apart",
                          "L, D from global, one loop"),
                         ("by the loader: masked steps apart / one loop, time",
                          "L, D by the loader, masked steps apart", "L, D by the loader, one loop")),
    "bwd_dq_tiles": (("register order / rows, time", "dQ tiles in register order", "dQ tiles as rows"),
                     ("register order / FA4, time", "dQ tiles in register order", "fa4")),
}


_SPLITS_ROW = re.compile(r"^ours (?P<layout>contiguous|paged), (?P<splits>\d+) splits(?: \((?P<role>heuristic|rounded up)\))?$")


def decode_splits_table(path: Path) -> str:
    """The split-count decision's rows (GB/s of K and V read, one process): per
    shape, our contiguous-cache kernel at the heuristic's split count (programs rounded down to
    one wave), at the count rounding up would give, at the best other count measured, and SDPA
    flash and cuDNN beside them."""
    rows = pd.read_csv(path, keep_default_na=False)
    header = ("| batch x cache, kv heads | heuristic: splits, GB/s | rounded up: splits, GB/s | heuristic / rounded up "
              "| best other count: splits, GB/s | SDPA flash GB/s | cuDNN GB/s | heuristic / cuDNN |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for column, group in rows.groupby("column", sort=False):
        ours, peers = {}, {}
        for _, r in group.iterrows():
            m = _SPLITS_ROW.match(r["row"])
            if m is None:
                peers[r["row"]] = r["value"]
            elif m["layout"] == "contiguous":
                ours[int(m["splits"])] = (r["value"], m["role"])
        heuristic = next(n for n, (_, role) in ours.items() if role == "heuristic")
        up = next((n for n, (_, role) in ours.items() if role == "rounded up"), heuristic)
        others = {n: v for n, (v, _) in ours.items() if n not in (heuristic, up)}
        best = max(others, key=others.get) if others else None
        h, u = ours[heuristic][0], ours[up][0]
        best_cell = f"{best}, {others[best]:,.0f}" if best is not None else "-"
        up_cell = f"{up}, {u:,.0f}" if up != heuristic else "same count"
        lines.append(f"| {column} | {heuristic}, {h:,.0f} | {up_cell} | {_ratio(h, u)} | {best_cell} | "
                     f"{peers.get('sdpa-flash', float('nan')):,.0f} | {peers.get('sdpa-cudnn', float('nan')):,.0f} | "
                     f"{_ratio(h, peers.get('sdpa-cudnn', float('nan')))} |")
    lines += ["", f"{_settings(rows['tool'].iloc[0])}; rows: `{path.relative_to(H200.parents[1])}`."]
    return "\n".join(lines)


def bwd_schedule_label(stats: bool, dq_first: bool) -> str:
    """A schedule's row name in the backward schedule decision's rows."""
    return (f"L, D {'in shared memory' if stats else 'from global memory'}, "
            f"dQ {'before dK' if dq_first else 'after dK and dV'}")


_SCHEDULES = {(stats, dq_first): bwd_schedule_label(stats, dq_first) for stats in (False, True)
              for dq_first in (False, True)}
_SCHEDULE_CASE = re.compile(r"^(?P<variant>[\w-]+) .* (?P<heads>\d+)/(?P<kv>\d+)h$")


def _launcher_schedule(column: str) -> tuple[bool, bool]:
    """The schedule kernels/flash_attn_hopper.py's launcher takes for an experiment's case (its
    column: variant, shape, q/kv heads), by the launcher's own rule."""
    from kernels import flash_attn_hopper as hopper
    from kernels.configs import HOPPER_BWD_CONFIGS

    m = _SCHEDULE_CASE.match(column)
    flags = {name: m["variant"] == name.lower() for name in hopper.GLUON_FEATURE_FLAGS}
    return True, hopper.dq_first(HOPPER_BWD_CONFIGS[128], int(m["heads"]) // int(m["kv"]), flags)


def bwd_schedule_table(path: Path) -> str:
    """The backward schedule decision's rows (ms of the whole backward, one process, the
    median of its rounds): the four schedules of the Gluon dK/dV kernel per case, cuDNN beside
    the dense ones, then each choice's speed-up and the schedule the launcher takes
    (kernels/flash_attn_hopper.py: L and D in shared memory, dQ before dK with GQA, a window or
    ALiBi) against cuDNN."""
    times, checks, source = _experiment_rows(path)
    wide = times.pivot_table(index="row", columns="column", values="value", aggfunc="median", sort=False)
    columns = list(dict.fromkeys(times["column"]))
    wide = wide.reindex(columns=columns)
    lines = ["| ms | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for label, values in wide.iterrows():
        lines.append(f"| {label} | " + " | ".join("" if pd.isna(v) else f"{v:.3f}" for v in values) + " |")

    def cells(values) -> str:
        return " | ".join(_ratio(*v) for v in values)

    lines.append("| **L, D in shared memory: speed-up (dQ after dK)** | " + cells(
        (wide.at[_SCHEDULES[False, False], c], wide.at[_SCHEDULES[True, False], c]) for c in columns) + " |")
    lines.append("| **dQ before dK: speed-up (L, D in shared memory)** | " + cells(
        (wide.at[_SCHEDULES[True, False], c], wide.at[_SCHEDULES[True, True], c]) for c in columns) + " |")

    def taken(column: str) -> float:
        return wide.at[_SCHEDULES[_launcher_schedule(column)], column]

    cudnn = wide.loc["sdpa-cudnn"] if "sdpa-cudnn" in wide.index else pd.Series(dtype=float)
    lines.append("| **speed over cuDNN (cuDNN time / the launcher's schedule)** | " + cells(
        (cudnn.get(c, float("nan")), taken(c)) for c in columns) + " |")
    failed = sorted(checks.loc[checks["unit"] != "ok", "row"])
    check_note = ("every schedule matched the float64 gradients within 2x the Triton backward's error"
                  if not failed else "failed the float64 check (not timed): " + "; ".join(failed))
    # cells whose measurement failed or was not 'ok': the reason the experiment appended to the tool
    marked = times[times["tool"].str.contains("; ", regex=False)]
    if len(marked):
        check_note += "; not measured or not ok: " + "; ".join(
            f"{r.row}, {r.column}: {r.tool.split('; ', 1)[-1]}" for r in marked.itertuples())
    lines += ["", f"{source}; {check_note}; rows: `{_decision_rows_path(path)}`."]
    return "\n".join(lines)


LADDER_PROBE = Path(__file__).resolve().parents[1] / "ablations" / "probe"
CODE_FACTS = {"provider": "rung", "config": "tile", "mma": "mma, warps", "regs": "regs", "spills": "spills",
              "shared_bytes": "smem B", "sass_HMMA": "HMMA", "sass_HGMMA": "HGMMA", "sass_MUFU.EX2": "MUFU.EX2",
              "sass_BAR": "BAR", "sass_STS": "STS", "sass_LDS": "LDS"}


def dkdv_kernel_name(config: str) -> str:
    """The dK/dV kernel a result row's config (its JSON column) records, in the coverage table's words."""
    path = json.loads(config)["bwd_dkdv_path"]
    return {"gluon-ws": "Gluon dense", "gluon-ws-packed": "Gluon varlen (batch rows packed)"}.get(path, "Triton")


def csv_table(path: Path, columns: dict[str, str], query: str | None = None,
              select: Callable[[pd.DataFrame], pd.DataFrame] | None = None) -> str:
    """Some columns of a CSV as a Markdown table (headers renamed by `columns`, rows in file
    order, optionally those matching a pandas query, or those `select` returns); floats with
    three decimals."""
    rows = pd.read_csv(path, keep_default_na=False)
    if query:
        rows = rows.query(query)
    if select is not None:
        rows = select(rows)
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for _, r in rows.iterrows()]
    return "\n".join(lines + ["", f"Rows: `{path.relative_to(LADDER_PROBE.parents[1])}`."])


def tree_rounds_table(path: Path, tree_column: str, trees: dict[str, str]) -> str:
    """Runner rows of two source trees timed in alternating rounds (one decision CSV, the tree
    named in `tree_column`): one line per call, one ms column per tree and round. `trees` maps
    each tree's name in the rows to its header, in the order the columns go."""
    def select(rows):
        table = rows.assign(
            call=rows.batch.astype(str) + " x " + rows.seqlen.astype(str) + rows.causal.map({True: ", causal",
                                                                                                False: ""}),
            kernel=rows.config.map(dkdv_kernel_name),
            column=rows[tree_column] + ", round " + rows["round"].astype(str))
        return table.pivot_table(index=["call", "hdim", "kernel"], columns="column", values="ms",
                                 sort=False).reset_index()
    rounds = sorted(pd.read_csv(path)["round"].unique())
    columns = {"call": "call (causal where said)", "hdim": "head dim", "kernel": "dK/dV kernel"}
    columns |= {f"{tree}, round {r}": f"{header}, ms (round {r})" for r in rounds for tree, header in trees.items()}
    return csv_table(path, columns, select=select)


def ladder_code_facts_table(path: Path, headdim: int = 128) -> str:
    """`tools/ladder_probe.py --compile-only`'s rows for the tiles the ladder runs at `headdim`
    (kernels/fa_ladder.HOPPER_LADDER_CONFIGS), rungs 0-3: compiled for sm_90, the same ptxas as
    on the GPU."""
    from kernels.fa_ladder import HOPPER_LADDER_CONFIGS

    tiles = {rung: f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"
             for (rung, d), c in HOPPER_LADDER_CONFIGS.items() if d == headdim}

    def ladder_tiles(rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows[(rows["hdim"] == headdim) & (rows["config"] == rows["rung"].map(tiles))]
        return rows.drop_duplicates(["rung", "config"]).assign(provider="rung" + rows["rung"].astype(str))

    return csv_table(path, CODE_FACTS, select=ladder_tiles)


ANCHOR_METHODS = {"sdpa_flash": "sdpa-flash", "sdpa_efficient": "sdpa-efficient", "sdpa_cudnn": "sdpa-cudnn",
                  "torch_eager": "pytorch"}


def anchor_table(rows: pd.DataFrame, anchors: pd.DataFrame, band: float = 0.10) -> str:
    """This project's TFLOPs/s of each peer over the cited anchors' for the same (mode, causal,
    hdim, seqlen, batch, heads), each cell the median of its repeats: min / median / max per
    provider and mode, and how many cells differ by more than `band`."""
    anchors = anchors[anchors["method"].isin(ANCHOR_METHODS)].assign(
        provider=lambda a: a["method"].map(ANCHOR_METHODS))
    keys = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads"]
    ok = rows[rows["status"] == "ok"].groupby(keys, as_index=False)["tflops"].median()
    joined = anchors.merge(ok, on=keys, suffixes=("_anchor", ""))
    joined["ratio"] = joined["tflops"] / joined["tflops_anchor"]
    lines = ["| provider | mode | cells | min | median | max | outside +-10% |", "|---|---|---|---|---|---|---|"]
    for (provider, mode), group in joined.groupby(["provider", "mode"]):
        r = group["ratio"]
        outside = int(((r < 1 - band) | (r > 1 + band)).sum())
        lines.append(f"| {provider} | {mode} | {len(r)} | {r.min():.2f} | {r.median():.2f} | {r.max():.2f} | {outside} |")
    return "\n".join(lines)


PAPER_PEERS_DIR = H200 / "paper_fa4"
PAPER_PEERS_FP16_DIR = H200 / "paper_fa4_fp16"
PEERS = (("fa4", "FA4"), ("sdpa-cudnn", "cuDNN"), ("sdpa-flash", "official FA2"))
# the compilers, a reviewer's question: said in the sentences (and drawn in the folder's plots), not in the cells
COMPILER_PEERS = (("flex-attention", "FlexAttention"), ("torch-compile", "eager attention under torch.compile"))


LEVEL = 0.01  # a speed ratio within 1% of 1 counts as level, neither ahead nor behind


def _standing(ratio: pd.Series, label: str) -> str:
    """'ahead of LABEL in a of n configurations (by up to x%), behind in b (by y% to z%)'."""
    def span(low: float, high: float) -> str:
        return f"by {low:.0%}" if f"{low:.0%}" == f"{high:.0%}" else f"by {low:.0%} to {high:.0%}"

    ahead, behind = ratio[ratio >= 1 + LEVEL], ratio[ratio <= 1 - LEVEL]
    level = len(ratio) - len(ahead) - len(behind)
    text = f"ahead of {label} in {len(ahead)} of {len(ratio)} configurations"
    if len(ahead):
        text += f" ({span(ahead.min() - 1, ahead.max() - 1)})"
    if level:
        text += f", level (within {LEVEL:.0%}) in {level}"
    if len(behind):
        text += f", behind in {len(behind)} ({span(1 - behind.max(), 1 - behind.min())})"
    return text


def peers_table(rows: pd.DataFrame, folder: Path = PAPER_PEERS_DIR) -> str:
    """The strongest peers next to ours, from one paper-suite run: one line per (mode, hdim,
    causal), one column per seqlen, each cell our TFLOPs/s then our speed over FA4, cuDNN and the
    official FA2 kernel; then one generated sentence per mode saying where ours is ahead and
    behind each peer (the compilers too, where the run measured them), and by how much; then the
    peers' rows that did not time, with their reasons."""
    failed = rows[(rows.status != "ok") & rows.provider.isin([name for name, _ in PEERS + COMPILER_PEERS])]
    rows = rows[rows.status == "ok"]
    wide, lines = _speedup_grid(rows, tuple(name for name, _ in PEERS))
    env = rows.iloc[0]
    lines += ["", "Each cell: this repo's kernels in TFLOPs/s · their speed over " +
              ", ".join(label for _, label in PEERS) + f", measured in the same run ({env['dtype']}, "
              f"{run_environment(env)}; rows: "
              f"`reports/h200/{folder.name}/results.csv`).", ""]
    processes = rows.timestamp.nunique()
    if processes > 1:  # a run resumed (--resume) in another process: say which configurations span two
        spans = rows.groupby(["mode", "hdim", "causal", "seqlen"]).timestamp.nunique()
        spans = [", ".join(str(v) for v in key) for key in spans[spans > 1].index]
        machines = rows[[c for c in ("gpu", "driver", "torch", "triton", "git_commit") if c in rows]].drop_duplicates()
        same = (f"the same {', '.join(machines.columns)}" if len(machines) == 1
                else f"{len(machines)} different environments")
        lines += [(f"The rows come from {processes} processes (a run resumed with `--resume`; {same}, as the rows "
                   f"record them); configurations whose providers span two of them: "
                   f"{'; '.join(spans) if spans else 'none'}."), ""]
    for mode, group in wide.groupby(level=0, sort=True):
        parts = []
        for name, label in PEERS + COMPILER_PEERS:
            if name not in group:
                continue
            ratio = (group[OURS] / group[name]).dropna()
            if not ratio.empty:
                parts.append(_standing(ratio, label))
        lines.append(f"- **{mode}**: ours is " + "; ".join(parts) + ".")
    if not failed.empty:
        labels = dict(PEERS + COMPILER_PEERS)
        lines.append("")
        for (name, status), group in failed.groupby(["provider", "status"], sort=True):
            reason = str(group.reason.iloc[0]).split(";")[0][:160]
            lines.append(f"- {labels[name]}: {len(group)} configurations {status} ({reason})")
    return "\n".join(lines)


HOST_OVERHEAD_CSV = H200 / "host_overhead.csv"


def _experiment_rows(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """An experiment's rows in the decisions format: its 'ms' rows (values as floats), its float64
    check rows (unit 'ok' or 'wrong'), and its source (the tool without the per-row notes an
    experiment appends after '; ', and the commits)."""
    rows = pd.read_csv(path, keep_default_na=False)
    times = rows[rows["unit"] == "ms"].copy()
    times["value"] = times["value"].astype(float)
    return times, rows[rows["column"] == "check against float64"], _settings(rows["tool"].iloc[0].split("; ", 1)[0])


def _checked_times(path: Path, yardstick: str = "the Triton kernels' error") -> tuple[pd.DataFrame, str, str]:
    """_experiment_rows' times, its checks as a sentence (each within 2x `yardstick`), and its
    source line with the rows' path."""
    times, checks, source = _experiment_rows(path)
    failed = sorted(checks.loc[checks["unit"] != "ok", "row"])
    if checks.empty:
        check_note = "no float64 check in the rows"
    elif failed:
        check_note = "failed the float64 check (not timed): " + "; ".join(failed)
    else:
        check_note = f"{', '.join(checks['row'])}: each matched float64 within 2x {yardstick}"
    return times, check_note, f"{source}; rows: `{_decision_rows_path(path)}`"


def alibi_column_term_table(path: Path) -> str:
    """ALiBi's key-term decision rows: the dense causal forward and ALiBi's key term
    added each way (ms, the median of the rounds), and each way's time over the dense one's (the
    features bar: at most 1.1x)."""
    times, check_note, source = _checked_times(
        path, "the same-dtype PyTorch error (bf16 and fp16), its logsumexp within 1e-3")
    wide = times.pivot_table(index="column", columns="row", values="value", aggfunc="median", sort=False)
    dense = "no ALiBi (the dense forward)"
    ways = [r for r in dict.fromkeys(times["row"]) if r != dense]
    lines = ["| case | no ALiBi ms | " + " | ".join(f"{w} ms" for w in ways) + " | "
             + " | ".join(f"{w} / no ALiBi" for w in ways) + " |", "|---|---|" + "---|" * (2 * len(ways))]
    for case, r in wide.iterrows():
        lines.append(f"| {case} | {r[dense]:.3f} | " + " | ".join(f"{r[w]:.3f}" for w in ways) + " | "
                     + " | ".join(_ratio(r[w], r[dense]) for w in ways) + " |")
    return "\n".join(lines + ["", f"{source}; {check_note}."])


DECODE_ANCHORS = ((1, 65536), (8, 8192), (32, 4096))


def _decode_rows(folder: Path) -> pd.DataFrame:
    rows = pd.read_csv(Path(folder) / "decode.csv", keep_default_na=False)
    rows = rows[rows.provider != "device-copy"]
    return rows.assign(gbps=pd.to_numeric(rows.gbps, errors="coerce"))


def decode_peers_table(folder: Path) -> str:
    """GB/s of K and V read per (provider, layout) at the decode suite's anchor shapes, then each
    provider that has no ok row with its reason: every decode peer of one run."""
    rows = _decode_rows(folder)
    anchors = rows[rows[["batch", "cache_len"]].apply(tuple, axis=1).isin(DECODE_ANCHORS)]
    ok = anchors[anchors.status == "ok"]
    wide = ok.pivot_table(index=["label", "layout"], columns=["kv_heads", "batch", "cache_len"], values="gbps",
                          aggfunc="first", sort=False)
    columns = list(wide.columns)
    lines = ["| provider | cache | " + " | ".join(f"{b} x {n // 1024}k, {h} kv heads" for h, b, n in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for (label, layout), values in wide.iterrows():
        lines.append(f"| {label} | {layout} | " + " | ".join("" if pd.isna(v) else f"{v:,.0f}" for v in values) + " |")
    never = rows.groupby(["label", "layout"], sort=False).filter(lambda g: not (g.status == "ok").any())
    notes = [f"- {label} ({layout}): {status}, {reason}" for (label, layout), (status, reason) in
             never.groupby(["label", "layout"], sort=False)[["status", "reason"]].first().iterrows()]
    env = rows.iloc[0]
    source = (f"GB/s of K and V read, one run ({env.gpu}, torch {env.torch}), rows: "
              f"{_repository_path(Path(folder) / 'decode.csv')}.")
    return "\n".join(lines + ["", source] + (["", "Providers without a measured row here:", ""] + notes if notes else []))


def peer_counters_table(run: Path) -> str:
    """`runner.py --ncu-only` rows (counters.csv of the run's folder) of our kernels beside a
    peer's: one table per call (reports.counters.counter_table with SHOWN_BESIDE_PEER), ours
    first; under them how they were taken and the run's environment."""
    from reports.counters import SHOWN_BESIDE_PEER, counter_table

    markdown, _ = counter_table(pd.read_csv(run / "counters.csv"), ["fa2"], SHOWN_BESIDE_PEER)
    sections = ["### " + section.strip() for section in markdown.split("\n### ")[1:]]
    runs = load_runs(run)
    env = runs[-1]["environment_before"] if runs else {}
    command = re.sub(r" --out \S+", "", runs[-1]["command"].split("runner.py", 1)[-1].strip()) if runs else ""
    source = (f"`python runner.py {command}` "
              f"(Nsight Compute, `--clock-control none`, one launch a kernel after warm-up; fa2 is ours): "
              f"{run_environment(env)}, FA4 {env.get('flash_attn_4', '')}; rows: "
              f"`{_repository_path(run / 'counters.csv')}`.")
    return "\n\n".join(sections) + "\n\n" + source


def compare_configs_table(path: Path, a_label: str | None = None, b_label: str | None = None) -> str:
    """tools/compare_configs.py's rows (one or several runs, config A against config B per call
    shape): per shape, each config's median time over its interleaved rounds and B's speed-up
    (A's time / B's), one line per shape; `a_label` and `b_label` say what A and B ran. Without
    them each run is a line of its own that names its configs' fields (a file of several fields
    compared against the table, several of them on one shape)."""
    rows = pd.read_csv(path, keep_default_na=False)
    shape = ["call", "batch", "seqlen", *(["seqlen_k"] if "seqlen_k" in rows else []), "lengths", "heads", "kv_heads",
             "headdim", "causal", "dtype"]
    shape += [column for column in ("window", "dropout_p") if column in rows]
    per_run = a_label is None or b_label is None
    key = shape + (["timestamp"] if per_run else [])  # a compare_configs.py run's rows share its timestamp
    medians = rows.groupby(key + ["config"], sort=False)["ms"].median().unstack("config")
    fields = rows.groupby(key + ["config"], sort=False)["fields"].first().unstack("config") if per_run else None
    rounds = rows.groupby(key + ["config"], sort=False).size().min()
    if per_run:
        header = "| call | batch x seqlen | heads (kv) | head dim | causal | A | A, ms | B | B, ms | B's speed-up |"
    else:
        header = (f"| call | batch x seqlen | heads (kv) | head dim | causal | A: {a_label}, ms | B: {b_label}, ms "
                  "| B's speed-up |")
    lines = [header, "|---|---|---|---|---|" + "---|" * (5 if per_run else 3)]
    checked = (rows.groupby(key, sort=False)["checked_shape"].first() if "checked_shape" in rows
               else pd.Series(dtype=str))
    for index, ms in medians.sort_index(level=["causal", "seqlen"], sort_remaining=False).iterrows():
        row = dict(zip(key, index))
        size = f"{row['batch']} sequences: {row['lengths']}" if row["lengths"] else f"{row['batch']} x {row['seqlen']}"
        if row.get("seqlen_k") and row["seqlen_k"] != row["seqlen"]:  # keys of another length (--seqlen-k)
            size += f" q, {row['seqlen_k']} k"
        if checked.get(index, ""):
            size += f" (checked on {checked[index]})"
        heads = f"{row['heads']}" + (f" ({row['kv_heads']})" if row["kv_heads"] != row["heads"] else "")
        a_cell, b_cell = f"{ms['A']:.3f}", f"{ms['B']:.3f}"
        if per_run:
            a_cell = f"{fields.loc[index, 'A'] or 'the table'} | {a_cell}"
            b_cell = f"{fields.loc[index, 'B'] or 'the table'} | {b_cell}"
        causal = (f"{row['causal']}" + (f", window {row['window']}" if row.get("window") else "")
                  + (f", dropout {row['dropout_p']}" if float(row.get("dropout_p") or 0) else ""))
        lines.append(f"| {row['call']} | {size} | {heads} | {row['headdim']} | {causal} | {a_cell} "
                     f"| {b_cell} | {_ratio(ms['A'], ms['B'])} |")
    gpus = ", ".join(sorted(rows.gpu.unique()))
    source = (f"`tools/compare_configs.py`, {rows.dtype.iloc[0]}, {gpus}: the median of at least {rounds} "
              "interleaved rounds per config, both in one process per shape, each checked against float64 first "
              "(where the whole call's reference would not fit, on its first batch rows and heads: named where the "
              f"rows record it); rows: `{_repository_path(path)}`.")
    notes = path.with_name(path.stem + ".notes.txt")  # harness.suite.SuiteRows' throttle notes
    if notes.exists() and "throttled" in notes.read_text():
        source += (" Clocks were throttled during some of these runs (A and B alike, in turn): "
                   f"`{_repository_path(notes)}`.")
    return "\n".join([*lines, "", source])


def transformers_example_table(path: Path) -> str:
    """tools/transformers_llama.py's rows: each phase's time per provider and ours over SDPA's,
    with the agreement checks of the same run."""
    rows = pd.read_csv(path)
    ours = next(p for p in rows.provider.unique() if p != "sdpa")
    wide = rows.pivot_table(index="phase", columns="provider", values="ms", sort=False)
    memory = rows.pivot_table(index="phase", columns="provider", values="peak_mem_mb", sort=False, dropna=False)
    lines = ["| phase | ours, ms | SDPA, ms | speed over SDPA | peak memory ours / SDPA, MiB |", "|---|---|---|---|---|"]
    for phase, ms in wide.iterrows():
        first = rows[rows.phase == phase].iloc[0]
        what = (f"{phase} ({first.batch} x {first.seqlen} tokens)" if phase != "generate" else
                f"generate ({first.batch} x {first.new_tokens} new tokens after {first.seqlen})")
        mem = memory.reindex(wide.index).loc[phase]
        peak = "-" if pd.isna(mem[ours]) else f"{mem[ours]:,.0f} / {mem['sdpa']:,.0f}"
        lines.append(f"| {what} | {ms[ours]:.1f} | {ms['sdpa']:.1f} | {_ratio(ms['sdpa'], ms[ours])} | {peak} |")
    env = rows.iloc[0]
    single = (rows.ms_p20 == rows.ms_p80).all()
    timing = ("each time one timed call after a warm-up one (these rows were timed with a do_bench window "
              "shorter than one call)" if single else "each time the median of do_bench's calls")
    source = (f"One run, {env.gpu}, torch {env.torch}, bf16; {timing}; generate is the wall time of one call. "
              "Largest prefill logit difference between the two on real tokens (bf16 both): "
              f"{float(env.max_logit_diff):.3g}; greedy tokens the same: {env.same_tokens}. "
              f"Rows: `{_repository_path(path)}`.")
    return "\n".join([*lines, "", source])


EAGER_BAR = 0.9  # eager ours / cuDNN wherever the CUDA-graph timing reaches it


def decode_eager_table(graph_folder: Path, eager_folder: Path) -> str:
    """Ours and cuDNN (SDPA) per shape, timed by CUDA-graph replay and eagerly (do_bench with host
    time, as model.generate calls it), two runs on one machine: GB/s and ours / cuDNN, then the
    check that eager ours reads at least EAGER_BAR x cuDNN's GB/s at every shape where the
    CUDA-graph timing does."""
    both = []
    for how, folder in (("CUDA graph", graph_folder), ("eager", eager_folder)):
        rows = _decode_rows(folder)
        rows = rows[(rows.status == "ok") & (rows.layout == "contiguous")
                    & rows.provider.isin(["ours-splitkv", "sdpa-cudnn"])]
        both.append(rows.assign(how=how))
    wide = pd.concat(both).pivot_table(index=["kv_heads", "batch", "cache_len"], columns=["how", "provider"],
                                       values="gbps", sort=False)
    lines = [("| kv heads | batch x cache | ours, CUDA graph | cuDNN, CUDA graph | ours / cuDNN | ours, eager | "
             "cuDNN, eager | ours / cuDNN, eager |"), "|---|---|---|---|---|---|---|---|"]
    checked, missed = 0, []
    for (heads, batch, cache_len), r in wide.sort_index().iterrows():
        cells, ratios = [], {}
        for how in ("CUDA graph", "eager"):
            ours, cudnn = r[(how, "ours-splitkv")], r[(how, "sdpa-cudnn")]
            ratios[how] = ours / cudnn
            cells += [f"{ours:,.0f}", f"{cudnn:,.0f}", f"{ours / cudnn:.2f}x"]
        shape = f"{batch} x {cache_len // 1024}k"
        lines.append(f"| {heads} | {shape} | " + " | ".join(cells) + " |")
        if ratios["CUDA graph"] >= EAGER_BAR:
            checked += 1
            if not ratios["eager"] >= EAGER_BAR:
                missed.append(f"{shape}, {heads} kv heads ({ratios['eager']:.2f}x)")
    verdict = ("no shape reaches it on CUDA-graph timing" if not checked else
               f"met at all {checked} shapes" if not missed else
               f"not met at {len(missed)} of {checked} shapes: " + "; ".join(missed))
    env = _decode_rows(eager_folder).iloc[0]
    return "\n".join(lines + ["", (f"Eager ours / cuDNN >= {EAGER_BAR} wherever the CUDA-graph timing reaches it: "
                                   f"{verdict}."),
                              "", (f"GB/s of K and V read ({env.gpu}, torch {env.torch}); rows: "
                                   f"{_repository_path(Path(graph_folder) / 'decode.csv')}, "
                                   f"{_repository_path(Path(eager_folder) / 'decode.csv')}.")])


SECTIONS = {
    "ablation": lambda: file_section(H200 / "ablation" / "ablation.md", stop_at="## Sweep"),
    "anchors": lambda: anchor_table(load_results(H200 / "paper"),
                                    pd.read_csv(H200 / "peer_anchors" / "h200_anchors_2026-11-30.csv")),
    "matmul_ceiling": lambda: (H200 / "matmul_ceiling.txt").read_text().strip(),
    "utilisation": lambda: utilisation_table(pd.read_csv(KERNEL_VS_FA2_CSV),
                                             matmul_ceiling_tflops(H200 / "matmul_ceiling.txt")),
    "peers": lambda: peers_table(load_results(PAPER_PEERS_DIR)),
    "peers_fp16": lambda: peers_table(load_results(PAPER_PEERS_FP16_DIR), PAPER_PEERS_FP16_DIR),
    "host_overhead": lambda: host_overhead_table(pd.read_csv(HOST_OVERHEAD_CSV), _repository_path(HOST_OVERHEAD_CSV)),
    "host_engine": lambda: host_engine_table(pd.read_csv(HOST_OVERHEAD_CSV), _repository_path(HOST_OVERHEAD_CSV)),
    "alibi_matmul_wide": lambda: alibi_column_term_table(DECISIONS / "alibi_matmul_wide.csv"),
    "decode_splits": lambda: decode_splits_table(DECISIONS / "decode_splits.csv"),
    "bwd_schedule": lambda: bwd_schedule_table(DECISIONS / "bwd_schedule.csv"),
    "features_bar": lambda: file_section(H200 / "features" / "features.md", stop_at="## Notes",
                                         start_at="## The bar"),
    "decode_targets": lambda: file_section(H200 / "decode" / "report.md", stop_at="## 8 kv heads",
                                           start_at="## The targets"),
    "train_table1_h100": lambda: file_section(H100 / "train" / "report.md", stop_at="### Every measurement",
                                              start_at="## Table 1"),
    "train_longest_h100": lambda: file_section(H100 / "train" / "report.md", stop_at="![tokens/s",
                                               start_at="## The longest context"),
    "train_parity_h100": lambda: file_section(H100 / "train" / "report.md", stop_at="![loss curves",
                                              start_at="## The same model"),
    "decode_peers_h100": lambda: decode_peers_table(H100 / "decode"),
    "decode_peers_h200": lambda: decode_peers_table(H200 / "decode"),
    "decode_eager_h200": lambda: decode_eager_table(H200 / "decode", H200 / "decode_eager"),
    "coverage_h200": lambda: file_section(H200 / "coverage" / "coverage.md", start_at="TFLOPs/s on the visible",
                                          stop_at="## Providers that did not take"),
    "decode_eager_h100": lambda: decode_eager_table(H100 / "decode_graph_quick", H100 / "decode_eager_quick"),
    "ladder_code_facts": lambda: ladder_code_facts_table(LADDER_PROBE / "code_facts_sm90.csv"),
    "coverage_h100": lambda: file_section(H100 / "coverage" / "coverage.md", start_at="TFLOPs/s on the visible",
                                          stop_at="## Providers that did not take"),
    "gluon_forward_wide_heads_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_wide_heads.csv", "Triton forward", "Gluon forward"),
    "gluon_forward_min_keys_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_min_keys.csv",
        "the table's when measured (the Triton forward, below its hopper_gluon_min_keys)",
        "Gluon forward (hopper_gluon_min_keys lowered to the call's keys)"),
    "gluon_forward_block_n_d192_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_block_n_d192.csv", "64-key blocks (the table's)",
        "128-key blocks (hopper_gluon_block_n=128)"),
    "gluon_forward_d64_short_causal_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_d64_short_causal.csv"),
    "gluon_forward_half_key_blocks_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_half_key_blocks.csv", "the table's key blocks",
        "half as many keys a block (hopper_gluon_block_n)"),
    "gluon_forward_extra_keys_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_extra_keys.csv"),
    "gluon_forward_kv_ring_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_kv_ring.csv"),
    "gluon_backward_d64_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_backward_d64.csv",
                                                             "Triton dK/dV, then Triton dQ",
                                                             "Gluon dK/dV adding dQ in turns"),
    "gluon_backward_d64_128_rows_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_d64_128_rows.csv"),
    "gluon_backward_d96_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_backward_d96.csv",
                                                             "Triton dK/dV, then Triton dQ",
                                                             "Gluon dK/dV in two head-dim sections, dQ in turns"),
    "gluon_backward_d192_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_backward_d192.csv",
                                                              "Triton dK/dV, then Triton dQ",
                                                              "Gluon dK/dV for wide heads, dQ fused"),
    "gluon_backward_d256_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_d256.csv", "Gluon dK/dV for wide heads, dQ from registers (the table)",
        "Triton dK/dV, then Triton dQ (hopper_gluon_min_keys above the call's keys)"),
    "gluon_backward_wide_exchange_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_wide_exchange.csv",
        "P^T to the dP warpgroup, which forms dS^T (the kept form)", "dP^T - D to the S warpgroup, which forms dS^T"),
    "gluon_backward_min_keys_d256_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_min_keys_d256.csv", "Triton dK/dV, then Triton dQ (the table's when measured)",
        "Gluon dK/dV for wide heads (hopper_gluon_min_keys 512)"),
    "bwd_s_dq_tile_d192_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_s_dq_tile_d192.csv", "the dP warpgroup computing dQ (the kept form)",
        "the S warpgroup computing dQ's first tile, from registers"),
    "gluon_backward_wide_fields_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_wide_fields.csv"),
    "gluon_backward_cross_fields_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_cross_fields.csv"),
    "gluon_forward_persistent_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_persistent.csv"),
    "gluon_forward_tile_loop_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_tile_loop.csv"),
    "gluon_backward_varlen_mask_h200": lambda: compare_configs_table(
        H200 / "decisions" / "gluon_backward_varlen_mask.csv"),
    "gluon_fields": lambda: compare_configs_table(DECISIONS / "gluon_fields.csv"),
    "gluon_fields_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_fields.csv"),
    "fwd_launch_order_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_launch_order.csv"),
    "fwd_named_barriers_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_named_barriers.csv",
                                                             "mbarrier arrives", "named barriers"),
    "fwd_q_in_registers_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_q_in_registers.csv"),
    "bwd_k_in_registers_d192_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_k_in_registers_d192.csv", "K read from shared memory (the kept form)",
        "the S warpgroup's K in registers"),
    "bwd_dq_reductions_d192_h200": lambda: compare_configs_table(
        DECISIONS / "gluon_backward_dq_atomics_d192.csv", "dQ staged for the writer warp (the kept form)",
        "dQ added from registers by 16-byte reductions"),
    "bwd_triton_fused_dq_d256_h100": lambda: compare_configs_table(
        H100 / "decisions" / "triton_fused_dq_d256.csv"),
    "bwd_dq_writer_per_consumer_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_dq_writer_per_consumer.csv", "one dQ writer warp (the kept form)",
        "a dQ writer warp per consumer"),
    "fwd_pin_softmax_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_pin_softmax.csv",
                                                          "without the pin",
                                                          "row sums stored before P V's wait"),
    "fwd_pin_store_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_pin_store.csv", "row sums to an unread shared row, after a barrier",
        "row sums by a store never taken"),
    "fwd_pin_store_table_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_forward_pin_store_table.csv"),
    "fwd_mask_loops_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_forward_mask_loops.csv", "masked blocks behind a run-time branch in the key loop",
        "unmasked and masked key blocks in loops of their own"),
    "gluon_backward_varlen_persistent_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_varlen_persistent.csv", "one program a key block",
        "a persistent grid, two K/V slots"),
    "fwd_counters_h100": lambda: peer_counters_table(H100 / "counters_fa4"),
    "bwd_counters_sections_h100": lambda: peer_counters_table(H100 / "counters_bwd_fa4_sections"),
    "bwd_counters_h100": lambda: peer_counters_table(H100 / "counters_bwd_fa4"),
    "bwd_counters_writer_h100": lambda: peer_counters_table(H100 / "counters_bwd_fa4_writer"),
    "bwd_dq_scale_h100": lambda: csv_table(
        H100 / "decisions" / "gluon_backward_dq_scale.csv",
        {"hdim": "head dim", "causal": "causal", "every step, round 1": "scaled every step, ms (round 1)",
         "cast, round 1": "scaled in the cast, ms (round 1)", "every step, round 2": "scaled every step, ms (round 2)",
         "cast, round 2": "scaled in the cast, ms (round 2)"},
        select=lambda rows: rows.assign(column=rows.dq_scale.map({"scaled every step": "every step",
                                                                  "scaled in the cast": "cast"})
                                        + ", round " + rows["round"].astype(str))
        .pivot_table(index=["hdim", "causal"], columns="column", values="ms", sort=False).reset_index()),
    "bwd_dq_writer_h100": lambda: tree_rounds_table(
        H100 / "decisions" / "gluon_backward_dq_writer.csv", "dq_writer",
        {"consumers issue the reduce-adds": "consumers issue", "writer warp": "writer warp"}),
    "bwd_dq_writer_d192_h100": lambda: tree_rounds_table(
        H100 / "decisions" / "gluon_backward_dq_writer_d192.csv", "dq_writer",
        {"dP warpgroup issues the reduce-adds": "dP warpgroup issues", "writer warp": "writer warp"}),
    "bwd_dq_writer_in_flight_h100": lambda: tree_rounds_table(
        H100 / "decisions" / "gluon_backward_dq_writer_in_flight.csv", "dq_release",
        {"tile released once read": "released once read", "reduce-adds left in flight": "left in flight"}),
    "host_overhead_off_grid_h100": lambda: host_overhead_table(
        pd.read_csv(H100 / "host_overhead" / "host_overhead.csv"),
        _repository_path(H100 / "host_overhead" / "host_overhead.csv")),
    "varlen_host_plans_h100": lambda: csv_table(
        H100 / "decisions" / "varlen_host_plans.csv",
        {"case": "call (bf16, causal)", "hdim": "head dim", "mode": "pass",
         "host_enqueue_ms, descriptors built per call": "host ms, descriptors per call",
         "host_enqueue_ms, per-shape plan": "host ms, plan",
         "do_bench_ms, descriptors built per call": "timed ms, descriptors per call",
         "do_bench_ms, per-shape plan": "timed ms, plan"},
        select=lambda rows: rows.pivot_table(index=["case", "hdim", "mode"], columns="launch",
                                             values=["host_enqueue_ms", "do_bench_ms"], aggfunc="median", sort=False)
        .pipe(lambda t: t.set_axis([f"{value}, {launch}" for value, launch in t.columns], axis=1)).reset_index()),
    "bwd_launch_order_h100": lambda: compare_configs_table(H100 / "decisions" / "gluon_backward_launch_order.csv"),
    "gluon_backward_dq_first_d192_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_dq_first_d192.csv", "dQ after dV and dK (the table's when measured)",
        "dQ first, written out under dV and dK"),
    "gluon_backward_min_keys_d192_h100": lambda: compare_configs_table(
        H100 / "decisions" / "gluon_backward_min_keys_d192.csv",
        "the table's when measured (1k keys: the Gluon kernel; 512: the Triton one)",
        "the other kernel (hopper_gluon_min_keys 0, or 512)"),
    "transformers_llama_h100": lambda: transformers_example_table(H100 / "transformers" / "transformers_llama.csv"),
    "decode_xformers_h100": lambda: decode_peers_table(H100 / "decode_xformers"),
    **{name: (lambda name=name, ratios=ratios: decision_table(DECISIONS / f"{name}.csv", ratios))
       for name, ratios in DECISION_RATIOS.items()},
}


def update_markdown(path: Path) -> list[str]:
    """Rewrite each marked section of `path`; returns the names of the sections rewritten.
    A section whose source is missing is left as it is, with a note on stderr."""
    text = path.read_text()
    done = []
    for name, render in SECTIONS.items():
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n)(?:.*?\n)?(<!-- END {name} -->)", re.DOTALL)
        if not pattern.search(text):
            continue
        try:
            body = render()
        except FileNotFoundError as exc:
            print(f"{path}: section {name!r} left as it is: {exc}")
            continue
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
        done.append(name)
    path.write_text(text)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("markdown", nargs="*", type=Path, help="Markdown files whose marked sections to rewrite")
    parser.add_argument("--kernel-vs-fa2", type=Path, action="append", metavar="RESULTS_CSV", default=[],
                        help="extract reports/h200/kernel_vs_fa2.csv (bf16) / kernel_vs_fa2_fp16.csv from a "
                             "paper-suite results.csv first (once per file: --kernel-vs-fa2 A --kernel-vs-fa2 B)")
    args = parser.parse_args()
    not_markdown = [str(path) for path in args.markdown if path.suffix != ".md"]
    if not_markdown:  # e.g. a second results.csv after one --kernel-vs-fa2 (each file needs its own flag)
        parser.error(f"not Markdown files: {', '.join(not_markdown)} (give each results.csv its own --kernel-vs-fa2)")
    for results_csv in args.kernel_vs_fa2:
        extract_kernel_vs_fa2(results_csv)
    for path in args.markdown:
        print(f"{path}: rewrote {', '.join(update_markdown(path)) or 'nothing'}")


if __name__ == "__main__":
    main()
