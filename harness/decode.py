"""The decode suite: one query token per sequence against a KV cache, as serving engines decode.

The FlashAttention-2 paper's claim on decoding: FlashAttention (v1) parallelises over batch and
heads only, which cannot fill a GPU at small batch with long caches; splitting the KV cache
across thread blocks and combining the partial results with their logsumexps speeds decoding
up. This suite measures that on the batch x cache-length grid, 32 q heads with 8 (GQA) and 32
(MHA) kv heads, head dim 128, bf16, every sequence holding the whole cache:

* providers: ours with the split heuristic and with num_splits=1 (contiguous and paged in
  16-token pages), FA1 (the ladder's rung 0 on one query token; MHA only: the ladder takes
  equal q and kv heads), and the decode registry of baselines.providers.decode (SDPA
  flash/cuDNN/efficient/math, PyTorch eager, eager under torch.compile, FA4, FlashInfer,
  xformers split-K) where each is available;
* timing: CUDA-graph replay (`triton.testing.do_bench_cudagraph`) wherever the call can be
  captured, so host launch time (tens of us, as long as the kernels themselves) is not timed;
  a provider that cannot be captured is timed by `do_bench`, and its row says so. A graph does
  not flush L2, so each captured call reads a different copy of the cache, at least
  L2_COPIES_FACTOR x the L2 size in all;
* bandwidth: bytes of K and V read / time, against a device-to-device copy measured in the
  same run ((bytes read + bytes written) / time), the ceiling line of the plot;
* accuracy: each provider's output on the first sequence against the float64 reference.

Rows are long format (one measurement per row, the environment beside them) in
`decode.csv`; `write_decode_report` makes `report.md` and the plot from those rows alone.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from baselines.flops import decode_kv_bytes, gigabytes_per_second
from baselines.reference import attention_reference
from harness.timing import benchmark
from reports.environment import ROW_ENV_COLUMNS, capture_environment, throttle_warnings

HEADS, HDIM, DTYPE, PAGE_SIZE = 32, 128, torch.bfloat16, 16
KV_HEADS = (8, 32)
FULL_GRID = {"batch": (1, 8, 32, 64), "cache_len": (1024, 4096, 8192, 16384, 65536, 131072)}
QUICK_GRID = {"batch": (1, 8), "cache_len": (4096, 65536)}
ANCHORS = ((1, 65536), (8, 8192), (32, 4096))  # the bar's shapes: measured first, and by every provider
MAX_KV_BYTES = 8 << 30  # K + V of one configuration (the paged copy doubles it)
L2_COPIES_FACTOR = 4
COPY_BYTES = 2 << 30  # the bandwidth ceiling's copy: far beyond L2
REP_MS = 20  # do_bench_cudagraph's rep: 10 replays of a graph of calls lasting about this long
BUDGET_S = {"full": 170.0, "quick": 60.0}  # configurations not started by then are listed as skipped
WRONG_REL_ERR = 0.02  # max |out - ref| / max |ref| above this marks a row 'wrong' (bf16 rounding: ~0.004)
PER_SHAPE_COMPILE = {"torch-compile"}  # compiles per shape (seconds): measured at the anchors only
DECODE_CSV = "decode.csv"
COLUMNS = ("provider", "label", "layout", "batch", "cache_len", "heads", "kv_heads", "hdim", "dtype", "status",
           "reason", "timing", "ms", "ms_p20", "ms_p80", "kv_bytes", "gbps", "rel_err", "config", "interpreter",
           *ROW_ENV_COLUMNS)


def kv_bytes(batch: int, cache_len: int, kv_heads: int) -> int:
    """Bytes of K and V one decode call reads (every sequence holds the whole cache)."""
    return decode_kv_bytes(batch * cache_len, kv_heads, HDIM, torch.finfo(DTYPE).bits // 8)


def grid(quick: bool) -> list[tuple[int, int, int]]:
    """(kv_heads, batch, cache_len) in measuring order: the anchors first, then the rest,
    without configurations whose K + V exceed MAX_KV_BYTES."""
    chosen = QUICK_GRID if quick else FULL_GRID
    shapes = list(itertools.product(chosen["batch"], chosen["cache_len"]))
    ordered = [s for s in ANCHORS if s in shapes] + [s for s in shapes if s not in ANCHORS]
    return [(kv_heads, b, n) for b, n in ordered for kv_heads in KV_HEADS if kv_bytes(b, n, kv_heads) <= MAX_KV_BYTES]


def timing_copies(batch: int, cache_len: int, kv_heads: int, device) -> int:
    """How many copies of a configuration's cache the timing cycles through: together at least
    L2_COPIES_FACTOR x the L2 size, so no captured call finds its cache in L2 (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    from kernels.common import l2_cache_bytes

    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, math.ceil(L2_COPIES_FACTOR * l2_cache_bytes(index) / kv_bytes(batch, cache_len, kv_heads)))


class Inputs:
    """One configuration's caches: `copies` contiguous copies (B, S, Hkv, D) of the same values and
    their paged forms (a shuffled pool of 16-token pages and its block table), the query, and
    full-length cache_seqlens."""

    def __init__(self, batch, cache_len, kv_heads, device, copies):
        generator = torch.Generator(device=device).manual_seed(batch * 1_000_003 + cache_len * 7 + kv_heads)
        shape = (batch, cache_len, kv_heads, HDIM)
        self.q = torch.randn(batch, 1, HEADS, HDIM, generator=generator, device=device, dtype=DTYPE)
        k = torch.randn(shape, generator=generator, device=device, dtype=DTYPE)
        v = torch.randn(shape, generator=generator, device=device, dtype=DTYPE)
        self.contiguous = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
        num_pages = batch * cache_len // PAGE_SIZE
        self.block_tables, self.paged = [], []
        for k_c, v_c in self.contiguous:
            order = torch.randperm(num_pages, generator=generator, device=device)
            pools = [torch.empty((num_pages, PAGE_SIZE, kv_heads, HDIM), device=device, dtype=DTYPE) for _ in "kv"]
            for pool, cache in zip(pools, (k_c, v_c)):
                pool[order] = cache.reshape(num_pages, PAGE_SIZE, kv_heads, HDIM)  # page j of the cache in slot order[j]
            self.paged.append(tuple(pools))
            self.block_tables.append(order.reshape(batch, cache_len // PAGE_SIZE).to(torch.int32))
        self.seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
        self.copies = copies

    def reference(self) -> torch.Tensor:
        k, v = self.contiguous[0]
        return attention_reference(self.q[:1], k[:1], v[:1])[0][0, 0]  # (H, D) float64: sequence 0's token


def _ours(num_splits: int, paged: bool):
    from kernels.decode import flash_attn_with_kvcache

    def call(inputs: Inputs, i: int):
        if paged:
            k_cache, v_cache = inputs.paged[i]
            return flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                           block_table=inputs.block_tables[i], num_splits=num_splits)
        k_cache, v_cache = inputs.contiguous[i]
        return flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                       num_splits=num_splits)

    return call


def _fa1(inputs: Inputs, i: int):
    from kernels.fa_ladder import ladder_forward

    k_cache, v_cache = inputs.contiguous[i]
    return ladder_forward(inputs.q, k_cache, v_cache, rung=0)[0]


def _registry(provider):
    def call(inputs: Inputs, i: int):
        k_cache, v_cache = inputs.contiguous[i]
        return provider.decode(inputs.q, k_cache, v_cache, inputs.seqlens)

    return call


def providers() -> list[tuple[str, str, str, Callable, Callable]]:
    """(name, label, layout, call(inputs, copy), why_not(kv_heads) -> None or (status, reason))."""
    from baselines.providers.decode import DECODE_PROVIDERS, decode_unavailable_reason

    def mha_only(kv_heads):
        return None if kv_heads == HEADS else ("unsupported", "the ladder's FA1 takes equal q and kv heads (no GQA)")

    def everywhere(_kv_heads):
        return None

    entries = [
        ("ours-splitkv", "ours split-KV (num_splits=0)", "contiguous", _ours(0, False), everywhere),
        ("ours-nosplit", "ours num_splits=1", "contiguous", _ours(1, False), everywhere),
        ("ours-splitkv", "ours split-KV (num_splits=0)", "paged", _ours(0, True), everywhere),
        ("ours-nosplit", "ours num_splits=1", "paged", _ours(1, True), everywhere),
        ("fa1-rung0", "FA1 (ladder rung 0)", "contiguous", _fa1, mha_only),
    ]
    for name, provider in DECODE_PROVIDERS.items():
        reason = decode_unavailable_reason(provider)

        def why_not(kv_heads, reason=reason, provider=provider):
            from baselines.providers.decode import DecodeSpec

            if reason:
                return "unavailable", reason
            unsupported = provider.supports(DecodeSpec(1, HEADS, kv_heads, HDIM, 1, "bf16"))
            return ("unsupported", unsupported) if unsupported else None

        label = "PyTorch eager" if name == "pytorch" else provider.label
        entries.append((name, label, "contiguous", _registry(provider), why_not))
    return entries


def _our_config(name: str, batch: int, cache_len: int, kv_heads: int, device) -> str:
    """JSON of our launch: the tile and the split count the heuristic (or num_splits=1) gives."""
    from kernels import decode

    block_n, num_warps, num_stages = decode.GPU_CONFIG if device.type == "cuda" else decode.INTERPRETER_CONFIG
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else decode.INTERPRETER_SMS
    splits = 1 if name == "ours-nosplit" else decode.choose_num_splits(batch, kv_heads, 1, cache_len, block_n, sms)
    if device.type == "cuda":
        block_n, num_warps, num_stages = decode.choose_tile(splits * batch * kv_heads, sms, HDIM)
    return json.dumps({"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "num_splits": splits})


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_each(shapes, device, measure: Callable) -> None:
    """measure(batch, cache_len, kv_heads, inputs) for each (batch, cache_len, kv_heads) of
    `shapes` (the experiments' loop), each configuration's Inputs (timing_copies copies) made
    just before and freed before the next one is made."""
    for batch, cache_len, kv_heads in shapes:
        inputs = Inputs(batch, cache_len, kv_heads, device, timing_copies(batch, cache_len, kv_heads, device))
        measure(batch, cache_len, kv_heads, inputs)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()


class ExperimentCase:
    """One configuration of a decode experiment: its shape, its column label, the call of a
    variant's layout (`call(paged)` -> call(inputs, i)), the bytes of K and V it reads and its
    float64 reference (`reference(inputs)`; the whole cache's by default)."""

    def __init__(self, batch: int, cache_len: int, kv_heads: int, column: str, call: Callable,
                 nbytes: int | None = None, reference: Callable | None = None):
        self.batch, self.cache_len, self.kv_heads, self.column, self.call = batch, cache_len, kv_heads, column, call
        self.nbytes = kv_bytes(batch, cache_len, kv_heads) if nbytes is None else nbytes
        self.reference = reference or Inputs.reference


def layout_variants(settings, name: str = "{layout}, {setting}") -> dict:
    """A decode experiment's variants: each (label, value) of `settings` on a contiguous and on a
    paged cache, named by `name`; each variant's value is (paged, value)."""
    return {name.format(layout=layout, setting=label): (paged, value)
            for layout, paged in (("contiguous", False), ("paged", True)) for label, value in settings}


def run_experiment(description: str, csv_name: str, tool: str, variants: dict, select: Callable, restore: Callable,
                   cases, width: int = 32) -> None:
    """The decode experiments' command line (--out DIR, --repeats, --device) and loop: per case,
    its Inputs made (measure_each), then each variant (`select(value)`) checked against float64 and
    timed, rounds interleaved, in microseconds, rows to DIR/csv_name as they are measured
    (reports.decisions.DecisionWriter.time_interleaved); `restore()` after each case."""
    from reports.decisions import DecisionWriter

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    parser.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a smoke run, not timing)")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / csv_name, tool) as writer:
        for case in cases:

            def measure(batch, cache_len, kv_heads, inputs, case=case):
                reference = case.reference(inputs)

                def time_one(inputs, value):
                    return _measure(case.call(value[0]), inputs, reference, device, case.nbytes)

                writer.time_interleaved(variants, {case.column: inputs}, select, time_one, args.repeats, width=width,
                                        unit="us")
                restore()

            measure_each([(case.batch, case.cache_len, case.kv_heads)], device, measure)


def _time_call(call: Callable, inputs: Inputs, device, eager: bool = False) -> tuple[object, str]:
    """Timing of call(inputs, copy), copies cycling, by CUDA-graph replay or else do_bench;
    `eager`: by do_bench (host time included, as `model.generate` runs by default)."""
    counter = itertools.count()

    def fn():
        return call(inputs, next(counter) % inputs.copies)

    if device.type != "cuda":
        return benchmark(fn, device), "cpu interpreter (not performance)"
    if eager:
        return benchmark(fn, device, rep_ms=REP_MS), "do_bench (eager)"
    try:
        return benchmark(fn, device, rep_ms=REP_MS, cuda_graph=True), "cuda-graph"
    except Exception as exc:  # noqa: BLE001 -- a provider whose call cannot be captured
        _sync(device)
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        return benchmark(fn, device, rep_ms=REP_MS), f"do_bench (no CUDA graph: {reason})"


def measure_copy_bandwidth(device, nbytes: int) -> tuple[float, float]:
    """(ms, GB/s) of a device-to-device copy of nbytes, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    timing = benchmark(lambda: dst.copy_(src), device, rep_ms=REP_MS, cuda_graph=True)
    return timing.ms, gigabytes_per_second(2 * nbytes, timing.ms)


def _row(env, **fields) -> dict:
    row = dict.fromkeys(COLUMNS, "")
    row.update({k: env[k] for k in ROW_ENV_COLUMNS})
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[DTYPE]
    row.update(interpreter=env["interpreter"], heads=HEADS, hdim=HDIM, dtype=dtype)
    row.update(fields)
    return row


def run_suite(args, out_dir) -> int:
    """Measure the decode grid (args.quick: the small one) into out_dir/decode.csv, then write
    out_dir/report.md and out_dir/plots/ from those rows and print the report (args.report_only:
    only rewrite the report from the rows already there). Returns 0."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not getattr(args, "report_only", False):
        measure_suite(bool(getattr(args, "quick", False)), out_dir, eager=bool(getattr(args, "eager", False)))
    print(write_decode_report(out_dir).read_text())
    return 0


def measure_suite(quick: bool, out_dir: Path, device: torch.device | None = None, eager: bool = False) -> None:
    """The grid's rows into out_dir/decode.csv (a new file), and notes.txt. `device` cpu (tests
    only) runs the pipeline in Triton's interpreter; its times are not performance. `eager`:
    every call timed by do_bench, host time included (`_time_call`)."""
    device = device or torch.device("cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the decode suite times GPU kernels: it needs CUDA (the CPU interpreter's times "
                         "are not performance; tests/test_decode.py checks correctness there)")
    env = capture_environment()
    budget = BUDGET_S["quick" if quick else "full"]
    start = time.monotonic()
    entries = providers()
    skipped = []
    with (out_dir / DECODE_CSV).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        copy_bytes = COPY_BYTES if device.type == "cuda" else 1 << 20
        copy_ms, copy_gbps = measure_copy_bandwidth(device, copy_bytes)
        writer.writerow(_row(env, provider="device-copy", label="device-to-device copy (read + write)",
                             layout="", batch=0, cache_len=0, kv_heads=0, status="ok",
                             timing="cuda-graph" if device.type == "cuda" else "cpu interpreter (not performance)",
                             ms=copy_ms, kv_bytes=2 * copy_bytes, gbps=copy_gbps))
        for kv_heads, batch, cache_len in grid(quick):
            if time.monotonic() - start > budget:
                skipped.append((kv_heads, batch, cache_len))
                continue
            nbytes = kv_bytes(batch, cache_len, kv_heads)
            inputs = Inputs(batch, cache_len, kv_heads, device, timing_copies(batch, cache_len, kv_heads, device))
            reference = inputs.reference()
            for name, label, layout, call, why_not in entries:
                base = {"provider": name, "label": label, "layout": layout, "batch": batch, "cache_len": cache_len,
                        "kv_heads": kv_heads, "kv_bytes": nbytes}
                if name in PER_SHAPE_COMPILE and (batch, cache_len) not in ANCHORS:
                    continue  # its compile per shape would not fit the suite's time
                refused = why_not(kv_heads)
                if refused:
                    writer.writerow(_row(env, **base, status=refused[0], reason=refused[1]))
                    continue
                config = _our_config(name, batch, cache_len, kv_heads, device) if name.startswith("ours") else ""
                writer.writerow(_row(env, **base, config=config,
                                     **_measure(call, inputs, reference, device, nbytes, eager)))
                f.flush()
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env_after = capture_environment()
    notes = throttle_warnings(env, env_after)
    if skipped:
        notes.append(f"not measured (the suite's {budget:.0f}-s budget ran out): "
                     + ", ".join(f"{b} x {n} ({h} kv heads)" for h, b, n in skipped))
    (out_dir / "notes.txt").write_text("\n".join(notes) + ("\n" if notes else ""))


def _measure(call, inputs: Inputs, reference, device, nbytes, eager: bool = False) -> dict:
    try:
        out = call(inputs, 0)
        _sync(device)
        ref_max = reference.abs().max().item()
        rel_err = (out[0, 0].double() - reference).abs().max().item() / ref_max
        timing, how = _time_call(call, inputs, device, eager)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"status": "oom", "reason": " ".join(str(exc).split())[:200]}
    except Exception as exc:  # noqa: BLE001 -- a provider's failure is a row, not the suite's end
        return {"status": "error", "reason": " ".join(f"{type(exc).__name__}: {exc}".split())[:200]}
    status = "ok" if rel_err <= WRONG_REL_ERR else "wrong"
    return {"status": status, "reason": "" if status == "ok" else f"relative error {rel_err:.3g}",
            "timing": how, "ms": timing.ms, "ms_p20": timing.ms_p20, "ms_p80": timing.ms_p80,
            "gbps": gigabytes_per_second(nbytes, timing.ms), "rel_err": rel_err}


# --------------------------------------------------------------------------------------
# The report: tables, the bar's checks and the plot, from the rows alone
# --------------------------------------------------------------------------------------
def load_rows(out_dir) -> pd.DataFrame:
    return pd.read_csv(Path(out_dir) / DECODE_CSV, keep_default_na=False, na_values={"ms": [""], "gbps": [""]})


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
    for kv_heads in KV_HEADS:
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
    common = ours.index.intersection(flash.index)
    if len(common):
        ratios = ours[common] / flash[common]
        worst = ratios.idxmin()
        checks.append(("every shape: ours / SDPA flash >= 1", (f"min {ratios.min():.3f}x at {worst[1]} x {worst[2]} "
                       f"({worst[0]} kv heads)"), "met" if ratios.min() >= 1 else "not met"))
    common = ours.index.intersection(paged.index)
    if len(common):
        ratios = paged[common] / ours[common]
        worst = ratios.idxmin()
        checks.append(("every shape: paged / contiguous >= 0.9", (f"min {ratios.min():.3f}x at {worst[1]} x {worst[2]} "
                       f"({worst[0]} kv heads)"), "met" if ratios.min() >= 0.9 else "not met"))
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
    fig, axes = plt.subplots(len(KV_HEADS), len(batches), figsize=(4 * len(batches), 3.4 * len(KV_HEADS)),
                             squeeze=False, sharey=True)
    ok = df[(df.status == "ok") & (df.provider != "device-copy")]
    for row, kv_heads in enumerate(KV_HEADS):
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
    df = load_rows(out_dir)
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
             f"(the row's `timing` says why). Rows: `{DECODE_CSV}`."), ""]
    if len(copy):
        lines += [(f"Ceiling: a device-to-device copy moved {float(copy.gbps.iloc[0]):,.0f} GB/s "
                  "(bytes read + written / time) in the same run."), ""]
    if len(df[df.status == "wrong"]):
        lines += [("Rows marked `wrong` differ from the float64 reference by more than "
                  f"{WRONG_REL_ERR} relative error."), ""]
    lines += ["## The targets", "", "| check | measured | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {m} | {v} |" for c, m, v in bar_checks(df)]
    for kv_heads in KV_HEADS:
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


# --------------------------------------------------------------------------------------
# The kernel's own meta-parameters: tiles and split counts at the bar's shapes
# --------------------------------------------------------------------------------------
# (block_n, num_warps, num_stages): key blocks x pipeline depths at 4 warps, and 8 warps at depth 3
TUNE_TILES = (*itertools.product((32, 64, 128), (4,), (2, 3, 4)), (64, 8, 3), (128, 8, 3))
TUNE_SPLITS = (1, 4, 8, 16, 33, 66, 128)  # explicit num_splits at batch 1
TUNING_CSV = "tuning.csv"


def tune(out_dir) -> Path:
    """Ours across TUNE_TILES at the anchors (8 kv heads; paged too at batch 1), and across
    TUNE_SPLITS at batch 1 x 64k, into out_dir/tuning.csv (long format, with the environment):
    the measurements behind kernels.decode.GPU_CONFIG and its split heuristic."""
    from kernels import decode

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    env = capture_environment()
    shipped = decode.GPU_CONFIG
    columns = ("batch", "cache_len", "kv_heads", "layout", "block_n", "num_warps", "num_stages", "num_splits",
               "status", "reason", "ms", "gbps", *ROW_ENV_COLUMNS)
    with (out_dir / TUNING_CSV).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()

        def measure(inputs, batch, cache_len, layout, tile, num_splits):
            nbytes = kv_bytes(batch, cache_len, 8)
            decode.TILE_OVERRIDE = tile
            row = {"batch": batch, "cache_len": cache_len, "kv_heads": 8, "layout": layout, "block_n": tile[0],
                   "num_warps": tile[1], "num_stages": tile[2], "num_splits": num_splits,
                   **{k: env[k] for k in ROW_ENV_COLUMNS}}
            try:
                timing, _ = _time_call(_ours(num_splits, layout == "paged"), inputs, device)
                row.update(status="ok", reason="", ms=timing.ms, gbps=gigabytes_per_second(nbytes, timing.ms))
            except Exception as exc:  # noqa: BLE001 -- a tile that does not compile or fit is a row
                row.update(status="error", reason=" ".join(f"{type(exc).__name__}: {exc}".split())[:200])
            finally:
                decode.TILE_OVERRIDE = None
            writer.writerow(row)
            f.flush()

        for batch, cache_len in ANCHORS:
            inputs = Inputs(batch, cache_len, 8, device, timing_copies(batch, cache_len, 8, device))
            for layout in ("contiguous", "paged") if batch == 1 else ("contiguous",):
                for tile in TUNE_TILES:
                    measure(inputs, batch, cache_len, layout, tile, 0)
            if batch == 1:
                for num_splits in TUNE_SPLITS:
                    measure(inputs, batch, cache_len, "contiguous", shipped, num_splits)
            del inputs
            torch.cuda.empty_cache()
    return out_dir / TUNING_CSV


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The decode suite (batch x cache length, split-KV against peers)")
    parser.add_argument("--out", required=True, type=Path, help="folder for decode.csv, report.md and plots/")
    parser.add_argument("--quick", action="store_true", help="a small grid (2 batches x 2 cache lengths)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the folder's rows")
    parser.add_argument("--eager", action="store_true", help="time every call by do_bench, host time included "
                        "(as model.generate runs), not by CUDA-graph replay: a folder of its own")
    parser.add_argument("--tune", action="store_true", help="instead: our kernel's tiles and split counts "
                        "at the bar's shapes, into tuning.csv")
    args = parser.parse_args(argv)
    if args.tune:
        rows = pd.read_csv(tune(args.out))
        print(rows[["batch", "cache_len", "layout", "block_n", "num_warps", "num_stages", "num_splits", "status",
                    "ms", "gbps"]].to_string(index=False))
        return 0
    return run_suite(args, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
