"""The Gluon packed-sequence backward's L and D through shared memory (kernels/flash_attn_hopper.py,
BWD_VARLEN_STATS), against loads from global memory at every step, on the H200, FA4 beside where
it is installed.

    python tools/experiments/exp_bwd_varlen_stats.py --out DIR      # DIR/bwd_varlen_stats.csv

The floor: the kernel's five matmuls per query step. The dense kernel's loader brings each step's
rows of L and D into shared memory with Q_i and dO_i, which paid up to a tenth of its time
(decisions/bwd_schedule.csv); the varlen kernel still waits on global loads of them at every
step. With descriptors of the (heads, total_q) views (total_q a multiple of 4: 16-byte rows) a
query tile that crosses into the next sequence reads that sequence's L and D, so P is masked to
the sequence's rows. Prediction: a few percent, as the dense kernel gained. Both variants first
against float64 (dQ, dK, dV of ragged packed sequences, GQA, both causal modes, within 2x the
Triton deterministic backward's error), then the whole backward of the features suite's packed
batch (its last sequence one token longer, so that total_q is a multiple of 4) timed by
harness.features, rounds interleaved, FA4 beside.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL = "tools/experiments/exp_bwd_varlen_stats.py, bf16, head dim 128, do_bench of the whole backward"
VARIANTS = {"L, D from global memory": False, "L, D in shared memory": True}


def select(stats) -> None:
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_VARLEN_STATS = stats is True  # FA4's rows pass "fa4"


def check(device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference_varlen
    from harness.accuracy import _relative_error as relative_error
    from harness.accuracy import within_twice_the_error

    ok, notes = True, []
    lengths_q, lengths_k = [1500, 700, 2000, 131, 1025], [1100, 700, 2048, 300, 1024]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))
    for causal in (False, True):
        gen = torch.Generator(device=device).manual_seed(3 + causal)
        q, do = (torch.randn(int(cu_q[-1]), 4, 128, device=device, dtype=torch.bfloat16, generator=gen)
                 for _ in range(2))
        k, v = (torch.randn(int(cu_k[-1]), 2, 128, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        grads = {}
        for name in ("gluon", "triton"):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = kernels.flash_attn_varlen_func(*x, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                                 deterministic=name == "triton")
            out.backward(do)
            grads[name] = [t.grad for t in x]
        x64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_reference_varlen(*x64, cu_q, cu_k, None, causal=causal)
        ref.backward(do.double())
        for i, grad in enumerate(["dq", "dk", "dv"]):
            good, got, yardstick = within_twice_the_error(grads["gluon"][i], x64[i].grad, grads["triton"][i], 1e-4,
                                                          error=relative_error)
            ok &= good
            notes.append(f"{grad} causal={causal} {got:.2e} (triton {yardstick:.2e})")
    return ok, "; ".join(notes)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import cases, measure
    from kernels import flash_attn_hopper as hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    varlen = next(c for c in cases(quick=False) if c.variant == "varlen")
    lengths = list(varlen.lengths)
    lengths[-1] += -sum(lengths) % 4  # total_q a multiple of 4: L's rows can take a descriptor
    varlen = dataclasses.replace(varlen, lengths=tuple(lengths))
    column = f"varlen {varlen.batch} seqs, total {sum(lengths)}, causal"
    timed_cases = {column: varlen, column.replace("causal", "full"): dataclasses.replace(varlen, causal=False)}
    production = hopper.BWD_VARLEN_STATS
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with DecisionWriter(args.out / "bwd_varlen_stats.csv", TOOL) as writer:
            checks = {}
            for name, value in VARIANTS.items():
                select(value)
                checks[name] = check(device)
            passed = writer.write_checks(checks)
            writer.time_interleaved({**{name: VARIANTS[name] for name in passed}, "fa4": "fa4"}, timed_cases, select,
                                    lambda case, value: measure(case, "fa4" if value == "fa4" else "ours", "bwd",
                                                                device, torch.bfloat16), args.repeats)
    finally:
        select(production)


if __name__ == "__main__":
    main()
