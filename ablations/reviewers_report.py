"""reviewers.md from rows: each reviewer's question quoted, the rows that answer it and one
generated sentence, "not shown" where the rows do not clear their spread.

A cell is one (question, variant, setting, shape): its median time over the ok repeats and its
spread, the 20th-80th percentile of do_bench's call times (lowest p20 to highest p80 over the
repeats). Two cells differ ("clear the spread") when their spreads do not overlap. Every number
comes from the rows; nothing is typed in.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from ablations.questions import QUESTIONS, Question
from reports.tables import markdown_table

SHAPE = ["mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype"]
CELL_KEY = ["question", "variant", "setting", *SHAPE]
NOT_SHOWN = "not shown"
INTERPRETER_NOTE = ("> **Triton's CPU interpreter on tiny sizes: these numbers are NOT performance.** They show "
                    "that every study runs and the report is built end to end.")
OCCUPANCY_DEFINITIONS = [
    ("- **theoretical occupancy**: the warps an SM can hold for this launch, as a share of its 64 warp slots, "
    "limited by registers per thread, shared memory per block, warps per block and blocks per SM "
    "(`sm__maximum_warps_per_active_cycle_pct`; the limits, in blocks per SM, are `launch__occupancy_limit_*`);"),
    ("- **achieved occupancy**: the average number of resident warps per active cycle over those 64 slots "
    "(`sm__warps_active.avg.pct_of_peak_sustained_active`);"),
    ("- **waves**: the grid's programs divided by the programs all SMs hold at once "
    "(`launch__waves_per_multiprocessor`); below 1 some SMs have nothing to do;"),
    ("- **SM active**: the share of the kernel's elapsed cycles in which an SM had at least one warp "
    "(`sm__cycles_active.avg.pct_of_peak_sustained_elapsed`), averaged over SMs."),
]


def cells(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: ms (median), ms_lo (lowest p20), ms_hi (highest p80), tflops (median),
    repeats, status and reason of the last repeat when none is ok."""
    out = []
    for key, group in rows.groupby(CELL_KEY, sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        out.append({**dict(zip(CELL_KEY, key)), "label": group["label"].iloc[0], "config": group["config"].iloc[0],
                    "repeats": len(ok),
                    "ms": ok["ms"].median() if len(ok) else math.nan,
                    "ms_lo": ok["ms_p20"].min() if len(ok) else math.nan,
                    "ms_hi": ok["ms_p80"].max() if len(ok) else math.nan,
                    "tflops": ok["tflops"].median() if len(ok) else math.nan,
                    "status": "ok" if len(ok) else group["status"].iloc[-1],
                    "reason": "" if len(ok) else str(group["reason"].fillna("").iloc[-1])})
    return pd.DataFrame(out, columns=[*CELL_KEY, "label", "config", "repeats", "ms", "ms_lo", "ms_hi", "tflops",
                                      "status", "reason"])


def clears(a, b) -> bool:
    """The spreads of cells a and b do not overlap."""
    return bool(a["ms_lo"] > b["ms_hi"] or a["ms_hi"] < b["ms_lo"])


def _num(value, spec=".1f", suffix="") -> str:
    return "-" if value is None or pd.isna(value) else f"{value:{spec}}{suffix}"


def _tflops(value) -> str:
    return _num(value, ".1f" if pd.isna(value) or value >= 1 else ".3g")


def _shape_text(cell) -> str:
    return (f"{cell['mode']}, {'causal' if cell['causal'] else 'non-causal'}, hdim {cell['hdim']}, seqlen "
            f"{cell['seqlen']}, batch {cell['batch']}, {cell['heads']} heads, {cell['dtype']}")


def cell_table(group: pd.DataFrame, extra: dict | None = None) -> str:
    table = pd.DataFrame({
        "variant": group["variant"], "label": group["label"],
        "TFLOPs/s": [_tflops(v) if s == "ok" else f"{s}: {r}" for v, s, r in
                     zip(group["tflops"], group["status"], group["reason"])],
        "ms (median)": [_num(v, ".3f") for v in group["ms"]],
        "spread ms (p20-p80)": [f"{lo:.3f}-{hi:.3f}" if not pd.isna(lo) else "-"
                                for lo, hi in zip(group["ms_lo"], group["ms_hi"])],
        **(extra or {}),
    })
    return markdown_table(table)


def _by_setting(c: pd.DataFrame):
    yield from c.groupby("setting", sort=False)


def _ratio_sentence(slow, fast, what: str) -> str:
    if slow is None or fast is None or slow["status"] != "ok" or fast["status"] != "ok":
        return f"{what}: {NOT_SHOWN} (a cell did not run)"
    ratio = slow["ms"] / fast["ms"]
    verdict = "beyond the spread" if clears(slow, fast) else f"{NOT_SHOWN}: within the spread"
    return f"{what}: {ratio:.2f}x ({verdict})"


def _get(group: pd.DataFrame, variant: str):
    hit = group[group["variant"] == variant]
    return None if hit.empty else hit.iloc[0]


# --------------------------------------------------------------------------------------
# One section per question
# --------------------------------------------------------------------------------------
def fa1_causal_skip(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    lines, parts = [], []
    for setting, group in _by_setting(c):
        lines += [f"Setting {setting} ({_shape_text(group.iloc[0])}):", "", cell_table(group), ""]
        parts.append(_ratio_sentence(_get(group, "fwd-rung0-noskip"), _get(group, "fwd-rung0-skip"),
                                     f"in {setting}, FA1 computing the fully masked blocks takes, over FA1 skipping them"))
    sentence = ("; ".join(parts) + ". Every later rung skips the same blocks (kernels/fa_ladder.py), so the "
                "ladder's causal gains over rung 0 compare kernels that both skip.") if parts else NOT_SHOWN
    return lines, sentence


def _gains(group: pd.DataFrame, order: list[str]) -> tuple[list[str], list[str]]:
    gains, texts = [], []
    previous = None
    for name in order:
        cell = _get(group, name)
        if cell is None or previous is None or cell["status"] != "ok" or previous["status"] != "ok":
            gains.append("-")
        else:
            ratio = previous["ms"] / cell["ms"]
            gains.append(f"{ratio:.2f}x" + ("" if clears(cell, previous) else " (within spread)"))
            texts.append(f"{cell['label']} {gains[-1]}")
        previous = cell if cell is not None else previous
    return gains, texts


def backward_ladder(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    order = [f"bwd-rung{r}" for r in range(4)] + ["bwd-production"]
    lines, parts = [], []
    for setting, group in _by_setting(c):
        if setting == "sweep":
            continue
        group = group.set_index("variant", drop=False).reindex([*order, *[v for v in group["variant"]
                                                                            if v not in order]]).dropna(how="all")
        gains, texts = _gains(group, order)
        lines += [f"Setting {setting} ({_shape_text(group.iloc[0])}):", "",
                  cell_table(group, {"gain over previous rung": gains + ["-"] * (len(group) - len(gains))}), ""]
        if texts:
            parts.append(f"in {setting}: " + ", ".join(texts))
    sweep = c[c["setting"] == "sweep"]
    if not sweep.empty:
        wide = sweep.assign(cell=[_tflops(v) if s == "ok" else s for v, s in zip(sweep["tflops"], sweep["status"])])
        wide = wide.pivot_table(index=["hdim", "causal", "seqlen"], columns="variant", values="cell", aggfunc="first")
        lines += ["Sweep (TFLOPs/s, backward alone, paper's FLOP count):", "",
                  markdown_table(wide.reindex(columns=[v for v in dict.fromkeys(sweep["variant"])]).reset_index()), ""]
    sentence = ("Gain of each backward rung over the one before (time ratio; 'within spread' = " + NOT_SHOWN
                + "): " + "; ".join(parts) + ".") if parts else NOT_SHOWN
    counter_lines, counter_sentence = backward_counters(counters)
    return lines + counter_lines, sentence + counter_sentence


def backward_counters(counters: pd.DataFrame) -> tuple[list[str], str]:
    """The forward ladder's counter groups for backward rungs 0-3: non-matmul instructions
    (FP32 FFMA + FADD + FMUL, MUFU), mma.sync, parallelism (grid, waves, achieved occupancy) and
    communication (shared-memory wavefronts, barrier stalls)."""
    from harness import ncu

    ok = counters[counters["status"] == "ok"] if "status" in counters else counters
    if ok.empty:
        return [], ""
    fp32 = sum(ok[m] for m in (ncu.FFMA, ncu.FADD, ncu.FMUL) if m in ok) if ncu.FFMA in ok else math.nan
    ok = ok.assign(nonmatmul=fp32)
    columns = {"FP32 non-matmul inst": "nonmatmul", "MUFU": ncu.MUFU, "mma.sync": ncu.HMMA, "grid": ncu.GRID,
               "waves": ncu.WAVES, "achieved occupancy %": ncu.WARPS_ACTIVE,
               "shared wavefronts": ncu.SHARED_WAVEFRONTS, "barrier stall %": ncu.BARRIER_STALL,
               "duration ns": ncu.DURATION}
    table = pd.DataFrame({"variant": ok["variant"], "setting": ok["setting"],
                          **{name: [_num(v, ".3g") for v in ok[metric]] if metric in ok else "-"
                             for name, metric in columns.items()}})
    texts = []
    for setting in dict.fromkeys(ok["setting"]):
        rows = ok[ok["setting"] == setting].set_index("variant")
        if {"bwd-rung0", "bwd-rung1"} <= set(rows.index) and not pd.isna(rows.loc["bwd-rung0", "nonmatmul"]):
            ratio = rows.loc["bwd-rung1", "nonmatmul"] / rows.loc["bwd-rung0", "nonmatmul"]
            texts.append(f"in {setting} rung 1 executes {ratio:.2f}x rung 0's FP32 non-matmul instructions")
        if {"bwd-rung2", "bwd-rung3"} <= set(rows.index) and ncu.SHARED_WAVEFRONTS in rows:
            ratio = rows.loc["bwd-rung3", ncu.SHARED_WAVEFRONTS] / rows.loc["bwd-rung2", ncu.SHARED_WAVEFRONTS]
            texts.append(f"rung 3 {ratio:.2f}x rung 2's shared-memory wavefronts")
    lines = ["Counters of the backward rungs (one profiled launch of `_ladder_bwd_kernel` each):", "",
             markdown_table(table), ""]
    return lines, (" Counters: " + "; ".join(texts) + ".") if texts else ""


def block_size_tuning(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    import json

    ok = c[c["status"] == "ok"].copy()
    if ok.empty:
        return [], NOT_SHOWN + " (no candidate ran)"
    meta = ok["config"].map(json.loads)
    ok["kernel"], ok["fixed"] = meta.map(lambda m: m["kernel"]), meta.map(lambda m: m["fixed"])
    ok["tile"] = meta.map(lambda m: (m.get("block_m"), m.get("block_n"), m.get("num_warps")))
    ok["stages"] = meta.map(lambda m: m.get("num_stages"))
    lines, parts = [], []
    for kernel, group in ok.groupby("kernel", sort=False):
        table, gains, beyond, stage_gains = [], [], 0, []
        for _, shape in group.groupby(SHAPE, sort=False):
            fixed = shape[shape["fixed"]]
            best, worst = shape.loc[shape["ms"].idxmin()], shape.loc[shape["ms"].idxmax()]
            if fixed.empty:
                continue
            fixed = fixed.iloc[0]
            gain = fixed["ms"] / best["ms"]
            gains.append(gain)
            beyond += clears(fixed, best)
            deeper = shape[(shape["tile"] == fixed["tile"]) & (shape["stages"] == (fixed["stages"] or 0) + 1)]
            if len(deeper):  # the fixed tile with one more pipelining stage: the stage effect alone
                stage_gains.append(fixed["ms"] / deeper.iloc[0]["ms"])
            table.append({"hdim": best["hdim"], "causal": best["causal"], "seqlen": best["seqlen"],
                          "fixed": f"{fixed['label']} {_tflops(fixed['tflops'])}",
                          "tuned (best)": f"{best['label']} {_tflops(best['tflops'])}",
                          "worst": f"{worst['label']} {_tflops(worst['tflops'])}",
                          "tuned / fixed": f"{gain:.3f}x", "best / worst": f"{worst['ms'] / best['ms']:.2f}x",
                          "candidates": len(shape)})
        if not table:
            continue
        lines += [f"{kernel} (TFLOPs/s; the fixed config is the table's, used at every shape):", "",
                  markdown_table(pd.DataFrame(table)), ""]
        median = pd.Series(gains).median()
        text = (f"{kernel}: tuning per shape gains a median {median - 1:.1%} (at most {max(gains) - 1:.1%}) over "
                f"the fixed config, beyond the spread at {beyond} of {len(gains)} shapes")
        if max(gains) == 1.0:
            text = f"{kernel}: the fixed config is the fastest candidate at every shape ({len(gains)} shapes)"
        elif not beyond:
            text = (f"{kernel}: {NOT_SHOWN} (the best candidate does not clear the fixed config's spread at any "
                    f"shape; median gain {median - 1:.1%})")
        parts.append(text)
        if stage_gains:
            parts.append(f"{kernel}'s fixed tile with one more pipelining stage runs at a median "
                         f"{pd.Series(stage_gains).median():.2f}x its speed")
    return lines, ("; ".join(parts) + ". The authors answered: on the order of 5%.") if parts else NOT_SHOWN


def triton_vs_cutlass(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    pairs = {"fwd": (("fwd-rung3", "fwd-rung0"), ("sdpa-flash", "sdpa-efficient")),
             "bwd": (("bwd-rung3", "bwd-rung0"), ("sdpa-flash", "sdpa-efficient"))}
    table, ratios = [], {}
    for shape, group in c.groupby(SHAPE, sort=False):
        mode = shape[0]
        row = dict(zip(SHAPE, shape))
        for name, (fa2, fa1) in zip(("Triton FA2/FA1", "CUDA FA2/cutlass"), pairs[mode]):
            a, b = _get(group, fa2), _get(group, fa1)
            if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
                row[name] = "-"
                continue
            row[name] = f"{b['ms'] / a['ms']:.2f}x" + ("" if clears(a, b) else " (within spread)")
            ratios.setdefault((mode, name), []).append(b["ms"] / a["ms"])
        for variant in dict.fromkeys(group["variant"]):
            cell = _get(group, variant)
            row[variant] = _tflops(cell["tflops"]) if cell["status"] == "ok" else cell["status"]
        table.append(row)
    lines = ["TFLOPs/s per kernel and the speed ratios (same run, same shapes):", "",
             markdown_table(pd.DataFrame(table).fillna("-")), ""] if table else []
    parts = [f"{mode} {name} median {pd.Series(values).median():.2f}x" for (mode, name), values in ratios.items()]
    have_cuda = any(name == "CUDA FA2/cutlass" for _, name in ratios)
    if not parts:
        return lines, NOT_SHOWN
    sentence = "; ".join(parts) + "."
    if not have_cuda:
        sentence += f" The CUDA pair is {NOT_SHOWN}: SDPA's flash or efficient kernel did not run here."
    return lines, sentence


MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 64, 32  # Hopper (sm_90)


def theoretical_occupancy(counters: pd.DataFrame) -> pd.Series:
    """ncu's theoretical occupancy (%), or, where it gave none, the same from the launch limits:
    min(blocks by registers, by shared memory, by warps, by the SM's block cap) x warps per block
    over the SM's 64 warp slots."""
    from ablations.measure import LIMIT_BLOCKS, LIMIT_WARPS, THEORETICAL_OCCUPANCY
    from harness import ncu

    def one(row) -> float:
        given = row.get(THEORETICAL_OCCUPANCY, math.nan)
        if not pd.isna(given):
            return float(given)
        threads = [int(x) for x in re.findall(r"\d+", str(row.get("block_size", "")))]
        if not threads or pd.isna(row.get(ncu.OCCUPANCY_LIMIT_REGISTERS, math.nan)):
            return math.nan
        warps = math.prod(threads) // 32
        limits = [row.get(ncu.OCCUPANCY_LIMIT_REGISTERS), row.get(ncu.OCCUPANCY_LIMIT_SHARED, math.nan),
                  row.get(LIMIT_WARPS, MAX_WARPS_PER_SM // warps), row.get(LIMIT_BLOCKS, MAX_BLOCKS_PER_SM)]
        blocks = min(x for x in limits if not pd.isna(x))
        return 100.0 * blocks * warps / MAX_WARPS_PER_SM

    return counters.apply(one, axis=1) if len(counters) else pd.Series(dtype=float)


def occupancy(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    from ablations.measure import LIMIT_BLOCKS, LIMIT_WARPS, SM_ACTIVE, THEORETICAL_OCCUPANCY
    from harness import ncu

    lines = ["Definitions (Nsight Compute metric names):", "", *OCCUPANCY_DEFINITIONS, ""]
    ok = counters[counters["status"] == "ok"] if "status" in counters else counters
    if ok.empty:
        reason = "; ".join(sorted(set(counters["reason"].dropna().astype(str)))) if len(counters) else \
            "no counters (run on a GPU with Nsight Compute)"
        return lines, f"{NOT_SHOWN}: {reason}"
    columns = {"theoretical %": THEORETICAL_OCCUPANCY, "achieved %": ncu.WARPS_ACTIVE, "waves": ncu.WAVES,
               "SM active %": SM_ACTIVE, "grid": ncu.GRID, "regs/thread": ncu.REGISTERS,
               "smem/block B": ncu.SHARED_PER_BLOCK, "limit regs": ncu.OCCUPANCY_LIMIT_REGISTERS,
               "limit smem": ncu.OCCUPANCY_LIMIT_SHARED, "limit warps": LIMIT_WARPS, "limit blocks": LIMIT_BLOCKS}
    ok = ok.assign(**{THEORETICAL_OCCUPANCY: theoretical_occupancy(ok)})
    table = pd.DataFrame({"variant": ok["variant"], "setting": ok["setting"], "mode": ok["mode"],
                          **{name: [_num(v, ".2f" if name == "waves" else ".0f") for v in ok[metric]]
                             if metric in ok else "-" for name, metric in columns.items()}})
    lines += [markdown_table(table), ""]
    parts = []
    for mode in ("fwd", "bwd"):
        for setting in dict.fromkeys(ok["setting"]):
            rows = ok[(ok["mode"] == mode) & (ok["setting"] == setting)].set_index("variant")
            before, after = f"{mode}-rung1", f"{mode}-rung2"
            if before in rows.index and after in rows.index and ncu.WARPS_ACTIVE in rows:
                b, a = rows.loc[before], rows.loc[after]
                parts.append(f"{mode} {setting}: rung 1 -> 2 moves achieved occupancy {_num(b[ncu.WARPS_ACTIVE], '.0f')}% "
                             f"-> {_num(a[ncu.WARPS_ACTIVE], '.0f')}% and waves {_num(b[ncu.WAVES], '.2f')} -> "
                             f"{_num(a[ncu.WAVES], '.2f')}")
    return lines, ("Measured, per rung and setting (one profiled launch each): " + "; ".join(parts) + ".") \
        if parts else NOT_SHOWN


def smem_vs_sync(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    from harness import ncu

    lines, parts = [], []
    for setting, group in _by_setting(c):
        lines += [f"Setting {setting} ({_shape_text(group.iloc[0])}):", "", cell_table(group), ""]
        r2, r3 = _get(group, "fwd-rung2"), _get(group, "fwd-rung3")
        barrier = group[group["variant"].str.startswith("fwd-rung3-barriers")]
        rb = barrier.iloc[0] if len(barrier) else None
        if any(x is None or x["status"] != "ok" for x in (r2, r3, rb)):
            parts.append(f"{setting}: {NOT_SHOWN} (a variant did not run)")
            continue
        if not clears(r2, r3) or not r2["ms"] > r3["ms"]:
            parts.append(f"{setting}: {NOT_SHOWN} (rung 2 is not slower than rung 3 beyond the spread)")
            continue
        share = (rb["ms"] - r3["ms"]) / (r2["ms"] - r3["ms"])
        follows = "follows the barriers" if share >= 0.5 else "does not follow the barriers alone"
        parts.append(f"{setting}: adding rung 2's extra barriers to rung 3 ({rb['label']}) recovers {share:.0%} of "
                     f"the rung 2 -> 3 time gap{'' if clears(rb, r3) else ' (within the spread of rung 3)'}: the "
                     f"time {follows}")
    ok = counters[counters["status"] == "ok"] if "status" in counters else counters
    if not ok.empty:
        metrics = {"shared wavefronts": ncu.SHARED_WAVEFRONTS, "bank conflicts": ncu.BANK_CONFLICTS,
                   "barrier stall %": ncu.BARRIER_STALL, "duration ns": ncu.DURATION}
        table = pd.DataFrame({"variant": ok["variant"], "setting": ok["setting"],
                              **{name: [_num(v, ".3g") for v in ok[metric]] if metric in ok else "-"
                                 for name, metric in metrics.items()}})
        lines += ["Counters (one profiled launch each):", "", markdown_table(table), ""]
    return lines, ("; ".join(parts) + ".") if parts else NOT_SHOWN


def warp_split_one_tile(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    import json

    lines, parts = [], []
    for setting, group in _by_setting(c):
        facts = [json.loads(text) if isinstance(text, str) and text.startswith("{") else {} for text in group["config"]]
        spills = {v: f.get("spill_bytes") for v, f in zip(group["variant"], facts)}
        lines += [f"Setting {setting} ({_shape_text(group.iloc[0])}):", "",
                  cell_table(group, {"registers": [_num(f.get("registers"), ".0f") for f in facts],
                                     "spill bytes": [_num(f.get("spill_bytes"), ".0f") for f in facts]}), ""]
        split_q = _get(group, "ws-split-q")
        texts = []
        for other, name in (("ws-split-k-p", "Triton's split-K"), ("ws-split-k-o", "FA1's split-K")):
            spilled = [f"{v} spills {spills[v]:.0f} B" for v in ("ws-split-q", other) if (spills.get(v) or 0) > 0]
            text = _ratio_sentence(_get(group, other), split_q, f"split-Q over {name}")
            texts.append(text + (f" ({', '.join(spilled)})" if spilled else ""))
        texts.append(_ratio_sentence(_get(group, "fwd-rung2"), _get(group, "fwd-rung3"),
                                     "rung 3 over rung 2 (the compiler-chosen pair, tile sides swapped)"))
        parts.append(f"{setting}: " + "; ".join(texts))
    ok = counters[counters["status"] == "ok"] if "status" in counters else counters
    if not ok.empty:
        from harness import ncu

        metrics = {"shared wavefronts": ncu.SHARED_WAVEFRONTS, "bank conflicts": ncu.BANK_CONFLICTS,
                   "barrier stall %": ncu.BARRIER_STALL, "achieved occupancy %": ncu.WARPS_ACTIVE,
                   "duration ns": ncu.DURATION}
        table = pd.DataFrame({"variant": ok["variant"], "setting": ok["setting"],
                              **{name: [_num(v, ".3g") for v in ok[metric]] if metric in ok else "-"
                                 for name, metric in metrics.items()}})
        lines += ["Counters (one profiled launch each):", "", markdown_table(table), ""]
    sentence = ("Time ratios at the same tile, grid, warps and stages (the slower one's time over split-Q's): "
                + " | ".join(parts) + ".") if parts else NOT_SHOWN
    return lines, sentence


def decode_rows(c: pd.DataFrame, counters: pd.DataFrame) -> tuple[list[str], str]:
    """Rows the decode suite tags with this question (its own variants and units), shown as they
    are; until it writes some, the section says where they come from."""
    if c.empty:
        return [], (f"{NOT_SHOWN}: the decode suite's rows answer it (rows with question "
                    "'decode-fa1-cudagraph-compilers' in reviewers.csv); none are in this folder")
    lines = []
    for setting, group in _by_setting(c):
        extra = {"GB/s of K+V": [_num(v, ",.0f") for v in group["gbps"]]} if "gbps" in group else None
        lines += [(f"Cache {setting} ({group.iloc[0]['heads']} heads, head dim {group.iloc[0]['hdim']}, one query "
                  "token; every provider timed by CUDA-graph replay where it captures, see `config`):"), "",
                  cell_table(group, extra), ""]
    parts = []
    for setting, group in _by_setting(c):
        cells = {row["variant"]: row for _, row in group.iterrows()}
        for slow, fast, what in (("fa1-rung0", "ours-splitkv", "FA1 -> split-KV"),
                                 ("pytorch", "torch-compile", "eager (CUDA graphs) -> compiled")):
            if slow in cells and fast in cells:
                parts.append(f"{setting}: " + _ratio_sentence(cells[slow], cells[fast], what))
    return lines, "; ".join(parts) if parts else NOT_SHOWN


SECTIONS = {
    "warp-split-one-tile": warp_split_one_tile,
    "backward-ladder": backward_ladder,
    "block-size-tuning": block_size_tuning,
    "fa1-causal-skip": fa1_causal_skip,
    "occupancy": occupancy,
    "smem-vs-sync": smem_vs_sync,
    "triton-vs-cutlass": triton_vs_cutlass,
    "decode-fa1-cudagraph-compilers": decode_rows,
}


def _quote(q: Question) -> list[str]:
    lines = [f"## {q.title}", "", f"> \"{q.quote}\"", f"> -- {q.asked_by}"]
    if q.answered_then:
        lines.append(f"> The authors answered then: \"{q.answered_then}\".")
    return [*lines, ""]


def write_reviewers_report(rows: pd.DataFrame, counters: pd.DataFrame, out_path) -> str:
    """reviewers.md from the studies' timing rows and counter rows; returns its text."""
    from pathlib import Path

    c = cells(rows) if len(rows) else cells(pd.DataFrame(columns=[*CELL_KEY, "label", "config", "status", "reason",
                                                                 "ms", "ms_p20", "ms_p80", "tflops"]))
    lines = ["# The reviewers' questions, answered with measurements", ""]
    if len(rows) and rows["interpreter"].astype(bool).any():
        lines += [INTERPRETER_NOTE, ""]
    lines += [("Each section quotes a question, shows the rows that answer it (`reviewers.csv`, its `question` column; "
              "counters in `reviewers_counters.csv`) and says in one generated sentence what they show, or "
              f"\"{NOT_SHOWN}\" where they do not clear their spread (do_bench's p20-p80 call times)."), ""]
    for q in QUESTIONS:
        mine = c[c["question"] == q.question]
        theirs = counters[counters["question"] == q.question] if "question" in counters else counters.iloc[0:0]
        if q.question == "occupancy" and "question" in counters:  # the backward rungs' come with the backward part
            theirs = counters[counters["question"].isin(["occupancy", "backward-ladder"])]
        body, sentence = SECTIONS[q.question](mine, theirs)
        lines += [*_quote(q), *body, f"**What the rows show:** {sentence}", ""]
    text = "\n".join(lines)
    Path(out_path).write_text(text)
    return text
