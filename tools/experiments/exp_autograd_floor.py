"""Where the host time of an eager fwd+bwd call goes on this machine: the kernels' own launches
against the autograd engine's, next to SDPA flash (reports/h200/decisions/host_autograd.log).

    python tools/experiments/exp_autograd_floor.py [--calls 40]

Each line: microseconds per call, the call issued `--calls` times behind a GPU sleep long enough
that no call waits for the GPU (harness.host_overhead.host_ms, one pass), bf16, causal, (1, 1024, 16, 128):
- `fwd direct`, `bwd direct`: kernels.forward.flash_attn_forward and kernels.backward.flash_attn_backward
  without autograd (`bwd direct det`: deterministic=True);
- `fwd+bwd (.backward)`, `fwd+bwd (autograd.grad)`: kernels.flash_attn_func through autograd;
- `sdpa flash fwd+bwd`: F.scaled_dot_product_attention on its FLASH_ATTENTION backend;
- `trivial Function fwd+bwd`: a torch.autograd.Function whose forward is one clone and whose
  backward returns its input, the floor of any Python autograd.Function; `clone`: that clone alone;
  `6 x empty_like`: six allocations like q (a backward's outputs and buffers);
- the same calls inside torch.autograd.set_multithreading_enabled(False) (backward on the calling
  thread instead of the engine's device thread);
- `inside .backward`: FlashAttnFunc's forward and backward timed from inside during the
  `.backward` calls, the rest being the wrappers, the engine and the gradient accumulation;
- `bwd direct on a worker thread`: the direct backward issued from another Python thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call: harness.host_overhead's measurement (one warm-up call,
    then `calls` calls behind a GPU sleep), one pass."""
    from harness.host_overhead import host_ms

    return host_ms(fn, calls, repeats=1) * 1e3


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    import kernels
    from kernels.backward import flash_attn_backward
    from kernels.forward import flash_attn_forward

    shape = (1, 1024, 16, 128)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    scale = shape[-1] ** -0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = flash_attn_forward(qd, kd, vd, scale, True)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o.backward(dout.transpose(1, 2))

    calls = {
        "fwd direct": lambda: flash_attn_forward(qd, kd, vd, scale, True),
        "bwd direct": lambda: flash_attn_backward(dout, qd, kd, vd, out, lse, scale, True),
        "bwd direct det": lambda: flash_attn_backward(dout, qd, kd, vd, out, lse, scale, True, deterministic=True),
        "fwd+bwd (.backward)": lambda: kernels.flash_attn_func(q, k, v, causal=True).backward(dout),
        "fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(kernels.flash_attn_func(q, k, v, causal=True),
                                                               (q, k, v), dout),
        "sdpa flash fwd+bwd": sdpa,
        "trivial Function fwd+bwd": lambda: Trivial.apply(q, k, v).backward(dout),
        "clone": lambda: qd.clone(),
        "6 x empty_like": lambda: [torch.empty_like(qd) for _ in range(6)],
    }
    for name, fn in calls.items():
        threaded = host_us(fn, args.calls)
        with torch.autograd.set_multithreading_enabled(False):
            single = host_us(fn, args.calls)
        print(f"{shape} {name:26s} {threaded:7.1f} us   single-threaded engine {single:7.1f} us", flush=True)
    inside_autograd(kernels, q, k, v, dout, args.calls)
    on_another_thread(lambda: flash_attn_backward(dout, qd, kd, vd, out, lse, scale, True), args.calls)


def inside_autograd(kernels, q, k, v, dout, calls: int) -> None:
    """Where a `.backward` call's host time goes: FlashAttnFunc's forward and backward timed from
    inside (perf_counter around each), the rest is the wrappers, the engine and the gradient
    accumulation. The backward runs on the engine's device thread."""
    from kernels.ops import FlashAttnFunc

    spent = {"forward": 0.0, "backward": 0.0}
    originals = {name: getattr(FlashAttnFunc, name) for name in spent}

    def timed(name):
        inner = originals[name]

        def wrapper(*a):
            start = time.perf_counter()
            try:
                return inner(*a)
            finally:
                spent[name] += time.perf_counter() - start

        return staticmethod(wrapper)

    for name in spent:
        setattr(FlashAttnFunc, name, timed(name))
    try:
        def fn():
            kernels.flash_attn_func(q, k, v, causal=True).backward(dout)

        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                fn()
                for key in spent:
                    spent[key] = 0.0
                total = host_us(fn, calls)  # host_ms makes one warm-up call, then `calls` timed ones
                n = calls + 1
                forward, backward = spent["forward"] / n * 1e6, spent["backward"] / n * 1e6
                print(f"inside .backward ({'engine thread' if threaded else 'single-threaded engine'}): "
                      f"call {total:7.1f} us = Function.forward {forward:7.1f} + Function.backward {backward:7.1f} "
                      f"+ the rest {total - forward - backward:7.1f} us", flush=True)
    finally:
        for name, original in originals.items():
            setattr(FlashAttnFunc, name, staticmethod(original))


def on_another_thread(fn, calls: int) -> None:
    """`fn` issued by a long-lived worker thread (as the engine's device thread issues a backward),
    timed from that thread: whether running there alone makes the same Python slower."""
    import threading

    result = {}

    def worker():
        result["us"] = host_us(fn, calls)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    print(f"bwd direct on a worker thread {result['us']:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
