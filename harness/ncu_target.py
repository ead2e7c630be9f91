"""One representative launch of a provider, for Nsight Compute.

    ncu ... --profile-from-start off python -m harness.ncu_target --provider rung2-seq-parallel \
        --mode fwd --causal 1 --hdim 128 --seqlen 2048 --batch 8 --heads 16 --dtype bf16

Builds random inputs in flash-attn's layout (batch, seqlen, heads, hdim), looks the provider
up in baselines.providers, and runs it WARMUP_CALLS times so that compilation, autotuning and
cold caches stay outside the profiled range; then one call between cudaProfilerStart and
cudaProfilerStop. `fwd` profiles one forward, `bwd` one backward through autograd (its
forward runs before the range opens), `fwd_bwd` both. harness.ncu builds the command;
a provider that cannot run exits 2 with one line, 'ncu_target: ...', on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from baselines.flops import MODE_MULTIPLIER
from baselines.providers import DTYPES, Spec, get_provider, unavailable_reason
from harness.timing import random_inputs

WARMUP_CALLS = 3
SEED = 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.ncu_target",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", required=True, help="a name in baselines.providers.PROVIDERS")
    parser.add_argument("--mode", choices=sorted(MODE_MULTIPLIER), default="fwd")
    parser.add_argument("--causal", type=int, choices=(0, 1), default=0)
    parser.add_argument("--hdim", type=int, required=True)
    parser.add_argument("--seqlen", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    return parser.parse_args(argv)


def profiled_step(provider, spec: Spec, device: torch.device):
    """The callable whose one call is profiled, on fresh random inputs of `spec`."""
    backward = spec.mode != "fwd"
    q, k, v = random_inputs(spec, device, SEED, requires_grad=backward)  # (B, S, H, D)
    scale = 1.0 / math.sqrt(spec.hdim)
    if spec.mode == "fwd":
        return lambda: provider.forward(q, k, v, spec.causal, scale)
    dout = torch.randn_like(q)
    if spec.mode == "fwd_bwd":
        return lambda: torch.autograd.grad(provider.forward(q, k, v, spec.causal, scale), (q, k, v), dout)
    out = provider.forward(q, k, v, spec.causal, scale)  # bwd: the forward stays outside the range
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def fail(message: str) -> int:
    print(f"ncu_target: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        return fail("needs a CUDA GPU: Nsight Compute profiles GPU kernels")
    try:
        provider = get_provider(args.provider)
    except ValueError as err:
        return fail(str(err))
    spec = Spec(mode=args.mode, causal=bool(args.causal), hdim=args.hdim, seqlen=args.seqlen,
                batch=args.batch, heads=args.heads, dtype=args.dtype)
    reason = unavailable_reason(provider) or provider.supports(spec)
    if reason is None and spec.mode != "fwd" and not provider.has_backward:
        reason = "it has no backward"
    if reason:
        return fail(f"{provider.name} cannot run {spec}: {reason}")
    profile_once(profiled_step(provider, spec, torch.device("cuda")))
    return 0


def profile_once(step, warmup_calls: int = WARMUP_CALLS) -> None:
    """`warmup_calls` calls of `step` outside the profiled range (compilation, autotuning, cold
    caches), then one between cudaProfilerStart and cudaProfilerStop, where
    `ncu --profile-from-start off` profiles."""
    for _ in range(warmup_calls):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    sys.exit(main())
