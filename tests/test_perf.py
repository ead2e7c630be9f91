"""GPU performance tests of the production kernel path, timed with pytest-benchmark.

Marked `perf` (tests/conftest.py skips them without CUDA). Regression tracking with
pytest-benchmark's own storage:

    pytest -m perf --benchmark-autosave --benchmark-compare --benchmark-compare-fail=median:10%

saves this run under .benchmarks/ and fails when a test's median is more than 10% slower
than the newest saved run of the same machine (see the README, regression tracking).

Timing: pytest-benchmark's timer is the host clock, so every benchmarked call ends with
`torch.cuda.synchronize()`: a round measures the kernels, not their asynchronous launch.
Compilation happens in the warm-up rounds, never in a timed one. Each test also stores, in
`benchmark.extra_info`, its configuration, the kernel config, the TFLOPs/s of the median
round (baselines.flops) and the device-side time of the project's timing helper
(harness.timing: CUDA-event timing with L2 flushed, as the runner measures).

Shapes follow the paper's sweep (FA2 Sec. 4.1): hidden size 2048 = heads x head dim and
16k tokens = batch x seqlen, at seqlen 4096, bf16.
"""

import dataclasses
import math

import pytest
import torch

from baselines.flops import attention_flops, tflops_per_second
from harness.timing import time_attention
from kernels import flash_attn_func
from kernels.configs import default_bwd_config, default_fwd_config
from kernels.dispatch import fwd_memory_path

pytestmark = pytest.mark.perf

SEQLEN = 4096
TOKENS = 16384  # batch x seqlen
HIDDEN = 2048  # heads x head dim
DTYPE = torch.bfloat16
ROUNDS = 30
WARMUP_ROUNDS = 3  # the first compiles the kernel; none of them is timed


def _forward(q, k, v, causal, softmax_scale):
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_flash_attn_production_path_throughput(benchmark, mode, causal, hdim):
    batch, heads = TOKENS // SEQLEN, HIDDEN // hdim
    scale = 1.0 / math.sqrt(hdim)
    backward = mode == "fwd_bwd"
    q, k, v = (torch.randn(batch, SEQLEN, heads, hdim, device="cuda", dtype=DTYPE, requires_grad=backward)
               for _ in range(3))  # (B, S, H, D)
    dout = torch.randn_like(q)

    def forward_call():
        out = _forward(q, k, v, causal, scale)
        torch.cuda.synchronize()
        return out

    def forward_backward_call():
        out = _forward(q, k, v, causal, scale)
        grads = torch.autograd.grad(out, (q, k, v), dout)  # returned, not accumulated into .grad
        torch.cuda.synchronize()
        return grads

    benchmark.group = f"flash_attn {mode} hdim {hdim}"
    outputs = benchmark.pedantic(forward_backward_call if backward else forward_call,
                                 rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    for tensor in outputs if backward else (outputs,):
        assert torch.isfinite(tensor).all(), "the kernel produced non-finite values: timing a broken kernel"

    flops = attention_flops(batch, heads, SEQLEN, SEQLEN, hdim, causal, mode)
    device_ms = time_attention(_forward, q, k, v, causal, scale, mode).ms
    fwd_config = default_fwd_config(hdim, causal, q.device)
    # which forward ran: _flash_fwd_kernel's memory path, or 'gluon-ws' (kernels/flash_attn_hopper.py)
    config = {"fwd": dataclasses.asdict(fwd_config),
              "fwd_memory_path": fwd_memory_path(fwd_config, q, k, v, torch.empty_like(q), causal)}
    if backward:
        config["bwd"] = dataclasses.asdict(default_bwd_config(hdim, q.device))
    benchmark.extra_info.update(
        mode=mode, causal=causal, hdim=hdim, seqlen=SEQLEN, batch=batch, heads=heads, dtype="bf16",
        gpu=torch.cuda.get_device_name(), config=config,
        device_ms=device_ms, device_tflops=tflops_per_second(flops, device_ms),
    )
    if benchmark.enabled:  # --benchmark-disable runs each call once, without statistics
        benchmark.extra_info["tflops_median"] = tflops_per_second(flops, benchmark.stats.stats.median * 1e3)
