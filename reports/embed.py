"""Generated sections of the README and the notes, from committed result rows.

Markdown files mark a generated section with `<!-- BEGIN name -->` ... `<!-- END name -->`;
`python -m reports.embed README.md reports/h200/perf_notes.md` rewrites every marked section
from the CSVs under reports/h200/, so no number in them is typed by hand.

    python -m reports.embed --kernel-vs-fa2 results/paper/results.csv   # extract the rows first
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from reports.results import load_results

H200 = Path(__file__).resolve().parent / "h200"
KERNEL_VS_FA2_CSV = H200 / "kernel_vs_fa2.csv"
KERNEL_VS_FA2_COLUMNS = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "ms",
                         "ms_p20", "ms_p80", "tflops", "rel_err", "config", "gpu", "driver", "cuda",
                         "torch", "triton", "git_commit", "timestamp"]
OURS, OFFICIAL, CUDNN = "fa2", "sdpa-flash", "sdpa-cudnn"


def extract_kernel_vs_fa2(results_csv: Path, out_csv: Path = KERNEL_VS_FA2_CSV) -> pd.DataFrame:
    """The rows of our FA2 kernel, the official FA2 kernel and cuDNN from a paper-suite run."""
    rows = load_results(results_csv)  # a later row for the same key replaces an earlier one
    rows = rows[rows.provider.isin([OURS, OFFICIAL, CUDNN]) & (rows.status == "ok")]
    rows = rows[KERNEL_VS_FA2_COLUMNS].sort_values(["mode", "hdim", "causal", "seqlen", "provider"])
    rows.to_csv(out_csv, index=False)
    return rows


def _ratio(ours: float, peer: float) -> str:
    return "n/a" if pd.isna(peer) or peer == 0 else f"{ours / peer:.2f}x"


def kernel_vs_fa2_table(rows: pd.DataFrame) -> str:
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
                 f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; rows: `reports/h200/kernel_vs_fa2.csv`.")
    return "\n".join(lines)


def file_section(path: Path, stop_at: str | None = None) -> str:
    """A generated Markdown file, embedded as it is up to the heading `stop_at` (its own
    headings demoted by one level)."""
    text = path.read_text().strip()
    if stop_at and stop_at in text:
        text = text[:text.index(stop_at)].strip()
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.MULTILINE)


def tuning_table(path: Path) -> str:
    """tools/tune_fa2.py's rows: TFLOPs/s of each candidate config per (pass, hdim, causal), the
    two SDPA peers measured in the same process first."""
    rows = pd.read_csv(path)
    rows = rows[rows.status == "ok"]
    wide = rows.pivot_table(index="config", columns=["kind", "hdim", "causal"], values="tflops")
    wide = wide.reindex(["sdpa-flash", "sdpa-cudnn"] + [c for c in wide.index if c.startswith(("Fwd", "Bwd"))])
    header = [f"{kind} d{hdim} {'causal' if causal else 'full'}" for kind, hdim, causal in wide.columns]
    lines = ["| config | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for config, values in wide.iterrows():
        cells = ["" if pd.isna(v) else f"{v:.0f}" for v in values]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
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


ANCHOR_METHODS = {"sdpa_flash": "sdpa-flash", "sdpa_efficient": "sdpa-efficient", "sdpa_cudnn": "sdpa-cudnn",
                  "torch_eager": "pytorch"}


def anchor_table(rows: pd.DataFrame, anchors: pd.DataFrame, band: float = 0.10) -> str:
    """This project's TFLOPs/s of each peer over the cited anchors' for the same (mode, causal,
    hdim, seqlen, batch, heads): min / median / max per provider and mode, and how many cells
    differ by more than `band`."""
    anchors = anchors[anchors["method"].isin(ANCHOR_METHODS)].assign(
        provider=lambda a: a["method"].map(ANCHOR_METHODS))
    keys = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads"]
    ok = rows[rows["status"] == "ok"]
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
    "ablation": lambda: file_section(H200 / "ablation.md", stop_at="## Sweep"),
    "anchors": lambda: anchor_table(load_results(H200 / "paper"),
                                    pd.read_csv(H200 / "anchors" / "h200_anchors_2026-11-30.csv")),
    "tuning": lambda: tuning_table(H200 / "tuning" / "tune_fa2_seqlen4096_bf16.csv"),
    "tuning_d256_bwd": lambda: tuning_table(H200 / "tuning" / "tune_fa2_d256_bwd_seqlen4096_bf16.csv"),
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
    parser.add_argument("--kernel-vs-fa2", type=Path, metavar="RESULTS_CSV",
                        help="extract reports/h200/kernel_vs_fa2.csv from a paper-suite results.csv first")
    args = parser.parse_args()
    if args.kernel_vs_fa2:
        extract_kernel_vs_fa2(args.kernel_vs_fa2)
    for path in args.markdown:
        print(f"{path}: rewrote {', '.join(update_markdown(path)) or 'nothing'}")


if __name__ == "__main__":
    main()
