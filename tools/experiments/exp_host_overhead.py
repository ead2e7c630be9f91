"""Host time against GPU time of one attention call, per provider, where the paper sweep's
calls are shortest (seqlen 512 and 1k: ~0.1-0.8 ms of GPU work each).

For each provider and mode (fwd, bwd, fwd_bwd as `harness.timing` times them) it measures:
- `do_bench_ms`: the runner's clock (do_bench: L2 flush, then the call, back to back);
- `gpu_ms`: GPU time per call: CALLS calls queued behind a GPU sleep (torch.cuda._sleep) long
  enough that the host has issued them all before the first starts, timed by CUDA events
  around them (a CUDA graph cannot capture the autograd backward);
- `host_ms`: host time per call to issue those calls (time.perf_counter), the GPU busy.
Where `host_ms` approaches or exceeds `gpu_ms`, the GPU can wait on the host between a call's
launches, and do_bench's reading then includes host stalls (one 30-call sample per row: host
time varies from run to run).
With --profile, for fa2's calls of the last --modes mode (fwd_bwd by default) at the first
shape: the top Python functions by own
time (cProfile), then torch.profiler's operator table for fa2 and each other provider (CPU time
per operator and the CUDA kernels launched: copies or fills besides the attention kernels show
up there).
Rows go to $OUT/exp_host_overhead.csv.

    python tools/experiments/exp_host_overhead.py --hdims 128 256 --seqlens 512 1024 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from tune_fa2 import CsvRows

from baselines.providers import get_provider
from harness.timing import attention_call, time_attention
from kernels import flash_attn_func
from kernels.flash_attn import default_bwd_config

CALLS = 30
SLEEP_CYCLES = 400_000_000  # ~0.2 s at the H200's clocks: longer than issuing CALLS calls


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


def print_operator_table(name: str, mode: str, fn, tensors, calls: int = 10) -> None:
    """torch.profiler over `calls` calls of fn (gradients cleared before each): CPU time and
    count per operator, and the CUDA kernels, sorted by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in tensors:
                t.grad = None
            fn()
        torch.cuda.synchronize()
    print(f"== torch.profiler: {name}, {calls} {mode} calls")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def fa2_with_bwd_gluon_min_keys(min_keys: int, hdim: int):
    """flash_attn_func with the Hopper backward config's hopper_gluon_min_keys replaced."""
    config = dataclasses.replace(default_bwd_config(hdim, torch.device("cuda")), hopper_gluon_min_keys=min_keys)
    return lambda q, k, v, causal, softmax_scale: flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                                  bwd_config=config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--providers", nargs="+", default=["fa2", "sdpa-flash"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd", "fwd_bwd"])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--bwd-gluon-min-keys", type=int, nargs="+", default=[],
                    help="also time fa2 with the backward config's hopper_gluon_min_keys set to each of these "
                         "(provider 'fa2 gluon-dkdv>=N'; 0: the Triton dK/dV kernel throughout)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile fa2's calls of the last --modes mode at the first shape; torch.profiler for each provider")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    record = CsvRows(Path(os.environ.get("OUT", ".")) / "exp_host_overhead.csv", lambda r: (
        f"s{r['seqlen']:<5d} d{r['hdim']:<3d} causal={r['causal']!s:5s} {r['provider']:10s} {r['mode']:7s} "
        f"do_bench {r.get('do_bench_ms', float('nan')):7.3f}  gpu {r.get('gpu_ms', float('nan')):7.3f}  "
        f"host {r.get('host_ms', float('nan')):7.3f} ms (slack {r.get('slack_ms', float('nan')):6.1f}) {r.get('status', '')}"))
    profiled = not args.profile
    for seqlen in args.seqlens:
        for hdim in args.hdims:
            batch, heads = 16384 // seqlen, 2048 // hdim
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            scale = hdim ** -0.5
            for causal in (False, True):
                for name in args.providers + [f"fa2 gluon-dkdv>={n}" for n in args.bwd_gluon_min_keys]:
                    forward = (get_provider(name).forward if name in args.providers
                               else fa2_with_bwd_gluon_min_keys(int(name.split(">=")[1]), hdim))
                    for mode in args.modes:
                        row = {"seqlen": seqlen, "hdim": hdim, "causal": causal, "provider": name, "mode": mode,
                               "dtype": args.dtype}
                        try:
                            fn, _ = attention_call(forward, q, k, v, causal, scale, mode)
                            row["do_bench_ms"] = time_attention(forward, q, k, v, causal, scale, mode).ms
                            row["gpu_ms"], row["host_ms"], row["slack_ms"] = gpu_and_host_ms(fn, (q, k, v))
                            row["status"] = "ok"
                        except Exception as exc:  # noqa: BLE001 -- a failing measurement is a row
                            row["status"] = f"error: {exc}"[:200]
                        record(**row)
                        if not profiled and mode == args.modes[-1]:
                            if name == "fa2":
                                profiler = cProfile.Profile()
                                profiler.enable()
                                gpu_and_host_ms(fn, (q, k, v))
                                profiler.disable()
                                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
                            print_operator_table(name, mode, fn, (q, k, v))
                            profiled = name == args.providers[-1]
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
