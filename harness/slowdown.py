"""A provider file with known slowdowns, to calibrate the regression rule (harness.calibrate):

    python runner.py --quick --providers fa2,sdpa-flash,fa2-slowed-10 --provider-file harness/slowdown.py

`fa2-slowed-<percent>` is our FA2 kernel followed by a GPU spin (`torch.cuda._sleep`) of
<percent>% of that kernel's own time for the input's shape, in the forward and, through an
autograd function, in the backward: a slowdown of known size without touching the kernel.
The kernel's times per shape are measured with CUDA events at the first call for the shape
(outside the timed region: the runner's warm-up call), and the spin's cycles per millisecond
once per process.
"""

from __future__ import annotations

import torch

SLOWDOWNS = (10,)  # percent
_CALLS = 20
_cycles_per_ms: list[float] = []
_kernel_ms: dict[tuple, tuple[float, float]] = {}  # shape key -> (forward ms, backward ms)


def _fa2(q, k, v, causal, softmax_scale):
    from kernels import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


def _event_ms(fn, calls: int = _CALLS) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _cycles(ms: float) -> int:
    if not _cycles_per_ms:
        cycles = 10_000_000
        _cycles_per_ms.append(cycles / _event_ms(lambda: torch.cuda._sleep(cycles), calls=5))
    return max(0, int(ms * _cycles_per_ms[0]))


def _times(q, k, v, causal, softmax_scale) -> tuple[float, float]:
    key = (tuple(q.shape), q.dtype, causal, q.requires_grad)
    if key not in _kernel_ms:
        with torch.no_grad():
            fwd = _event_ms(lambda: _fa2(q, k, v, causal, softmax_scale))
        bwd = 0.0
        if q.requires_grad:
            qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            out = _fa2(qq, kk, vv, causal, softmax_scale)
            dout = torch.randn_like(out)
            bwd = _event_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True))
        _kernel_ms[key] = (fwd, bwd)
    return _kernel_ms[key]


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, cycles):
        ctx.cycles = cycles
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad, None


def slowed(percent: float):
    def forward(q, k, v, causal, softmax_scale):
        if not q.is_cuda:
            raise NotImplementedError("a GPU spin needs CUDA")
        fwd_ms, bwd_ms = _times(q, k, v, causal, softmax_scale)
        out = _fa2(q, k, v, causal, softmax_scale)
        torch.cuda._sleep(_cycles(fwd_ms * percent / 100))
        if q.requires_grad:
            out = _SleepInBackward.apply(out, _cycles(bwd_ms * percent / 100))
        return out

    return forward


PROVIDERS = {f"fa2-slowed-{percent}": slowed(percent) for percent in SLOWDOWNS}
