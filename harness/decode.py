"""The decode suite: one query token per sequence against a KV cache, as serving engines decode.

The FlashAttention-2 paper's claim on decoding: FlashAttention (v1) parallelises over batch and
heads only, which cannot fill a GPU at small batch with long caches; splitting the KV cache
across thread blocks and combining the partial results with their logsumexps speeds decoding
up. This suite measures that on the batch x cache-length grid, 32 q heads with 8 (GQA) and 32
(MHA) kv heads, head dim 128, bf16, every sequence holding the whole cache:

* providers: ours with the split heuristic and with num_splits=1 (contiguous and paged in
  16-token pages), FA1 (the ladder's rung 0 on one query token; MHA only: the ladder takes
  equal q and kv heads), and the registry's providers of kind 'decode' (SDPA
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
`decode.csv`; `reports.decode.write_decode_report` makes `report.md` and the plot from those rows alone.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from baselines.flops import decode_kv_bytes, gigabytes_per_second
from baselines.reference import attention_reference
from harness.environment import ROW_ENV_COLUMNS, capture_environment
from harness.suite import SuiteRows
from harness.timing import benchmark

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


def _ours(num_splits: int, paged: bool, tile: tuple[int, int, int] | None = None):
    from kernels.decode import flash_attn_with_kvcache

    def call(inputs: Inputs, i: int):
        if paged:
            k_cache, v_cache = inputs.paged[i]
            return flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                           block_table=inputs.block_tables[i], num_splits=num_splits, tile=tile)
        k_cache, v_cache = inputs.contiguous[i]
        return flash_attn_with_kvcache(inputs.q, k_cache, v_cache, cache_seqlens=inputs.seqlens,
                                       num_splits=num_splits, tile=tile)

    return call


def _fa1(inputs: Inputs, i: int):
    from kernels.fa_ladder import ladder_forward

    k_cache, v_cache = inputs.contiguous[i]
    return ladder_forward(inputs.q, k_cache, v_cache, rung=0)[0]


def _registry(provider):
    def call(inputs: Inputs, i: int):
        k_cache, v_cache = inputs.contiguous[i]
        return provider.forward(inputs.q, k_cache, v_cache, inputs.seqlens)

    return call


def _registry_paged(provider):
    def call(inputs: Inputs, i: int):
        k_pages, v_pages = inputs.paged[i]
        return provider.decode_paged(inputs.q, k_pages, v_pages, inputs.block_tables[i], inputs.seqlens)

    return call


def providers() -> list[tuple[str, str, str, Callable, Callable]]:
    """(name, label, layout, call(inputs, copy), why_not(kv_heads) -> None or (status, reason))."""
    from baselines.providers import registry, unavailable_reason

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
    for name, provider in registry("decode").items():
        reason = unavailable_reason(provider)

        def why_not(kv_heads, reason=reason, provider=provider):
            from baselines.providers.decode import DecodeSpec

            if reason:
                return "unavailable", reason
            unsupported = provider.supports(DecodeSpec(1, HEADS, kv_heads, HDIM, 1, "bf16"))
            return ("unsupported", unsupported) if unsupported else None

        label = "PyTorch eager" if name == "pytorch" else provider.label
        entries.append((name, label, "contiguous", _registry(provider), why_not))
        if provider.decode_paged is not None:
            entries.append((name, label, "paged", _registry_paged(provider), why_not))
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


def measure_rows(args, out_dir: Path) -> None:
    """The decode grid's rows (args.quick: the small one; args.eager: timed by do_bench, host
    time included; args.providers: only these peers beside ours) into out_dir/decode.csv;
    reports.decode makes report.md and plots/ from them."""
    peers = getattr(args, "providers", None)
    measure_suite(bool(args.quick), Path(out_dir), eager=bool(getattr(args, "eager", False)),
                  peers=None if not peers else tuple(peers))


def measure_suite(quick: bool, out_dir: Path, device: torch.device | None = None, eager: bool = False,
                  peers: tuple[str, ...] | None = None) -> None:
    """The grid's rows into out_dir/decode.csv (a new file), and notes.txt. `device` cpu (tests
    only) runs the pipeline in Triton's interpreter; its times are not performance. `eager`:
    every call timed by do_bench, host time included (`_time_call`). `peers`: the providers
    measured beside ours (None: every one)."""
    device = device or torch.device("cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the decode suite times GPU kernels: it needs CUDA (the CPU interpreter's times "
                         "are not performance; tests/test_decode.py checks correctness there)")
    entries = providers()
    if peers is not None:
        known = {entry[0] for entry in entries}
        unknown = sorted(set(peers) - known)
        if unknown:
            raise ValueError(f"--providers: unknown decode providers {unknown}; known: {sorted(known)}")
        entries = [entry for entry in entries if entry[0].startswith("ours") or entry[0] in peers]
    with SuiteRows(out_dir, DECODE_CSV, COLUMNS, BUDGET_S["quick" if quick else "full"]) as rows:
        env = rows.env
        copy_bytes = COPY_BYTES if device.type == "cuda" else 1 << 20
        copy_ms, copy_gbps = measure_copy_bandwidth(device, copy_bytes)
        rows.write(_row(env, provider="device-copy", label="device-to-device copy (read + write)", layout="", batch=0,
                        cache_len=0, kv_heads=0, status="ok",
                        timing="cuda-graph" if device.type == "cuda" else "cpu interpreter (not performance)",
                        ms=copy_ms, kv_bytes=2 * copy_bytes, gbps=copy_gbps))
        for kv_heads, batch, cache_len in grid(quick):
            if rows.out_of_time():
                rows.skip(f"{batch} x {cache_len} ({kv_heads} kv heads)")
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
                    rows.write(_row(env, **base, status=refused[0], reason=refused[1]))
                    continue
                config = _our_config(name, batch, cache_len, kv_heads, device) if name.startswith("ours") else ""
                rows.write(_row(env, **base, config=config,
                                **_measure(call, inputs, reference, device, nbytes, eager)))
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()


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


def load_rows(out_dir) -> pd.DataFrame:
    return pd.read_csv(Path(out_dir) / DECODE_CSV, keep_default_na=False, na_values={"ms": [""], "gbps": [""]})


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
            row = {"batch": batch, "cache_len": cache_len, "kv_heads": 8, "layout": layout, "block_n": tile[0],
                   "num_warps": tile[1], "num_stages": tile[2], "num_splits": num_splits,
                   **{k: env[k] for k in ROW_ENV_COLUMNS}}
            try:
                timing, _ = _time_call(_ours(num_splits, layout == "paged", tile), inputs, device)
                row.update(status="ok", reason="", ms=timing.ms, gbps=gigabytes_per_second(nbytes, timing.ms))
            except Exception as exc:  # noqa: BLE001 -- a tile that does not compile or fit is a row
                row.update(status="error", reason=" ".join(f"{type(exc).__name__}: {exc}".split())[:200])
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
    """`python -m harness.decode --tune --out DIR`: our kernel's tiles and split counts at the bar's
    shapes (the suite itself runs as `runner.py --suite decode`)."""
    parser = argparse.ArgumentParser(description="Our decode kernel's tiles and split counts at the bar's shapes, "
                                     "into DIR/tuning.csv (the suite itself: runner.py --suite decode)")
    parser.add_argument("--out", required=True, type=Path, help="folder for tuning.csv")
    parser.add_argument("--tune", action="store_true", required=True, help="measure the tiles and split counts")
    args = parser.parse_args(argv)
    rows = pd.read_csv(tune(args.out))
    print(rows[["batch", "cache_len", "layout", "block_n", "num_warps", "num_stages", "num_splits", "status",
                "ms", "gbps"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
