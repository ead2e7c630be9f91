"""Host time per eager call with the Gluon kernels' tensor maps encoded at every launch against
kept per base address (`kernels.launch.CACHE_TENSOR_MAPS`), next to SDPA flash: the measurement
behind that switch.

    python tools/experiments/exp_tensor_map_cache.py --out DIR      # DIR/tensor_map_cache.csv

One process, bf16, causal, harness.host_overhead's shapes, calls and timing (each call issued
HOST_CALLS times behind a GPU sleep, the median of 5 passes); the three variants measured in
turn, ROUNDS times, each cell the median of its rounds in microseconds. Rows in the decisions
format, one shape (all three modes) at a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = ("tools/experiments/exp_tensor_map_cache.py, bf16, causal, harness.host_overhead.host_ms, "
        "median of interleaved rounds")
ROUNDS = 3
VARIANTS = ("ours, tensor maps encoded at every launch", "ours, tensor maps kept", "sdpa-flash")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from harness.host_overhead import MODES, SHAPES, attention_fn, call_fn, host_ms
    from kernels import backward, forward, launch
    from reports.decisions import DecisionWriter

    args.out.mkdir(parents=True, exist_ok=True)
    shipped = launch.CACHE_TENSOR_MAPS
    with DecisionWriter(args.out / "tensor_map_cache.csv", TOOL) as writer:
        for batch, heads, seqlen, hdim in SHAPES:
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            for mode in MODES:
                times = {variant: [] for variant in VARIANTS}
                for _ in range(ROUNDS):
                    for variant in VARIANTS:
                        if variant.startswith("ours"):
                            launch.CACHE_TENSOR_MAPS = variant.endswith("kept")
                            forward._PLANS.clear()  # the plans' launches read the switch when made
                            backward._PLANS.clear()
                        fn = call_fn(attention_fn("sdpa-flash" if variant == "sdpa-flash" else "fa2", True),
                                     mode, q, k, v, dout)
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                        times[variant].append(host_ms(fn) * 1e3)
                column = f"{mode} {batch}x{heads}x{seqlen}x{hdim}"
                for variant in VARIANTS:
                    writer.write(variant, column, "us", statistics.median(times[variant]))
                print(column, "  ".join(f"{v}: {statistics.median(t):.1f}" for v, t in times.items()), flush=True)
            del q, k, v, dout
    launch.CACHE_TENSOR_MAPS = shipped


if __name__ == "__main__":
    main()
