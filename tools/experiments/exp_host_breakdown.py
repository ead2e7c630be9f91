"""Where one forward+backward call's host time goes, stage by stage, with the GPU kept busy
(the calls queued behind a GPU sleep) so that no launch waits on
the device.

The kernels' launchers and the pass functions that `kernels.ops` calls are wrapped (module
globals, no change to the library) so that each records a timestamp where it starts and ends;
a call is `flash_attn_func(...).backward(dout)`, the paper sweep's 'fwd_bwd' call. Per shape
and launch path (`--launches`: the library's cached launches, or every launch through Triton's
JIT, without the cache), in one process, the paths' calls taking turns: the median microseconds of
each stage over CALLS calls, their sum, host time per call, GPU time per call (of all paths
together: the kernels are the same), and the runner's do_bench reading (taken with the stamps
in place: 14 timestamps per call, well under a microsecond each). Rows go to
OUT/exp_host_breakdown.csv (`--out`).

    python tools/experiments/exp_host_breakdown.py --hdims 256 128 --seqlens 512 1024
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_fa2 import CsvRows

from harness.timing import time_attention
from kernels import backward, flash_attn_func, forward, ops
from kernels import flash_attn_hopper as fah

CALLS = 50  # rounds: each variant's call once per round
SLEEP_CYCLES = 400_000_000  # ~0.2 s at the H200's clocks: longer than issuing CALLS rounds
STAMPS: list[tuple[str, int]] = []


def gpu_and_host_ms(fn, tensors=(), calls: int = CALLS) -> tuple[float, float, float]:
    """For `calls` calls of fn (gradients of `tensors` cleared before each): (GPU ms per call,
    host ms per call, slack ms: how long the sleep outlasted the issuing; negative means the GPU
    caught up with the host and gpu_ms includes host time)."""
    before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    fn()
    torch.cuda.synchronize()
    before.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        for t in tensors:
            t.grad = None
        fn()
    host_total = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, host_total / calls, before.elapsed_time(start) - host_total


def stamp(label: str) -> None:
    STAMPS.append((label, time.perf_counter_ns()))


def stamped(fn, before: str, after: str):
    """fn, stamping `before` as it is called and `after` as it returns."""
    def wrapper(*args, **kwargs):
        stamp(before)
        result = fn(*args, **kwargs)
        stamp(after)
        return result
    return wrapper


class TimedKernel:
    """Stands in for a kernel's launcher in its module's namespace: `launcher[grid](...)` stamps
    the launch's start and end."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        return stamped(self.kernel[grid], f"{self.name} launch", f"after {self.name} launch")


def timed_function(label: str, fn):
    return stamped(fn, f"{label} entered", f"{label} returned")


# (module, name): the production launchers, Triton's and the Gluon kernels'
LAUNCHERS = {(module, name): getattr(module, name) for module, name in
             ((forward, "_fwd_launcher"), (backward, "_bwd_preprocess_launcher"), (backward, "_bwd_dkdv_launcher"),
              (backward, "_bwd_dq_launcher"), (fah, "_fwd_launcher"), (fah, "_bwd_dkdv_launcher"))}


def instrument() -> None:
    for name in ("flash_attn_forward", "flash_attn_backward"):
        setattr(ops, name, timed_function(name, getattr(ops, name)))  # the custom ops call them


def use_launches(launch: str) -> None:
    """'cached': the library's launchers (kernels/launch.py); 'jit': every launch through
    Triton's JIT (`kernel[grid](...)`, without the cache). Either way stamped."""
    for (module, name), launcher in LAUNCHERS.items():
        label = ("gluon " if module is fah else "") + name.strip("_")
        setattr(module, name, TimedKernel(label, launcher if launch == "cached" else launcher.kernel))


def stage_durations(calls: list[list[tuple[str, int]]]) -> dict[str, float]:
    """Median microseconds from each stamp to the next, by the pair's labels (every call must
    have passed the same stamps)."""
    labels = [label for label, _ in calls[0]]
    if any([label for label, _ in c] != labels for c in calls):
        raise RuntimeError("calls passed different stamps; cannot line them up")
    return {f"{a} -> {b}": statistics.median((c[i + 1][1] - c[i][1]) / 1e3 for c in calls)
            for i, (a, b) in enumerate(itertools.pairwise(labels))}


def breakdown(variants: dict, tensors) -> tuple[dict[str, dict[str, float]], dict[str, float], float, float]:
    """For each variant (name -> (setup, fn)): stage medians (us) and host ms per call over CALLS
    calls of fn; the GPU ms per call of all of them together; and how long the GPU sleep outlasted
    the issuing (ms; negative: the GPU caught up with the host). The variants' calls take turns
    (so that the host's speed, which drifts over seconds, weighs on each alike), all issued behind
    a GPU sleep by `gpu_and_host_ms`, one call of it per round of
    turns). `setup` runs before each call, outside the stamps and the per-variant host clock."""
    rounds: list[dict[str, tuple[list, int]]] = []

    def one_round():
        stamps_and_ns = {}
        for name, (setup, fn) in variants.items():
            setup()
            for t in tensors:
                t.grad = None
            STAMPS.clear()
            t0 = time.perf_counter_ns()
            stamp("call")
            fn()
            stamp("call returned")
            stamps_and_ns[name] = list(STAMPS), time.perf_counter_ns() - t0
        rounds.append(stamps_and_ns)

    gpu_ms_per_round, _, slack_ms = gpu_and_host_ms(one_round, calls=CALLS)
    timed = rounds[1:]  # the first round is gpu_and_host_ms's warm-up call
    stages = {name: stage_durations([r[name][0] for r in timed]) for name in variants}
    host_ms = {name: sum(r[name][1] for r in timed) / 1e6 / len(timed) for name in variants}
    return stages, host_ms, gpu_ms_per_round / len(variants), slack_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--causal", choices=["true", "false", "both"], default="true")
    ap.add_argument("--launches", nargs="+", choices=["cached", "jit"], default=["cached", "jit"],
                    help="launch paths to compare in this process (see use_launches)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                    help="folder for the rows (default: $OUT, else the current folder)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    instrument()
    record = CsvRows(args.out / "exp_host_breakdown.csv", lambda r: (
        f"  {r['launch']:6s} {r['stage']:70s} {r['us']:8.1f} us"))
    causals = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    for seqlen in args.seqlens:
        for hdim in args.hdims:
            batch, heads = 16384 // seqlen, 2048 // hdim
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)

            def forward(q, k, v, causal, softmax_scale):
                return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
            for causal in causals:
                def call(q=q, k=k, v=v, dout=dout, causal=causal):
                    flash_attn_func(q, k, v, causal=causal).backward(dout)
                variants = {launch: (functools.partial(use_launches, launch), call) for launch in args.launches}
                stages, host_ms, gpu_ms, slack_ms = breakdown(variants, (q, k, v))
                for launch in args.launches:
                    use_launches(launch)
                    STAMPS.clear()  # do_bench's calls are not stamped into any table
                    do_bench_ms = time_attention(forward, q, k, v, causal, hdim ** -0.5, "fwd_bwd").ms
                    print(f"seqlen {seqlen}, head dim {hdim}, causal {causal}, {args.dtype}, {launch} launches: host "
                          f"{host_ms[launch]:.3f} ms, GPU {gpu_ms:.3f} ms (all variants), do_bench {do_bench_ms:.3f} ms "
                          "per call; stage medians:")
                    row = {"seqlen": seqlen, "hdim": hdim, "causal": causal, "dtype": args.dtype, "launch": launch}
                    for stage, us in stages[launch].items():
                        record(**row, stage=stage, us=us)
                    record(**row, stage="sum of the medians", us=sum(stages[launch].values()))
                    record(**row, stage="host per call (mean)", us=host_ms[launch] * 1e3)
                    record(**row, stage="GPU per call (mean, all variants)", us=gpu_ms * 1e3)
                    record(**row, stage="GPU sleep's slack over the issuing (all variants)", us=slack_ms * 1e3)
                    record(**row, stage="do_bench per call (median)", us=do_bench_ms * 1e3)
            del q, k, v, dout
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
