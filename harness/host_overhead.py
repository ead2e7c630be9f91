"""Host time against GPU time per attention call: ours and SDPA's backends, eager and compiled.

A short attention call waits on Python, not on the GPU: at batch 1 and 1k keys the kernels take
~0.1 ms while the host needs longer to issue them. This benchmark separates the two:

* host_ms: wall time per call while the GPU is kept busy by a preceding `torch.cuda._sleep`, so
  no call waits for the GPU (the queue never fills): what issuing one call costs the CPU. The
  providers of one cell (mode, shape, compiled, engine) take turns in rounds and each keeps its
  median, so a ratio between them is read from one stretch of the host's time (its speed drifts
  between runs by more than many of the differences measured);
* gpu_ms: time per call replayed from a CUDA graph (harness.timing.benchmark with cuda_graph, i.e.
  `do_bench_cudagraph`), which has no host work: what the kernels cost the GPU ('bwd' rows have
  none: a backward recorded before the capture launches outside it, the row's reason says so);
* wall_ms: harness.timing.benchmark (`do_bench`) as every other table is timed: max(host, GPU), roughly.

Engines (`--engines`), for the modes with a backward, eager: 'threaded' (PyTorch's default: the
autograd engine runs a CUDA backward on its device thread, the calling thread waiting) and
'calling-thread' (`torch.autograd.set_multithreading_enabled(False)`: the calling thread runs it),
which separates the hand-over between the two threads from the backward's own host time.

Modes, the call's stages: 'fwd' (one forward, no autograd graph), 'bwd' (the backward alone:
`torch.autograd.backward` of one recorded forward, its graph retained) and 'fwd_bwd' (forward
and `backward` of the output). The backward modes accumulate into q, k and v's `.grad` as a
training step with gradient accumulation does (host and GPU time; `wall_ms` clears them between
calls, do_bench's `grad_to_none`). 'compiled' rows time `torch.compile(fullgraph=True)` of the same function (compile
time excluded). Rows are written as they are measured (CSV, one row per measurement, with the
environment); reports.host_overhead makes host_overhead.md from them. Run on a GPU:

    python runner.py --suite host-overhead --out DIR        # DIR/host_overhead.csv and host_overhead.md
    python -m harness.host_overhead --out reports/h200     # the rows only, every option
    python -m harness.host_overhead --out DIR --shapes "16,32,1000,64;5,16,3000,128"   # shapes of your own
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch._functorch.config  # for the 'bwd' rows: `import torch` alone does not import it
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

COLUMNS = ("provider", "mode", "causal", "hdim", "seqlen", "batch", "heads", "dtype", "compiled", "engine",
           "host_ms", "gpu_ms", "wall_ms", "status", "reason")
# (batch, heads, seqlen, headdim): small-batch shapes where host time matters, and the paper
# sweep's 512 and 1k points (batch x seqlen = 16k tokens, heads x headdim = 2048)
SHAPES = ((1, 16, 1024, 128), (1, 32, 512, 64), (4, 8, 1024, 64), (8, 16, 2048, 128),
          (32, 16, 512, 128), (16, 16, 1024, 128), (32, 32, 512, 64), (16, 32, 1024, 64))
SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
HOST_CALLS = 50  # calls per host-time measurement (issued behind one GPU sleep)
HOST_ROUNDS = 7  # rounds of turns per cell (interleaved_host_ms)


def attention_fn(provider: str, causal: bool):
    """(q, k, v) in flash-attn's layout (B, N, H, D) -> out, for one provider."""
    if provider == "fa2":
        import kernels

        return lambda q, k, v: kernels.flash_attn_func(q, k, v, causal=causal)
    backend = SDPA_BACKENDS[provider]

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal)
        return out.transpose(1, 2)

    return sdpa


MODES = ("fwd", "bwd", "fwd_bwd")
ENGINES = ("threaded", "calling-thread")


def call_fn(attention, mode: str, q, k, v, dout, engine: str = "threaded"):
    """The call one measurement repeats, for one of MODES; the backward's on one of ENGINES (both
    enter the same context, so that they pay the same for it)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    threaded = engine == "threaded"
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return attention(q, k, v)
        return fwd
    if mode == "bwd":
        out = attention(q, k, v)  # recorded once; each call runs its backward again

        def bwd():
            with torch.autograd.set_multithreading_enabled(threaded):
                torch.autograd.backward(out, dout, retain_graph=True)
            return out
        return bwd

    def fwd_bwd():
        out = attention(q, k, v)
        with torch.autograd.set_multithreading_enabled(threaded):
            out.backward(dout)
        return out

    return fwd_bwd


def host_ms(fn, calls: int = HOST_CALLS, repeats: int = 5) -> float:
    """Median over `repeats` of the wall time per call with the GPU kept ahead by a sleep."""
    return interleaved_host_ms({"fn": fn}, calls, repeats)["fn"]


def interleaved_host_ms(fns: dict, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS, before_turn=None,
                        after_turn=None) -> dict:
    """{name: median ms per call} over `rounds` rounds in which every function takes its turn:
    `calls` calls behind one GPU sleep, so no call waits for the GPU. Taking turns spreads the
    host's drift (its clocks, other processes) over all of them alike, so their ratios are read
    from one stretch of time. `before_turn(name)` runs before each turn's warm-up and timed calls
    (outside the clock: an experiment's switches); `after_turn(name, ms)` receives each turn's
    ms per call as it is measured."""
    for name, fn in fns.items():
        if before_turn is not None:
            before_turn(name)
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before_turn is not None:
                before_turn(name)
            torch.cuda._sleep(int(2e6 * calls))  # ~1 ms of GPU sleep per call (about 2 GHz): the GPU stays behind
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
            torch.cuda.synchronize()
            if after_turn is not None:
                after_turn(name, times[name][-1])
    return {name: statistics.median(ms) for name, ms in times.items()}


def _row(provider: str, mode: str, causal: bool, shape, dtype, compiled: bool, engine: str) -> dict:
    batch, heads, seqlen, hdim = shape
    return {"provider": provider, "mode": mode, "causal": causal, "hdim": hdim, "seqlen": seqlen, "batch": batch,
            "heads": heads, "dtype": str(dtype).removeprefix("torch."), "compiled": compiled, "engine": engine,
            "host_ms": float("nan"), "gpu_ms": float("nan"), "wall_ms": float("nan"), "status": "ok", "reason": ""}


def _note(row: dict, text: str) -> None:
    """Add `text` to the row's reason (a measured row's notes: what is missing and why)."""
    row["reason"] = f"{row['reason']}; {text}" if row["reason"] else text


def _failed(row: dict, exc: Exception) -> dict:
    row.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:300])
    return row


def measure_cell(providers, mode: str, causal: bool, shape, dtype, compiled: bool, engine: str = "threaded") -> list:
    """One row per provider for one (mode, shape, compiled, engine) cell: the providers' host
    times from interleaved rounds (interleaved_host_ms), then each one's wall and GPU time. A
    provider that cannot run the case is a row with its reason; the others are measured."""
    batch, heads, seqlen, hdim = shape
    rows, calls, tensors = {}, {}, {}
    # 'bwd' reruns one recorded backward (retain_graph=True); AOTAutograd's donated buffers refuse
    # that ("compiled with non-empty donated buffers which requires ... retain_graph=False") unless
    # turned off, as the error itself advises
    with torch._functorch.config.patch(donated_buffer=False) if mode == "bwd" else contextlib.nullcontext():
        if compiled:  # one cell's compilations: the providers' (SDPA's backends share one traced function,
            torch._dynamo.reset()  # whose recompilations across cells would pass Dynamo's limit)
        for provider in providers:
            rows[provider] = row = _row(provider, mode, causal, shape, dtype, compiled, engine)
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype,
                                   requires_grad=mode != "fwd") for _ in range(3))
            dout = torch.randn_like(q)
            attention = attention_fn(provider, causal)
            if compiled:
                attention = torch.compile(attention, fullgraph=True)
            try:
                fn = call_fn(attention, mode, q, k, v, dout, engine)  # 'bwd' records its forward here (compiling it)
                for _ in range(3):  # compile and warm up outside every timing
                    fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 -- a provider that cannot run this case is a row with its reason
                _failed(row, exc)
                continue
            calls[provider], tensors[provider] = fn, (q, k, v)
        try:
            for provider, ms in interleaved_host_ms(calls).items():
                rows[provider]["host_ms"] = ms
        except Exception as interleaving:  # noqa: BLE001 -- then each provider alone, so that a failure names itself
            for provider, fn in calls.items():
                try:
                    rows[provider]["host_ms"] = host_ms(fn)
                    _note(rows[provider], f"host_ms: timed alone (the interleaved rounds failed: "
                                          f"{type(interleaving).__name__}: {interleaving})"[:200])
                except Exception as exc:  # noqa: BLE001
                    _failed(rows[provider], exc)
        for provider, fn in calls.items():
            if rows[provider]["status"] == "ok":
                _timed(rows[provider], fn, mode, tensors[provider], engine)
    return list(rows.values())


def _timed(row: dict, fn, mode: str, tensors, engine: str = "threaded") -> dict:
    """Fill `row` with the call's wall and GPU time (or the reason one is missing)."""
    from harness.timing import benchmark

    device = tensors[0].device
    try:
        row["wall_ms"] = benchmark(fn, device, grad_to_none=tensors if mode != "fwd" else ()).ms
    except Exception as exc:  # noqa: BLE001 -- a provider that cannot run this case is a row with its reason
        return _failed(row, exc)
    if engine != "threaded":  # the kernels are the threaded row's
        _note(row, "gpu_ms: not measured: the same kernels as the threaded engine's row")
        return row
    if mode == "bwd":
        # Not captured: the backward's kernels go to the stream its forward ran on, outside the
        # capture's stream, which invalidates the capture and leaves the process unable to draw
        # random numbers (reports/h200/decisions/cuda_graph_backward_capture.log).
        _note(row, "gpu_ms: not measured: the backward of a forward recorded before the capture "
                   "runs on that forward's stream, outside a CUDA graph's")
        return row
    try:
        row["gpu_ms"] = benchmark(fn, device, cuda_graph=True).ms
    except Exception as exc:  # noqa: BLE001 -- the row keeps host and wall time, says why no GPU time
        _note(row, f"gpu_ms: CUDA-graph capture failed: {type(exc).__name__}: {exc}"[:300])
    return row


HOST_OVERHEAD_CSV = "host_overhead.csv"
DEFAULT_PROVIDERS = ("fa2", "sdpa-flash", "sdpa-cudnn")


def parse_shapes(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """`--shapes`: (batch, heads, seqlen, headdim) shapes as "B,H,S,D;B,H,S,D" (SHAPES' order),
    each a positive int."""
    shapes = []
    for item in text.split(";"):
        try:
            shape = tuple(int(x) for x in item.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 4 or min(shape) < 1:
            raise argparse.ArgumentTypeError(f"--shapes takes batch,heads,seqlen,headdim of positive ints, "
                                             f"';'-separated; got {item!r}")
        shapes.append(shape)
    return tuple(shapes)


def measure_suite(out_dir: Path, providers=DEFAULT_PROVIDERS, modes=MODES, compiled: bool = True,
                  engines=ENGINES, quick: bool = False, shapes=None) -> Path:
    """Every (mode, shape, compiled, engine) cell's rows into out_dir/host_overhead.csv (a new
    file) and notes.txt, written as each cell is measured: `compiled` adds the torch.compile rows, the
    'calling-thread' engine runs for the eager modes with a backward, `quick` takes the first three
    shapes, `shapes` (batch, heads, seqlen, headdim) tuples replace SHAPES (a dense call off the
    128-row grid times the packed varlen path). Needs a CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("the host-overhead suite measures host and GPU time per call: it needs a CUDA GPU")
    for name, values, allowed in (("providers", providers, ("fa2", *SDPA_BACKENDS)), ("modes", modes, MODES),
                                  ("engines", engines, ENGINES)):
        if unknown := sorted(set(values) - set(allowed)):
            raise SystemExit(f"host overhead: {name} {unknown} not among {allowed}")
    from tqdm import tqdm

    from harness.environment import ROW_ENV_COLUMNS
    from harness.suite import SuiteRows

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shapes = shapes or (SHAPES[:3] if quick else SHAPES)
    cells = [(m, shape, c, e) for shape in shapes for m in modes for c in ((False, True) if compiled else (False,))
             for e in engines if e == "threaded" or (m != "fwd" and not c)]
    with SuiteRows(out_dir, HOST_OVERHEAD_CSV, (*COLUMNS, *ROW_ENV_COLUMNS)) as rows:
        env = {column: rows.env[column] for column in ROW_ENV_COLUMNS}
        for mode, shape, is_compiled, engine in tqdm(cells, desc="host overhead (cells of all providers)"):
            for row in measure_cell(providers, mode, True, shape, torch.bfloat16, is_compiled, engine):
                rows.write({**row, **env})
    return rows.path


def measure_rows(args, out_dir: Path) -> None:
    """`runner.py --suite host-overhead`: args.providers and args.modes narrow it (defaults:
    DEFAULT_PROVIDERS, every mode), args.quick takes three shapes; eager and compiled, both engines."""
    measure_suite(out_dir, tuple(args.providers or DEFAULT_PROVIDERS), tuple(args.modes or MODES), quick=args.quick)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for host_overhead.csv")
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS), help="comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--no-compiled", action="store_true", help="eager rows only")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated, from {','.join(ENGINES)} (the second: eager modes with a backward)")
    parser.add_argument("--quick", action="store_true", help="the first three shapes only")
    parser.add_argument("--shapes", type=parse_shapes, metavar="B,H,S,D;...",
                        help="these (batch, heads, seqlen, headdim) shapes instead of the suite's")
    args = parser.parse_args(argv)
    return measure_suite(args.out, tuple(args.providers.split(",")), tuple(args.modes.split(",")),
                         not args.no_compiled, tuple(args.engines.split(",")), args.quick, args.shapes)


if __name__ == "__main__":
    print(main())
