"""The launches Nsight Compute profiles for the reviewers' studies (ablations/measure.py).

    ncu ... --profile-from-start off python -m ablations.ncu_target '[{"variant": "bwd-rung2", "mode": "bwd", ...}]'

For each job: fresh random inputs, WARMUP_CALLS calls outside the profiled range (compilation,
cold caches; for 'bwd' the forward too), then one call between cudaProfilerStart and
cudaProfilerStop. A job that cannot run exits 2 with one line, 'ncu_target: ...', on stderr.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from ablations.measure import SPEC_FIELDS, spec_of
from ablations.variants import get_variant
from harness.ncu_target import profile_once
from harness.timing import random_inputs

WARMUP_CALLS = 2
SEED = 0


def profiled_step(variant, spec, device):
    q, k, v = random_inputs(spec, device, SEED, requires_grad=spec.mode != "fwd")  # (B, S, H, D)
    scale = 1.0 / math.sqrt(spec.hdim)
    if spec.mode == "fwd":
        return lambda: variant.forward(q, k, v, spec.causal, scale)
    out = variant.forward(q, k, v, spec.causal, scale)  # the forward stays outside the range
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("ncu_target: expected one argument, the JSON list of jobs", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ncu_target: needs a CUDA GPU: Nsight Compute profiles GPU kernels", file=sys.stderr)
        return 2
    try:
        jobs = [(get_variant(job["variant"]), spec_of(**{name: job[name] for name in SPEC_FIELDS}))
                for job in json.loads(argv[0])]
    except (ValueError, KeyError, TypeError) as err:
        print(f"ncu_target: bad job list: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    for variant, spec in jobs:
        profile_once(profiled_step(variant, spec, torch.device("cuda")), WARMUP_CALLS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
