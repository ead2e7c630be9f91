"""Generated sections of the README and the notes, from committed result rows.

Markdown files mark a generated section with `<!-- BEGIN name -->` ... `<!-- END name -->`;
`python -m reports.embed README.md reports/h200/perf_notes.md` rewrites every marked section
from the CSVs under reports/h200/, so no number in them is typed by hand.

    python -m reports.embed --kernel-vs-fa2 results/paper/results.csv results/paper_fp16/results.csv
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from harness.results import load_results

H200 = Path(__file__).resolve().parent / "h200"
TUNING = H200 / "tuning"
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


def _ratio(ours: float, peer: float) -> str:
    return "n/a" if pd.isna(peer) or peer == 0 else f"{ours / peer:.2f}x"


def kernel_vs_fa2_table(rows: pd.DataFrame, source: Path = KERNEL_VS_FA2_CSV) -> str:
    """One line per (mode, hdim, causal), one column per seqlen; each cell: our TFLOPs/s, then
    our speed over the official FA2 kernel's and over cuDNN's, all measured in the same run."""
    wide = rows.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider",
                            values="tflops", aggfunc="median")
    for column in (OURS, OFFICIAL, CUDNN):
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
            cells.append(f"{r[OURS]:.0f} · {_ratio(r[OURS], r[OFFICIAL])} · {_ratio(r[OURS], r[CUDNN])}")
        lines.append(f"| {mode} | {hdim} | {causal} | " + " | ".join(cells) + " |")
    env = rows.iloc[0]
    tokens = sorted((rows["batch"] * rows["seqlen"]).unique())
    hidden = sorted((rows["heads"] * rows["hdim"]).unique())
    lines.append("")
    lines.append(f"Each cell: this repo's FA2 kernel in TFLOPs/s · its speed over the official FA2 CUDA kernel "
                 f"(SDPA flash) · over cuDNN (SDPA cudnn), measured in the same run. {env['dtype']}, "
                 f"batch x seqlen = {', '.join(map(str, tokens))}, heads x hdim = {', '.join(map(str, hidden))}, "
                 f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; rows: `reports/h200/{source.name}`.")
    return "\n".join(lines)


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


def text_block(path: Path) -> str:
    """A tool's saved text output (e.g. a compiler report), embedded verbatim as a code block."""
    return "```\n" + path.read_text().strip() + "\n```"


def tuning_table(path: Path, hdims: tuple[int, ...] | None = None) -> str:
    """tools/tune_fa2.py's rows: TFLOPs/s of each candidate config per (pass, hdim, causal), the
    two SDPA peers measured in the same process first; `hdims` keeps only those head dims."""
    rows = pd.read_csv(path)
    rows = rows[(rows.status == "ok") & (rows.hdim.isin(hdims) if hdims else True)]
    if "seqlen" not in rows:  # the first session's rows: seqlen 4096 only
        rows = rows.assign(seqlen=4096)
    wide = rows.pivot_table(index="config", columns=["kind", "seqlen", "hdim", "causal"], values="tflops")
    wide = wide.reindex(["sdpa-flash", "sdpa-cudnn"] + [c for c in wide.index if c.startswith(("Fwd", "Bwd"))])
    several = rows["seqlen"].nunique() > 1
    header = [f"{kind}{f' n{seqlen}' if several else ''} d{hdim} {'causal' if causal else 'full'}"
              for kind, seqlen, hdim, causal in wide.columns]
    lines = ["| config | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for config, values in wide.iterrows():
        cells = ["" if pd.isna(v) else f"{v:.0f}" for v in values]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def provider_table(path: Path, hdim: int) -> str:
    """tools/experiments/exp_fwd_gluon.py's rows: forward TFLOPs/s of each kernel (one process per
    dtype, the SDPA peers included) per (seqlen, causal) at head dim `hdim`."""
    rows = pd.read_csv(path)
    rows = rows[rows.hdim == hdim]
    wide = rows.pivot_table(index="provider", columns=["seqlen", "causal"], values="tflops", sort=False)
    header = [f"n{seqlen} {'causal' if causal else 'full'}" for seqlen, causal in wide.columns]
    lines = ["| kernel | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for provider, values in wide.iterrows():
        lines.append(f"| {provider} | " + " | ".join(f"{v:.0f}" for v in values) + " |")
    return "\n".join(lines)


def backward_parts_table(path: Path) -> str:
    """tools/experiments/exp_bwd.py's rows: milliseconds of the whole backward and of its dK/dV
    and dQ kernels alone, per config and causal mode (and seqlen, where the rows have several),
    the SDPA peers' whole backward first."""
    rows = pd.read_csv(path)
    rows = rows[rows.status == "ok"].fillna({"part": "all"})
    wide = rows.pivot_table(index=["config", "part"], columns=["seqlen", "causal"], values="ms", sort=False)
    several = rows["seqlen"].nunique() > 1
    header = [f"ms, {f'n{seqlen} ' if several else ''}{'causal' if causal else 'non-causal'}"
              for seqlen, causal in wide.columns]
    lines = ["| config | kernels timed | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
    for (config, part), values in wide.iterrows():
        lines.append(f"| {config} | {part} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines)


def provider_ratio_table(sources: list[tuple[str, Path]], hdim: int, numerator: str, denominator: str) -> str:
    """exp_fwd_gluon.py's rows: `numerator`'s TFLOPs/s over `denominator`'s, measured in the same
    process, one line per source (a run, labelled) and one column per (seqlen, causal)."""
    lines, header = [], None
    for label, path in sources:
        rows = pd.read_csv(path)
        wide = rows[rows.hdim == hdim].pivot_table(index=["seqlen", "causal"], columns="provider", values="tflops")
        ratio = wide[numerator] / wide[denominator]
        if header is None:
            header = [f"n{seqlen} {'causal' if causal else 'full'}" for seqlen, causal in ratio.index]
            lines = ["| run | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}x" for v in ratio) + " |")
    return "\n".join(lines)


def ms_ratio_table(path: Path, hdim: int, providers: list[str], ratios: list[tuple[str, str, str]]) -> str:
    """tools/experiments/exp_bwd_gluon.py's rows at `hdim`: milliseconds of each of `providers`
    per (seqlen, causal), all measured in one process, then each ratio (label, a, b): a's time
    over b's."""
    rows = pd.read_csv(path)
    wide = rows[rows.hdim == hdim].pivot_table(index=["seqlen", "causal"], columns="provider", values="ms")
    header = [f"{p} ms" for p in providers] + [label for label, _, _ in ratios]
    lines = ["| seqlen | causal | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
    for (seqlen, causal), r in wide.iterrows():
        cells = [f"{r[p]:.3f}" for p in providers] + [f"{r[a] / r[b]:.2f}" for _, a, b in ratios]
        lines.append(f"| {seqlen} | {causal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_ratio_table(sources: list[tuple[str, Path]], hdims: tuple[int, ...], seqlens: tuple[int, ...],
                     peer: str = "sdpa-flash") -> str:
    """Runner result rows of several runs of the same sweep: our TFLOPs/s over `peer`'s at `hdims`
    and `seqlens` (medians of each run's repeats), each ratio within one run, one column per run."""
    columns = {}
    for label, path in sources:
        rows = pd.read_csv(path)
        ratios = _ratios(rows[(rows.status == "ok") & rows.hdim.isin(hdims) & rows.seqlen.isin(seqlens)], peer)
        columns[label] = ratios.set_index(["mode", "hdim", "causal", "seqlen"])["ratio"]
    table = pd.DataFrame(columns)
    lines = ["| mode | hdim | causal | seqlen | " + " | ".join(table.columns) + " |",
             "|---|---|---|---|" + "---|" * len(table.columns)]
    for (mode, hdim, causal, seqlen), r in table.iterrows():
        lines.append(f"| {mode} | {hdim} | {causal} | {seqlen} | " + " | ".join(f"{v:.3f}x" for v in r) + " |")
    return "\n".join(lines)


def host_breakdown_table(path: Path, seqlen: int) -> str:
    """tools/experiments/exp_host_breakdown.py's rows at `seqlen`: the median microseconds of each
    stage of a forward+backward call, per (head dim, causal) and launch path, in one process."""
    rows = pd.read_csv(path)
    if "launch" not in rows:  # the first version of the experiment had Triton's JIT launches only
        rows = rows.assign(launch="jit")
    rows = rows[rows.seqlen == seqlen]
    wide = rows.pivot_table(index="stage", columns=["hdim", "causal", "launch"], values="us", sort=False)
    header = [f"d{h} {'causal' if c else 'full'} {launch}" for h, c, launch in wide.columns]
    lines = ["| stage (us) | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for stage, r in wide.iterrows():
        lines.append(f"| {stage} | " + " | ".join(f"{v:.1f}" for v in r) + " |")
    return "\n".join(lines)


def fused_dq_prediction_table(paths: list[Path]) -> str:
    """exp_bwd.py's rows of the two-kernel backward and the fused-dQ configs: the prediction (the
    fused kernel running its 5 matmuls at the rate the dK/dV kernel runs its 4: 5/4 of the dK/dV
    kernel's time, the preprocessing left out) against the best fused config measured. Both whole
    backwards are timed through flash_attn_backward (the two-kernel one as `production`, with
    deterministic=True), so allocations count alike."""
    lines = [("| hdim | seqlen | causal | two kernels ms | dK/dV kernel ms | predicted fused ms | fused ms (best) "
              "| fused speed vs two kernels |"), "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        rows = pd.read_csv(path)
        rows = rows[rows.status == "ok"].fillna({"part": "all"})
        separate = rows[rows.config.str.endswith(",0,0,0")]
        fused = rows[rows.config.str.endswith(",1") & (rows.part == "all")]
        production = rows[rows.config == "production"]
        for (hdim, seqlen, causal), group in separate.groupby(["hdim", "seqlen", "causal"]):
            whole = production[(production.seqlen == seqlen) & (production.causal == causal)].ms.iloc[0]
            dkdv = group[group.part == "dkdv"].ms.iloc[0]
            best = fused[(fused.seqlen == seqlen) & (fused.causal == causal)].ms.min()
            lines.append(f"| {hdim} | {seqlen} | {causal} | {whole:.3f} | {dkdv:.3f} | {dkdv * 5 / 4:.3f} | "
                         f"{best:.3f} | {whole / best:.2f}x |")
    return "\n".join(lines)


def counters_by_call_table(path: Path) -> str:
    """tools/experiments/exp_bwd_dq_counters.py's rows: one column per profiled kernel launch
    (which backward it belongs to, and the kernel), one line per Nsight Compute metric."""
    rows = pd.read_csv(path, thousands=",")
    header = [f"{call}: {kernel.removeprefix('_flash_bwd_').removesuffix('_kernel')}"
              for call, kernel in zip(rows["call"], rows["Kernel Name"])]
    lines = ["| metric | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for metric in rows.columns.drop(["call", "Kernel Name"]):
        lines.append(f"| `{metric}` | " + " | ".join(f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
                                                     for v in rows[metric]) + " |")
    return "\n".join(lines)


def host_time_table(path: Path, modes: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")) -> str:
    """tools/experiments/exp_host_overhead.py's rows: per call, the GPU time, the host time to
    issue it and what do_bench reads, for each provider. Where the host takes about as long as
    the GPU or longer, host stalls between a call's launches can show in do_bench's reading."""
    rows = pd.read_csv(path)
    rows = rows[(rows.status == "ok") & rows["mode"].isin(modes)]
    wide = rows.pivot_table(index=["seqlen", "hdim", "causal", "mode"], columns="provider",
                            values=["gpu_ms", "host_ms", "do_bench_ms"], sort=False)
    providers = list(dict.fromkeys(rows["provider"]))
    header = [f"{p} {what}" for p in providers for what in ("GPU", "host", "do_bench")]
    lines = ["| seqlen | hdim | causal | mode | " + " | ".join(header) + " |",
             "|---|---|---|---|" + "---|" * len(header)]
    for (seqlen, hdim, causal, mode), r in wide.iterrows():
        cells = [f"{r[(what, p)]:.3f}" for p in providers for what in ("gpu_ms", "host_ms", "do_bench_ms")]
        lines.append(f"| {seqlen} | {hdim} | {causal} | {mode} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Milliseconds per call, {', '.join(sorted(rows['dtype'].unique()))}, paper shapes; GPU: calls "
                 "queued behind a GPU sleep, timed by CUDA events; host: time to issue them; do_bench: the "
                 "runner's clock.")
    return "\n".join(lines)


def timing_window_table(short: pd.DataFrame, sustained: pd.DataFrame, hdim: int = 128) -> str:
    """Forward TFLOPs/s of ours and cuDNN at `hdim` in two paper runs of the same code family:
    20-ms do_bench windows against the default (25 ms warm-up, 100 ms of calls)."""
    def forward(rows):
        rows = rows[(rows["status"] == "ok") & (rows["mode"] == "fwd") & (rows["hdim"] == hdim)
                    & rows["provider"].isin([OURS, CUDNN]) & (rows["seqlen"] >= 4096)]
        return rows.pivot_table(index=["causal", "seqlen"], columns="provider", values="tflops")
    a, b = forward(short), forward(sustained)
    lines = ["| causal | seqlen | cuDNN, 20 ms | cuDNN, 100 ms | ours, 20 ms | ours, 100 ms | ours/cuDNN, 20 ms | ours/cuDNN, 100 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for (causal, seqlen), r in a.iterrows():
        q = b.loc[(causal, seqlen)]
        lines.append(f"| {causal} | {seqlen} | {r[CUDNN]:.0f} | {q[CUDNN]:.0f} | {r[OURS]:.0f} | {q[OURS]:.0f} | "
                     f"{r[OURS] / r[CUDNN]:.2f} | {q[OURS] / q[CUDNN]:.2f} |")
    return "\n".join(lines)


def matmul_ceiling_tflops(path: Path) -> float:
    """The bf16 matmul rate measured on the device (tools/device_run3.sh's first line)."""
    match = re.search(r"([0-9.]+) TFLOP/s", path.read_text())
    if match is None:
        raise ValueError(f"{path}: no 'TFLOP/s' figure in it")
    return float(match.group(1))


def utilisation_table(rows: pd.DataFrame, ceiling: float) -> str:
    """At each (mode, hdim, causal)'s longest sequence: TFLOPs/s of ours, the official FA2
    kernel and cuDNN as a fraction of the measured matmul ceiling (the floor of METHOD.md:
    attention cannot run faster than its matmul FLOPs at the matmul rate)."""
    longest = rows[rows.seqlen == rows.seqlen.max()]
    wide = longest.pivot_table(index=["mode", "hdim", "causal"], columns="provider", values="tflops")
    lines = [f"Ceiling: {ceiling:.0f} TFLOP/s (bf16 8192^3 matmul, same GPU). Seqlen {rows.seqlen.max()}.", "",
             "| mode | hdim | causal | ours | official FA2 | cuDNN |", "|---|---|---|---|---|---|"]
    for (mode, hdim, causal), r in wide.iterrows():
        cells = [f"{r[p] / ceiling:.0%}" if p in r and not pd.isna(r[p]) else "n/a" for p in (OURS, OFFICIAL, CUDNN)]
        lines.append(f"| {mode} | {hdim} | {causal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(rows: pd.DataFrame, peer: str) -> pd.DataFrame:
    """Our TFLOPs/s over `peer`'s, per (dtype, mode, hdim, causal, seqlen), same run."""
    wide = rows.pivot_table(index=["dtype", "mode", "hdim", "causal", "seqlen"], columns="provider",
                            values="tflops", aggfunc="median")
    return (wide[OURS] / wide[peer]).rename("ratio").reset_index().dropna()


def _worst(ratios: pd.DataFrame, by: list[str], bar: float, target: str) -> list[str]:
    lines = []
    for key, group in ratios.groupby(by, sort=True):
        worst = group.loc[group["ratio"].idxmin()]
        where = ", ".join(f"{k} {v}" for k, v in zip(by, key if isinstance(key, tuple) else (key,)))
        lines.append(f"| {target} | {where} | {worst['ratio']:.3f}x (seqlen {worst['seqlen']}) | "
                     f"{'met' if worst['ratio'] >= bar else 'not met'} |")
    return lines


def targets_table(runs: list[pd.DataFrame], ablation: pd.DataFrame | None = None) -> str:
    """Issue 7's targets checked against the committed rows: for each group, the worst ratio of
    our kernel over the peer measured in the same run, and whether it clears the bar."""
    rows = pd.concat(runs, ignore_index=True)
    official, cudnn = _ratios(rows, OFFICIAL), _ratios(rows, CUDNN)
    lines = ["| target | group | worst ratio (where) | verdict |", "|---|---|---|---|"]
    fwd = official[(official["mode"] == "fwd") & (official["seqlen"] >= 2048)]
    lines += _worst(fwd, ["dtype", "hdim", "causal"], 1.3, "fwd >= 1.3x official FA2, seqlen >= 2k")
    fwd_cudnn = cudnn[(cudnn["mode"] == "fwd") & (cudnn["hdim"] == 128) & (cudnn["seqlen"] >= 4096)]
    lines += _worst(fwd_cudnn, ["dtype", "causal"], 0.9, "fwd >= 0.9x cuDNN, hdim 128, seqlen >= 4k")
    bwd = official[(official["mode"] == "bwd") & (official["seqlen"] >= 2048)]
    lines += _worst(bwd, ["dtype", "hdim", "causal"], 1.2, "bwd >= 1.2x official FA2, seqlen >= 2k")
    bwd_cudnn = cudnn[(cudnn["mode"] == "bwd") & (cudnn["seqlen"] >= 2048)]
    lines += _worst(bwd_cudnn, ["dtype", "hdim"], 0.85, "stretch: bwd >= 0.85x cuDNN, seqlen >= 2k")
    short = official[official["seqlen"] <= 1024]
    lines += _worst(short, ["dtype", "mode", "hdim"], 1.0, "seqlen 512 and 1k: no slower than official FA2")
    if ablation is not None:
        ok = ablation[(ablation["status"] == "ok") & ablation["setting"].isin(["A", "B"])]
        medians = ok.groupby(["setting", "provider"])["tflops"].median()
        for setting in sorted(ok["setting"].unique()):
            ratio = medians[(setting, "rung4-hopper")] / medians[(setting, OFFICIAL)]
            lines.append(f"| ablation fwd >= 1.3x official FA2 | setting {setting} | {ratio:.3f}x | "
                         f"{'met' if ratio >= 1.3 else 'not met'} |")
    lines += ["", ("Ratios of medians measured in the same run; rows: `reports/h200/kernel_vs_fa2.csv` (bf16), "
                   "`kernel_vs_fa2_fp16.csv` (fp16) and `ablation.csv` (fp16, CUDA-graph timing).")]
    return "\n".join(lines)


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


SECTIONS = {
    "kernel_vs_fa2": lambda: kernel_vs_fa2_table(pd.read_csv(KERNEL_VS_FA2_CSV)),
    "kernel_vs_fa2_fp16": lambda: kernel_vs_fa2_table(pd.read_csv(KERNEL_VS_FA2_FP16_CSV), KERNEL_VS_FA2_FP16_CSV),
    "targets": lambda: targets_table([pd.read_csv(KERNEL_VS_FA2_CSV), pd.read_csv(KERNEL_VS_FA2_FP16_CSV)],
                                     load_results(H200 / "ablation")),
    "ablation": lambda: file_section(H200 / "ablation.md", stop_at="## Sweep"),
    "anchors": lambda: anchor_table(load_results(H200 / "paper"),
                                    pd.read_csv(H200 / "anchors" / "h200_anchors_2026-11-30.csv")),
    "tuning": lambda: tuning_table(H200 / "tuning" / "tune_fa2_seqlen4096_bf16.csv"),
    "tuning_d256_bwd": lambda: tuning_table(H200 / "tuning" / "tune_fa2_d256_bwd_seqlen4096_bf16.csv"),
    **{f"tuning_tma_d{h}": (lambda h=h: tuning_table(H200 / "tuning" / f"tune_fa2_fwd_tma_d{h}_bf16.csv"))
       for h in (64, 128, 256)},
    "tuning_launch_order": lambda: tuning_table(H200 / "tuning" / "tune_fa2_fwd_d128_after_launch_order_bf16.csv"),
    "tuning_tma_by_seqlen": lambda: tuning_table(H200 / "tuning" / "tune_fa2_fwd_tma_by_seqlen_d128_bf16.csv"),
    "timing_window": lambda: timing_window_table(load_results(H200 / "tuning" / "paper_bf16_rep20ms"),
                                                 load_results(H200 / "paper_runs" / "session2_bf16")),
    # third session (v3): host-made descriptors, the query-major head-dim-256 backward
    **{f"tuning_host_tma_d{h}": (lambda h=h: tuning_table(TUNING / "tune_fa2_fwd_host2d_d64_d128_bf16.csv", (h,)))
       for h in (64, 128)},
    "tuning_host_tma_d256": lambda: tuning_table(TUNING / "tune_fa2_fwd_host2d_d256_bf16.csv"),
    "tuning_host_tma_d128_fp16": lambda: tuning_table(TUNING / "tune_fa2_fwd_host2d_d128_fp16.csv"),
    "tuning_host4d_d128": lambda: tuning_table(TUNING / "tune_fa2_fwd_host4d_vs_kernel_d64_d128_bf16.csv", (128,)),
    "tuning_bwd_d256_v3": lambda: tuning_table(TUNING / "tune_fa2_bwd_query_major_d256_bf16.csv"),
    "bwd_tma_d256": lambda: backward_parts_table(TUNING / "exp_bwd_tma_d256_bf16.csv"),
    "bwd_tma_d128": lambda: backward_parts_table(TUNING / "exp_bwd_tma_d128_bf16.csv"),
    "bwd_tma_d64": lambda: backward_parts_table(TUNING / "exp_bwd_tma_d64_bf16.csv"),
    "fwd_host_vs_kernel_bf16": lambda: tuning_table(TUNING / "tune_fa2_fwd_host_vs_kernel_4k_16k_d128_bf16.csv"),
    "fwd_host_vs_kernel_fp16": lambda: tuning_table(TUNING / "tune_fa2_fwd_host_vs_kernel_4k_16k_d128_fp16.csv"),
    "host_time_before": lambda: host_time_table(TUNING / "exp_host_overhead_before_trims_bf16.csv", ("fwd_bwd",)),
    "host_time": lambda: host_time_table(TUNING / "exp_host_overhead_bf16.csv"),
    "compile_bwd_tma": lambda: text_block(TUNING / "compile_check_bwd_tma_sm90.txt"),
    "compile_fwd_overlap": lambda: text_block(TUNING / "exp_fwd_overlap_sm90_compile.txt"),
    "fwd_16warps_d128_bf16": lambda: tuning_table(TUNING / "tune_fa2_fwd_256rows_16warps_d128_bf16.csv"),
    "fwd_16warps_d128_fp16": lambda: tuning_table(TUNING / "tune_fa2_fwd_256rows_16warps_d128_fp16.csv"),
    "fwd_16warps_d64_bf16": lambda: tuning_table(TUNING / "tune_fa2_fwd_256rows_16warps_d64_bf16.csv"),
    "compile_fwd_warp_specialize": lambda: text_block(TUNING / "exp_fwd_warp_specialize_sm90_compile.txt"),
    "fwd_warp_specialize": lambda: text_block(TUNING / "exp_fwd_warp_specialize_bf16.log"),
    "compile_fwd_gluon": lambda: text_block(TUNING / "exp_fwd_gluon_sm90_compile.txt"),
    "fwd_gluon_d128_bf16": lambda: provider_table(TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_bf16.csv", 128),
    "fwd_gluon_d128_fp16": lambda: provider_table(TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_fp16.csv", 128),
    "fwd_gluon_d64_bf16": lambda: provider_table(TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_bf16.csv", 64),
    "fwd_gluon_d64_fp16": lambda: provider_table(TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_fp16.csv", 64),
    "fwd_gluon_one_partition_bf16": lambda: provider_table(TUNING / "exp_fwd_gluon_a9646c6" / "exp_fwd_gluon_bf16.csv",
                                                           128),
    "compile_fwd_hopper": lambda: text_block(TUNING / "compile_check_hopper_gluon_sm90.txt"),
    **{f"fwd_gluon_v6_d{h}_bf16": (lambda h=h: provider_table(TUNING / "exp_fwd_gluon_30e5a98" / "exp_fwd_gluon_bf16.csv",
                                                                h)) for h in (128, 64)},
    "compile_fwd_hopper_v6": lambda: text_block(TUNING / "compile_check_hopper_gluon_v6_sm90.txt"),
    "fwd_gluon_v6_vs_v5": lambda: "\n\n".join(
        f"Head dim {h}:\n\n" + provider_ratio_table([("30e5a98 bf16", TUNING / "exp_fwd_gluon_30e5a98" / "exp_fwd_gluon_bf16.csv")],
                                                   h, "gluon-ws-s3", "gluon-ws-previous") for h in (128, 64)),
    "fwd_gluon_same_kernel_twice": lambda: provider_ratio_table(
        [("30e5a98 bf16", TUNING / "exp_fwd_gluon_30e5a98" / "exp_fwd_gluon_bf16.csv")], 128, "gluon-ws-s3", "fa2"),
    # `fa2` was the Triton forward at head dim 64 in these runs (before the table took the Gluon
    # kernel there); later runs name the Triton forward `fa2-triton`
    "fwd_gluon_d64_vs_triton": lambda: provider_ratio_table(
        [("6cef64c bf16", TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_bf16.csv"),
         ("6cef64c fp16", TUNING / "exp_fwd_gluon_6cef64c" / "exp_fwd_gluon_fp16.csv"),
         ("30e5a98 bf16", TUNING / "exp_fwd_gluon_30e5a98" / "exp_fwd_gluon_bf16.csv")], 64, "gluon-ws-s3", "fa2"),
    "host_time_gluon_fwd": lambda: host_time_table(TUNING / "exp_host_overhead_gluon_fwd_f5015f3" / "exp_host_overhead.csv",
                                                   ("fwd",)),
    "fwd_gluon_d64_vs_triton_3cc3be2": lambda: provider_ratio_table(
        [(f"3cc3be2 {dtype}", TUNING / "exp_fwd_gluon_3cc3be2" / f"exp_fwd_gluon_{dtype}.csv") for dtype in ("bf16", "fp16")],
        64, "gluon-ws-s3", "fa2-triton"),
    "bwd_fused_dq_prediction": lambda: fused_dq_prediction_table(
        [TUNING / "exp_bwd_fused_dq_cd1510e" / f"exp_bwd_d{h}.csv" for h in (128, 64)]),
    "counters_fwd_gluon": lambda: file_section(H200 / "counters_fwd_gluon" / "counters.md", start_at="### "),
    **{f"bwd_fused_dq_d{h}": (lambda h=h: backward_parts_table(TUNING / "exp_bwd_fused_dq_cd1510e" / f"exp_bwd_d{h}.csv"))
       for h in (128, 64)},
    "compile_bwd_fused_dq": lambda: text_block(TUNING / "compile_check_bwd_fused_dq_sm90.txt"),
    "bwd_dq_counters": lambda: counters_by_call_table(TUNING / "exp_bwd_dq_counters_eb2e8a9" / "exp_bwd_dq_counters.csv"),
    **{f"bwd_parts_d{h}": (lambda h=h: backward_parts_table(
        TUNING / f"exp_bwd_kernel_by_kernel_d{h}_seqlen4096_bf16.csv")) for h in (128, 256)},
    **{f"bwd_gluon_dkdv_d{h}": (lambda h=h: ms_ratio_table(
        TUNING / "exp_bwd_gluon_c13020c" / "exp_bwd_gluon_bf16.csv", h,
        ["triton dkdv", "gluon dkdv s2", "gluon dkdv s3", "fa2 backward", "fa2 backward, gluon dkdv s2", "sdpa-cudnn"],
        [("Gluon s2 / Triton dK/dV time", "gluon dkdv s2", "triton dkdv"),
         ("Gluon s3 / Triton dK/dV time", "gluon dkdv s3", "triton dkdv"),
         ("backward with Gluon s2 / without, time", "fa2 backward, gluon dkdv s2", "fa2 backward"),
         ("cuDNN / backward with Gluon s2, time (speed vs cuDNN)", "sdpa-cudnn", "fa2 backward, gluon dkdv s2")]))
       for h in (128, 64)},
    **{f"bwd_gluon_fused_dq_d{h}": (lambda h=h: ms_ratio_table(
        TUNING / "exp_bwd_gluon_fc1794e" / "exp_bwd_gluon_bf16.csv", h,
        ["fa2 backward", "gluon fused dQ s2", "gluon fused kernel alone s2", "triton dkdv", "sdpa-cudnn"],
        [("fused backward / two-kernel backward, time", "gluon fused dQ s2", "fa2 backward"),
         ("fused kernel / Triton dK/dV kernel, time", "gluon fused kernel alone s2", "triton dkdv")]))
       for h in (128, 64)},
    **{f"bwd_gluon_fused_tma_{dtype}": (lambda dtype=dtype: ms_ratio_table(
        TUNING / "exp_bwd_gluon_174d56b" / f"exp_bwd_gluon_{dtype}.csv", 128,
        ["fa2 backward", "fa2 backward, gluon dkdv s2", "gluon fused dQ s2", "sdpa-cudnn"],
        [("production (174d56b) / fused backward, time (speed-up)", "fa2 backward", "gluon fused dQ s2"),
         ("cuDNN / fused backward, time (speed vs cuDNN)", "sdpa-cudnn", "gluon fused dQ s2")]))
       for dtype in ("bf16", "fp16")},
    "host_time_gluon_fused_dq": lambda: host_time_table(
        TUNING / "exp_host_overhead_gluon_fused_dq_d1d3766" / "exp_host_overhead.csv", ("bwd", "fwd_bwd")),
    "short_points_v7_runs": lambda: "\n\n".join(
        f"{dtype}:\n\n" + runs_ratio_table(
            [(f"{run.format(dtype=dtype)} ({commit})", H200 / "paper_runs" / run.format(dtype=dtype) / "results.csv")
             for run, commit in (("v7_{dtype}_d128_bwd", "3506551"), ("v7_{dtype}_d128_bwd_fused_dq", "d1d3766"))],
            (128,), (512, 1024))
        for dtype in ("bf16", "fp16")),
    "host_time_gluon_dkdv": lambda: host_time_table(
        TUNING / "exp_host_overhead_gluon_dkdv_3506551" / "exp_host_overhead.csv", ("bwd", "fwd_bwd")),
    "compile_hopper_v7": lambda: text_block(TUNING / "compile_check_hopper_gluon_v7_sm90.txt"),
    "host_breakdown_v8_first": lambda: host_breakdown_table(
        TUNING / "exp_host_breakdown_16f5992" / "exp_host_breakdown.csv", 512),
    "host_breakdown_v8": lambda: host_breakdown_table(
        TUNING / "exp_host_breakdown_38c87fc" / "exp_host_breakdown.csv", 512),
    "host_time_gluon_from_1k_v8": lambda: host_time_table(
        TUNING / "exp_host_overhead_gluon_from_1k_b6c20d7" / "exp_host_overhead.csv", ("bwd", "fwd_bwd")),
    "short_points_v8_runs": lambda: "\n\n".join(
        f"{dtype}:\n\n" + runs_ratio_table(
            [(f"{run.format(dtype=dtype)} ({commit})", H200 / "paper_runs" / run.format(dtype=dtype) / "results.csv")
             for run, commit in (("v8c_{dtype}_short_x3_b6c20d7", "b6c20d7"), ("v8_{dtype}_short_x3", "38c87fc"))],
            (64, 128, 256), (512, 1024))
        for dtype in ("bf16", "fp16")),
    "matmul_ceiling": lambda: (H200 / "matmul_ceiling.txt").read_text().strip(),
    "utilisation": lambda: utilisation_table(pd.read_csv(KERNEL_VS_FA2_CSV),
                                             matmul_ceiling_tflops(H200 / "matmul_ceiling.txt")),
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
    parser.add_argument("--kernel-vs-fa2", type=Path, nargs="+", metavar="RESULTS_CSV", default=[],
                        help="extract reports/h200/kernel_vs_fa2.csv (bf16) / kernel_vs_fa2_fp16.csv from "
                             "paper-suite results.csv files first")
    args = parser.parse_args()
    for results_csv in args.kernel_vs_fa2:
        extract_kernel_vs_fa2(results_csv)
    for path in args.markdown:
        print(f"{path}: rewrote {', '.join(update_markdown(path)) or 'nothing'}")


if __name__ == "__main__":
    main()
