"""The host-overhead suite's report (host_overhead.md), from its rows alone: host time per call
against the GPU's, ours against SDPA flash, eager and compiled, and the backward's engine."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.host_overhead import HOST_OVERHEAD_CSV
from reports.tables import ratio_cell

OURS, OFFICIAL = "fa2", "sdpa-flash"


def host_overhead_table(rows: pd.DataFrame, rows_path: str = HOST_OVERHEAD_CSV) -> str:
    """Host time per call, ours against SDPA flash, eager and under torch.compile, with the GPU
    time of the eager calls, from harness/host_overhead.py's rows (all from one run; `rows_path` names them); a cell
    without an ok row reads n/a, and the rows' errors are listed below the table. The backward's
    engine is PyTorch's default (rows from before the engine column had only that one)."""
    rows = _threaded_engine(rows)
    ok = rows[rows.status == "ok"].copy()
    ok["compiled"] = ok.compiled.astype(bool)
    wide = ok.pivot_table(index=["mode", "batch", "heads", "seqlen", "hdim"], columns=["compiled", "provider"],
                          values=["host_ms", "gpu_ms"], aggfunc="median")

    def cell(r, value, compiled, provider):
        x = r.get((value, compiled, provider), float("nan"))
        return float("nan") if pd.isna(x) else float(x)

    ms = _host_ms

    lines = [("| mode | batch, heads, seqlen, hdim | ours host ms | SDPA flash host ms | host ratio | "
              "compiled: ours host ms | compiled: SDPA flash host ms | compiled host ratio | ours GPU ms | "
              "SDPA flash GPU ms |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, batch, heads, seqlen, hdim), r in wide.iterrows():
        host = [cell(r, "host_ms", c, p) for c in (False, True) for p in (OURS, OFFICIAL)]
        gpu = [cell(r, "gpu_ms", False, p) for p in (OURS, OFFICIAL)]
        lines.append(f"| {mode} | {batch}, {heads}, {seqlen}, {hdim} | {ms(host[0])} | {ms(host[1])} | "
                     f"{ratio_cell(host[0], host[1])} | {ms(host[2])} | {ms(host[3])} | {ratio_cell(host[2], host[3])} | "
                     f"{ms(gpu[0])} | {ms(gpu[1])} |")
    env = rows.iloc[0]
    lines += ["", (f"Causal, {env['dtype']}; host time with the GPU kept ahead by a sleep, GPU time by CUDA-graph "
                   f"replay of the eager call; 'compiled': `torch.compile(fullgraph=True)` of the same call "
                   f"({env['gpu']}, torch {env['torch']}, commit {env['git_commit']}; rows: "
                   f"`{rows_path}`).")]
    no_gpu = rows[(rows.status == "ok") & rows.gpu_ms.isna() & rows.reason.notna()]
    for reason, group in no_gpu.groupby("reason"):
        modes = ", ".join(sorted(set(group["mode"])))
        lines.append(f"- no GPU time for mode {modes}: {reason.removeprefix('gpu_ms: ')}")
    failed = rows[rows.status != "ok"]
    names = {OURS: "ours", OFFICIAL: "SDPA flash"}
    for (provider, mode, compiled, reason), group in failed.groupby(["provider", "mode", "compiled", "reason"]):
        kind = "compiled" if compiled else "eager"
        lines.append(f"- {names.get(provider, provider)} {mode} ({kind}) failed at {len(group)} shapes: {reason}")
    return "\n".join(lines)


def _host_ms(x: float) -> str:
    return "n/a" if pd.isna(x) else f"{x:.3f}"


def _threaded_engine(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose backward ran on PyTorch's default engine (its device threads)."""
    if "engine" not in rows:
        return rows
    return rows[rows.engine.isna() | (rows.engine == "threaded")]


def host_engine_table(rows: pd.DataFrame, rows_path: str = HOST_OVERHEAD_CSV) -> str:
    """Eager host time per call with the backward on the autograd engine's device thread (the
    default) and on the calling thread (`torch.autograd.set_multithreading_enabled(False)`), ours
    and SDPA flash, from harness/host_overhead.py's rows: how much of each call is the hand-over
    between the two threads. A cell without an ok row reads n/a."""
    if "engine" not in rows or not (rows.engine == "calling-thread").any():
        raise ValueError("no rows with the backward on the calling thread: run harness.host_overhead with "
                         "--engines threaded,calling-thread")
    ok = rows[(rows.status == "ok") & ~rows.compiled.astype(bool) & (rows["mode"] != "fwd")].copy()
    ok["engine"] = ok.engine.fillna("threaded")
    wide = ok.pivot_table(index=["mode", "batch", "heads", "seqlen", "hdim"], columns=["engine", "provider"],
                          values="host_ms", aggfunc="median")
    ms = _host_ms
    faster = dict.fromkeys((OURS, OFFICIAL), 0)  # cells where the calling thread was the faster engine

    lines = [("| mode | batch, heads, seqlen, hdim | ours: device thread | ours: calling thread | SDPA flash: device "
              "thread | SDPA flash: calling thread | ours / SDPA flash, calling thread |"), "|---|---|---|---|---|---|---|"]
    for (mode, batch, heads, seqlen, hdim), r in wide.iterrows():
        cells = [float(r.get((engine, provider), float("nan"))) for provider in (OURS, OFFICIAL)
                 for engine in ("threaded", "calling-thread")]
        faster[OURS] += cells[1] < cells[0]
        faster[OFFICIAL] += cells[3] < cells[2]
        lines.append(f"| {mode} | {batch}, {heads}, {seqlen}, {hdim} | {' | '.join(ms(c) for c in cells)} | "
                     f"{ratio_cell(cells[1], cells[3])} |")
    env = rows.iloc[0]
    lines += ["", (f"The calling thread issued faster than the device thread in {faster[OURS]} of {len(wide)} "
                   f"cells for ours, {faster[OFFICIAL]} of {len(wide)} for SDPA flash."),
              "", (f"Host ms per eager call, causal, {env['dtype']}, the GPU kept ahead by a sleep ({env['gpu']}, "
                   f"torch {env['torch']}, commit {env['git_commit']}; rows: `{rows_path}`).")]
    return "\n".join(lines)


def write_host_overhead_report(out_dir) -> Path:
    """host_overhead.md from out_dir/host_overhead.csv: the host table and, where the rows have the
    backward on the calling thread too, the engines' table."""
    out_dir = Path(out_dir)
    rows = pd.read_csv(out_dir / HOST_OVERHEAD_CSV)
    lines = ["# Host time per call", "", host_overhead_table(rows)]
    if "engine" in rows and (rows.engine == "calling-thread").any():
        lines += ["", "## The backward's engine", "", host_engine_table(rows)]
    path = out_dir / "host_overhead.md"
    path.write_text("\n".join(lines) + "\n")
    return path
