"""The one timing helper: every time in the project's results comes from `time_attention`.

On a GPU: `triton.testing.do_bench` (which flushes L2 before each call) returns the median
and the 20th/80th percentiles of the call time; one call before it compiles and warms up
(Triton JIT, torch.compile, cuDNN plans), so compilation is never timed, and that call's
peak memory is recorded, as is the mean SM clock while do_bench runs (its own warm-up and the
timed calls), read by NVML (harness.environment.ClockSampler). On CPU (Triton's interpreter):
the median of a few `time.perf_counter` measurements after one warm-up call; those numbers are
not performance.

Modes, as the paper times them: 'fwd' the forward alone; 'bwd' the backward alone
(`out.backward(dout, retain_graph=True)` on one forward's graph); 'fwd_bwd' both.
Gradients are cleared before every timed call (`grad_to_none`) so none accumulate.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from harness.environment import ClockSampler

QUANTILES = (0.5, 0.2, 0.8)  # median, 20th and 80th percentile of the call time
CPU_REPS = 3  # timed calls per measurement in the interpreter (each may take seconds)
DEFAULT_WARMUP_MS, DEFAULT_REP_MS = 25, 100  # do_bench's own defaults


@dataclass(frozen=True)
class Timing:
    ms: float  # median milliseconds per call
    ms_p20: float  # 20th percentile (a faster call than the median)
    ms_p80: float  # 80th percentile
    peak_mem_mb: float  # peak memory allocated during the warm-up call, inputs included (NaN on CPU)
    sm_clock_mhz: float = math.nan  # mean SM clock while do_bench ran (NaN on CPU or without NVML)


def seed_of(*parts) -> int:
    """A reproducible seed from any printable parts (a Spec, a repeat number)."""
    return zlib.crc32(repr(parts).encode())


def random_inputs(spec, device: torch.device, seed: int, requires_grad: bool) -> list[torch.Tensor]:
    """Fresh randn q, k, v of a Spec's size, (batch, seqlen, heads, hdim), reproducible by seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (spec.batch, spec.seqlen, spec.heads, spec.hdim)
    return [torch.randn(shape, generator=generator, device=device, dtype=spec.torch_dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def _clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


KERNEL_NAME_CHARS = 120  # a kernel's name as kernel_times keys it (CUTLASS DSL names run to hundreds)
KERNEL_TIME_CALLS = 10  # the calls kernel_times profiles, by default


def kernel_times(fn: Callable[[], object], device: torch.device, calls: int = KERNEL_TIME_CALLS,
                 grad_to_none: Sequence[torch.Tensor] = ()) -> dict[str, float]:
    """Each GPU kernel's time in one call of `fn`, in microseconds by kernel name (its first
    KERNEL_NAME_CHARS characters): torch.profiler's CUDA activity over `calls` calls after one
    untimed call, each kernel's total over the calls divided by them. It says which of a call's
    kernels takes its time (a backward's preprocess, main kernel and dQ cast); the call's own time
    is `benchmark`'s. {} off CUDA (Triton's interpreter launches no GPU kernel)."""
    if device.type != "cuda":
        return {}
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    fn()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            _clear_grads(grad_to_none)
            fn()
        torch.cuda.synchronize(device)
    times: dict[str, float] = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:KERNEL_NAME_CHARS]
            times[name] = times.get(name, 0.0) + event.device_time / calls
    return times


def benchmark(fn: Callable[[], object], device: torch.device, warmup_ms: float = DEFAULT_WARMUP_MS, rep_ms: float = DEFAULT_REP_MS,
              grad_to_none: Sequence[torch.Tensor] = (), cpu_reps: int = CPU_REPS, cuda_graph: bool = False) -> Timing:
    """Time `fn()` on `device`; the first call (compile, warm-up) is never timed.

    cuda_graph: time with `triton.testing.do_bench_cudagraph` instead: the calls are captured
    in one CUDA graph and replayed back to back, so host launch overhead (tens of us per call
    in Python) and the L2 flush are not timed; quantiles are over 10 replays of the graph.
    The clock for kernels of ~0.1 ms, whose do_bench time is partly host time; forward only
    (time_attention refuses it for the backward modes)."""
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
        _clear_grads(grad_to_none)
        with ClockSampler() as clocks:
            if cuda_graph:
                ms, p20, p80 = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=list(grad_to_none) or None,
                                                                 quantiles=list(QUANTILES))
            else:
                ms, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                                       grad_to_none=list(grad_to_none) or None,
                                                       quantiles=list(QUANTILES))
        return Timing(ms, p20, p80, peak_mb, clocks.sm_clock_mhz)
    if cpu_reps < 1:
        raise ValueError(f"cpu_reps must be >= 1, got {cpu_reps}")
    fn()
    times = []
    for _ in range(cpu_reps):
        _clear_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    # linear interpolation between order statistics, as do_bench's quantiles
    ms, p20, p80 = torch.tensor(times, dtype=torch.float64).quantile(
        torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return Timing(ms, p20, p80, math.nan)


def attention_call(forward: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float, mode: str) -> tuple[Callable[[], object], tuple[torch.Tensor, ...]]:
    """The call that `mode` times for one provider's `forward(q, k, v, causal, softmax_scale)`,
    and the tensors whose gradients are cleared before each call. 'fwd': the forward; 'bwd':
    `out.backward(dout, retain_graph=True)` on one forward's graph; 'fwd_bwd': both. For 'bwd'
    and 'fwd_bwd', q, k and v must require grad; dout is fresh randn like the output."""
    if mode == "fwd":
        return (lambda: forward(q, k, v, causal, softmax_scale)), ()
    if mode not in ("bwd", "fwd_bwd"):
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd_bwd', got {mode!r}")
    if not all(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"mode {mode!r} needs q, k and v with requires_grad=True")
    if mode == "bwd":
        out = forward(q, k, v, causal, softmax_scale)
        dout = torch.randn_like(out)
        return (lambda: out.backward(dout, retain_graph=True)), (q, k, v)
    dout = torch.randn_like(q)
    return (lambda: forward(q, k, v, causal, softmax_scale).backward(dout)), (q, k, v)


def time_attention(forward: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float, mode: str, warmup_ms: float = DEFAULT_WARMUP_MS, rep_ms: float = DEFAULT_REP_MS,
                   cpu_reps: int = CPU_REPS, cuda_graph: bool = False) -> Timing:
    """Time one provider's `forward(q, k, v, causal, softmax_scale)` in `mode` (the call
    `attention_call` makes)."""
    if cuda_graph and mode in ("bwd", "fwd_bwd"):
        # Seen on the H200 (reports/h200/decisions/cuda_graph_backward_capture.log):
        # do_bench_cudagraph failed to capture mode 'bwd' (the backward of a graph whose forward
        # ran before the capture; our kernel and SDPA's alike), and the failed capture left the
        # process unable to draw random numbers, so 'fwd_bwd' could not be tried after it. Captured
        # on its own, 'fwd_bwd' replays (harness/host_overhead.py's GPU column); the sweeps keep
        # refusing both until their timing of it is checked against do_bench.
        raise ValueError(f"cuda_graph times forward passes only: capturing the backward timing (mode "
                         f"{mode!r}) failed on the H200")
    fn, grads = attention_call(forward, q, k, v, causal, softmax_scale, mode)
    return benchmark(fn, q.device, warmup_ms, rep_ms, grad_to_none=grads, cpu_reps=cpu_reps,
                     cuda_graph=cuda_graph)
