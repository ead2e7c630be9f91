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

H200 = Path(__file__).resolve().parent / "h200"
KERNEL_VS_FA2_CSV = H200 / "kernel_vs_fa2.csv"
KERNEL_VS_FA2_COLUMNS = ["provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "ms",
                         "ms_p20", "ms_p80", "tflops", "rel_err", "config", "gpu", "driver", "cuda",
                         "torch", "triton", "git_commit", "timestamp"]
OURS, OFFICIAL, CUDNN = "fa2", "sdpa-flash", "sdpa-cudnn"


def extract_kernel_vs_fa2(results_csv: Path, out_csv: Path = KERNEL_VS_FA2_CSV) -> pd.DataFrame:
    """The rows of our FA2 kernel, the official FA2 kernel and cuDNN from a paper-suite run."""
    rows = pd.read_csv(results_csv)
    rows = rows[rows.provider.isin([OURS, OFFICIAL, CUDNN]) & (rows.status == "ok")]
    rows = rows[KERNEL_VS_FA2_COLUMNS].sort_values(["mode", "hdim", "causal", "seqlen", "provider"])
    rows.to_csv(out_csv, index=False)
    return rows


def kernel_vs_fa2_table(rows: pd.DataFrame) -> str:
    """One line per (mode, hdim, causal, seqlen): our TFLOPs/s, the official kernel's, cuDNN's
    and the two ratios, all measured in the same run."""
    wide = rows.pivot_table(index=["mode", "hdim", "causal", "seqlen"], columns="provider",
                            values="tflops", aggfunc="median").reset_index()
    for column in (OURS, OFFICIAL, CUDNN):
        if column not in wide:
            wide[column] = float("nan")
    wide["vs FA2"] = wide[OURS] / wide[OFFICIAL]
    wide["vs cuDNN"] = wide[OURS] / wide[CUDNN]
    lines = ["| mode | hdim | causal | seqlen | ours (Triton FA2) | official FA2 (SDPA flash) | cuDNN "
             "| ours / FA2 | ours / cuDNN |", "|---|---|---|---|---|---|---|---|---|"]
    for r in wide.itertuples(index=False):
        lines.append(_format_row(r, wide.columns))
    env = rows.iloc[0]
    lines.append("")
    lines.append(f"TFLOPs/s, {env.dtype}, {env.gpu}, torch {env.torch}, triton {env.triton}, "
                 f"commit {env.git_commit}, {env.timestamp}; rows: `reports/h200/kernel_vs_fa2.csv`.")
    return "\n".join(lines)


def _format_row(r, columns) -> str:
    values = dict(zip(columns, r))

    def num(x, digits=0):
        return "n/a" if pd.isna(x) else f"{x:.{digits}f}"

    return (f"| {values['mode']} | {values['hdim']} | {values['causal']} | {values['seqlen']} | "
            f"{num(values[OURS])} | {num(values[OFFICIAL])} | {num(values[CUDNN])} | "
            f"{num(values['vs FA2'], 2)}x | {num(values['vs cuDNN'], 2)}x |")


def file_section(path: Path) -> str:
    """A generated Markdown file, embedded as it is (its own headings demoted by one level)."""
    text = path.read_text().strip()
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)


SECTIONS = {
    "kernel_vs_fa2": lambda: kernel_vs_fa2_table(pd.read_csv(KERNEL_VS_FA2_CSV)),
    "ablation": lambda: file_section(H200 / "ablation.md"),
    "counters": lambda: file_section(H200 / "counters.md"),
    "comparison": lambda: file_section(H200 / "comparison.md"),
}


def update_markdown(path: Path) -> list[str]:
    """Rewrite each marked section of `path`; returns the names of the sections rewritten.
    A section whose source is missing is left as it is, with a note on stderr."""
    text = path.read_text()
    done = []
    for name, render in SECTIONS.items():
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(\n<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            continue
        try:
            body = render()
        except FileNotFoundError as exc:
            print(f"{path}: section {name!r} left as it is: {exc}")
            continue
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
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
