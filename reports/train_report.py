"""The training suite's report (harness/train.py), made from its rows alone: OUT/train.csv and
OUT/train_losses.csv, beside the paper's published A100 numbers (models/paper_table1_a100.csv).

report.md holds: Table 1 (model TFLOPs/s per GPU per (model, context) and provider, the
paper's 8x A100 numbers beside), the measurements in full, the longest context each provider
trained at in the memory budget, and the loss-curve comparison; plots/ holds tokens/s against
context (the search's rows) and the loss curves (the parity rows).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from harness.io import atomic_write_text, save_figure
from reports.tables import markdown_table

PAPER_CSV = Path(__file__).resolve().parents[1] / "models" / "paper_table1_a100.csv"
REPORT_MD = "report.md"
FAILED_TEXT = {"oom": "OOM", "unsupported": "n/a", "unavailable": "-", "error": "error"}
PARITY_TAIL = 0.1  # the final loss: the mean over the last tenth of the steps
FLOP_COUNT = ("Model FLOPs per sequence as the paper counts them (after Megatron-LM): 6 x seqlen x params + "
              "12 x layers x hidden x seqlen^2 (baselines.flops.training_flops_per_sequence; params counts the "
              "tied embedding once and the position table; activation recomputation is not counted).")
PRECISION = ("Each step: forward and loss of the global batch, backward, AdamW update (no gradient accumulation); "
             "bf16 autocast over fp32 weights, gradients and AdamW state (fp32 without autocast in Triton's "
             "interpreter); synthetic tokens (models/train.py).")


def load(out_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(measurement rows, loss rows) of out_dir; an empty frame for a missing file."""
    from harness.train import LOSSES_CSV, TRAIN_CSV

    def read(name):
        path = Path(out_dir) / name
        return pd.read_csv(path, keep_default_na=False, na_values=[""]) if path.exists() else pd.DataFrame()

    return read(TRAIN_CSV), read(LOSSES_CSV)


def _cell(group: pd.DataFrame) -> str:
    """The last row's TFLOPs/s per GPU, or why there is none."""
    row = group.iloc[-1]
    return f"{row.tflops_per_gpu:.0f}" if row.status == "ok" else FAILED_TEXT.get(row.status, row.status)


def table1(rows: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, context, GPUs): the paper's A100 numbers, then each provider's."""
    ours = rows[(rows.part == "table") & (rows["rank"].astype(str) == "all")]
    methods = list(dict.fromkeys(paper.method))
    providers = list(dict.fromkeys(ours.provider))
    lines = []
    for (model, context, gpus), group in ours.groupby(["model", "context", "world_size"], sort=False):
        line = {"model": model, "context": context, "GPUs": gpus}
        published = paper[(paper.model == model) & (paper.context == context)]
        for method in methods:
            values = published[published.method == method].tflops_per_gpu
            line[f"paper A100: {method}"] = f"{values.iloc[0]:.0f}" if len(values) else ""
        for provider in providers:
            cells = group[group.provider == provider]
            line[provider] = _cell(cells) if len(cells) else ""
        lines.append(line)
    return pd.DataFrame(lines)


def _number(value, digits: int) -> str:
    return "" if pd.isna(value) or value == "" else f"{float(value):.{digits}f}"


def measurements(rows: pd.DataFrame) -> pd.DataFrame:
    table = rows[rows.part == "table"]
    return pd.DataFrame({
        "model": table.model, "context": table.context, "provider": table.provider, "GPUs": table.world_size,
        "rank": table["rank"], "batch (seqs)": table.global_batch, "status": table.status,
        "step ms": table.step_ms.map(lambda v: _number(v, 1)),
        "tokens/s": table.tokens_per_s.map(lambda v: _number(v, 0)),
        "TFLOPs/s/GPU": table.tflops_per_gpu.map(lambda v: _number(v, 1)),
        "peak GiB": table.peak_mem_gib.map(lambda v: _number(v, 1)), "reason": table.reason.fillna(""),
    })


def longest_context(rows: pd.DataFrame) -> pd.DataFrame:
    """Per provider: the longest context that trained, and what stopped the search."""
    search = rows[rows.part == "search"]
    lines = []
    for provider, group in search.groupby("provider", sort=False):
        ok = group[group.status == "ok"]
        stop = group[group.status != "ok"]
        lines.append({"provider": provider, "model": group.model.iloc[0],
                      "budget GiB": _number(group.memory_budget_gib.iloc[0], 0),
                      "longest context": int(ok.context.max()) if len(ok) else "none",
                      "stopped at": (f"{int(stop.context.iloc[0])}: {FAILED_TEXT.get(stop.status.iloc[0])}"
                                     if len(stop) else "the search's end"),
                      "reason": stop.reason.iloc[0] if len(stop) else ""})
    return pd.DataFrame(lines)


def plot_tokens_per_second(rows: pd.DataFrame, path: Path) -> Path | None:
    search = rows[(rows.part == "search") & (rows.status == "ok")]
    if search.empty:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for provider, group in search.groupby("provider", sort=False):
        ax.plot(group.context, group.tokens_per_s, marker="o", label=provider)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("training tokens/s")
    budget = search.memory_budget_gib.iloc[0]
    ax.set_title(f"{search.model.iloc[0]}, one sequence per step, {budget:.0f} GiB budget ({search.gpu.iloc[0]})",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120, bbox_inches="tight")


def final_loss(losses: list[float]) -> float:
    """The mean loss over the last PARITY_TAIL of the steps."""
    tail = max(1, int(len(losses) * PARITY_TAIL))
    return sum(losses[-tail:]) / tail


def halving_step(losses: list[float]) -> int | None:
    """The first step whose loss is below half the first step's (None if none is): where the
    copying task is learnt."""
    return next((step for step, loss in enumerate(losses) if loss < losses[0] / 2), None)


def parity_summary(losses: pd.DataFrame) -> pd.DataFrame:
    """Per provider: the first and final loss, the step where the loss halved, and the gaps to
    PyTorch eager's loss at the same step."""
    parity = losses[losses.part == "parity"]
    curves = {provider: group.set_index("step").loss for provider, group in parity.groupby("provider", sort=False)}
    reference = curves.get("pytorch")
    lines = []
    for provider, curve in curves.items():
        gap = (curve - reference).abs() if reference is not None else None
        halved = halving_step(curve.tolist())
        lines.append({"provider": provider, "steps": len(curve), "first loss": f"{curve.iloc[0]:.3f}",
                      "loss halved at step": "-" if halved is None else halved,
                      "final loss (last tenth)": f"{final_loss(curve.tolist()):.4f}",
                      "max gap to pytorch": "" if gap is None else f"{gap.max():.2e}",
                      "mean gap to pytorch": "" if gap is None else f"{gap.mean():.2e}"})
    return pd.DataFrame(lines)


def plot_loss_curves(losses: pd.DataFrame, path: Path) -> Path | None:
    parity = losses[losses.part == "parity"]
    if parity.empty:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for index, (provider, group) in enumerate(parity.groupby("provider", sort=False)):
        ax.plot(group.step, group.loss, label=provider, linewidth=1, linestyle="-" if index == 0 else "--")
    first = parity.iloc[0]
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{first['model']}, copying task, context {first['context']}, {first['dtype']}, same seed "
                 f"({first['gpu']})",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120, bbox_inches="tight")


def write_report(out_dir) -> Path:
    out_dir = Path(out_dir)
    rows, losses = load(out_dir)
    paper = pd.read_csv(PAPER_CSV)
    lines = ["# Training: the FlashAttention-2 paper's Table 1", ""]
    if rows.empty:
        lines.append("No rows yet.")
        return atomic_write_text(out_dir / REPORT_MD, "\n".join(lines) + "\n")
    gpus = ", ".join(sorted(set(rows.gpu.astype(str))))
    lines += [(f"Measured on {gpus} (torch {rows.torch.iloc[0]}, triton {rows.triton.iloc[0]}, commit "
              f"{rows.git_commit.iloc[0]})."), ""]
    if rows.interpreter.astype(str).str.lower().eq("true").any():
        lines += ["**Triton's CPU interpreter: these times are NOT performance; they show that the pipeline works.**",
                  ""]
    lines += [PRECISION, FLOP_COUNT, ""]
    if (rows.part == "table").any():
        lines += ["## Table 1: model TFLOPs/s per GPU", "",
                  (f"The paper's columns: {paper.source.iloc[0]} ({paper.gpus.iloc[0]} GPUs); its FlashAttention-2 "
                  "column is the official kernel, measured here as sdpa-flash. OOM: out of memory; n/a: the provider "
                  "cannot train it (reason below); -: not installed here."), "",
                  markdown_table(table1(rows, paper)), "", "### Every measurement", "",
                  markdown_table(measurements(rows)), ""]
    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    if (rows.part == "search").any():
        lines += ["## The longest context in a fixed memory budget", "",
                  ("One sequence per step, the context doubled until the step ran out of the budget (the allocator "
                  "capped there)."), "", markdown_table(longest_context(rows)), ""]
        if plot_tokens_per_second(rows, plots / "tokens_per_s_vs_context.png"):
            lines += ["![tokens/s against context](plots/tokens_per_s_vs_context.png)", ""]
    if not losses.empty and (losses.part == "parity").any():
        lines += ["## The same model trains the same with every kernel", "",
                  ("The copying task (the second half of each sequence repeats the first), the same seed and "
                  "batches for every provider; gaps are |loss - PyTorch eager's loss| at the same step."), "",
                  markdown_table(parity_summary(losses)), ""]
        if plot_loss_curves(losses, plots / "loss_curves.png"):
            lines += ["![loss curves](plots/loss_curves.png)", ""]
    return atomic_write_text(out_dir / REPORT_MD, "\n".join(lines) + "\n")
